"""Shared-memory segments that disappear with the processes that map them.

Default (``ELASTIX_SHM=memfd``): the creator makes an anonymous ``memfd`` and the others open
it through ``/proc/<creator pid>/fd/<fd>``. There is no name anywhere, so nothing can be left
behind: the memory is freed when the last process that maps it exits, however it exits.

Fallback (``ELASTIX_SHM=file``, or where memfd is unavailable): a file in /dev/shm with a unique
name, space reserved up front (a full /dev/shm is an error now, not a SIGBUS later), unlinked
as soon as every rank has attached; from then on it is as nameless as a memfd. A creator that
crashes before the unlink leaves a file named after its pid, which the next creator on the
host removes (``sweep_stale``).
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
from typing import Optional

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "elastix-cc-"
PAGE = 4096


def _method() -> str:
    method = os.environ.get("ELASTIX_SHM", "memfd").lower()
    if method not in ("memfd", "file"):
        raise ValueError(f"ELASTIX_SHM must be 'memfd' or 'file', not {method!r}")
    if method == "memfd" and not hasattr(os, "memfd_create"):
        return "file"
    return method


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Removes segment files of this user whose creator is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-")[0])
            path = os.path.join(directory, name)
            if os.stat(path).st_uid == uid and not _pid_alive(pid):
                os.unlink(path)
                removed += 1
        except (ValueError, OSError):
            continue
    return removed


class Segment:
    """``size`` bytes of shared memory mapped in this process (``.mmap``, ``.addr``)."""

    def __init__(self, mm: mmap.mmap, size: int, handle: dict, fd: Optional[int], path: Optional[str]):
        self.mmap = mm
        self.size = size
        self.handle = handle
        self._fd = fd
        self._path = path
        self.bytes = np.frombuffer(mm, dtype=np.uint8)
        self.addr = int(self.bytes.__array_interface__["data"][0])

    @classmethod
    def create(cls, size: int, method: Optional[str] = None) -> "Segment":
        size = max(PAGE, -(-size // PAGE) * PAGE)
        method = method or _method()
        if method == "memfd":
            fd = os.memfd_create("elastix-collectives", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
            handle = {"kind": "memfd", "pid": os.getpid(), "fd": fd, "size": size}
            return cls(mm, size, handle, fd, None)
        sweep_stale()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                raise OSError(
                    err.errno,
                    f"cannot reserve {size} bytes in {SHM_DIR} ({err.strerror}); "
                    "make /dev/shm larger, or lower ELASTIX_SHM_SLOT_BYTES",
                ) from None
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(mm, size, {"kind": "file", "path": path, "size": size}, None, path)

    @classmethod
    def attach(cls, handle: dict) -> "Segment":
        size = int(handle["size"])
        if handle["kind"] == "memfd":
            path = f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as err:
                raise OSError(
                    err.errno,
                    f"cannot open the shared memory of process {handle['pid']} "
                    f"through {path} ({err.strerror}); set ELASTIX_SHM=file to use "
                    f"{SHM_DIR} instead",
                ) from None
        else:
            fd = os.open(handle["path"], os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(mm, size, handle, None, None)

    def encode(self) -> str:
        return json.dumps(self.handle)

    @staticmethod
    def decode(text) -> dict:
        return json.loads(text)

    def release_name(self) -> None:
        """Called by the creator once every rank attached: drops the fd or the file name."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None

    def close(self) -> None:
        self.release_name()
        self.bytes = None
        try:
            self.mmap.close()
        except (BufferError, ValueError):
            pass  # views still exist: the mapping goes when they do


__all__ = ["Segment", "sweep_stale"]

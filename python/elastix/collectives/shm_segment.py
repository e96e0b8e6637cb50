"""Shared-memory segments that disappear with the processes that map them.

The memory is mapped and owned by Rust (``elastix._core.collectives.Segment``): Python reaches
its words by byte offsets (``load``, ``publish``, ``Waiter``), checked for bounds and alignment,
and its bytes through the buffer protocol (``np.frombuffer(segment, ...)``, ``memoryview``).
``close()`` ends the waits in progress and returns once they have left; the memory is unmapped
when the last NumPy view of it is gone too, so no order of calls can reach unmapped memory.

Default (``ELASTIX_SHM=auto``): a memfd where the other ranks can open it, else a file.

``ELASTIX_SHM=memfd``: the creator makes an anonymous ``memfd`` (sealed against shrinking) and
the others open it through ``/proc/<creator pid>/fd/<fd>``. There is no name anywhere, so
nothing can be left behind: the memory is freed when the last process that maps it exits,
however it exits. Only a privileged process can open an undumpable one's descriptors that way,
and a worker that loaded the job secret makes itself undumpable: for an ordinary user, such a
job's segments are files.

``ELASTIX_SHM=file`` (and where memfd is unavailable or cannot be attached): a file in /dev/shm
with a unique name, readable by its owner only, space reserved up front (a full /dev/shm is an
error now, not a SIGBUS later), unlinked as soon as every rank has attached; from then on it is
as nameless as a memfd. A creator that crashes before the unlink leaves a file named after its
pid, which the next creator on the host removes (``sweep_stale``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import numpy.typing as npt

from .._core import collectives as _mod

if TYPE_CHECKING:
    from .._core import Segment
else:
    Segment = _mod.Segment

SHM_DIR = "/dev/shm"
PREFIX = "elastix-cc-"
PAGE = 4096


def _method() -> str:
    method = os.environ.get("ELASTIX_SHM", "auto").lower()
    if method not in ("auto", "memfd", "file"):
        raise ValueError(f"ELASTIX_SHM must be 'auto', 'memfd' or 'file', not {method!r}")
    if method == "auto":
        # an undumpable process's memfds open for privileged peers only
        method = "memfd" if _mod.memfd_attachable() else "file"
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


def create(size: int, method: Optional[str] = None) -> Segment:
    """A new segment of ``size`` bytes (rounded up to pages), zeroed."""
    method = method or _method()
    if method == "memfd":
        return Segment.create(size)
    sweep_stale()
    try:
        return Segment.create(size, SHM_DIR)
    except OSError as err:
        raise type(err)(f"{err}; make /dev/shm larger, or lower ELASTIX_SHM_SLOT_BYTES") from None


def view(segment: Segment, dtype: npt.DTypeLike, count: int = -1, offset: int = 0) -> np.ndarray[Any, Any]:
    """A NumPy array over the segment's bytes (it keeps the mapping alive)."""
    # typeshed's Buffer, before Python 3.12, names the builtin buffer types only
    return np.frombuffer(segment, dtype=dtype, count=count, offset=offset)  # type: ignore[call-overload]


def attach(handle: Union[str, bytes, bytearray]) -> Segment:
    """Maps the segment whose ``encode()``d handle (str or bytes) another process published."""
    if isinstance(handle, (bytes, bytearray)):
        handle = handle.decode()
    try:
        return Segment.attach(handle)
    except OSError as err:
        hint = f"; set ELASTIX_SHM=file to use {SHM_DIR} instead" if '"memfd"' in handle else ""
        raise type(err)(f"{err}{hint}") from None


__all__ = ["Segment", "create", "attach", "view", "sweep_stale", "PAGE"]

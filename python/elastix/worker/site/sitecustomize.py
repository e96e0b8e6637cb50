"""Run at the start-up of every Python worker of ``elastix run``: the agent puts this directory
first on the worker's ``PYTHONPATH``. Standard library only: nothing of elastix is imported.

1. A warm standby (``ELASTIX_STANDBY_FD`` set; see elastix/agent/standby.py) waits here for its
   activation on that descriptor: the worker's whole environment, ``KEY=VALUE`` entries each
   ended by a NUL byte. Nothing at all means the agent no longer needs this standby, which then
   exits. While it waits, its name (``/proc/self/comm``: what ``ps -e``, ``top`` and ``pgrep``
   show) is ``elastix-standby``, so that it is not taken for a worker; the worker gets its own
   name back.
2. Hang detection, so that it needs no change to the program (plain torch scripts that never
   import elastix are watched too). In the worker itself (not in children it starts with spawn
   or forkserver, which inherit the variables: the slot names the pid that claimed it), with a
   heartbeat slot (``ELASTIX_HEARTBEAT_FILE``, ``ELASTIX_HEARTBEAT_SLOT``; see
   rust/core/src/agent/hangs/heartbeats.rs): the slot is claimed with this process's pid, which the
   agent then watches through the kernel (whether its main thread runs at all, and its CPU
   use: rust/core/src/agent/hangs/activity.rs), and ``faulthandler`` is armed on a real-time signal,
   writing every thread's stack to ``ELASTIX_STACKS_FILE`` (the slot says which signal; the
   agent sends it before it kills a hung worker, and for ``elastix dump``). Nothing runs in
   the worker afterwards: no thread, no timer.
3. Then it leaves no trace (off ``sys.path`` and ``sys.modules``) and runs the ``sitecustomize``
   a plain start would have run, and start-up goes on.
"""

import os
import sys

_WORDS = 32  # a slot's 64-bit words, as the agent reads them
_DUMP_SIGNAL, _OWNER = 3, 5


_STANDBY_NAME = b"elastix-standby"  # at most 15 bytes: the kernel's limit for a name


def _rename(name: bytes) -> None:
    try:
        with open("/proc/self/comm", "wb") as comm:
            comm.write(name)
    except OSError:
        pass  # a name is for people: nothing depends on it


def _wait_for_the_worker_environment(fd: int) -> None:
    try:
        with open("/proc/self/comm", "rb") as comm:
            own = comm.read().rstrip(b"\n")
    except OSError:
        own = b""
    _rename(_STANDBY_NAME)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    if not chunks:
        os._exit(0)
    if own:
        _rename(own)
    os.environb.clear()
    for entry in b"".join(chunks).split(b"\0"):
        if entry:
            key, _, value = entry.partition(b"=")
            os.environb[key] = value


def _claim() -> "tuple[memoryview, int] | None":  # quoted: no typing import in every worker
    """This worker's slot as 64-bit words and its first word's index, or None."""
    path, slot = os.environ.get("ELASTIX_HEARTBEAT_FILE"), os.environ.get("ELASTIX_HEARTBEAT_SLOT")
    if not path or not slot:
        return None
    import mmap

    try:
        with open(path, "r+b") as page:
            words = memoryview(mmap.mmap(page.fileno(), 0)).cast("Q")
        base = int(slot) * _WORDS
        if base + _WORDS > len(words) or words[base + _OWNER] not in (0, os.getpid()):
            return None  # not this slot's worker: a child started with spawn or forkserver
    except (OSError, ValueError):
        return None  # the agent's page is gone: nothing to report to
    words[base + _OWNER] = os.getpid()
    return words, base


def _arm_stack_dumps(words: memoryview, base: int) -> None:
    path = os.environ.get("ELASTIX_STACKS_FILE")
    if not path:
        return
    import faulthandler
    import signal

    number = signal.SIGRTMIN + 3  # a real-time signal: no program uses it for anything else
    # faulthandler keeps the file (and so its descriptor) for as long as the signal is registered
    faulthandler.register(number, file=open(path, "a"), all_threads=True)
    words[base + _DUMP_SIGNAL] = number


def _step_aside() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if not (entry and os.path.realpath(entry) == here)]
    sys.path_importer_cache.pop(here, None)
    del sys.modules[__name__]
    try:
        import sitecustomize  # noqa: F401  (the one a plain start runs; the import takes its place)
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        raise ImportError("no sitecustomize besides elastix's", name="sitecustomize") from None


def _start() -> None:
    claimed = _claim()
    if claimed is None:
        return
    _arm_stack_dumps(*claimed)


_fd = os.environ.get("ELASTIX_STANDBY_FD")
if _fd is not None:
    _wait_for_the_worker_environment(int(_fd))
try:
    _start()
except Exception as error:  # never the reason a worker does not start
    print(f"elastix: hang detection is off for this worker: {error!r}", file=sys.stderr)
_step_aside()

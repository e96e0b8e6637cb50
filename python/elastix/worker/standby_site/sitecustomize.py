"""Run at the start-up of every interpreter with this directory on ``sys.path``: the warm
standby workers of elastix/agent/standby.py.

With ``ELASTIX_STANDBY_FD`` set, it waits for the activation on that descriptor: the worker's
whole environment, ``KEY=VALUE`` entries each ended by a NUL byte. Nothing at all means the
agent no longer needs this standby, which then exits. Then, and without the variable, it
leaves no trace: off ``sys.path`` and ``sys.modules``, it runs the ``sitecustomize`` a cold
start would have run, and start-up goes on. It imports nothing beyond what site already has.
"""

import os
import sys


def _wait_for_the_worker_environment(fd: int) -> None:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    if not chunks:
        os._exit(0)
    os.environb.clear()
    for entry in b"".join(chunks).split(b"\0"):
        if entry:
            key, _, value = entry.partition(b"=")
            os.environb[key] = value


def _step_aside() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if not (entry and os.path.realpath(entry) == here)]
    sys.path_importer_cache.pop(here, None)
    del sys.modules[__name__]
    try:
        import sitecustomize  # noqa: F401  (the one a cold start runs; the import takes its place)
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        # none: site ignores this error alone, and the import system forgets this module, as
        # after a cold start without one
        raise ImportError("no sitecustomize besides elastix's standby", name="sitecustomize") from None


_fd = os.environ.get("ELASTIX_STANDBY_FD")
if _fd is not None:
    _wait_for_the_worker_environment(int(_fd))
_step_aside()

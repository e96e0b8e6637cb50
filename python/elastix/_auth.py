"""The job's shared secret, which proves that a process belongs to the job.

Loading and checking it is the core's (one loader for Rust and Python): ``ELASTIX_AUTH_TOKEN_FILE``
names a file holding it (preferred), which must be the user's own regular file (not a symbolic
link), private to its owner (mode 0600 or stricter) and not in a directory everyone may write to,
as ssh demands of keys; ``ELASTIX_AUTH_TOKEN`` holds it inline, with a warning, because environment
variables leak. A secret shorter than 16 bytes or visibly guessable is refused: ``elastix secret
FILE`` writes a strong one. A process that loaded the secret cannot be dumped (no core file, no
debugger of another user's process).

The secret never reaches Python: it stays in the core, and Python holds a ``JobSecret`` handle
whose repr names only where it came from.
"""

from __future__ import annotations

from typing import Optional

from . import _core

FILE_ENV = "ELASTIX_AUTH_TOKEN_FILE"
TOKEN_ENV = "ELASTIX_AUTH_TOKEN"


def load_secret() -> Optional[_core.JobSecret]:
    """The job's secret, or None without one. A variable that is set but empty, a file others
    may read or change, and a weak secret raise PermissionError saying why: each would
    silently weaken the job."""
    return _core.load_job_secret()


def write_secret(path: str) -> None:
    """Writes a new strong secret to ``path`` (which must not exist yet), mode 0600."""
    _core.write_job_secret(path)


__all__ = ["FILE_ENV", "TOKEN_ENV", "load_secret", "write_secret"]

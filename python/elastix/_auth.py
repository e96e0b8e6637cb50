"""The job's shared secret, which proves that a process belongs to the job.

``ELASTIX_AUTH_TOKEN_FILE`` names a file holding it (preferred): the file must be private to its
owner (mode 0600 or stricter), as ssh demands of keys, and trailing whitespace is dropped, so
``openssl rand -hex 32 > token`` works. ``ELASTIX_AUTH_TOKEN`` holds it inline; that works, with a
warning, because environment variables leak (``/proc/<pid>/environ``, children, crash reports).
Neither set: no secret, and callers fall back to what the store alone can keep private.

The secret never appears in a message, a log line or a repr.
"""

from __future__ import annotations

import os
import stat
import warnings
from typing import Optional

FILE_ENV = "ELASTIX_AUTH_TOKEN_FILE"
TOKEN_ENV = "ELASTIX_AUTH_TOKEN"


def _read_file(path: str) -> bytes:
    # open first, then check the descriptor: what is checked is what is read
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise type(err)(err.errno, f"{FILE_ENV}={path}: cannot open the secret file ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{FILE_ENV}={path}: the secret must be a regular file")
        if st.st_mode & 0o077:
            raise PermissionError(
                f"{FILE_ENV}={path}: the secret file has mode {stat.S_IMODE(st.st_mode):04o}, so users other than "
                f"its owner may read or change it; chmod 600 it (elastix refuses it, as ssh refuses such keys)"
            )
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_secret() -> Optional[bytes]:
    """The job's secret: from the file named by ELASTIX_AUTH_TOKEN_FILE, else from
    ELASTIX_AUTH_TOKEN (with a warning), else None. A variable that is set but empty, an empty
    secret and a file others can read or write are errors: each would silently weaken the job."""
    path = os.environ.get(FILE_ENV)
    if path is not None:
        if not path:
            raise ValueError(f"{FILE_ENV} is set but empty; name the secret file, or unset it")
        secret = _read_file(path).rstrip()
        if not secret:
            raise ValueError(f"{FILE_ENV}={path}: the secret file is empty")
        return secret
    token = os.environ.get(TOKEN_ENV)
    if token is None:
        return None
    secret = token.encode().rstrip()
    if not secret:
        raise ValueError(f"{TOKEN_ENV} is set but empty; set a secret, or unset it")
    # warnings shows this once per process (the default filter), not once per group
    warnings.warn(
        f"the job secret comes from {TOKEN_ENV}: environment variables leak (to child processes, "
        f"/proc/<pid>/environ, crash reports); prefer {FILE_ENV} naming a file of mode 0600",
        UserWarning,
        stacklevel=2,
    )
    return secret


__all__ = ["FILE_ENV", "TOKEN_ENV", "load_secret"]

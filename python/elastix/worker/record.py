"""``@elastix.record``: on an uncaught exception, write torch's ``error.json`` to the file the
agent named, so the launcher can show the real traceback as the failure's root cause.

Format (torch's, read by torch's and elastix's agents alike)::

    {"message": {"message": "ValueError: bad lr",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1718000000"}}}

The file is ``TORCHELASTIC_ERROR_FILE``, and also ``ELASTIX_ERROR_FILE`` if that is set to
another path. Without either, nothing is written. ``SystemExit(0)`` counts as a normal return
(scripts run with ``--run-path`` end that way); any other SystemExit and KeyboardInterrupt pass
through unrecorded, as in torch. Kept light: json and traceback load only when an error occurs.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, List, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ERROR_FILE_VARS = ("TORCHELASTIC_ERROR_FILE", "ELASTIX_ERROR_FILE")


class ErrorHandler:
    """What ``record`` does at start and on failure (torch's ErrorHandler methods); subclass it
    and pass ``record(fn, error_handler=...)`` to change it."""

    def error_files(self) -> List[str]:
        files: List[str] = []
        for name in ERROR_FILE_VARS:
            path = os.environ.get(name)
            if path and path not in files:
                files.append(path)
        return files

    def initialize(self) -> None:
        """Dump every thread's stack on a fatal signal (SIGSEGV, SIGABRT, ...)."""
        import faulthandler
        import sys

        try:
            if sys.stderr is not None:
                faulthandler.enable(all_threads=True)
        except Exception:  # stderr without a file descriptor (e.g. captured)
            pass

    def record_exception(self, e: BaseException) -> None:
        import time
        import traceback

        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(type(e), e, _user_frames(e))),
                    # whole seconds, as a string: torch's readers do int() on it
                    "timestamp": str(int(time.time())),
                },
            }
        }
        self._write_all(data)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a failed child's error file to ours (setting ``errorCode``), so that a launcher
        run by another launcher passes its workers' root cause up."""
        import json

        with open(rootcause_error_file) as f:
            data = json.load(f)
        if error_code and isinstance(data.get("message"), dict):
            data["message"]["errorCode"] = error_code
        self._write_all(data)

    def _write_all(self, data: Any) -> None:
        import json

        text = json.dumps(data)
        for path in self.error_files():
            _write_atomically(path, text)


def _user_frames(e: BaseException) -> Any:
    """The traceback without its leading frames in elastix's wrappers and runpy, which the
    root-cause summary would otherwise show before the user's own code (the last frame stays)."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (filename.startswith(here) or filename in ("<frozen runpy>", "<frozen importlib._bootstrap>")
                or filename.endswith(os.sep + "runpy.py")):  # fmt: skip
            break
        tb = tb.tb_next
    return tb


def _write_atomically(path: str, text: str) -> None:
    # the agent may read the file as soon as the process exits: never let it see half a file
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:
        import warnings

        warnings.warn(f"elastix.record: could not write the error file {path}: {err}", stacklevel=3)


def record(fn: Optional[F] = None, error_handler: Optional[ErrorHandler] = None) -> Any:
    """Decorate a worker's entry function (``@record``, or ``@record(error_handler=h)``)."""
    if fn is None:
        return lambda f: record(f, error_handler)
    handler = error_handler or ErrorHandler()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code == 0:
                return None
            raise
        except Exception as e:
            from ..errors import ChildFailedError

            if isinstance(e, ChildFailedError):
                _, failure = e.get_first_failure()
                if failure.error_file and os.path.isfile(failure.error_file):
                    handler.dump_error_file(failure.error_file, failure.exitcode)
            else:
                handler.record_exception(e)
            raise

    return wrapper


__all__ = ["record", "ErrorHandler", "ERROR_FILE_VARS"]

"""elastix's log output. Library use: the core's events arrive in Python's ``logging`` under
the ``elastix`` logger (see rust/python/src/logging.rs), next to Python's own, and nothing is
configured for you. Command-line use (``elastix run``): :func:`setup_cli` sends both to stderr
at one level, ``--log-level`` / ``ELASTIX_LOG_LEVEL`` (default ``info``), with ``RUST_LOG`` for
detail in the core."""

from __future__ import annotations

import logging
from typing import Optional

LOGGER = logging.getLogger("elastix")

DEFAULT_CLI_LEVEL = "info"

# Python's levels for the names the core accepts (a tracing directive counts as info).
_PYTHON_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 1,
}


def setup_cli(level: Optional[str], node: Optional[str] = None) -> None:
    """Both pipelines to stderr at ``level``, each line naming ``node`` when given (an agent's
    lines do); ValueError, naming the flag, for a bad level."""
    from . import _core

    level = (level or DEFAULT_CLI_LEVEL).strip()
    try:
        _core.init_cli_logging(level, node)
    except ValueError as err:
        raise ValueError(f"--log-level: {err}") from None
    LOGGER.handlers[:] = [_CoreHandler()]
    LOGGER.setLevel(_PYTHON_LEVELS.get(level.lower(), logging.INFO))
    LOGGER.propagate = False


class _CoreHandler(logging.Handler):
    """Hands the CLI's records to the core's stderr subscriber: Python's lines and the core's
    share one form (timestamp, level, node) and one writer, so they never interleave."""

    def emit(self, record: logging.LogRecord) -> None:
        from . import _core

        try:
            _core.log_line(record.levelno, self.format(record))
        except Exception:  # a record that cannot be formatted must not end the program
            self.handleError(record)


def warn(message: str) -> None:
    """A warning about the configuration the user gave (logged, so it follows the level)."""
    LOGGER.warning(message)


__all__ = ["LOGGER", "setup_cli", "warn"]

"""A worker of an elastix job that dies of a broken collective (a peer's loss: ``PeerError``)
says so in two lines instead of a traceback through the collectives' internals: when a node
dies, every survivor's worker fails this way at once, and their interleaved tracebacks would
bury the agent's one line naming what was lost. The last line stays Python's own
(``module.PeerError: message``), which the agent's failure summary reads;
``ELASTIX_FULL_TRACEBACK=1`` prints the whole traceback. Installed by ``init_process_group``
in workers that ``elastix run`` started (``ELASTIX_ROUND`` set); anything else, a stranger's
``AuthenticationError`` included, keeps the hook that was there."""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType
from typing import Callable, Optional, Type

from .errors import AuthenticationError, PeerError

FULL_VAR = "ELASTIX_FULL_TRACEBACK"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Hook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], object]


def install() -> None:
    """Folds uncaught peer errors in this process (once; a second call changes nothing)."""
    if os.environ.get("ELASTIX_ROUND") is None or getattr(sys.excepthook, "_elastix_folds", False):
        return
    sys.excepthook = _folding(sys.excepthook)


def _folding(previous: Hook) -> Hook:
    def hook(kind: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> object:
        if not _folds(kind) or os.environ.get(FULL_VAR, "") not in ("", "0"):
            return previous(kind, value, tb)
        sys.stderr.write(folded(kind, value, tb))
        sys.stderr.flush()
        return None

    hook._elastix_folds = True  # type: ignore[attr-defined]
    return hook


def _folds(kind: Type[BaseException]) -> bool:
    return issubclass(kind, PeerError) and not issubclass(kind, AuthenticationError)


def folded(kind: Type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> str:
    """The two lines: where the program was (its own innermost frame), then Python's last line."""
    frames = [frame for frame in traceback.extract_tb(tb) if not frame.filename.startswith(_PACKAGE)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    rank = os.environ.get("RANK", "?")
    head = (
        f"rank {rank}: a collective broke{where}, its traceback folded: a peer's loss breaks every "
        f"survivor's collectives, and the agent names what was lost ({FULL_VAR}=1 prints it)\n"
    )
    return head + "".join(traceback.format_exception_only(kind, value))

"""Exceptions raised by elastix.

The hierarchy is torch.distributed's, so code written against torch catches elastix errors
unchanged: ``DistError`` < ``RuntimeError``; ``DistStoreError``, ``DistNetworkError`` and
``DistBackendError`` < ``DistError``; ``QueueEmptyError`` < ``DistStoreError``.
elastix adds a ``TimeoutError`` subclass for every deadline, so ``except TimeoutError`` works.

Once ``torch.distributed`` is loaded, a store error is raised as :func:`raised` makes it: an
instance of torch's own class (``except torch.distributed.DistStoreError`` and friends catch
it) that builtin ``except`` clauses catch exactly as they catch torch's (a timeout is then not
a ``TimeoutError``, as torch's is not).

``ChildFailedError`` (workers failed, raised by the launcher) is here too, with the other
errors, so that worker code (``elastix.worker.record``) can catch it without importing the
launcher; ``elastix.agent.failures`` re-exports it beside ``ProcessFailure``.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple, Type

#: What torch shows for a field it does not know (a worker without an error file).
NOT_AVAILABLE = "<N/A>"


class DistError(RuntimeError):
    """Base class of elastix's distributed errors."""


class DistStoreError(DistError):
    """A store operation failed (including a wait that timed out)."""


class DistNetworkError(DistError):
    """Connecting to, or talking with, a store server failed."""


class DistBackendError(DistError):
    """A collective backend failed."""


class QueueEmptyError(DistStoreError):
    """A non-blocking ``queue_pop`` found the queue empty."""


class StoreTimeoutError(DistStoreError, TimeoutError):
    """A wait, get, barrier, or a master's wait for its workers passed its deadline."""


class NetworkTimeoutError(DistNetworkError, TimeoutError):
    """No connection could be made, or the server sent no reply, before the deadline."""


class AuthenticationError(DistNetworkError):
    """The store and this process do not share the job secret (one lacks it, or they hold
    different ones): set ``ELASTIX_AUTH_TOKEN_FILE`` to the job's secret file."""


class RendezvousError(RuntimeError):
    """Base class of rendezvous errors (torch's names)."""


class RendezvousClosedError(RendezvousError):
    """The job's rendezvous is closed: the job is over."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A rendezvous deadline passed; the message says who joined and what was missing."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous store could not be reached."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is unreadable (another elastix version?)."""


class RendezvousGracefulExitError(RendezvousError):
    """A spare node leaves because the job finished without it; not a failure."""


class SignalException(Exception):
    """The agent stopped because it received a signal (torch's name); ``sigval`` is the signal.
    The workers got the same signal, and the rendezvous stays open for the other nodes."""

    def __init__(self, msg: str, sigval: int) -> None:
        super().__init__(msg)
        import signal

        try:
            self.sigval = signal.Signals(sigval)
        except ValueError:
            self.sigval = sigval  # type: ignore[assignment]


class ProcessFailureLike(Protocol):
    """What ChildFailedError reads of a failure (``elastix.agent.failures.ProcessFailure`` is
    one): the errors stay below the launcher that makes them."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: Optional[str]
    timestamp: Optional[float]
    host: str
    signal: Optional[str]
    hung: Optional[str]
    held_others_up: bool

    def traceback(self) -> str: ...


class ChildFailedError(Exception):
    """Workers failed: ``name`` is the program, ``failures`` maps global rank to failure (an
    ``elastix.agent.failures.ProcessFailure``). The message is torch's table with the root cause
    last, as the agent prints it: the agent's rule chooses the root cause (a rank the others
    waited for in a collective, else the first observed failure) and its renderer writes the
    table (``_core.failure_summary``)."""

    def __init__(self, name: str, failures: Mapping[int, ProcessFailureLike]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        import json

        from ._core import failure_summary

        self.name = name
        self.failures: Dict[int, ProcessFailureLike] = dict(failures)
        self._text, root = failure_summary(name, json.dumps([_agent_form(r, f) for r, f in self.failures.items()]))
        self._root_rank = list(self.failures)[root]
        super().__init__(self.format_msg())

    def get_first_failure(self) -> Tuple[int, ProcessFailureLike]:
        """The root cause (torch's name: with torch's rule it is the earliest failure)."""
        return self._root_rank, self.failures[self._root_rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        text = self._text
        if (boarder_delim, section_delim) != ("=", "-"):
            lines = text.split("\n")
            rules = {0: boarder_delim, len(lines) - 1: boarder_delim}
            text = "\n".join(
                rules.get(i, section_delim) * len(line) if line and set(line) <= {"=", "-"} else line
                for i, line in enumerate(lines)
            )
        return "\n" + text


def _agent_form(rank: int, failure: ProcessFailureLike) -> Dict[str, Any]:
    """A failure as the agent's renderer reads it."""
    return {
        "global_rank": rank,
        "local_rank": failure.local_rank,
        "host": failure.host or _hostname(),
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal if failure.exitcode < 0 else None,
        "timestamp": failure.timestamp or 0.0,
        "error_file": None if failure.error_file in (None, NOT_AVAILABLE) else failure.error_file,
        "message": failure.traceback(),
        "hung": failure.hung,
        "held_others_up": failure.held_others_up,
    }


def _hostname() -> str:
    import socket

    return socket.gethostname()


# The torch class each store error is, for code that catches torch's classes.
_TORCH_CLASS = {
    "DistStoreError": "DistStoreError",
    "StoreTimeoutError": "DistStoreError",
    "QueueEmptyError": "QueueEmptyError",
    "DistNetworkError": "DistNetworkError",
    "NetworkTimeoutError": "DistNetworkError",
    "AuthenticationError": "DistNetworkError",
}
_TORCH_FLAVOURS: Dict[type, type] = {}


def raised(cls: Type[DistError], message: str) -> DistError:
    """The store error to raise: ``cls(message)``; or, once torch.distributed is loaded, an
    error that every ``except`` clause catches exactly as it catches torch's own stores' error
    for the same event (torch's class, and no builtin ``TimeoutError`` since torch's store
    errors are not one), which is still an instance of the elastix class when that class adds
    no builtin base to torch's."""
    torch_distributed = sys.modules.get("torch.distributed")
    torch_name = _TORCH_CLASS.get(cls.__name__)
    torch_class = getattr(torch_distributed, torch_name, None) if torch_name else None
    if torch_class is None:
        return cls(message)
    flavour = _TORCH_FLAVOURS.get(cls)
    if flavour is None:
        # the elastix class, less its TimeoutError: e.g. StoreTimeoutError -> DistStoreError
        ours = next(base for base in cls.__mro__ if not issubclass(base, TimeoutError))
        flavour = type(cls.__name__, (torch_class, ours), {"__module__": __name__, "__doc__": cls.__doc__})
        _TORCH_FLAVOURS[cls] = flavour
    return flavour(message)  # type: ignore[no-any-return]


__all__ = [
    "DistError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendError",
    "QueueEmptyError",
    "StoreTimeoutError",
    "NetworkTimeoutError",
    "AuthenticationError",
    "RendezvousError",
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousGracefulExitError",
    "SignalException",
    "ChildFailedError",
]

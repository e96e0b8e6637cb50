"""Exceptions raised by elastix.

The hierarchy is torch.distributed's, so code written against torch catches elastix errors
unchanged: ``DistError`` < ``RuntimeError``; ``DistStoreError``, ``DistNetworkError`` and
``DistBackendError`` < ``DistError``; ``QueueEmptyError`` < ``DistStoreError``.
elastix adds a ``TimeoutError`` subclass for every deadline, so ``except TimeoutError`` works.
"""


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
]

"""Errors of the collectives (all are torch's ``DistError`` family, so ``except DistError``
and ``except DistBackendError`` catch them as they catch torch's)."""

from __future__ import annotations

from typing import Optional, Sequence

from ..errors import DistBackendError, DistError


class CollectiveError(DistBackendError):
    """A collective failed; the group may be unusable afterwards (see the message)."""


class MismatchError(CollectiveError, ValueError):
    """Ranks called a collective with different shapes, dtypes, ops, roots, or different
    collectives. Between ranks of one host (shared memory) every rank raises it in the same
    call and the group stays usable. Over TCP the mismatched calls' data is already in flight,
    so the group is unusable afterwards (destroy it and make a new one): the ranks that read a
    mismatched header raise it, the others when they next find a connection closed (a rank
    that only sends, such as a broadcast's root, may finish that call first). The message
    says which case it is."""


class PeerError(CollectiveError):
    """A peer died, closed its connection or gave up; ``rank`` is its global rank."""

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """Peers did not arrive before the group's timeout; ``ranks`` are their global ranks."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class AuthenticationError(PeerError):
    """A connection failed the group's handshake: the other end does not hold this group's key
    (a stranger, a process of another job or round, or a garbled stream). ``address`` is the
    other end's ``host:port``; ``rank`` the global rank it claimed or was expected to be (None when
    the claim is not a rank of the group)."""

    def __init__(self, message: str, address: str, rank: Optional[int] = None) -> None:
        super().__init__(message, rank)
        self.address = address


class NotInitializedError(DistError, ValueError):
    """A collective was called before ``init_process_group`` (torch raises ValueError too)."""


class GroupError(DistError, ValueError):
    """A group was misused: this rank is not a member, the group was destroyed, or a rank
    given is not in it."""


class BackendUnavailableError(DistError, ImportError):
    """The backend asked for needs something that is not installed (the message says what)."""


__all__ = [
    "CollectiveError",
    "MismatchError",
    "PeerError",
    "CollectiveTimeoutError",
    "AuthenticationError",
    "NotInitializedError",
    "GroupError",
    "BackendUnavailableError",
]

"""What a mismatch means for a group, said the same way on both paths.

In shared memory every rank compares every rank's descriptor before any data moves, so all
raise ``MismatchError`` in the same step and the group stays usable. Over TCP a rank sees only
the headers of the peers it reads from, and the mismatched calls' data is already in flight on
the connections: the group cannot go on. The rank that finds the mismatch leaves it in the
group's store (``mismatch``) before it closes its connections, so that the ranks which only see
the consequence (a closed connection, an aborted host leader) raise ``MismatchError`` with the
cause too, rather than a ``PeerError`` about a peer that is alive and well.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

STILL_USABLE = "the group is still usable"
UNUSABLE = (
    "over TCP the mismatched calls' data is in flight between the ranks, so this group is unusable now: "
    "destroy it and create a new one"
)
KEY = "mismatch"
# Read when a connection closes: a store that is gone too must not delay the PeerError long.
PROBE_TIMEOUT = timedelta(seconds=0.5)


class MismatchRecord:
    """The group's record of a mismatch found over TCP (on a connection of its own, with a
    short timeout)."""

    def __init__(self, store) -> None:
        self._store = store.clone()
        self._store.set_timeout(PROBE_TIMEOUT)

    def write(self, message: str) -> None:
        try:
            self._store.set(KEY, message)
            # SET has no reply in the wire protocol: a request that has one, on the same
            # connection, returns once the server has applied it (before anyone is told)
            self._store.check([KEY])
        except Exception:  # the store is gone too: the finder still raises; the others see a PeerError
            pass

    def read(self) -> Optional[str]:
        try:
            if self._store.check([KEY]):
                return self._store.get(KEY).decode(errors="replace")
        except Exception:
            pass
        return None


def seen_elsewhere(found: str, then: str) -> str:
    """The message of a rank that learned of another rank's finding (``then``: how it did)."""
    return f"{found} (found by another rank: {then}); {UNUSABLE}"


__all__ = ["MismatchRecord", "STILL_USABLE", "UNUSABLE", "seen_elsewhere"]

"""Point-to-point channels between two ranks of one host: a ring buffer in shared memory.

One segment per direction (src -> dst), made by the sender on its first send and announced in
the group's store; the receiver attaches on its first receive (the sender's first send waits
until it has, so the segment outlives a sender that exits right away). Each side owns one
position counter (single writer) and waits on the other's with the same spin/yield/futex wait
as the lock-step collectives, checking that the peer is alive. A message is a 128-byte
descriptor (kind, dtype, shape, tag) and the payload, streamed through the ring, so messages
larger than the ring work and the receiver can refuse one that does not match its buffer.
"""

from __future__ import annotations

import os
import struct
from typing import Dict, Optional

import numpy as np

from . import _native, shm_segment
from .errors import CollectiveError, CollectiveTimeoutError, MismatchError, PeerError
from .shm_comm import spin_policy
from .shm_segment import PAGE, Segment, view

HEADER = struct.Struct("<QQ14q")
MAGIC = 0x454C4153_54495850
W_POS, W_WAITERS, W_ABORT = 0, 128, 192  # sender-owned (write position)
R_POS, R_WAITERS, R_ABORT = 256, 384, 448  # receiver-owned (read position)
ATTACHED = 512


def capacity() -> int:
    return max(PAGE, int(os.environ.get("ELASTIX_SHM_P2P_BYTES", 1 << 20)) // PAGE * PAGE)


class _End:
    """One side of a channel."""

    def __init__(self, segment: Segment, sender: bool, peer_rank: int, pid: int, timeout: Optional[float]):
        self.segment = segment
        self.sender = sender
        self.peer_rank = peer_rank
        self.timeout = timeout
        self.cap = segment.size - PAGE
        self.data = view(segment, np.uint8, offset=PAGE)
        # the sender lets go of the segment's name once the receiver attached (first send)
        self.first = False
        spin, yield_us, check_ms = spin_policy(2)
        mine, theirs = (W_POS, R_POS) if sender else (R_POS, W_POS)
        their_waiters = R_WAITERS if sender else W_WAITERS
        my_waiters = W_WAITERS if sender else R_WAITERS
        their_abort = R_ABORT if sender else W_ABORT
        self.my_pos = mine
        self.my_waiters = my_waiters
        try:
            self.waiter = _native.Waiter(
                segment,
                [theirs],
                [their_abort],
                [their_waiters],
                [pid],
                own_flag=mine,
                own_waiters=my_waiters,
                own_abort=W_ABORT if sender else R_ABORT,
                spin_iters=spin,
                yield_us=yield_us,
                check_ms=check_ms,
            )
            self.attached_waiter = _native.Waiter(
                segment, [ATTACHED], [their_abort], [None], [pid], spin_iters=0, yield_us=0, check_ms=2
            )
        except ProcessLookupError:
            raise PeerError(f"rank {peer_rank} (pid {pid}) is already gone", peer_rank) from None
        self.pos = segment.load(mine)
        self.broken: Optional[str] = None

    def _wait(self, target: int, waiter=None) -> None:
        if target <= 0:
            return
        try:
            outcome = (waiter or self.waiter).wait(target, self.timeout)
        except ValueError:
            if self.segment.closed:  # destroyed by another thread
                raise CollectiveError(f"the channel with rank {self.peer_rank} was closed (group destroyed)") from None
            raise
        if outcome is None:
            return
        kind, _args = outcome
        if kind == "timeout":
            message = f"timed out after {self.timeout:.1f} s waiting for rank {self.peer_rank}"
            self.fail(message)
            raise CollectiveTimeoutError(message, [self.peer_rank])
        if kind == "closed":
            message = f"the group was destroyed while waiting for rank {self.peer_rank} in send/recv"
            self.broken = message
            raise CollectiveError(message)
        if kind == "dead":
            message = f"rank {self.peer_rank} died (its process exited) during send/recv"
        else:
            message = f"rank {self.peer_rank} refused or abandoned the message"
        self.fail(message)
        raise PeerError(message, self.peer_rank)

    def fail(self, reason: str) -> None:
        self.broken = reason
        try:
            self.waiter.abort(1)
        except Exception:
            pass

    def write(self, view: memoryview) -> None:
        n, done = len(view), 0
        src = np.frombuffer(view, dtype=np.uint8)
        while done < n:
            want = min(n - done, self.cap // 2)
            self._wait(self.pos + want - self.cap)  # the reader freed enough room
            start = self.pos % self.cap
            k = min(want, self.cap - start)
            self.data[start : start + k] = src[done : done + k]
            if k < want:
                self.data[: want - k] = src[done + k : done + want]
            self.pos += want
            done += want
            self.segment.publish(self.my_pos, self.my_waiters, self.pos)

    def read_into(self, view: memoryview) -> None:
        n, done = len(view), 0
        dst = np.frombuffer(view, dtype=np.uint8)
        while done < n:
            want = min(n - done, self.cap // 2)
            self._wait(self.pos + want)  # the writer wrote that much
            start = self.pos % self.cap
            k = min(want, self.cap - start)
            dst[done : done + k] = self.data[start : start + k]
            if k < want:
                dst[done + k : done + want] = self.data[: want - k]
            self.pos += want
            done += want
            self.segment.publish(self.my_pos, self.my_waiters, self.pos)

    def close(self) -> None:
        """Ends the waits on this channel (they fail), then lets go of the memory."""
        self.broken = self.broken or "the group was destroyed"
        self.segment.close()
        self.data = np.empty(0, np.uint8)  # our view goes; the memory with the last one


class ShmP2P:
    """The channels of this rank to and from the other ranks of its host."""

    def __init__(self, store, me: int, ranks, pids: Dict[int, int], timeout: Optional[float]):
        # sends and receives run on different threads: each gets its own store connection, so
        # that a receiver waiting for its peer's announcement does not hold up our own
        self.send_store = store.clone()
        self.recv_store = store.clone()
        self.me = me
        self.ranks = ranks  # global ranks by group rank
        self.pids = pids  # group rank -> pid, for local peers
        self.timeout = timeout
        self.out: Dict[int, _End] = {}
        self.inc: Dict[int, _End] = {}

    def _out(self, peer: int) -> _End:
        end = self.out.get(peer)
        if end is None:
            seg = shm_segment.create(PAGE + capacity())
            end = _End(seg, True, self.ranks[peer], self.pids[peer], self.timeout)
            self.send_store.set(f"p2p/{self.me}/{peer}", seg.encode())
            end.first = True
            self.out[peer] = end
        return end

    def _in(self, peer: int) -> _End:
        end = self.inc.get(peer)
        if end is None:
            seg = shm_segment.attach(self.recv_store.get(f"p2p/{peer}/{self.me}"))
            end = _End(seg, False, self.ranks[peer], self.pids[peer], self.timeout)
            seg.publish(ATTACHED, None, 1)
            self.inc[peer] = end
        return end

    def send(self, peer: int, header: bytes, payload: memoryview) -> None:
        end = self._out(peer)
        if end.broken:
            raise CollectiveError(f"the channel to rank {end.peer_rank} is unusable ({end.broken})")
        end.write(memoryview(header))
        end.write(payload)
        if end.first:
            end._wait(1, end.attached_waiter)
            end.segment.release_name()
            end.first = False

    def recv(self, peer: int, desc, payload: memoryview, what: str = "recv") -> None:
        end = self._in(peer)
        if end.broken:
            raise CollectiveError(f"the channel from rank {end.peer_rank} is unusable ({end.broken})")
        raw = bytearray(HEADER.size)
        end.read_into(memoryview(raw))
        fields = HEADER.unpack(raw)
        theirs = list(fields[2:])
        if fields[0] != MAGIC or theirs != list(desc):
            from .descriptor import describe

            message = (
                f"{what}: rank {self.ranks[self.me]} expected {describe(desc)} from rank "
                f"{end.peer_rank}, which sent {describe(theirs)}"
            )
            end.fail(message)
            raise MismatchError(message)
        end.read_into(payload)

    def close(self) -> None:
        for end in list(self.out.values()) + list(self.inc.values()):
            try:
                end.close()
            except OSError:
                pass
        self.out.clear()
        self.inc.clear()


__all__ = ["ShmP2P", "HEADER", "MAGIC"]

"""Lock-step exchange between the ranks of one host through a shared-memory segment.

Layout: a header page; one 512-byte control block per rank; then two data slots per rank
(double buffering). Control block, in bytes: [0] the rank's step counter (u64, only it writes
it, alone on its cache line); [64] and [192] the descriptor of its current collective (14
words; one copy per step parity, since a peer may already write step s + 1's while another
still reads step s's); [320] (u32) the sleepers waiting on its counter; [384] its abort code;
[392] its pid; [400] where the inputs of its current large all_reduce, reduce_scatter or
all_gather lie (four words, ``shm_shared.layout``; one copy: those collectives take at least
two steps, so no peer writes the next one's before every rank has read this one's).

A collective is a sequence of steps. In step s (counters start at 0, s >= 1), rank r:
  1. writes what it contributes into its own slot s % 2 (and its descriptor in the first step),
  2. publishes s (release store; futex wake if someone sleeps),
  3. waits until every peer published s (acquire loads; spin, yield, then futex),
  4. reads what it needs from the peers' slots s % 2.
Data written in step s may be read in step s and in step s + 1 (before the reader publishes
s + 1); a rank writes slot s % 2 again only in step s + 2, after every peer published s + 1, so
no one is still reading it. The first step of each collective compares descriptors, so ranks
that called different collectives, shapes, dtypes, ops or roots all raise ``MismatchError``
instead of exchanging garbage, and the group stays usable.

A peer that dies (pidfd/pid checked while waiting), gives up (abort word) or does not arrive
in time turns the wait into an error naming its rank; the group is then broken: this rank sets
its own abort word so that the others stop waiting for it too.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from .errors import CollectiveError, CollectiveTimeoutError, MismatchError, PeerError
from .mismatch import STILL_USABLE, MismatchRecord, seen_elsewhere
from .shm_segment import PAGE, Segment, view
from .shm_shared import LAYOUT_WORDS, NOT_SHARED, SharedArrays

CTRL_BYTES = 512
DESC_WORDS = 14
DESC_BYTES = (64, 192)
W_FLAG, W_WAITERS_BYTE, W_ABORT, W_PID, W_LAYOUT = 0, 320, 48, 49, 50

ABORT_ERROR = 1
ABORT_DESTROYED = 2
_ABORT_REASONS = {ABORT_ERROR: "failed", ABORT_DESTROYED: "destroyed the group"}


#: Bytes per rank per step. 2 MiB measured best on 2 ranks at 16 and 64 MiB (6.1-7.7 GB/s
#: busbw against 4.2-6.0 with 4 MiB, runs alternated; 4 ranks alike either way): the segment's
#: double buffers and a step's chunks stay in the shared cache.
SLOT_BYTES = 2 << 20


def default_slot_bytes() -> int:
    """A rank's slot in the segment (``ELASTIX_SHM_SLOT_BYTES`` overrides it)."""
    env = os.environ.get("ELASTIX_SHM_SLOT_BYTES")
    value = int(env) if env else SLOT_BYTES
    return max(PAGE, -(-value // PAGE) * PAGE)


def segment_bytes(nranks: int, slot_bytes: int) -> int:
    ctrl = -(-nranks * CTRL_BYTES // PAGE) * PAGE
    return PAGE + ctrl + 2 * nranks * slot_bytes


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_policy(nlocal: int) -> Tuple[int, int, int]:
    """(spin iterations, yield microseconds, check milliseconds). With more ranks than cores a
    spinning (or sched_yield-ing) rank keeps the core its peer needs, so it goes to sleep on
    the futex almost at once (measured: 4 ranks on 2 cores, 4 KiB all_reduce 1.3 ms with a
    2 ms yield phase, 86 us without)."""
    oversubscribed = nlocal > _cpus()
    spin = int(os.environ.get("ELASTIX_SPIN_ITERS", 50 if oversubscribed else 20000))
    yield_us = int(os.environ.get("ELASTIX_YIELD_US", 0 if oversubscribed else 300))
    return spin, yield_us, 2


class ShmComm:
    """The lock-step engine of one host's ranks of a group (``me`` is this rank's index)."""

    def __init__(
        self,
        segment: Segment,
        nranks: int,
        me: int,
        ranks: Sequence[int],
        pids: Sequence[int],
        timeout: Optional[float],
        slot_bytes: int,
        record: Optional[MismatchRecord] = None,
    ):
        self.segment = segment
        self.record = record  # a hierarchical group's record of a mismatch between hosts
        self.n = nranks
        self.me = me
        self.ranks = list(ranks)  # global ranks, for messages
        self.timeout = timeout
        self.slot_bytes = slot_bytes
        self.seq = 0
        self.broken: Optional[str] = None
        # largest all_reduce done in one step (shm_algos.small_limit), worked out on first use
        self.small_bytes: Optional[int] = None
        self._data_base = PAGE + (-(-nranks * CTRL_BYTES // PAGE) * PAGE)
        ctrl = view(segment, np.int64, nranks * CTRL_BYTES // 8, PAGE)
        ctrl[me * CTRL_BYTES // 8 + W_PID] = os.getpid()
        del ctrl
        peers = [j for j in range(nranks) if j != me]
        self._peers = peers
        spin, yield_us, check_ms = spin_policy(nranks)
        try:
            self.waiter = _native.Waiter(
                segment,
                [self._ctrl(j) for j in peers],
                [self._ctrl(j) + 8 * W_ABORT for j in peers],
                [self._ctrl(j) + W_WAITERS_BYTE for j in peers],
                [int(pids[j]) for j in peers],
                own_flag=self._ctrl(me),
                own_waiters=self._ctrl(me) + W_WAITERS_BYTE,
                own_abort=self._ctrl(me) + 8 * W_ABORT,
                spin_iters=spin,
                yield_us=yield_us,
                check_ms=check_ms,
                desc_offsets=DESC_BYTES,
                slots=(self._data_base, slot_bytes, nranks, me),
            )
        except ProcessLookupError as err:
            gone = [j for j in peers if str(pids[j]) in str(err)] or peers
            j = gone[0]
            raise PeerError(f"rank {self.ranks[j]} (pid {pids[j]}) is already gone", self.ranks[j]) from None
        # the arrays this host's ranks map (shared_empty), and where each rank's inputs lie
        self.shared = SharedArrays(me)
        self._layouts = [view(segment, np.int64, LAYOUT_WORDS, self._ctrl(j) + 8 * W_LAYOUT) for j in range(nranks)]
        slots = view(segment, np.uint8, 2 * nranks * slot_bytes, self._data_base)
        self._slots = [[slots[(j * 2 + b) * slot_bytes :][:slot_bytes] for b in range(2)] for j in range(nranks)]
        self._typed: Dict[tuple, np.ndarray] = {}

    @staticmethod
    def _ctrl(j: int) -> int:
        """The byte offset of rank j's control block in the segment."""
        return PAGE + j * CTRL_BYTES

    # -- slots ------------------------------------------------------------------------------

    @property
    def next_buf(self) -> int:
        """The slot buffer the next step writes."""
        return (self.seq + 1) & 1

    def slot(self, j: int, buf: int, dtype: np.dtype, offset: int = 0, count: int = -1) -> np.ndarray:
        """Rank j's slot ``buf`` as ``dtype`` elements from byte ``offset`` (aligned)."""
        key = (j, buf, dtype, offset)
        view = self._typed.get(key)
        if view is None:
            raw = self._slots[j][buf][offset:]
            usable = (raw.size // dtype.itemsize) * dtype.itemsize
            view = raw[:usable].view(dtype)
            if len(self._typed) > 4096:
                self._typed.clear()
            self._typed[key] = view
        return view if count < 0 else view[:count]

    # -- inputs in shared arrays -------------------------------------------------------------

    def publish_layout(self, arrays: Sequence[np.ndarray], writes: Sequence[np.ndarray]) -> None:
        """Says where this rank's inputs of the collective about to start lie (before its first
        step, which publishes it): ``shared.layout``'s words."""
        self._layouts[self.me][:] = self.shared.layout(arrays, writes) if self.shared.buffers else NOT_SHARED

    def agreed_layouts(self, count: int, size: int, itemsize: int) -> Optional[List[List[int]]]:
        """After the first step: every rank's layout, when all of them lie in shared arrays."""
        if not self.shared.buffers:
            return None  # this rank published none, so no rank agrees
        layouts = [[int(v) for v in words] for words in self._layouts]
        return layouts if self.shared.agreed(layouts, count, size, itemsize) else None

    # -- steps ------------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken is not None:
            raise CollectiveError(
                f"this group is unusable after an earlier failure ({self.broken}); destroy it and create a new one"
            )

    def step(self, desc: Optional[List[int]] = None, what: str = "collective") -> int:
        """Publishes the next step and waits for every peer; returns the buffer it used."""
        seq = self._next_seq()
        try:
            outcome = self.waiter.step(seq, desc, self.timeout)
        except ValueError:
            self._destroyed_first(what)
            raise
        if outcome is not None:
            self._fail(outcome, desc, what)
        return seq & 1

    def native_step(self, call: Callable[..., Any], desc: List[int], what: str, *args: Any) -> None:
        """A collective done in one step by the waiter's ``call`` (``all_reduce_small``,
        ``copy_small``, ``reduce_scatter_small``: copies in, the step, copies or a reduction
        out, natively), given ``args`` after the step's own."""
        seq = self._next_seq()
        try:
            outcome = call(seq, desc, self.timeout, *args)
        except ValueError:
            self._destroyed_first(what)
            raise
        if outcome is not None:
            self._fail(outcome, desc, what)

    def _next_seq(self) -> int:
        if self.broken is not None:
            self.check_usable()
        self.seq += 1
        return self.seq

    def _destroyed_first(self, what: str) -> None:
        if self.segment.closed:  # destroyed by another thread before this step began
            raise CollectiveError(f"{what}: the group was destroyed before this collective ran") from None

    def _fail(self, outcome, desc, what: str) -> None:
        kind, args = outcome
        if kind == "mismatch":
            j = self._peers[int(args[0])]
            mine = self._describe(desc)
            theirs = self._describe(self._peer_desc(j, len(desc), self.seq & 1))
            raise MismatchError(
                f"{what}: rank {self.ranks[self.me]} called {mine} but rank {self.ranks[j]} called {theirs}; "
                f"{STILL_USABLE}"
            )
        if kind == "timeout":
            late = [self.ranks[self._peers[int(i)]] for i in args]
            message = (
                f"{what}: timed out after {self.timeout:.1f} s waiting for rank(s) "
                f"{', '.join(map(str, late))} (they did not reach the same collective)"
            )
            self.abort(ABORT_ERROR, message)
            raise CollectiveTimeoutError(message, late)
        if kind == "closed":
            late = [self.ranks[self._peers[int(i)]] for i in args]
            waited = f" while waiting for rank(s) {', '.join(map(str, late))}" if late else ""
            message = f"{what}: the group was destroyed{waited}"
            self.broken = self.broken or message
            raise CollectiveError(message)
        j = self._peers[int(args[0])]
        rank = self.ranks[j]
        found = self.record.read() if kind != "dead" and self.record is not None else None
        if found is not None:  # the host's leader gave up on a mismatch between hosts
            self.abort(ABORT_ERROR, f"mismatch: {found}")
            raise MismatchError(seen_elsewhere(found, f"rank {rank}, this host's leader, gave up on it"))
        if kind == "dead":
            message = f"{what}: rank {rank} died (its process exited) before reaching this collective"
        else:
            reason = _ABORT_REASONS.get(int(args[1]), "gave up")
            message = f"{what}: rank {rank} {reason} before completing this collective"
        self.abort(ABORT_ERROR, message)
        raise PeerError(message, rank)

    def abort(self, code: int, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        try:
            self.waiter.abort(code)
        except Exception:
            pass

    def _peer_desc(self, j: int, count: int, parity: int) -> List[int]:
        words = view(self.segment, np.int64, count, self._ctrl(j) + DESC_BYTES[parity])
        return [int(v) for v in words]

    @staticmethod
    def _describe(desc: Sequence[int]) -> str:
        from .descriptor import describe

        return describe(desc)

    def close(self) -> None:
        """Drops this engine's views of the segment (the segment itself is closed by its owner)."""
        self._typed.clear()
        self._slots = []
        self._layouts = []
        self.shared.close()


__all__ = ["ShmComm", "segment_bytes", "default_slot_bytes", "spin_policy"]

"""Arrays every rank of a host maps (``shared_empty``), which collectives read in place.

A large all_reduce, reduce_scatter or all_gather over shared memory otherwise copies each
rank's input into its slot of the group's segment so that the peers can read it there: for
reduce_scatter that copy is a third of the bytes it moves (a 2-rank reduce_scatter of 64 MiB
reached 82-86% of its memory roofline with it). Inputs that live in memory the peers already
map need no copy: each rank reads the others' inputs where they are.

``SharedArrays`` is one host's list of such buffers. ``CpuBackend.shared_empty`` makes one per
call, collectively: each local rank creates a segment of the same size and maps everyone
else's, so the list is the same on every rank, in the same order. A collective then publishes,
in its first step, where its inputs lie (``layout``: four words); the ranks take the direct path
only if every rank's inputs lie in a shared buffer (``agreed``, a function of the published
words alone, so that every rank decides the same) and otherwise copy as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from .shm_segment import Segment, view

#: Words a rank publishes about its inputs: [buffer number (1-based, 0: not shared), byte offset
#: of the first input, bytes from one input to the next, buffers this rank holds].
LAYOUT_WORDS = 4
NOT_SHARED = [0, 0, 0, 0]


@dataclass
class SharedBuffer:
    """One buffer: every local rank's segment (its own among them), viewed as bytes."""

    nbytes: int
    segments: List[Segment]
    views: List[np.ndarray]
    #: The address of this rank's own buffer.
    base: int


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are the same bytes (not merely overlapping)."""
    return _address(a) == _address(b) and a.nbytes == b.nbytes


class SharedArrays:
    """The shared buffers of one host's ranks of a group."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.buffers: List[SharedBuffer] = []

    def add(self, segments: Sequence[Segment], nbytes: int) -> np.ndarray:
        """Registers the buffer whose segment on each local rank is ``segments[j]``; returns
        this rank's ``nbytes`` as a byte array."""
        views = [view(s, np.uint8, nbytes) for s in segments]
        own = views[self.me]
        self.buffers.append(SharedBuffer(nbytes, list(segments), views, _address(own)))
        return own

    def layout(self, arrays: Sequence[np.ndarray], writes: Sequence[np.ndarray] = ()) -> List[int]:
        """The words this rank publishes for ``arrays``, its inputs (all of one size, C-contiguous):
        where they lie in a shared buffer, evenly spaced, or ``NOT_SHARED``. Also not shared when
        one of ``writes`` overlaps an input the peers read (any but ``arrays[self.me]``, when
        there is one per rank): this rank writes those while they read."""
        if not self.buffers or not arrays:
            return NOT_SHARED
        first = _address(arrays[0])
        size = arrays[0].nbytes
        found = next((i for i, b in enumerate(self.buffers) if b.base <= first < b.base + b.nbytes), None)
        if found is None:
            return NOT_SHARED
        buffer = self.buffers[found]
        stride = _address(arrays[1]) - first if len(arrays) > 1 else 0
        offset = first - buffer.base
        if stride < 0 or offset + stride * (len(arrays) - 1) + size > buffer.nbytes:
            return NOT_SHARED
        if any(_address(a) != first + k * stride or a.nbytes != size for k, a in enumerate(arrays)):
            return NOT_SHARED
        if any(w.nbytes and self._overlaps_read(w, first, stride, size, len(arrays)) for w in writes):
            return NOT_SHARED
        return [found + 1, offset, stride, len(self.buffers)]

    def _overlaps_read(self, written: np.ndarray, first: int, stride: int, size: int, count: int) -> bool:
        """``written`` overlaps one of the ``count`` inputs from ``first`` that a peer reads."""
        start, end = _address(written), _address(written) + written.nbytes
        for k in range(count):
            if count > 1 and k == self.me:
                continue  # its own part: read and written by this rank only
            a = first + k * stride
            if start < a + size and a < end:
                return True
        return False

    def agreed(self, layouts: Sequence[Sequence[int]], count: int, size: int, itemsize: int) -> bool:
        """Whether every rank's ``count`` inputs of ``size`` bytes lie in a shared buffer, by
        the words they published (``layouts[j]`` rank j's): the same answer on every rank, as
        it reads nothing else that could differ between them (buffers are only ever added, the
        same on every rank, so one that every rank held when it published is the same size
        everywhere)."""
        held = {theirs for *_, theirs in layouts}
        if len(held) != 1:
            return False  # a shared_empty finished on some ranks and not yet (or never) on others
        (held_by_all,) = held
        if held_by_all > len(self.buffers):
            return False  # only after close(): the group is being destroyed
        for number, offset, stride, _ in layouts:
            if not 1 <= number <= held_by_all or offset < 0 or stride < 0 or offset % itemsize or stride % itemsize:
                return False
            if offset + stride * (count - 1) + size > self.buffers[number - 1].nbytes:
                return False
        return True

    def peer(self, j: int, layout: Sequence[int], k: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Rank j's ``k``-th input, as it published it, viewed as ``count`` ``dtype`` elements."""
        number, offset, stride, _ = layout
        start = offset + k * stride
        raw = self.buffers[number - 1].views[j][start : start + count * dtype.itemsize]
        return raw.view(dtype)

    def close(self) -> None:
        """Forgets the buffers: each segment is unmapped once no array of it is left."""
        self.buffers = []


__all__ = ["SharedArrays", "SharedBuffer", "LAYOUT_WORDS", "NOT_SHARED", "same_memory"]

"""The collectives of one host's ranks over a ``ShmComm`` (see shm_comm for the step rules).

Arrays here are C-contiguous 1-D NumPy arrays; reductions get them already viewed as the
kernel's dtype. Ranks are local indexes of the comm.

all_reduce, small messages: each rank copies its input into its slot, one step, and each rank
reduces all slots in rank order itself (one synchronisation; every rank computes the same sums
in the same order, so results are bit-identical), all in one native call (``all_reduce_small``).
Large messages: a pipelined reduce-scatter plus all-gather. The array is cut into segments of
(slot size) bytes and each segment into one chunk per rank; in step t a rank copies segment t's
chunks that others reduce into its slot, reduces its own chunk of segment t-1 from the peers'
slots (sources in rank order, its own chunk read from its array) into its array and its slot,
and after the step copies the other chunks of segment t-1 out of their owners' slots. Each rank
moves (p-1)/p of the data in and out, the reduction work is split p ways, and a segment stays
in cache between its steps.

all_gather writes outputs that no step reads again; when those of all local ranks together
outgrow the last-level cache they are copied with streaming stores (``_streams``).
"""

from __future__ import annotations

import functools
import glob
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from .shm_comm import ShmComm
from .shm_shared import same_memory

_U8 = np.dtype(np.uint8)


def small_limit(comm: ShmComm) -> int:
    """Largest all_reduce done in one step (measured crossover on 2 ranks: ~256 KiB; with more
    ranks each one reduces p copies, so lower)."""
    if comm.small_bytes is None:
        default = (256 << 10) if comm.n <= 2 else (64 << 10)
        comm.small_bytes = min(comm.slot_bytes, int(os.environ.get("ELASTIX_SHM_SMALL_BYTES", default)))
    return comm.small_bytes


@functools.lru_cache(maxsize=1)
def stream_bytes() -> int:
    """Outputs of all local ranks together above this are written around the caches
    (``ELASTIX_SHM_STREAM_BYTES`` overrides it; by default the last-level cache's size)."""
    env = os.environ.get("ELASTIX_SHM_STREAM_BYTES")
    if not env:
        return last_level_cache_bytes()
    if not env.isdigit():
        raise ValueError(f"ELASTIX_SHM_STREAM_BYTES must be a number of bytes, not {env!r}")
    return int(env)


def last_level_cache_bytes() -> int:
    """This machine's largest cache (sysfs; 32 MiB where it says nothing)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1:] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=32 << 20)


def _streams(comm: ShmComm, written: int) -> bool:
    """Whether a collective in which each rank writes ``written`` bytes of its output writes them
    around the caches: when the local ranks' outputs together outgrow the last-level cache, a
    store through it costs a read of the line first (a 2-rank all_gather of 64 MiB: 71-81% of
    the roofline, 87-95% streaming); below that, the outputs stay cached for the caller (a
    reduce_scatter, streaming its 4 MiB output, took 315 us against 190). A reduce_scatter of
    64 MiB gained nothing from it once the reduction ran at NumPy's speed, so it does not stream."""
    return written * comm.n > stream_bytes()


def _region(comm: ShmComm) -> int:
    """Bytes of a slot given to each rank's chunk (64-byte aligned)."""
    return (comm.slot_bytes // comm.n) // 64 * 64


def _segments(nbytes: int, size: int) -> range:
    return range(max(1, -(-nbytes // size)))


def all_reduce(
    comm: ShmComm,
    x: np.ndarray,
    code: int,
    op: int,
    div: int,
    desc: List[int],
    root: Optional[int] = None,
    what: str = "all_reduce",
) -> None:
    """In place; with ``root`` it is a reduce: only the root's array changes."""
    if x.nbytes <= (comm.small_bytes or small_limit(comm)):  # first: the latency-bound case
        comm.native_step(comm.waiter.all_reduce_small, desc, what, x, code, op, div, root is None or root == comm.me)
        return
    p, me, dt, n = comm.n, comm.me, x.dtype, x.size
    region = _region(comm)
    per_chunk = region // dt.itemsize
    per_seg = per_chunk * p
    nseg = -(-n // per_seg)
    prev = None
    prev_buf = 0
    # in place where every rank's array is shared, each rank writing only where no peer reads
    # (a reduce changes the root's only; one segment costs a step more than it saves)
    in_place = root is None and nseg > 1
    if in_place:
        comm.publish_layout([x], ())
    for t in range(nseg + 1):
        b = comm.next_buf
        bounds = None
        if t < nseg:
            bounds = _parts(t, per_seg, n, p)
            for j in range(p):
                a, e = bounds[j]
                if j != me and e > a:
                    np.copyto(comm.slot(me, b, dt, j * region, e - a), x[a:e])
        if prev is not None:
            a, e = prev[me]
            if e > a:
                srcs = [x[a:e] if j == me else comm.slot(j, prev_buf, dt, me * region, e - a) for j in range(p)]
                dsts = [comm.slot(me, b, dt, me * region, e - a)]
                if root is None or root == me:
                    dsts.append(x[a:e])
                _native.reduce(code, op, srcs, dsts, div)
        comm.step(desc if t == 0 else None, what)
        if t == 0 and in_place:
            layouts = comm.agreed_layouts(1, x.nbytes, dt.itemsize)
            if layouts is not None:  # every rank's array shared: reduce where they are
                _all_reduce_in_place(comm, x, layouts, code, op, div, what, per_seg)
                return
        if prev is not None and (root is None or root == me):
            for j in range(p):
                a, e = prev[j]
                if j != me and e > a:
                    np.copyto(x[a:e], comm.slot(j, b, dt, j * region, e - a))
        prev, prev_buf = bounds, b


def _all_reduce_in_place(
    comm: ShmComm, x: np.ndarray, layouts: List[List[int]], code: int, op: int, div: int, what: str, per_seg: int
) -> None:
    """all_reduce of arrays every local rank maps, pipelined over the same segments as the
    copying path: in step t rank r reduces part r of segment t of every rank's array into its
    own (no peer reads that part of it then) and copies the other parts of segment t-1 from
    their owners' arrays (which no rank writes any more); the last step keeps every array
    unchanged until all have copied. Nothing passes through the slots."""
    p, me, n = comm.n, comm.me, x.size
    arrays = [x if j == me else comm.shared.peer(j, layouts[j], 0, x.dtype, n) for j in range(p)]
    nseg = -(-n // per_seg)
    prev = None
    for t in range(nseg + 1):
        bounds = _parts(t, per_seg, n, p) if t < nseg else None
        if bounds is not None:
            a, e = bounds[me]
            if e > a:
                _native.reduce(code, op, [array[a:e] for array in arrays], [x[a:e]], div)
        if prev is not None:
            for j in range(p):
                a, e = prev[j]
                if j != me and e > a:
                    np.copyto(x[a:e], arrays[j][a:e])
        comm.step(None, what)
        prev = bounds


def _parts(t: int, per_seg: int, n: int, p: int) -> List[Tuple[int, int]]:
    """The bounds of each rank's part of segment ``t`` of an all_reduce of ``n`` elements."""
    start = t * per_seg
    length = min(per_seg, n - start)
    part = -(-length // p)
    return [(start + min(j * part, length), start + min((j + 1) * part, length)) for j in range(p)]


def broadcast(comm: ShmComm, x: np.ndarray, root: int, desc: List[int]) -> None:
    data = x.view(_U8)
    seg = comm.slot_bytes
    if data.size <= seg:  # one step, natively
        recv: List[Optional[np.ndarray]] = [None] * comm.n
        if comm.me != root:
            recv[root] = data
        comm.native_step(comm.waiter.copy_small, desc, "broadcast", data if comm.me == root else None, recv)
        return
    for t in _segments(data.size, seg):
        a, e = t * seg, min(data.size, (t + 1) * seg)
        b = comm.next_buf
        if comm.me == root and e > a:
            np.copyto(comm.slot(root, b, _U8, 0, e - a), data[a:e])
        comm.step(desc if t == 0 else None, "broadcast")
        if comm.me != root and e > a:
            np.copyto(data[a:e], comm.slot(root, b, _U8, 0, e - a))


def all_gather(
    comm: ShmComm,
    outs: Optional[Sequence[np.ndarray]],
    x: np.ndarray,
    desc: List[int],
    root: Optional[int] = None,
    what: str = "all_gather",
) -> None:
    """``outs[j]`` gets rank j's ``x`` (bytes); with ``root``, only there (gather)."""
    data = x.view(_U8)
    targets = [o.view(_U8) for o in outs] if outs is not None else []  # given where received
    seg = comm.slot_bytes
    me = comm.me
    receive = root is None or root == me
    if data.size <= seg:  # one step, natively (this rank's own part comes from its slot)
        comm.native_step(comm.waiter.copy_small, desc, what, data, targets if receive else [])
        return
    copy = _native.copy_streaming if receive and _streams(comm, data.size * comm.n) else np.copyto
    # its own part may be its input itself (all_gather_into_tensor in place): nothing to copy then
    own = receive and not same_memory(targets[me], data)
    comm.publish_layout([data], [o for j, o in enumerate(targets) if j != me or own])
    for t in _segments(data.size, seg):
        a, e = t * seg, min(data.size, (t + 1) * seg)
        b = comm.next_buf
        if e > a:
            np.copyto(comm.slot(me, b, _U8, 0, e - a), data[a:e])
            if own:  # its own part while it is in cache
                copy(targets[me][a:e], data[a:e])
        comm.step(desc if t == 0 else None, what)
        if t == 0:
            layouts = comm.agreed_layouts(1, data.size, 1)
            if layouts is not None:  # every rank's input in a shared array: read where it is
                if own:
                    copy(targets[me][e:], data[e:])
                if receive:
                    for j in range(comm.n):
                        if j != me:
                            copy(targets[j], comm.shared.peer(j, layouts[j], 0, _U8, data.size))
                comm.step(None, what)  # no rank changes its input before all read it
                return
        if receive and e > a:
            for j in range(comm.n):
                if j != me:
                    copy(targets[j][a:e], comm.slot(j, b, _U8, 0, e - a))


def scatter(comm: ShmComm, x: np.ndarray, ins: Optional[Sequence[np.ndarray]], root: int, desc: List[int]) -> None:
    data = x.view(_U8)
    me = comm.me
    sources = [i.view(_U8) for i in ins] if me == root and ins is not None else []  # given at the root
    if me == root:
        np.copyto(data, sources[me])
    region = _region(comm)
    for t in _segments(data.size, region):
        a, e = t * region, min(data.size, (t + 1) * region)
        b = comm.next_buf
        if me == root and e > a:
            for j in range(comm.n):
                if j != me:
                    np.copyto(comm.slot(me, b, _U8, j * region, e - a), sources[j][a:e])
        comm.step(desc if t == 0 else None, "scatter")
        if me != root and e > a:
            np.copyto(data[a:e], comm.slot(root, b, _U8, me * region, e - a))


def reduce_scatter(
    comm: ShmComm, out: np.ndarray, ins: Sequence[np.ndarray], code: int, op: int, div: int, desc: List[int]
) -> None:
    """``out`` gets the reduction over ranks of their ``ins[me]`` (all viewed as the kernel's dtype)."""
    p, me, dt, n = comm.n, comm.me, out.dtype, out.size
    region = _region(comm)
    per = region // dt.itemsize
    if n <= per:  # one step, natively
        comm.native_step(comm.waiter.reduce_scatter_small, desc, "reduce_scatter", ins, out, region, code, op, div)
        return
    comm.publish_layout(ins, (out,))
    for t in _segments(n, per):
        a, e = t * per, min(n, (t + 1) * per)
        b = comm.next_buf
        for j in range(p):
            if j != me and e > a:
                np.copyto(comm.slot(me, b, dt, j * region, e - a), ins[j][a:e])
        comm.step(desc if t == 0 else None, "reduce_scatter")
        if t == 0:
            layouts = comm.agreed_layouts(p, out.nbytes, dt.itemsize)
            if layouts is not None:  # every rank's inputs in shared arrays: read where they are
                srcs = [ins[me] if j == me else comm.shared.peer(j, layouts[j], me, dt, n) for j in range(p)]
                _native.reduce(code, op, srcs, [out], div)
                comm.step(None, "reduce_scatter")  # no rank changes its inputs before all read them
                return
        if e > a:
            srcs = [ins[me][a:e] if j == me else comm.slot(j, b, dt, me * region, e - a) for j in range(p)]
            _native.reduce(code, op, srcs, [out[a:e]], div)


def all_to_all(comm: ShmComm, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], desc: List[int]) -> None:
    me = comm.me
    targets = [o.view(_U8) for o in outs]
    sources = [i.view(_U8) for i in ins]
    nbytes = sources[me].size
    region = _region(comm)
    for t in _segments(nbytes, region):
        a, e = t * region, min(nbytes, (t + 1) * region)
        b = comm.next_buf
        if e > a:
            for j in range(comm.n):
                if j != me:
                    np.copyto(comm.slot(me, b, _U8, j * region, e - a), sources[j][a:e])
        comm.step(desc if t == 0 else None, "all_to_all")
        if e > a:
            for j in range(comm.n):
                if j != me:
                    np.copyto(targets[j][a:e], comm.slot(j, b, _U8, me * region, e - a))
    np.copyto(targets[me], sources[me])


def barrier(comm: ShmComm, desc: List[int]) -> None:
    comm.step(desc, "barrier")


__all__ = ["all_reduce", "broadcast", "all_gather", "scatter", "reduce_scatter", "all_to_all", "barrier"]

"""Collectives over TCP among ``members`` (group ranks, in ring order) of a ``TcpComm``.

all_reduce: small messages go straight to every member (one network hop; every member then
reduces all contributions in member order, so results are bit-identical). Large ones take the
ring: reduce-scatter then all-gather, each chunk cut into pieces that stream through the
sender thread, a piece being forwarded as soon as it is reduced, so every link is busy at once
and a rank moves 2(q-1)/q of the data. broadcast is a pipelined chain from the root;
all_gather a ring (or direct when small); gather, scatter and all_to_all are direct transfers
scheduled so that in round k a rank sends to the member k places ahead and receives from the
one k places behind (no cycle of blocked sends).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

from . import _native
from .tcp_comm import INLINE_BYTES, TcpComm, Ticket

_U8 = np.dtype(np.uint8)


def _piece_bytes() -> int:
    return int(os.environ.get("ELASTIX_TCP_PIECE_BYTES", 512 << 10))


def _small() -> int:
    return int(os.environ.get("ELASTIX_TCP_SMALL_BYTES", 32 << 10))


def _pieces(a: int, e: int, per: int):
    while a < e:
        yield a, min(e, a + per)
        a += per


def _bytes(x: np.ndarray) -> memoryview:
    return x.view(_U8).data if x.size else memoryview(b"")


def exchange_direct(
    comm: TcpComm, members: Sequence[int], x: np.ndarray, outs: List[Optional[np.ndarray]], desc: List[int], what: str
) -> None:
    """Sends ``x`` to every other member and receives each one's into ``outs[j]`` (member
    index); small messages are sent inline, larger ones through the sender thread."""
    q, i = len(members), members.index(comm.me)
    header = comm.header(desc)
    ticket = Ticket() if x.nbytes > INLINE_BYTES else None
    for k in range(1, q):
        comm.send(members[(i + k) % q], [header, _bytes(x)], ticket, last=(k == q - 1))
    for k in range(1, q):
        j = (i - k) % q
        out = outs[j]
        assert out is not None  # every other member's array is given
        comm.check_header(members[j], desc, what)
        comm.recv_into(members[j], out.view(_U8))
    if ticket is not None:
        comm.wait(ticket, members[(i + 1) % q])


def all_reduce(
    comm: TcpComm,
    members: Sequence[int],
    x: np.ndarray,
    code: int,
    op: int,
    div: int,
    desc: List[int],
    what: str = "all_reduce",
) -> None:
    q = len(members)
    if q == 1:
        if div > 1:
            _native.reduce(code, op, [x], [x], 1)
        return
    i = members.index(comm.me)
    if x.nbytes <= _small():
        outs = [np.empty_like(x) if j != i else None for j in range(q)]
        exchange_direct(comm, members, x, outs, desc, what)
        if x.size:
            _native.reduce(code, op, [x if j == i else outs[j] for j in range(q)], [x], div)
        return
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    comm.send(right, [comm.header(desc)])
    comm.check_header(left, desc, what)
    n, isz = x.size, x.itemsize
    bounds = [(n * c // q, n * (c + 1) // q) for c in range(q)]
    per = max(1, _piece_bytes() // isz)
    scratch = np.empty(min(per, n), dtype=x.dtype)
    ticket = Ticket()

    def queue_send(a: int, e: int) -> None:
        comm.send(right, [_bytes(x[a:e])], ticket, last=False)

    for a, e in _pieces(*bounds[i], per):
        queue_send(a, e)
    for s in range(q - 1):  # reduce-scatter
        c = (i - s - 1) % q
        last_step = s == q - 2
        for a, e in _pieces(*bounds[c], per):
            buf = scratch[: e - a]
            comm.recv_into(left, buf.view(_U8))
            _native.reduce(code, op, [x[a:e], buf], [x[a:e]], div if last_step else 1)
            queue_send(a, e)  # next step's chunk, or (last step) the first all-gather chunk
    for s in range(q - 1):  # all-gather
        c = (i - s) % q
        for a, e in _pieces(*bounds[c], per):
            comm.recv_into(left, x[a:e].view(_U8))
            if s < q - 2:
                queue_send(a, e)
    comm.send(right, [b""], ticket, last=True)
    comm.wait(ticket, right)


def broadcast(comm: TcpComm, members: Sequence[int], x: np.ndarray, root: int, desc: List[int]) -> None:
    q = len(members)
    if q == 1:
        return
    i, r = members.index(comm.me), members.index(root)
    data = x.view(_U8)
    header = comm.header(desc)
    if data.size <= _small():
        if i == r:
            for k in range(1, q):
                comm.send(members[(r + k) % q], [header, _bytes(data)])
        else:
            comm.check_header(root, desc, "broadcast")
            comm.recv_into(root, data)
        return
    pos = (i - r) % q
    nxt = members[(i + 1) % q] if pos < q - 1 else None
    prv = members[(i - 1) % q]
    ticket = Ticket()
    if nxt is not None:
        comm.send(nxt, [header], ticket, last=False)
    if pos > 0:
        comm.check_header(prv, desc, "broadcast")
    for a, e in _pieces(0, data.size, _piece_bytes()):
        if pos > 0:
            comm.recv_into(prv, data[a:e])
        if nxt is not None:
            comm.send(nxt, [_bytes(data[a:e])], ticket, last=False)
    if nxt is not None:
        comm.send(nxt, [b""], ticket, last=True)
        comm.wait(ticket, nxt)


def all_gather(
    comm: TcpComm,
    members: Sequence[int],
    outs: Sequence[np.ndarray],
    x: np.ndarray,
    desc: List[int],
    what: str = "all_gather",
) -> None:
    """``outs[j]`` (member index; sizes may differ: all_gatherv) gets member j's ``x``."""
    q, i = len(members), members.index(comm.me)
    np.copyto(outs[i].view(_U8), x.view(_U8))
    if q == 1:
        return
    if max(o.nbytes for o in outs) <= _small():
        exchange_direct(comm, members, x, list(outs), desc, what)
        return
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    ticket = Ticket()
    per = _piece_bytes()
    comm.send(right, [comm.header(desc)], ticket, last=False)
    for a, e in _pieces(0, x.nbytes, per):
        comm.send(right, [_bytes(x.view(_U8)[a:e])], ticket, last=False)
    comm.check_header(left, desc, what)
    for s in range(q - 1):
        c = (i - s - 1) % q
        target = outs[c].view(_U8)
        for a, e in _pieces(0, target.size, per):
            comm.recv_into(left, target[a:e])
            if s < q - 2:
                comm.send(right, [_bytes(target[a:e])], ticket, last=False)
    comm.send(right, [b""], ticket, last=True)
    comm.wait(ticket, right)


def _rounds(comm: TcpComm, members: Sequence[int], send_to, recv_from, desc: List[int], what: str) -> None:
    """Direct transfers: in round k send ``send_to(j)`` to member i+k, receive into
    ``recv_from(j)`` from member i-k (None: nothing that round)."""
    q, i = len(members), members.index(comm.me)
    if q == 1:
        return
    header = comm.header(desc)
    ticket = Ticket()
    for k in range(1, q):
        j = (i + k) % q
        data = send_to(j)
        if data is not None:
            comm.send(members[j], [header, _bytes(data)], ticket, last=False)
    comm.send(members[(i + 1) % q], [b""], ticket, last=True)
    for k in range(1, q):
        j = (i - k) % q
        target = recv_from(j)
        if target is not None:
            comm.check_header(members[j], desc, what)
            comm.recv_into(members[j], target.view(_U8))
    comm.wait(ticket, members[(i + 1) % q])


def gather(
    comm: TcpComm,
    members: Sequence[int],
    outs: Optional[Sequence[np.ndarray]],
    x: np.ndarray,
    root: int,
    desc: List[int],
) -> None:
    i, r = members.index(comm.me), members.index(root)
    targets: Sequence[np.ndarray] = outs if outs is not None else ()  # given at the root
    if i == r:
        np.copyto(targets[r].view(_U8), x.view(_U8))
    _rounds(comm, members, lambda j: x if j == r else None, lambda j: targets[j] if i == r else None, desc, "gather")


def scatter(
    comm: TcpComm,
    members: Sequence[int],
    x: np.ndarray,
    ins: Optional[Sequence[np.ndarray]],
    root: int,
    desc: List[int],
) -> None:
    i, r = members.index(comm.me), members.index(root)
    sources: Sequence[np.ndarray] = ins if ins is not None else ()  # given at the root
    if i == r:
        np.copyto(x.view(_U8), sources[r].view(_U8))
    _rounds(comm, members, lambda j: sources[j] if i == r else None, lambda j: x if j == r else None, desc, "scatter")


def all_to_all(
    comm: TcpComm, members: Sequence[int], outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], desc: List[int]
) -> None:
    i = members.index(comm.me)
    np.copyto(outs[i].view(_U8), ins[i].view(_U8))
    _rounds(comm, members, lambda j: ins[j], lambda j: outs[j], desc, "all_to_all")


def reduce_scatter(
    comm: TcpComm,
    members: Sequence[int],
    out: np.ndarray,
    ins: Sequence[np.ndarray],
    code: int,
    op: int,
    div: int,
    desc: List[int],
) -> None:
    """Ring reduce-scatter on a working copy of the inputs; member i ends with chunk i."""
    q, i = len(members), members.index(comm.me)
    if q == 1:
        _native.reduce(code, op, [ins[0]], [out], div)
        return
    work = [np.array(t, copy=True) for t in ins]
    right, left = members[(i + 1) % q], members[(i - 1) % q]
    comm.send(right, [comm.header(desc)])
    comm.check_header(left, desc, "reduce_scatter")
    per = max(1, _piece_bytes() // out.itemsize)
    scratch = np.empty(min(per, max(out.size, 1)), dtype=out.dtype)
    ticket = Ticket()
    for a, e in _pieces(0, out.size, per):
        comm.send(right, [_bytes(work[(i - 1) % q][a:e])], ticket, last=False)
    for s in range(q - 1):
        c = (i - s - 2) % q
        final = s == q - 2
        for a, e in _pieces(0, out.size, per):
            buf = scratch[: e - a]
            comm.recv_into(left, buf.view(_U8))
            if final:
                _native.reduce(code, op, [work[c][a:e], buf], [out[a:e]], div)
            else:
                _native.reduce(code, op, [work[c][a:e], buf], [work[c][a:e]], 1)
                comm.send(right, [_bytes(work[c][a:e])], ticket, last=False)
    comm.send(right, [b""], ticket, last=True)
    comm.wait(ticket, right)


def barrier(comm: TcpComm, members: Sequence[int], desc: List[int]) -> None:
    q, i = len(members), members.index(comm.me)
    token = np.zeros(1, np.uint8)
    outs = [np.empty(1, np.uint8) if j != i else None for j in range(q)]
    if q > 1:
        exchange_direct(comm, members, token, outs, desc, "barrier")


__all__ = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "gather",
    "scatter",
    "all_to_all",
    "reduce_scatter",
    "barrier",
    "exchange_direct",
]

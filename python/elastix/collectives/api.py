"""The collectives (torch.distributed's names and signatures), on NumPy and CuPy arrays.

Every function checks its arguments on the calling rank (types, shapes, dtypes, ops, ranks),
describes the call to its peers (so ranks that disagree raise ``MismatchError`` rather than
hang), and runs on the group's backend, now or, with ``async_op=True``, on the group's worker
thread (returning a ``Work``). Ranks in arguments (src, dst) are global ranks, as in torch.
CuPy arrays go to NCCL directly with the ``nccl`` backend; with ``cpu`` they are staged
through host memory.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import descriptor, dtypes
from .arrays import check_array, check_arrays, flat_in, flat_out, is_cupy
from .group import ProcessGroup, resolve
from .reduce_op import ReduceOp, as_op, kernel_op
from .work import CompletedWork, Work

_U8 = np.dtype(np.uint8)

#: A NumPy array, or a CuPy array with the nccl backend (CuPy is optional, so untyped here).
Array = Any
#: A reduction: a ReduceOp or its name ("sum", "avg", ...).
Op = Union[ReduceOp, str]


def _run(g: ProcessGroup, fn: Callable[[], Any], async_op: bool, desc: List[int]) -> Optional[Work]:
    """A Work with ``async_op`` (torch's contract), else None once the collective is done. The
    collective (``desc``) goes in the flight recorder."""
    if not async_op:
        g.run_now(fn, desc)
        return None
    fn = g.recorded(fn, desc)
    if g.send_executor._pending:
        g.send_executor.drain()  # a collective never shares a connection with a pending send
    return g.executor.submit(fn)


def _nccl(g: ProcessGroup) -> bool:
    return g.backend_name == "nccl"


def _on_nccl(g: ProcessGroup, fn: Callable[[], Any], async_op: bool) -> Optional[Work]:
    """Runs ``fn`` on the NCCL backend's stream: a Work with ``async_op``, else None."""
    work: Optional[Work] = g.backend.run(fn, async_op)
    return work


def _started_on_nccl(g: ProcessGroup, fn: Callable[[], Any]) -> Work:
    work: Work = g.backend.run(fn, True)
    return work


class _Host:
    """A NumPy array to run a CPU collective on: the array itself, or a host copy of a CuPy
    array written back by ``done()``."""

    def __init__(self, x: Array, write_back: bool) -> None:
        self.x = x
        self.cupy = is_cupy(x)
        self.write_back = write_back
        self.host = x.get() if self.cupy else x

    def done(self) -> None:
        if self.cupy and self.write_back:
            import cupy

            self.x[...] = cupy.asarray(self.host)


def _all_same(xs: Sequence[Array], b: Array, what: str) -> None:
    """``_same`` for every ``xs[i]`` (named ``what[i]`` only when it fails)."""
    for i, x in enumerate(xs):
        if x.shape != b.shape or x.dtype != b.dtype:
            _same(x, b, f"{what}[{i}]")


def _same(a: Array, b: Array, what: str) -> None:
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        raise ValueError(
            f"{what} must match the input's shape {tuple(b.shape)} and dtype {b.dtype}, got {tuple(a.shape)} {a.dtype}"
        )


def _reduction(
    g: ProcessGroup, x: Array, op: Op, dtype: Optional[str], what: str
) -> Tuple[ReduceOp, Any, int, int, int]:
    op = as_op(op)
    kind = dtypes.reduce_kind(x.dtype, dtype)
    kop, div = kernel_op(op, kind, g.size())
    return op, kind, kind.code, kop, div


#: How many reduction plans a group keeps (one per collective, dtype, shape and op in use).
PLANS = 256


def _plan(
    g: ProcessGroup, what: str, x: Array, op: Op, dtype: Optional[str]
) -> Tuple[ReduceOp, Any, int, int, int, List[int]]:
    """``_reduction``'s answer and the descriptor for collective ``what`` (a reduction with no
    root) of arrays like ``x``, worked out once per dtype, shape and op of a group: for small
    arrays they cost more than the step."""
    key = (what, x.dtype, x.shape, type(op), op, dtype)  # type(op): True is not PRODUCT
    try:
        plan = g.plans.get(key)
        hashable = True
    except TypeError:  # an unhashable op, which _reduction refuses
        plan, hashable = None, False
    if plan is None:
        op, kind, code, kop, div = _reduction(g, x, op, dtype, what)
        plan = (op, kind, code, kop, div, descriptor.make(what, x.dtype, x.shape, int(op)))
        if hashable:
            if len(g.plans) >= PLANS:
                g.plans.clear()
            g.plans[key] = plan
    return plan


def _plain(xs: Sequence[Array]) -> bool:
    """Every array is a C-contiguous, writable NumPy array (the fast paths' case)."""
    for x in xs:
        if type(x) is not np.ndarray or not (x.flags.c_contiguous and x.flags.writeable):
            return False
    return True


# -- reductions ----------------------------------------------------------------------------------


def all_reduce(
    tensor: Array,
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    *,
    dtype: Optional[str] = None,
) -> Optional[Work]:
    """Reduces ``tensor`` over the group, in place on every rank. ``dtype="bfloat16"`` reads
    16-bit integer arrays as bfloat16."""
    g = resolve(group)
    x = check_array(tensor)
    op, kind, code, kop, div, desc = _plan(g, "all_reduce", x, op, dtype)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.all_reduce(x, op, kind, desc), async_op)
    if type(x) is np.ndarray and x.flags.c_contiguous and x.flags.writeable:
        # the common case, kept short: a contiguous NumPy array reduced where it is
        view = x if x.ndim == 1 and x.dtype == kind.view else x.reshape(-1).view(kind.view)
        return _run(g, lambda: g.backend.all_reduce(view, code, kop, div, desc), async_op, desc)
    h = _Host(x, True)
    flat = flat_out(h.host, "all_reduce tensor")
    view = flat.flat.view(kind.view)

    def fn() -> None:
        g.backend.all_reduce(view, code, kop, div, desc)
        flat.finish()
        h.done()

    return _run(g, fn, async_op, desc)


def reduce(
    tensor: Array,
    dst: int,
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    *,
    dtype: Optional[str] = None,
) -> Optional[Work]:
    """Reduces ``tensor`` over the group into rank ``dst``'s ``tensor`` (others unchanged)."""
    g = resolve(group)
    x = check_array(tensor)
    root = g.group_rank(dst, "dst")
    op, kind, code, kop, div = _reduction(g, x, op, dtype, "reduce")
    desc = descriptor.make("reduce", x.dtype, x.shape, int(op), root)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.reduce(x, root, op, kind, desc), async_op)
    is_root = g.rank() == root
    h = _Host(x, is_root)
    flat = flat_out(h.host, "reduce tensor") if is_root else None
    view = (flat.flat if flat is not None else flat_in(h.host).copy()).view(kind.view)

    def fn() -> None:
        g.backend.reduce(view, root, code, kop, div, desc)
        if flat is not None:
            flat.finish()
            h.done()

    return _run(g, fn, async_op, desc)


def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    *,
    dtype: Optional[str] = None,
) -> Optional[Work]:
    """``output`` on rank i gets the reduction over ranks of their ``input_list[i]``."""
    g = resolve(group)
    out = check_array(output, "output")
    ins = check_arrays(input_list, "input_list")
    if len(ins) != g.size():
        raise ValueError(f"input_list needs {g.size()} arrays (one per rank), got {len(ins)}")
    _all_same(ins, out, "input_list")
    op, kind, code, kop, div, desc = _plan(g, "reduce_scatter", out, op, dtype)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.reduce_scatter(out, ins, op, kind, desc), async_op)
    if _plain(ins) and _plain((out,)):  # the common case, kept short
        flat, views = out.reshape(-1).view(kind.view), [t.reshape(-1).view(kind.view) for t in ins]
        return _run(g, lambda: g.backend.reduce_scatter(flat, views, code, kop, div, desc), async_op, desc)
    h = _Host(out, True)
    flat = flat_out(h.host, "output")
    host_ins = [_Host(t, False).host for t in ins]
    views = [flat_in(t).view(kind.view) for t in host_ins]

    def fn() -> None:
        g.backend.reduce_scatter(flat.flat.view(kind.view), views, code, kop, div, desc)
        flat.finish()
        h.done()

    return _run(g, fn, async_op, desc)


def reduce_scatter_tensor(
    output: Array,
    input: Array,
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    *,
    dtype: Optional[str] = None,
) -> Optional[Work]:
    """``input`` holds size() consecutive blocks the shape of ``output``; rank i gets block i reduced."""
    g = resolve(group)
    out, inp = check_array(output, "output"), check_array(input, "input")
    if inp.size != out.size * g.size() or inp.dtype != out.dtype:
        raise ValueError(
            f"input must hold {g.size()} x output.size elements of {out.dtype}, got {inp.size} of {inp.dtype}"
        )
    src = inp if is_cupy(inp) else flat_in(inp)
    blocks = [b.reshape(out.shape) for b in src.reshape(g.size(), -1)]
    return reduce_scatter(out, blocks, op, group, async_op, dtype=dtype)


# -- data movement -------------------------------------------------------------------------------


def broadcast(tensor: Array, src: int, group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Copies rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    g = resolve(group)
    x = check_array(tensor)
    root = g.group_rank(src, "src")
    desc = descriptor.make("broadcast", x.dtype, x.shape, -1, root)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.broadcast(x, root, desc), async_op)
    is_root = g.rank() == root
    if type(x) is np.ndarray and x.flags.c_contiguous and (is_root or x.flags.writeable):  # kept short
        data = x.reshape(-1)
        return _run(g, lambda: g.backend.broadcast(data, root, desc), async_op, desc)
    h = _Host(x, not is_root)
    if is_root:
        data = flat_in(h.host)
        fn = lambda: g.backend.broadcast(data, root, desc)  # noqa: E731
    else:
        flat = flat_out(h.host, "broadcast tensor")

        def fn() -> None:
            g.backend.broadcast(flat.flat, root, desc)
            flat.finish()
            h.done()

    return _run(g, fn, async_op, desc)


def all_gather(
    tensor_list: List[Array], tensor: Array, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """``tensor_list[i]`` gets rank i's ``tensor`` on every rank."""
    g = resolve(group)
    x = check_array(tensor)
    outs = check_arrays(tensor_list, "tensor_list")
    if len(outs) != g.size():
        raise ValueError(f"tensor_list needs {g.size()} arrays (one per rank), got {len(outs)}")
    _all_same(outs, x, "tensor_list")
    desc = descriptor.make("all_gather", x.dtype, x.shape)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.all_gather(outs, x, desc), async_op)
    if type(x) is np.ndarray and _plain(outs):  # the common case, kept short
        data, flats = flat_in(x), [t.reshape(-1) for t in outs]
        return _run(g, lambda: g.backend.all_gather(flats, data, desc), async_op, desc)
    hosts = [_Host(t, True) for t in outs]
    flats = [flat_out(h.host, f"tensor_list[{i}]") for i, h in enumerate(hosts)]
    data = flat_in(_Host(x, False).host)

    def fn() -> None:
        g.backend.all_gather([f.flat for f in flats], data, desc)
        for f, h in zip(flats, hosts):
            f.finish()
            h.done()

    return _run(g, fn, async_op, desc)


def all_gather_into_tensor(
    output_tensor: Array, input_tensor: Array, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """``output_tensor`` (size() x input size elements) gets every rank's input, in rank order."""
    g = resolve(group)
    out, inp = check_array(output_tensor, "output_tensor"), check_array(input_tensor, "input_tensor")
    if out.size != inp.size * g.size() or out.dtype != inp.dtype:
        raise ValueError(
            f"output_tensor must hold {g.size()} x input size elements of {inp.dtype}, got {out.size} of {out.dtype}"
        )
    blocks = (
        [b.reshape(inp.shape) for b in out.reshape(g.size(), -1)] if out.flags.c_contiguous or is_cupy(out) else None
    )
    if blocks is None:
        staged = np.empty((g.size(), *tuple(inp.shape)), inp.dtype)
        work = all_gather(list(staged), inp, group, async_op)

        if work is not None:
            work.wait()
        out[...] = staged.reshape(out.shape)
        return CompletedWork() if async_op else None
    return all_gather(blocks, inp, group, async_op)


def gather(
    tensor: Array,
    gather_list: Optional[List[Array]] = None,
    dst: int = 0,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Rank ``dst``'s ``gather_list[i]`` gets rank i's ``tensor``."""
    g = resolve(group)
    x = check_array(tensor)
    root = g.group_rank(dst, "dst")
    is_root = g.rank() == root
    outs: List[Array] = []  # the destination's only
    if is_root:
        if gather_list is None or len(gather_list) != g.size():
            raise ValueError(f"gather_list on the destination rank needs {g.size()} arrays")
        outs = [check_array(t, f"gather_list[{i}]") for i, t in enumerate(gather_list)]
        for i, t in enumerate(outs):
            _same(t, x, f"gather_list[{i}]")
    elif gather_list:
        raise ValueError("gather_list must be None or empty on ranks other than dst")
    desc = descriptor.make("gather", x.dtype, x.shape, -1, root)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.gather(outs, x, root, desc), async_op)
    hosts = [_Host(t, True) for t in outs] if is_root else []
    flats = [flat_out(h.host, f"gather_list[{i}]") for i, h in enumerate(hosts)]
    data = flat_in(_Host(x, False).host)

    def fn() -> None:
        g.backend.gather([f.flat for f in flats] if is_root else None, data, root, desc)
        for f, h in zip(flats, hosts):
            f.finish()
            h.done()

    return _run(g, fn, async_op, desc)


def scatter(
    tensor: Array,
    scatter_list: Optional[List[Array]] = None,
    src: int = 0,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Rank i's ``tensor`` gets rank ``src``'s ``scatter_list[i]``."""
    g = resolve(group)
    x = check_array(tensor)
    root = g.group_rank(src, "src")
    is_root = g.rank() == root
    ins: List[Array] = []  # the source's only
    if is_root:
        if scatter_list is None or len(scatter_list) != g.size():
            raise ValueError(f"scatter_list on the source rank needs {g.size()} arrays")
        ins = [check_array(t, f"scatter_list[{i}]") for i, t in enumerate(scatter_list)]
        for i, t in enumerate(ins):
            _same(t, x, f"scatter_list[{i}]")
    elif scatter_list:
        raise ValueError("scatter_list must be None or empty on ranks other than src")
    desc = descriptor.make("scatter", x.dtype, x.shape, -1, root)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.scatter(x, ins, root, desc), async_op)
    h = _Host(x, True)
    flat = flat_out(h.host, "scatter tensor")
    host_ins = [flat_in(_Host(t, False).host) for t in ins] if is_root else None

    def fn() -> None:
        g.backend.scatter(flat.flat, host_ins, root, desc)
        flat.finish()
        h.done()

    return _run(g, fn, async_op, desc)


def all_to_all(
    output_tensor_list: List[Array],
    input_tensor_list: List[Array],
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Rank i's ``output_tensor_list[j]`` gets rank j's ``input_tensor_list[i]`` (all arrays
    of one shape and dtype)."""
    g = resolve(group)
    outs = [check_array(t, f"output_tensor_list[{i}]") for i, t in enumerate(output_tensor_list)]
    ins = [check_array(t, f"input_tensor_list[{i}]") for i, t in enumerate(input_tensor_list)]
    if len(outs) != g.size() or len(ins) != g.size():
        raise ValueError(f"all_to_all needs {g.size()} input and output arrays (one per rank)")
    for t in ins + outs:
        _same(t, ins[0], "every all_to_all array")
    desc = descriptor.make("all_to_all", ins[0].dtype, ins[0].shape)
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.all_to_all(outs, ins, desc), async_op)
    hosts = [_Host(t, True) for t in outs]
    flats = [flat_out(h.host, f"output_tensor_list[{i}]") for i, h in enumerate(hosts)]
    datas = [flat_in(_Host(t, False).host) for t in ins]

    def fn() -> None:
        g.backend.all_to_all([f.flat for f in flats], datas, desc)
        for f, h in zip(flats, hosts):
            f.finish()
            h.done()

    return _run(g, fn, async_op, desc)


def all_to_all_single(
    output: Array,
    input: Array,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Equal splits of the first dimension: block j of ``input`` goes to rank j, block i of
    ``output`` comes from rank i."""
    g = resolve(group)
    out, inp = check_array(output, "output"), check_array(input, "input")
    if output_split_sizes is not None or input_split_sizes is not None:
        raise NotImplementedError("all_to_all_single with split sizes is not supported; use equal splits")
    p = g.size()
    if out.shape != inp.shape or out.dtype != inp.dtype or (inp.shape[0] if inp.ndim else 0) % p:
        raise ValueError(f"input and output must have one shape and dtype whose first dimension divides by {p}")
    outs = list(out.reshape((p, -1, *tuple(out.shape[1:]))) if out.flags.c_contiguous else np.array_split(out, p))
    ins = list(inp.reshape((p, -1, *tuple(inp.shape[1:])))) if inp.flags.c_contiguous else np.array_split(inp, p)
    return all_to_all(outs, ins, group, async_op)


def barrier(
    group: Optional[ProcessGroup] = None, async_op: bool = False, device_ids: Optional[List[int]] = None
) -> Optional[Work]:
    """Returns once every rank of the group entered the barrier."""
    g = resolve(group)
    desc = descriptor.make("barrier", np.dtype(np.uint8), ())
    if _nccl(g):
        return _on_nccl(g, lambda: g.backend.barrier(desc), async_op)
    return _run(g, lambda: g.backend.barrier(desc), async_op, desc)


# -- point to point -------------------------------------------------------------------------------


def _p2p_desc(x: Array, tag: int) -> List[int]:
    return descriptor.make("send/recv", x.dtype, x.shape, -1, -1, int(tag))


def send(tensor: Array, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Sends ``tensor`` to rank ``dst``, which must ``recv`` an array of the same shape and
    dtype with the same tag."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor: Array, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0) -> int:
    """Receives into ``tensor`` from rank ``src``; returns ``src``."""
    sender: int = irecv(tensor, src, group, tag).result()
    return sender


def isend(tensor: Array, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    g = resolve(group)
    x = check_array(tensor)
    peer = g.group_rank(dst, "dst")
    desc = _p2p_desc(x, tag)
    if _nccl(g):
        return _started_on_nccl(g, lambda: g.backend.send(x, peer, desc))
    data = flat_in(_Host(x, False).host)  # the caller's memory: do not change it before wait()
    # sends run on their own thread, so that isend + irecv pairs cannot block each other
    return g.send_executor.submit(lambda: g.backend.send(data, peer, desc))


def irecv(tensor: Array, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    g = resolve(group)
    x = check_array(tensor)
    if src is None:
        raise NotImplementedError("recv from any source is not supported: pass src=")
    peer = g.group_rank(src, "src")
    desc = _p2p_desc(x, tag)
    if _nccl(g):
        return _started_on_nccl(g, lambda: (g.backend.recv(x, peer, desc), src)[1])
    h = _Host(x, True)
    flat = flat_out(h.host, "recv tensor")

    def fn() -> Optional[int]:
        g.backend.recv(flat.flat, peer, desc)
        flat.finish()
        h.done()
        return src

    return g.executor.submit(fn)


__all__ = [
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
]

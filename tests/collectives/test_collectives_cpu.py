"""Every collective of the cpu backend against a NumPy reference on 2, 3 and 4 local ranks
(shared memory), with every op and dtype, odd sizes, empty and non-contiguous arrays, and a
configuration with tiny slots that drives the pipelined paths through many segments.

The worker functions here are reused by test_collectives_tcp.py with ranks on fake hosts."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import collectives_harness as harness

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
]
SIZES = [0, 1, 5, 1003, 40_000]
TINY = {
    "ELASTIX_SHM_SLOT_BYTES": "8192",
    "ELASTIX_SHM_SMALL_BYTES": "256",
    # some outputs of 3001 elements are written around the caches, others through them
    "ELASTIX_SHM_STREAM_BYTES": "16384",
    "ELASTIX_TCP_SMALL_BYTES": "256",
    "ELASTIX_TCP_PIECE_BYTES": "4096",
}


# -- reference data and arithmetic --------------------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def data(dtype: str, rank: int, n: int, op: str = "SUM") -> np.ndarray:
    rng = np.random.default_rng(1000 + 17 * rank + n)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype == "bfloat16":
        return f32_to_bf16(rng.uniform(0.5, 1.5, n).astype(np.float32))
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        hi = 4 if op == "PRODUCT" else np.iinfo(dt).max
        lo = 0 if dt.kind == "u" else (-4 if op == "PRODUCT" else np.iinfo(dt).min)
        return rng.integers(lo, hi, n, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.uniform(-1, 1, n) + 1j * rng.uniform(-1, 1, n)).astype(dt)
    return rng.uniform(0.5, 1.5, n).astype(dt)


def ops_for(dtype: str):
    if dtype in ("float16", "float32", "float64", "bfloat16"):
        return ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
    if dtype == "complex64":
        return ["SUM", "AVG"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def reference(dtype: str, op: str, inputs):
    if dtype == "bfloat16":
        vals = [bf16_to_f32(x) for x in inputs]
        return bf16_to_f32(f32_to_bf16(_combine(op, vals, np.float32)))
    if dtype == "float16":
        return _combine(op, [x.astype(np.float32) for x in inputs], np.float32).astype(np.float16)
    return _combine(op, inputs, None)


def _combine(op, xs, _acc):
    if op == "AVG":
        return functools.reduce(np.add, xs) / len(xs)
    fn = {
        "SUM": np.add,
        "PRODUCT": np.multiply,
        "MIN": np.minimum,
        "MAX": np.maximum,
        "BAND": np.bitwise_and,
        "BOR": np.bitwise_or,
        "BXOR": np.bitwise_xor,
    }[op]
    with np.errstate(over="ignore"):
        return functools.reduce(fn, xs)


def close(dtype: str, got: np.ndarray, want: np.ndarray, exact: bool) -> bool:
    if dtype == "bfloat16":
        got = bf16_to_f32(got)
        # each rounding to bfloat16 costs up to half an ulp (2^-9); rings and the hierarchy round
        # partial results too
        return bool(np.allclose(got, want, rtol=3e-2 if not exact else 8e-3, atol=0))
    dt = np.dtype(dtype)
    if dt.kind in "biu":
        return bool(np.array_equal(got, want))
    tol = {"float16": 2e-3 if exact else 6e-3, "float32": 1e-6, "float64": 1e-12, "complex64": 1e-6}[dtype]
    return bool(
        np.allclose(
            got.astype(np.complex128 if dt.kind == "c" else np.float64),
            np.asarray(want).astype(np.complex128 if dt.kind == "c" else np.float64),
            rtol=tol,
            atol=0 if exact else 4 * tol,
        )
    )


# -- the worker --------------------------------------------------------------------------------


def matrix(sizes=SIZES, dtypes=DTYPES, exact=True):
    """Runs every collective on this rank and returns the list of what went wrong."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    bad = []

    def check(ok, what):
        if not ok:
            bad.append(what)

    for dtype in dtypes:
        for op in ops_for(dtype):
            for n in sizes:
                ins = [data(dtype, k, n, op) for k in range(p)]
                x = ins[r].copy()
                kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                ec.all_reduce(x, getattr(ec.ReduceOp, op), **kw)
                check(close(dtype, x, reference(dtype, op, ins), exact), f"all_reduce {dtype} {op} n={n}")
            n = sizes[-1]
            ins = [data(dtype, k, n, op) for k in range(p)]
            want = reference(dtype, op, ins)
            kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            for root in range(p):
                x = ins[r].copy()
                ec.reduce(x, root, getattr(ec.ReduceOp, op), **kw)
                check(
                    close(dtype, x, want, exact) if r == root else np.array_equal(x, ins[r]),
                    f"reduce {dtype} {op} root={root}",
                )
            m = max(1, n // p)
            chunks = [[data(dtype, 100 * k + j, m, op) for j in range(p)] for k in range(p)]
            out = np.empty(m, dtype=chunks[0][0].dtype)
            ec.reduce_scatter(out, chunks[r], getattr(ec.ReduceOp, op), **kw)
            check(
                close(dtype, out, reference(dtype, op, [chunks[k][r] for k in range(p)]), exact),
                f"reduce_scatter {dtype} {op}",
            )
    # data movement, a few dtypes and odd sizes
    for dtype in ("uint8", "float32", "complex64", "int64"):
        for n in sizes:
            for root in range(p):
                x = data(dtype, r, n) if r == root else np.zeros(n, dtype=data(dtype, 0, 1).dtype)
                ec.broadcast(x, root)
                check(np.array_equal(x, data(dtype, root, n)), f"broadcast {dtype} n={n} root={root}")
            outs = [np.empty(n, data(dtype, 0, 1).dtype) for _ in range(p)]
            ec.all_gather(outs, data(dtype, r, n))
            check(all(np.array_equal(outs[k], data(dtype, k, n)) for k in range(p)), f"all_gather {dtype} n={n}")
            flat = np.empty(p * n, data(dtype, 0, 1).dtype)
            ec.all_gather_into_tensor(flat, data(dtype, r, n))
            check(
                np.array_equal(flat, np.concatenate([data(dtype, k, n) for k in range(p)])),
                f"all_gather_into_tensor {dtype} n={n}",
            )
            root = (n + 1) % p
            outs = [np.empty(n, data(dtype, 0, 1).dtype) for _ in range(p)] if r == root else None
            ec.gather(data(dtype, r, n), outs, root)
            if r == root:
                check(all(np.array_equal(outs[k], data(dtype, k, n)) for k in range(p)), f"gather {dtype} n={n}")
            x = np.empty(n, data(dtype, 0, 1).dtype)
            ec.scatter(x, [data(dtype, 50 + k, n) for k in range(p)] if r == root else None, root)
            check(np.array_equal(x, data(dtype, 50 + r, n)), f"scatter {dtype} n={n}")
            ins = [data(dtype, 10 * r + j, n) for j in range(p)]
            outs = [np.empty(n, ins[0].dtype) for _ in range(p)]
            ec.all_to_all(outs, ins)
            check(
                all(np.array_equal(outs[k], data(dtype, 10 * k + r, n)) for k in range(p)), f"all_to_all {dtype} n={n}"
            )
    ec.barrier()
    ec.destroy_process_group()
    return bad


def layouts():
    """Shapes and memory layouts: 2-D, Fortran order, strided views (staged and written back),
    scalars, and the *_tensor / *_single variants."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    bad = []
    base = np.arange(40, dtype=np.float64).reshape(5, 8) * (r + 1)
    x = np.asfortranarray(base)
    ec.all_reduce(x)
    if not np.array_equal(x, np.arange(40.0).reshape(5, 8) * sum(range(1, p + 1))):
        bad.append("fortran-order all_reduce")
    buf = np.full(20, -1.0)
    view = buf[::2]
    view[:] = r + 1
    ec.all_reduce(view)
    if not (np.all(buf[::2] == sum(range(1, p + 1))) and np.all(buf[1::2] == -1.0)):
        bad.append("strided all_reduce")
    s = np.array(float(r))
    ec.all_reduce(s, ec.ReduceOp.MAX)
    if float(s) != p - 1:
        bad.append("0-d all_reduce")
    t = np.arange(3 * p, dtype=np.int32).reshape(p, 3) + 100 * r
    o = np.empty((3,), np.int32)
    ec.reduce_scatter_tensor(o, t)
    if not np.array_equal(o, sum(np.arange(3 * p, dtype=np.int32).reshape(p, 3)[r] + 100 * k for k in range(p))):
        bad.append("reduce_scatter_tensor")
    a = np.arange(2 * p, dtype=np.int16).reshape(p, 2) + 10 * r
    b = np.empty_like(a)
    ec.all_to_all_single(b, a)
    if not np.array_equal(b, np.stack([np.arange(2 * p, dtype=np.int16).reshape(p, 2)[r] + 10 * k for k in range(p)])):
        bad.append("all_to_all_single")
    col = np.zeros((4, 3), np.float32)[:, 1]
    ec.broadcast(col, 0) if r else (col.__setitem__(slice(None), 7), ec.broadcast(col, 0))
    if not np.all(col == 7):
        bad.append("strided broadcast")
    ec.destroy_process_group()
    return bad


def subgroups():
    """new_group: collectives inside a subgroup (global ranks as roots), several groups on one
    store, non-members told clearly, and the world still working after."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    bad = []
    evens = ec.new_group([k for k in range(p) if k % 2 == 0])
    odds = ec.new_group([k for k in range(p) if k % 2 == 1])
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    members = mine.ranks
    x = np.array([r + 1.0])
    ec.all_reduce(x, group=mine)
    if x[0] != sum(k + 1 for k in members):
        bad.append(f"subgroup all_reduce {x[0]}")
    y = np.array([r])
    ec.broadcast(y, members[-1], group=mine)
    if y[0] != members[-1]:
        bad.append("subgroup broadcast with a global src")
    if ec.get_rank(mine) != members.index(r) or ec.get_world_size(mine) != len(members):
        bad.append("subgroup rank/size")
    if ec.get_rank(other) != -1 or ec.get_world_size(other) != -1:
        bad.append("non-member rank/size")
    try:
        ec.all_reduce(np.zeros(1), group=other)
        bad.append("non-member collective did not raise")
    except ec.GroupError as err:
        if "not a member" not in str(err):
            bad.append(f"non-member message: {err}")
    try:
        ec.broadcast(np.zeros(1), members[0] + 1 if members[0] + 1 not in members else p + 5, group=mine)
        bad.append("src outside group did not raise")
    except ec.GroupError:
        pass
    pair = ec.new_group([0, p - 1])
    if r in (0, p - 1):
        z = np.array([1], np.int64)
        ec.all_reduce(z, group=pair)
        if z[0] != 2:
            bad.append("pair group")
        ec.destroy_process_group(pair)
        try:
            ec.all_reduce(z, group=pair)
            bad.append("destroyed group did not raise")
        except ec.GroupError:
            pass
    w = np.array([1.0])
    ec.all_reduce(w)
    if w[0] != p:
        bad.append("world after subgroups")
    ec.destroy_process_group()
    return bad


def async_and_p2p():
    """async_op handles (ordered, waitable) and send/recv around a ring, with isend/irecv."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    bad = []
    xs = [np.full(1000, float(r + k)) for k in range(5)]
    works = [ec.all_reduce(x, async_op=True) for x in xs]
    y = np.array([1.0])
    ec.all_reduce(y)  # a blocking call behind pending async ones
    for k, (x, w) in enumerate(zip(xs, works)):
        if not (w.wait() and w.is_completed() and w.is_success()):
            bad.append("work state")
        if not np.all(x == sum(q + k for q in range(p))):
            bad.append(f"async all_reduce {k}")
    if y[0] != p:
        bad.append("blocking after async")
    right, left = (r + 1) % p, (r - 1) % p
    for n in (0, 3, 200_000, 3_000_000):  # larger than the shared-memory ring
        out = np.arange(n, dtype=np.float32) + r
        inc = np.empty(n, np.float32)
        s = ec.isend(out, right, tag=n % 7)
        q = ec.irecv(inc, left, tag=n % 7)
        q.wait()
        s.wait()
        if not np.array_equal(inc, np.arange(n, dtype=np.float32) + left):
            bad.append(f"ring send/recv n={n}")
    if r == 0:
        ec.send(np.array([42], np.int64), p - 1)
    if r == p - 1:
        got = np.zeros(1, np.int64)
        if ec.recv(got, 0) != 0 or got[0] != 42:
            bad.append("blocking send/recv")
    ec.barrier()
    ec.destroy_process_group()
    return bad


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_matches_numpy(world):
    for bad in harness.run(matrix, world, timeout=120):
        assert bad == []


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_paths_with_tiny_slots(world):
    results = harness.run(
        matrix,
        world,
        timeout=120,
        env=TINY,
        kwargs={"sizes": [0, 7, 3001], "dtypes": ["int32", "float16", "float64", "bfloat16", "uint8"]},
    )
    for bad in results:
        assert bad == []


@pytest.mark.parametrize("world", [2, 3])
def test_layouts(world):
    for bad in harness.run(layouts, world, timeout=60):
        assert bad == []


@pytest.mark.parametrize("world", [3, 4])
def test_subgroups(world):
    for bad in harness.run(subgroups, world, timeout=60):
        assert bad == []


@pytest.mark.parametrize("world", [2, 3])
def test_async_and_point_to_point(world):
    for bad in harness.run(async_and_p2p, world, timeout=60):
        assert bad == []


def test_world_of_one():
    for bad in harness.run(matrix, 1, timeout=60, kwargs={"sizes": [0, 5], "dtypes": ["float32", "int8", "bfloat16"]}):
        assert bad == []

"""Arrays made by ``shared_empty`` (memory.py, shm_shared.py): every local rank maps them, so a
large reduce_scatter or all_gather reads them in place, in two steps instead of one per
segment, and an all_reduce reduces them where they are, with the same results bit for bit as
the copying paths; and whenever one rank's inputs are not shared, or reading them in place
would race with a write, every rank copies instead.

The step count (the comm's ``seq``) tells which path ran. The slot is 64 KiB here, so the
copying path of the sizes below takes dozens of steps."""

from __future__ import annotations

import numpy as np
import pytest
from test_collectives_cpu import data, ops_for, reference

import collectives_harness as harness
from elastix.collectives import shm_segment
from elastix.collectives.shm_shared import NOT_SHARED, SharedArrays

SMALL_SLOTS = {"ELASTIX_SHM_SLOT_BYTES": "65536"}
N = 70_001  # elements per rank's part: odd, past one slot even in bytes


def _comm(ec):
    return ec._world().default.backend.shm


def _steps(comm, call, *args) -> int:
    """Steps ``call(*args)`` took."""
    before = comm.seq
    call(*args)
    return comm.seq - before


def _segments(comm, x) -> int:
    """The segments a large all_reduce of ``x`` is pipelined over (shm_algos.all_reduce): the
    copying path takes one step more than there are, the one reading in place two more (the
    descriptor's step comes first)."""
    region = (comm.slot_bytes // comm.n) // 64 * 64
    per_segment = region // x.itemsize * comm.n
    return -(-x.size // per_segment)


def read_in_place():
    """reduce_scatter, all_gather and all_reduce on shared arrays, several dtypes and ops, each
    input overwritten as soon as the call returns (a rank that returned while a peer still read its
    input would corrupt that peer's result)."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    comm, bad, steps = _comm(ec), [], set()
    for dtype in ("float32", "float64", "int64", "uint8"):
        whole = ec.shared_empty((p, N), data(dtype, 0, 1).dtype)
        for op in ops_for(dtype)[:4]:
            for it in range(3):
                parts = [data(dtype, 10 * r + j + it, N, op) for j in range(p)]
                whole[:] = parts
                out, plain_out = np.empty(N, whole.dtype), np.empty(N, whole.dtype)
                steps.add(_steps(comm, ec.reduce_scatter, out, list(whole), getattr(ec.ReduceOp, op)))
                whole[:] = 0
                ec.reduce_scatter(plain_out, parts, getattr(ec.ReduceOp, op))  # the copying path
                if not np.array_equal(out, plain_out):
                    bad.append(f"reduce_scatter {dtype} {op}: differs from the copying path")
                want = reference(dtype, op, [data(dtype, 10 * k + r + it, N, op) for k in range(p)])
                if dtype in ("int64", "uint8") and not np.array_equal(out, want):
                    bad.append(f"reduce_scatter {dtype} {op}: wrong")
                # all_reduce of the whole shared array, in place
                whole[:] = parts
                taken = _steps(comm, ec.all_reduce, whole, getattr(ec.ReduceOp, op))
                if taken != _segments(comm, whole) + 2:  # the copying path takes one step less
                    bad.append(f"all_reduce {dtype} {op}: {taken} steps, not in place")
                plain = np.array(parts)
                ec.all_reduce(plain, getattr(ec.ReduceOp, op))
                if not np.array_equal(whole, plain):
                    bad.append(f"all_reduce {dtype} {op}: differs from the copying path")
        # in place: the output is this rank's own part of its input (which no peer reads)
        whole[:] = [data(dtype, 10 * r + j, N) for j in range(p)]
        steps.add(_steps(comm, ec.reduce_scatter, whole[r], list(whole)))
        want = reference(dtype, "SUM", [data(dtype, 10 * k + r, N) for k in range(p)])
        if dtype in ("int64", "uint8") and not np.array_equal(whole[r], want):
            bad.append(f"reduce_scatter {dtype} in place: wrong")
        x = ec.shared_empty(N, data(dtype, 0, 1).dtype)
        x[:] = data(dtype, r, N)
        outs = [np.empty(N, x.dtype) for _ in range(p)]
        steps.add(_steps(comm, ec.all_gather, outs, x))
        x[:] = 0
        if not all(np.array_equal(outs[k], data(dtype, k, N)) for k in range(p)):
            bad.append(f"all_gather {dtype}: wrong")
    # all_gather_into_tensor in place: the input is this rank's part of a shared output
    flat = ec.shared_empty(p * N, np.float64)
    flat[r * N : (r + 1) * N] = r + 0.5
    steps.add(_steps(comm, ec.all_gather_into_tensor, flat, flat[r * N : (r + 1) * N]))
    if not np.array_equal(flat, np.repeat(np.arange(p) + 0.5, N)):
        bad.append("all_gather_into_tensor in place: wrong")
    # a reduce changes the root's array only: it copies
    x = ec.shared_empty(N, np.float64)
    x[:] = r + 1
    ec.reduce(x, 0)
    if not np.array_equal(x, np.full(N, p * (p + 1) / 2 if r == 0 else r + 1)):
        bad.append("reduce: wrong")
    return {"bad": bad, "steps": sorted(steps)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", ["memfd", "file"])  # file: a job with a secret, as an ordinary user
def test_collectives_read_shared_inputs_in_place_with_the_copying_paths_results(world, method):
    env = {**SMALL_SLOTS, "ELASTIX_SHM": method}
    for result in harness.run(read_in_place, world, env=env, timeout=120):
        assert result["bad"] == []
        assert result["steps"] == [2]  # the descriptor's step, and the one that ends the reads


def copy_unless_all_shared():
    """Cases where reading in place is wrong or impossible: each must copy, on every rank, and
    give the right answer."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    comm, found = _comm(ec), {}
    want = sum(np.arange(N, dtype=np.float64) * (k + 1) for k in range(p))
    # one rank's inputs are ordinary arrays
    whole = ec.shared_empty((p, N), np.float64)
    whole[:] = np.arange(N) * (r + 1)
    ins = list(whole) if r == 0 else [w.copy() for w in whole]
    out = np.empty(N)
    found["one rank copies"] = (_steps(comm, ec.reduce_scatter, out, ins), bool(np.array_equal(out, want)))
    # the output is a part of its own input that a peer reads (written while the peer reads it)
    peer = (r + 1) % p
    out = whole[peer]
    found["output over a peer's part"] = (
        _steps(comm, ec.reduce_scatter, out, list(whole)),
        bool(np.array_equal(out, want)),
    )
    # the inputs lie in a shared array, but last to first
    whole = ec.shared_empty((p, N), np.float64)
    whole[:] = np.arange(N) * (r + 1)
    out = np.empty(N)
    found["last to first"] = (_steps(comm, ec.reduce_scatter, out, list(whole)[::-1]), bool(np.array_equal(out, want)))
    return found


def test_every_rank_copies_unless_every_rank_can_read_in_place():
    results = harness.run(copy_unless_all_shared, 2, env=SMALL_SLOTS, timeout=120)
    for found in results:
        for case, (steps, right) in found.items():
            assert right, case
            assert steps > 2, f"{case}: read in place ({steps} steps)"
    assert results[0] == results[1]  # the same path on both ranks


def different_sizes():
    ec = harness.init()
    try:
        ec.shared_empty(1000 + ec.get_rank(), np.uint8)
    except ValueError as err:
        x = np.ones(10)
        ec.all_reduce(x)  # the group is still usable
        return f"{err} / {x[0]}"
    return "no error"


def test_ranks_asking_for_different_sizes_all_get_a_clear_error():
    for said in harness.run(different_sizes, 2, timeout=60):
        assert "asked for different sizes" in said and "rank 0 1000, rank 1 1001" in said
        assert said.endswith("/ 2.0")


def alone():
    ec = harness.init()
    a = ec.shared_empty((2, 3), np.int32)
    out = np.empty(3, np.int32)
    ec.reduce_scatter(out, [np.arange(3, dtype=np.int32)])
    try:
        ec.shared_empty((-1,))
    except ValueError as err:
        refused = str(err)
    return [list(a.shape), str(a.dtype), int(a.sum()), out.tolist(), refused]


def test_a_group_of_one_gets_an_ordinary_array_and_bad_shapes_are_refused():
    (result,) = harness.run(alone, 1, timeout=60)
    assert result[:4] == [[2, 3], "int32", 0, [0, 1, 2]]
    assert "non-negative integers" in result[4]


# -- the decision itself, fed wrong layouts -------------------------------------------------------


@pytest.fixture
def two_buffers():
    """Rank 0's view of a host of two ranks holding two shared buffers of 4096 bytes (one
    segment stands for both ranks' memory: the checks read sizes and words, not data)."""
    segments = [shm_segment.create(4096, "memfd") for _ in range(2)]
    shared = SharedArrays(0)
    arrays = [shared.add([s, s], 4096) for s in segments]
    yield shared, arrays
    shared.close()
    for s in segments:
        s.close()


def test_layout_says_where_evenly_spaced_inputs_lie(two_buffers):
    shared, (first, second) = two_buffers
    parts = list(second[256:].view(np.float64)[:128].reshape(2, 64))
    assert shared.layout(parts) == [2, 256, 512, 2]
    assert shared.layout([first[:64]]) == [1, 0, 0, 2]
    assert shared.layout([np.zeros(64)]) == NOT_SHARED  # not in a shared buffer
    assert shared.layout([first[0:64], first[100:164], first[300:364]]) == NOT_SHARED  # uneven
    assert shared.layout(parts, writes=[parts[0]]) == [2, 256, 512, 2]  # its own part: only it reads
    assert shared.layout(parts, writes=[parts[1][10:20]]) == NOT_SHARED  # the part rank 1 reads


@pytest.mark.parametrize(
    "layouts, why",
    [
        ([[1, 0, 512, 2], [1, 0, 512, 2]], None),
        ([[1, 0, 512, 2], [0, 0, 0, 0]], "one rank not shared"),
        ([[1, 0, 512, 2], [1, 0, 512, 1]], "one rank holds fewer buffers"),
        ([[3, 0, 512, 3], [3, 0, 512, 3]], "a buffer this rank does not hold"),
        ([[1, 0, 512, 2], [1, 3600, 512, 2]], "past the buffer's end"),
        ([[1, 4, 512, 2], [1, 0, 512, 2]], "not aligned to the dtype"),
        ([[1, 0, -512, 2], [1, 0, 512, 2]], "a negative stride"),
    ],
)
def test_agreement_refuses_every_wrong_layout(two_buffers, layouts, why):
    shared, _ = two_buffers
    assert shared.agreed(layouts, 2, 512, 8) is (why is None), why


def killed_mid_collective(op):
    """Both ranks run collectives on shared arrays back to back; rank 1 is killed by a timer,
    in the middle of one."""
    import os
    import signal
    import threading

    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    whole = ec.shared_empty((p, 8 * N), np.float64)
    whole[:] = 1.0
    out = np.empty(8 * N)
    if r == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    calls = 0
    try:
        for _ in range(100_000):
            if op == "all_reduce":
                ec.all_reduce(whole)
            else:
                ec.reduce_scatter(out, list(whole))
            calls += 1
    except ec.PeerError as err:
        # the peer's memory stays mapped here: reading every rank's part does not fault
        peer = _comm(ec).shared.buffers[0].views[1]
        return ["PeerError", err.rank, calls, float(peer[:64].sum()) >= 0]
    return ["no error", None, calls, None]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_a_peer_killed_inside_a_collective_on_shared_arrays_is_named(op):
    results = harness.run(killed_mid_collective, 2, check=False, env=SMALL_SLOTS, timeout=60, kwargs={"op": op})
    kind, rank, calls, readable = results[0].value
    assert (kind, rank, readable) == ("PeerError", 1, True), results[0].value
    assert calls > 0  # it was running collectives when its peer died
    assert results[1].returncode == -9


def across_hosts():
    """Shared arrays in a group that spans hosts: each host's ranks share theirs; results as
    with ordinary arrays."""
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    whole = ec.shared_empty((p, N), np.float64)
    whole[:] = np.arange(N) * (r + 1)
    ec.all_reduce(whole)
    want = np.arange(N) * sum(range(1, p + 1))
    right = [bool(np.array_equal(whole[k], want)) for k in range(p)]
    whole[:] = np.arange(N) * (r + 1)
    out = np.empty(N)
    ec.reduce_scatter(out, list(whole))
    right.append(bool(np.array_equal(out, want)))
    x = ec.shared_empty(N, np.float64)
    x[:] = r
    outs = [np.empty(N) for _ in range(p)]
    ec.all_gather(outs, x)
    right.append(all(np.array_equal(outs[k], np.full(N, k)) for k in range(p)))
    return right


def test_shared_arrays_in_a_group_across_hosts_give_the_same_results():
    for right in harness.run(across_hosts, 4, hosts=["a", "a", "b", "b"], env=SMALL_SLOTS, timeout=120):
        assert all(right), right

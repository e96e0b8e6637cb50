"""Failures turn into clear errors, never hangs: ranks that disagree (shape, dtype, op,
collective) raise MismatchError; a peer that died raises PeerError naming it, well before the
timeout; a peer that is alive but never arrives raises CollectiveTimeoutError naming it; and
misuse (no init, bad arguments) is refused on the calling rank."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest

import collectives_harness as harness
import elastix
import elastix.collectives as ec


def mismatch(shape_only=False):
    cc = harness.init()
    r = cc.get_rank()
    seen = []
    cases = [
        ("shape", lambda: cc.all_reduce(np.zeros(4 + r, np.float32))),
        ("dtype", lambda: cc.all_reduce(np.zeros(4, np.float32 if r == 0 else np.float64))),
        ("op", lambda: cc.all_reduce(np.zeros(4), cc.ReduceOp.SUM if r == 0 else cc.ReduceOp.MAX)),
        ("collective", lambda: cc.all_reduce(np.zeros(4)) if r == 0 else cc.broadcast(np.zeros(4), 0)),
        ("root", lambda: cc.broadcast(np.zeros(3), r % 2)),
    ]
    for name, call in cases[:1] if shape_only else cases:
        try:
            call()
            seen.append(f"{name}: no error")
        except cc.MismatchError as err:
            seen.append(f"{name}: {err}")
        except cc.CollectiveError as err:  # over TCP the group is unusable after the first one
            seen.append(f"{name}: other {type(err).__name__}: {err}")
            break
    x = np.ones(3)
    if cc.get_world_size() and not any("other" in s for s in seen):
        cc.all_reduce(x)  # still usable after mismatches in shared memory
    seen.append(float(x[0]))
    cc.destroy_process_group()
    return seen


def mismatch_then_call(between_hosts=False, op="all_reduce"):
    """A mismatched call (shapes differ by rank, or by host), then a matching one: what each
    rank raised, as [class, message] (or "ok")."""
    cc = harness.init()
    r = cc.get_rank()
    n = 4 + (r // 2 if between_hosts else r)
    first = {
        "all_reduce": lambda: cc.all_reduce(np.zeros(n, np.float32)),
        "broadcast": lambda: cc.broadcast(np.zeros(n, np.float32), 0),
    }[op]
    seen = []
    for call in (first, lambda: cc.all_reduce(np.ones(3))):
        try:
            call()
            seen.append("ok")
        except cc.CollectiveError as err:
            seen.append([type(err).__name__, str(err)])
    return seen


UNUSABLE = "this group is unusable now: destroy it and create a new one"


@pytest.mark.parametrize(
    "hosts,between_hosts",
    [(["a", "b"], False), (["a", "b", "c"], False), (["a", "a", "b", "b"], True)],
    ids=["2-hosts", "3-hosts", "2x2-between-hosts"],
)
def test_over_tcp_every_rank_raises_the_mismatch_and_the_group_says_it_is_unusable(hosts, between_hosts):
    results = harness.run(
        mismatch_then_call, len(hosts), hosts=hosts, timeout=60, kwargs={"between_hosts": between_hosts}
    )
    for r, (first, second) in enumerate(results):
        # every rank names the mismatch itself, not a peer that "closed its connection"
        assert first[0] == "MismatchError" and "called all_reduce(shape" in first[1] and UNUSABLE in first[1], (
            r,
            first,
        )
        assert "Broken pipe" not in first[1] and "exited or failed" not in first[1], (r, first)
        # and the next call says why the group cannot be used
        assert second[0] == "CollectiveError", (r, second)
        assert "unusable after an earlier failure (mismatch: " in second[1], (r, second)
        assert "destroy it and create a new one" in second[1], (r, second)


def test_a_broadcast_root_that_only_sends_learns_of_the_mismatch_at_its_next_call():
    root, other = harness.run(mismatch_then_call, 2, hosts=["a", "b"], timeout=60, kwargs={"op": "broadcast"})
    assert other[0][0] == "MismatchError" and UNUSABLE in other[0][1], other
    assert root[0] == "ok", root  # it sent, and nothing told it otherwise during the call
    assert root[1][0] == "MismatchError" and "found by another rank" in root[1][1], root
    assert "called broadcast(shape" in root[1][1] and UNUSABLE in root[1][1], root


def test_in_shared_memory_the_mismatch_says_the_group_is_still_usable():
    results = harness.run(mismatch_then_call, 2, timeout=60)
    for first, second in results:
        assert first[0] == "MismatchError" and first[1].endswith("the group is still usable"), first
        assert second == "ok"


def dies_or_waits(victim=1, how="exit", sleep=0.0):
    cc = harness.init(timeout=timedelta(seconds=float(os.environ.get("CC_TIMEOUT", "30"))))
    r = cc.get_rank()
    x = np.ones(1000)
    cc.all_reduce(x)
    if r == victim:
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(sleep)  # alive, but never arrives in time
        os._exit(0)
    start = time.monotonic()
    try:
        cc.all_reduce(x)
        return ["no error"]
    except cc.PeerError as err:
        return ["PeerError", err.rank, str(err), time.monotonic() - start]
    except cc.CollectiveTimeoutError as err:
        return ["Timeout", err.ranks, str(err), time.monotonic() - start]
    except cc.CollectiveError as err:
        return [type(err).__name__, None, str(err), time.monotonic() - start]


@pytest.mark.parametrize("hosts", [None, ["a", "b"], ["a", "b", "c"]])
def test_mismatched_calls_raise_on_every_rank(hosts):
    world = 3 if hosts and len(hosts) == 3 else 2
    results = harness.run(mismatch, world, hosts=hosts, timeout=60)
    for r, seen in enumerate(results):
        first = seen[0]
        assert first.startswith("shape:"), seen
        if "other" not in first:
            # it names its own shape and a rank that called another one
            assert f"shape ({4 + r},)" in first and "but rank" in first, first
    if hosts is None:  # shared memory: every mismatch is seen by everyone, the group survives
        for seen in results:
            assert all(not s.startswith(("no error", "other")) for s in seen[:-1] if isinstance(s, str)), seen
            assert "float32" in seen[1] and "float64" in seen[1]
            assert "op SUM" in seen[2] and "op MAX" in seen[2]
            assert "broadcast" in seen[3] and "all_reduce" in seen[3]
            assert seen[-1] == 2.0


@pytest.mark.parametrize("how", ["exit", "kill"])
@pytest.mark.parametrize("hosts", [None, ["a", "b"]])
def test_a_dead_peer_is_named_before_the_timeout(how, hosts):
    results = harness.run(dies_or_waits, 2, hosts=hosts, check=False, timeout=60, kwargs={"how": how})
    kind, rank, message, _elapsed = results[0].value
    assert kind == "PeerError", results[0].value
    assert rank == 1 and "rank 1" in message  # a PeerError: death is noticed, not timed out


def test_a_dead_peer_among_three():
    results = harness.run(dies_or_waits, 3, check=False, timeout=60, kwargs={"how": "kill", "victim": 2})
    for r in (0, 1):
        kind, rank, _message, _ = results[r].value
        assert kind == "PeerError" and rank == 2, results[r].value


@pytest.mark.parametrize("hosts", [None, ["a", "b"]])
def test_a_hung_peer_times_out_with_its_rank(hosts):
    results = harness.run(
        dies_or_waits,
        2,
        hosts=hosts,
        check=False,
        timeout=60,
        env={"CC_TIMEOUT": "1.5"},
        kwargs={"how": "sleep", "sleep": 6.0},
    )
    kind, ranks, message, elapsed = results[0].value
    assert kind == "Timeout", results[0].value
    assert ranks == [1] and "rank" in message and "1" in message
    assert elapsed >= 1.4, f"the 1.5 s timeout must run its course, not end after {elapsed:.2f} s"


# -- misuse, in this process (a world of one over an in-process store) -------------------------


@pytest.fixture
def world_of_one():
    ec.init_process_group(store=elastix.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5))
    yield ec
    if ec.is_initialized():
        ec.destroy_process_group()


def test_calls_before_init_are_refused():
    assert not ec.is_initialized()
    with pytest.raises(ec.NotInitializedError, match="init_process_group"):
        ec.all_reduce(np.zeros(3))
    with pytest.raises(ValueError):
        ec.get_rank()


def test_bad_arguments_are_refused(world_of_one):
    with pytest.raises(RuntimeError, match="twice"):
        ec.init_process_group(store=elastix.HashStore(), rank=0, world_size=1)
    with pytest.raises(TypeError, match="integer or bool"):
        ec.all_reduce(np.zeros(3), ec.ReduceOp.BAND)
    with pytest.raises(TypeError, match="floating-point"):
        ec.all_reduce(np.zeros(3, np.int32), ec.ReduceOp.AVG)
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        ec.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="objects"):
        ec.broadcast(np.array([object()]), 0)
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ec.all_reduce(ro)
    with pytest.raises(ValueError, match="one per rank"):
        ec.all_gather([np.zeros(3), np.zeros(3)], np.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        ec.all_gather([np.zeros(4)], np.zeros(3))
    with pytest.raises(ec.GroupError, match="not a member"):
        ec.broadcast(np.zeros(3), 5)
    with pytest.raises(ValueError, match="unknown reduction op"):
        ec.all_reduce(np.zeros(3), "median")
    with pytest.raises(ValueError, match="bfloat16"):
        ec.all_reduce(np.zeros(3, np.uint16), dtype="float8")
    with pytest.raises(TypeError, match="16-bit"):
        ec.all_reduce(np.zeros(3, np.float32), dtype="bfloat16")
    with pytest.raises(ValueError, match="world"):
        ec.new_group([0, 3])
    with pytest.raises(NotImplementedError, match="src"):
        ec.recv(np.zeros(1))


def test_a_call_refused_once_is_refused_after_valid_calls_of_the_same_shape_too(world_of_one):
    # all_reduce keeps its checks' answer per (dtype, shape, op): a refused op must not share
    # one with an accepted op that compares and hashes equal (True == 1 == PRODUCT)
    x = np.full(3, 2.0)
    ec.all_reduce(x, ec.ReduceOp.PRODUCT)
    ec.all_reduce(x, 1)
    with pytest.raises(ValueError, match="unknown reduction op"):
        ec.all_reduce(x, True)
    with pytest.raises(ValueError, match="unknown reduction op"):
        ec.all_reduce(x, ["sum"])  # unhashable: refused, not a TypeError from the cache
    y = np.full(3, 2, np.int32)
    ec.all_reduce(y, ec.ReduceOp.SUM)
    with pytest.raises(TypeError, match="floating-point"):
        ec.all_reduce(y, ec.ReduceOp.AVG)
    ec.all_reduce(x, ec.ReduceOp.AVG)
    with pytest.raises(TypeError, match="floating-point"):
        ec.all_reduce(y, ec.ReduceOp.AVG)


def test_world_of_one_works_in_process(world_of_one):
    x = np.arange(5.0)
    ec.all_reduce(x, ec.ReduceOp.AVG)
    assert np.array_equal(x, np.arange(5.0))
    out = [np.empty(5)]
    ec.all_gather(out, x)
    assert np.array_equal(out[0], x)
    w = ec.all_reduce(x, async_op=True)
    assert w.wait() and w.is_success()
    ec.barrier()
    assert ec.get_backend() == "cpu" and ec.get_rank() == 0 and ec.get_world_size() == 1


def test_unknown_backend_and_bad_init_method():
    with pytest.raises(ValueError, match="unknown backend"):
        ec.init_process_group("mpi", store=elastix.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="init_method"):
        ec.init_process_group(init_method="udp://x", rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank"):
        ec.init_process_group(store=elastix.HashStore(), world_size=1)
    assert not ec.is_initialized()

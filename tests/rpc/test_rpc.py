"""elastix.rpc end to end: real worker processes (tests/collectives_harness.py starts them with
the environment `elastix run` gives workers), real sockets, and the RRef protocol's debug
counters (`_get_debug_info`) to see OwnerRRefs deleted exactly when their last reference goes.

The functions above the tests run inside the workers; their RPC targets are in rpc_targets.py.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import sys

import pytest

import collectives_harness as harness
from agents import elastix_run, finish, wait_for

WORKERS = [f"w{rank}" for rank in range(4)]


def _init(**options):
    import elastix.rpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=30, **options))
    return rpc, rank


# -- scenarios (run in the workers) -----------------------------------------------------------


def basics():
    import numpy as np

    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        out["sync"] = rpc.rpc_sync("w1", t.add, args=(2,), kwargs={"b": 3})
        out["by_rank_and_info"] = [rpc.rpc_sync(1, t.add, args=(1, 1)), rpc.rpc_sync(rpc.get_worker_info("w1"), t.noop)]
        out["self"] = rpc.rpc_sync("w0", t.add, args=(4, 4))
        arr = np.arange(300_000, dtype=np.float64).reshape(1000, 300)
        back = rpc.rpc_sync("w1", t.add, args=(arr, 1.0))
        out["array"] = bool((back == arr + 1.0).all()) and back.shape == arr.shape and back.flags.writeable
        small = np.arange(10, dtype=np.int32)
        out["small_array"] = rpc.rpc_sync("w1", t.ident, args=(small,)).tolist()
        fut = rpc.rpc_async("w1", t.add, args=(20, 1))
        out["async"] = [fut.wait(), fut.done(), fut.then(lambda f: f.value() * 2).wait()]
        rref = rpc.remote("w1", t.make_box, args=(5,))
        out["rref"] = [
            rref.owner().name,
            rref.owner_name(),
            rref.is_owner(),
            rref.rpc_sync().add(2),
            rref.rpc_async().add(3).wait(),
            rref.remote().get().to_here(),
            rref.to_here().n,
            rref.confirmed_by_owner(),
        ]
        local = rpc.RRef([1, 2, 3])
        out["local"] = [local.is_owner(), local.local_value(), local.to_here(), local.owner().name]
        try:
            rref.local_value()
        except RuntimeError as err:
            out["local_value_on_user"] = "w1" in str(err)
        out["info"] = [list(rpc.get_worker_info()), list(rpc.get_worker_info("w1"))]
        # a stranger on the RPC port is refused; the workers go on
        host, port = rpc.api.current_agent().endpoint.describe(1).rsplit(", ", 1)[1].rstrip(")").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\n" + bytes(64))
            stranger.settimeout(10)
            out["stranger_closed"] = stranger.recv(100) == b""
        out["after_stranger"] = rpc.rpc_sync("w1", t.add, args=(1, 2))
        try:
            rpc.rpc_sync("nobody", t.noop)
        except ValueError as err:
            out["unknown_name"] = str(err)
    rpc.shutdown()
    return out


def exceptions():
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        try:
            rpc.rpc_sync("w1", t.raise_custom, args=(7,))
        except t.CustomError as err:
            out["custom"] = [err.code, "raise_custom" in err.remote_traceback, "w1" in "".join(err.__notes__)]
        try:
            rpc.rpc_sync("w1", t.raise_unpicklable)
        except t.UnpicklableError as err:
            out["unpicklable"] = ["cannot travel" in str(err), "raise_unpicklable" in err.remote_traceback]
        try:
            rpc.rpc_async("w1", t.add, args=(1, "x")).wait()
        except TypeError as err:
            out["async_type_error"] = "add" in err.remote_traceback
        failed = rpc.remote("w1", t.raise_custom, args=(3,))
        try:
            failed.to_here()
        except t.CustomError as err:
            out["remote_to_here"] = err.code
        try:
            rpc.rpc_sync("w1", lambda: 1)
        except Exception as err:
            out["lambda"] = type(err).__name__
        try:
            import pickle

            pickle.dumps(rpc.RRef(1))
        except RuntimeError as err:
            out["pickle_outside"] = "only as part of an elastix.rpc call" in str(err)
    rpc.shutdown()
    return out


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped: kill(SIGSTOP) returns before they all are, and
    on a busy machine a thread not yet stopped can still answer a call."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            pass
    return all(state in ("T", "t") for state in states)


def timeouts():
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        try:
            rpc.rpc_sync("w1", t.sleep, args=(3,), timeout=0.2)
        except TimeoutError as err:
            out["sync"] = [type(err).__name__, "w1" in str(err)]
        try:
            rpc.rpc_async("w1", t.sleep, args=(3,), timeout=0.2).wait()
        except TimeoutError as err:
            out["async"] = [type(err).__name__, "w1" in str(err)]
        out["still_works"] = rpc.rpc_sync("w1", t.add, args=(1, 1))
        # a stopped callee (SIGSTOP) is silent, not gone: a timeout, then calls go on after SIGCONT
        pid = rpc.rpc_sync("w1", os.getpid)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(pid), timeout=10, what=f"worker {pid}'s threads all stopped by SIGSTOP")
        try:
            rpc.rpc_sync("w1", t.noop, timeout=0.5)
        except TimeoutError as err:
            out["stopped"] = [type(err).__name__, "w1" in str(err)]
        finally:
            os.kill(pid, signal.SIGCONT)
        out["resumed"] = rpc.rpc_sync("w1", t.add, args=(2, 2))
    rpc.shutdown()
    return out


def to_here_before_run_and_nested():
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        rref = rpc.remote("w1", t.wait_for_release)
        # to_here from a thread while the owner's function still waits
        import threading

        got = {}
        fetch = threading.Thread(target=lambda: got.setdefault("v", rref.to_here()))
        fetch.start()
        fetch.join(0.3)
        out["before"] = [fetch.is_alive(), rref.confirmed_by_owner(), rref._get_future().done()]
        rpc.rpc_sync("w1", t.release)
        fetch.join(30)
        out["after"] = [got.get("v"), rref.confirmed_by_owner()]
        out["nested"] = rpc.rpc_sync("w1", t.nested, args=("w2", 3, 4))
        made = rpc.rpc_sync("w1", t.remote_chain, args=("w2", 9))
        out["returned_rref"] = [made.owner_name(), made.to_here().n]
    rpc.shutdown()
    return out


def _owners(rpc, t, worker):
    return rpc.rpc_sync(worker, t.debug_info)["num_owner_rrefs"]


def sharing_cases():
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        everyone = WORKERS[:3]
        # 1. the creator is the owner
        local = rpc.RRef(t.Box(1))
        selfmade = rpc.remote("w0", t.make_box, args=(2,))
        selfmade.to_here()
        a = [_owners(rpc, t, "w0")]
        del local
        a.append(_owners(rpc, t, "w0"))
        del selfmade
        a.append(_owners(rpc, t, "w0"))
        out["creator_is_owner"] = a
        # 2. owner shares with user: the fork keeps it after the owner's code lets go
        shared = rpc.RRef(t.Box(3))
        out_b = [rpc.rpc_sync("w1", t.keep, args=("b", shared))]
        del shared
        t.settle(everyone)
        out_b.append(_owners(rpc, t, "w0"))
        rpc.rpc_sync("w1", t.drop, args=("b",))
        out_b.append(t.wait_until(lambda: _owners(rpc, t, "w0") == 0))
        out["owner_to_user"] = out_b
        # 3. user shares with owner: the owner's code holds it from then on
        user = rpc.remote("w1", t.make_box, args=(4,))
        out_c = [rpc.rpc_sync("w1", t.keep, args=("c", user))]
        del user
        t.settle(everyone)
        out_c.append(_owners(rpc, t, "w1"))
        rpc.rpc_sync("w1", t.drop, args=("c",))
        out_c.append(t.wait_until(lambda: _owners(rpc, t, "w1") == 0))
        out["user_to_owner"] = out_c
        # 4. user shares with user
        user = rpc.remote("w1", t.make_box, args=(5,))
        out_d = [rpc.rpc_sync("w2", t.keep, args=("d", user))]
        del user
        t.settle(everyone)
        out_d.append(_owners(rpc, t, "w1"))
        out_d.append(rpc.rpc_sync("w2", t.value_of, args=("d",)).n)
        rpc.rpc_sync("w2", t.drop, args=("d",))
        out_d.append(t.wait_until(lambda: _owners(rpc, t, "w1") == 0))
        out["user_to_user"] = out_d
        gc.collect()
        out["values_gone"] = [t.wait_until(lambda w=w: rpc.rpc_sync(w, t.live_values) == 0) for w in everyone]
    rpc.shutdown()
    return out


def reordered_chains(chains):
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        for i in range(chains):
            rpc.rpc_async("w1", t.forward, args=(rpc.RRef(t.Box(i)), ["w2", "w3"], f"chain{i}"))
        gc.collect()
        out["held_while_z_holds"] = t.wait_until(lambda: rpc.rpc_sync("w3", t.debug_info)["num_user_rrefs"] == chains)
        t.settle(WORKERS)
        out["owners"] = _owners(rpc, t, "w0")
        out["values"] = sorted(rpc.rpc_sync("w3", t.value_of, args=(f"chain{i}",)).n for i in range(chains))
        rpc.rpc_sync("w3", t.drop_all)
        out["gone"] = t.wait_until(lambda: _owners(rpc, t, "w0") == 0)
        infos = t.settle(WORKERS)
        out["leaks"] = [i["num_owner_rrefs"] + i["num_user_rrefs"] + i["num_forks"] for i in infos]
    rpc.shutdown()
    return out


def callee_killed():
    import rpc_targets as t

    rpc, rank = _init()
    out = {}
    if rank == 0:
        waiting = [rpc.rpc_async("w1", t.sleep, args=(60,), timeout=0) for _ in range(3)]
        rref = rpc.remote("w1", t.sleep, args=(60,))
        try:
            rpc.rpc_sync("w1", t.die, timeout=0)
        except rpc.WorkerGoneError as err:
            out["sync"] = "w1" in str(err)
        errors = []
        for fut in waiting:
            try:
                fut.wait(30)
            except rpc.WorkerGoneError as err:
                errors.append("w1" in str(err))
        out["async"] = errors
        try:
            rref.to_here(timeout=0)
        except rpc.WorkerGoneError as err:
            out["to_here"] = "w1" in str(err)
        try:
            rpc.rpc_sync("w1", t.noop, timeout=0)
        except rpc.WorkerGoneError as err:
            out["later_call"] = "w1" in str(err)
        rpc.shutdown(graceful=False)
        return out
    if rank == 1:
        rpc.api.current_agent()._threads[0].join()  # killed mid-call by its own RPC
    return out


def shutdown_with_rrefs_alive():
    import rpc_targets as t

    rpc, rank = _init()
    others = [w for w in WORKERS[:3] if w != f"w{rank}"]
    mine = rpc.RRef(t.Box(rank))
    theirs = [rpc.remote(w, t.make_box, args=(rank,)) for w in others]
    for w in others:
        rpc.rpc_sync(w, t.keep, args=(f"from{rank}", mine))
        rpc.rpc_sync(w, t.keep, args=(f"theirs{rank}", theirs[0]))
    agent = rpc.api.current_agent()
    before = agent.endpoint.stats()
    rpc.shutdown()  # graceful, with RRefs held everywhere
    after = agent.endpoint.stats()
    gc.collect()
    return {
        "before": before["num_owner_rrefs"] > 0 and before["num_user_rrefs"] > 0,
        "after": [after["num_owner_rrefs"], after["num_user_rrefs"], after["num_forks"]],
        "values_gone": t.wait_until(lambda: t.live_values() == 0),
        "kept": len(t.kept) + len(theirs) + (mine is not None),
    }


def shutdown_while_calls_start_calls(chains):
    import rpc_targets as t

    rpc, rank = _init()
    if rank == 0:
        # every hop waits, then passes the RRef on without waiting: w1 and w2 are idle when
        # the chains reach them, and each call is answered before the next hop starts
        for i in range(chains):
            rpc.rpc_async("w1", t.forward, args=(rpc.RRef(t.Box(i)), ["w2", "w0"], f"late{i}", None, 0.3))
    agent = rpc.api.current_agent()
    rpc.shutdown()
    after = agent.endpoint.stats()
    return {"arrived": len(t.arrivals), "after": [after["num_owner_rrefs"], after["num_user_rrefs"]]}


def random_exchange(total, seed):
    import rpc_targets as t

    rpc, rank = _init()
    rng = random.Random(seed + rank)
    world = len(WORKERS)
    pending = []
    chains = 0
    for i in range(total // world):
        if rng.random() < 0.5:
            rref = rpc.RRef(t.Box(i))
        else:
            rref = rpc.remote(rng.choice(WORKERS), t.make_box, args=(i,))
        to = rng.choice(WORKERS)
        if rng.random() < 0.5:
            pending.append(rpc.rpc_async(to, t.keep, args=(f"{rank}/{i % 50}", rref)))
        else:
            hops = [rng.choice(WORKERS) for _ in range(rng.randrange(3))]
            pending.append(rpc.rpc_async(to, t.forward, args=(rref, hops, f"{rank}/f{i % 50}", "arrived")))
            chains += 1
        del rref
        if len(pending) >= 64:
            rpc.wait_all(pending)
            pending = []
    rpc.wait_all(pending)
    # every chain has arrived, whoever sent it, before anyone lets go
    store = rpc.api.current_agent().store
    store.add("chains", chains)
    store.add("exchanged", 1)
    t.wait_until(lambda: store.add("exchanged", 0) == world, timeout=120)
    t.wait_until(lambda: store.add("arrived", 0) == store.add("chains", 0), timeout=120)
    t.drop_all()
    gc.collect()
    store.add("dropped", 1)
    t.wait_until(lambda: store.add("dropped", 0) == world, timeout=120)
    infos = t.settle(WORKERS, timeout=60)
    leaks = t.wait_until(lambda: all(rpc.rpc_sync(w, t.debug_info)["num_owner_rrefs"] == 0 for w in WORKERS), 60)
    held = [] if leaks else [rpc.rpc_sync(w, t.describe_refs) for w in WORKERS]
    rpc.shutdown()
    return {"no_leaks": leaks, "counts": [(i["num_owner_rrefs"], i["num_user_rrefs"]) for i in infos], "held": held}


# -- tests ----------------------------------------------------------------------------------


def test_calls_arrays_futures_and_rrefs():
    out = harness.run(basics, 2, timeout=90)[0]
    assert out["sync"] == 5
    assert out["by_rank_and_info"] == [2, None]
    assert out["self"] == 8
    assert out["array"] is True
    assert out["small_array"] == list(range(10))
    assert out["async"] == [21, True, 42]
    assert out["rref"] == ["w1", "w1", False, 7, 10, 10, 10, True]
    assert out["local"] == [True, [1, 2, 3], [1, 2, 3], "w0"]
    assert out["local_value_on_user"] is True
    assert out["info"] == [["w0", 0], ["w1", 1]]
    assert out["stranger_closed"] is True
    assert out["after_stranger"] == 3
    assert "'nobody'" in out["unknown_name"]


def test_remote_exceptions_arrive_as_their_own_type_with_the_remote_traceback():
    out = harness.run(exceptions, 2, timeout=90)[0]
    assert out["custom"] == [7, True, True]
    assert out["unpicklable"] == [True, True]
    assert out["async_type_error"] is True
    assert out["remote_to_here"] == 3
    assert out["lambda"] in ("PicklingError", "AttributeError")
    assert out["pickle_outside"] is True


def test_a_timeout_names_the_callee_slow_or_stopped_and_the_worker_goes_on():
    out = harness.run(timeouts, 2, timeout=90)[0]
    assert out["sync"] == ["RpcTimeoutError", True]
    assert out["async"] == ["RpcTimeoutError", True]
    assert out["still_works"] == 2
    assert out["stopped"] == ["RpcTimeoutError", True]
    assert out["resumed"] == 4


def test_to_here_before_the_owner_ran_the_function_and_nested_calls():
    out = harness.run(to_here_before_run_and_nested, 3, timeout=90)[0]
    assert out["before"] == [True, False, False]
    assert out["after"] == ["released", True]
    assert out["nested"] == 14
    assert out["returned_rref"] == ["w2", 9]


def test_the_four_sharing_cases_delete_the_owner_value_exactly_when_the_last_reference_goes():
    out = harness.run(sharing_cases, 3, timeout=120)[0]
    assert out["creator_is_owner"] == [2, 1, 0]
    assert out["owner_to_user"] == [False, 1, True]
    assert out["user_to_owner"] == [True, 1, True]
    assert out["user_to_user"] == [False, 1, 5, True]
    assert out["values_gone"] == [True, True, True]


def test_a_chain_owner_a_y_z_with_reordered_messages_never_deletes_early_and_never_leaks():
    delay = {"ELASTIX_RPC_TEST_CONTROL_DELAY": "0,0.05"}
    out = harness.run(reordered_chains, 4, timeout=120, kwargs={"chains": 20}, env=delay)[0]
    assert out["held_while_z_holds"] is True
    assert out["owners"] == 20
    assert out["values"] == list(range(20))
    assert out["gone"] is True
    assert out["leaks"] == [0, 0, 0, 0]


def test_a_callee_killed_mid_call_fails_every_pending_call_naming_it():
    results = harness.run(callee_killed, 2, timeout=90, check=False)
    assert results[0].returncode == 0, results[0].describe()
    assert results[1].returncode == -9
    out = results[0].value
    assert out == {"sync": True, "async": [True, True, True], "to_here": True, "later_call": True}


def test_graceful_shutdown_with_rrefs_alive_everywhere_ends_with_no_owner_rrefs():
    for out in harness.run(shutdown_with_rrefs_alive, 3, timeout=120):
        assert out["before"] is True
        assert out["after"] == [0, 0, 0]
        assert out["values_gone"] is True


def test_graceful_shutdown_waits_for_calls_that_running_calls_start_later():
    arrived = []
    for out in harness.run(shutdown_while_calls_start_calls, 3, timeout=120, kwargs={"chains": 5}):
        assert out["after"] == [0, 0]
        arrived.append(out["arrived"])
    assert arrived == [5, 0, 0]  # every chain ended on w0, though w0 had called shutdown first


def test_four_workers_exchanging_10000_rrefs_at_random_leak_nothing():
    for out in harness.run(random_exchange, 4, timeout=300, kwargs={"total": 10_000, "seed": 1}):
        assert out["no_leaks"] is True, out
        assert out["counts"] == [[0, 0]] * 4


JOB = """
import os
import elastix.rpc as rpc
import rpc_targets as t

rank = int(os.environ["RANK"])
rpc.init_rpc(f"w{rank}")
peer = f"w{(rank + 1) % int(os.environ['WORLD_SIZE'])}"
rref = rpc.remote(peer, t.make_box, args=(rank,))
print("rank", rank, "got", rpc.rpc_sync(peer, t.add, args=(rank, 100)), rref.to_here().n, flush=True)
rpc.shutdown()
"""


def test_under_elastix_run_workers_find_each_other_through_the_agent_store(tmp_path, marker, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rpc_targets
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    proc = elastix_run("--standalone", "--nproc-per-node", 3, script, out_dir=tmp_path, marker=marker)
    code, out, err = finish(proc)
    assert code == 0, err
    for rank in range(3):
        assert f"rank {rank} got {rank + 100} {rank}" in out, out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))

"""Re-forming in process (elastix.elastic): the workers of a job are not restarted when a node
is lost or joins, or when another worker fails; they abort their collectives, join the new
round and restore the step the survivors agree on, in the same processes. Real agents, real
workers training with all_reduce (tests/worker_programs/inprocess_loop.py), whole hosts killed in
network namespaces."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys

import elastix
from agents import FAST_RDZV, WORKERS, agent, finish_all, node_args, started, wait_for

PROGRAM = os.path.join(WORKERS, "inprocess_loop.py")


def steps(tmp_path, round_):
    """round_'s steps: {step: {rank: (crc32 of the parameters, pid)}}."""
    found = {}
    for path in glob.glob(str(tmp_path / f"steps_{round_}_*.txt")):
        rank = int(path.rsplit("_", 1)[1].split(".")[0])
        for line in open(path):
            if line.strip():
                _at, step, crc, pid = line.split()
                found.setdefault(int(step), {})[rank] = (int(crc), int(pid))
    return found


def trained(tmp_path, round_, world_size, count):
    """Whether every rank of round_ logged `count` steps."""
    done = steps(tmp_path, round_)
    return sum(1 for by_rank in done.values() if len(by_rank) == world_size) >= count


def assert_replicas_agree(tmp_path, round_, after_step):
    """Every step of round_ after `after_step` went on from it, with the same parameters on
    every rank (the crc32 of the parameters each rank logged)."""
    done = steps(tmp_path, round_)
    assert min(done) == after_step + 1, sorted(done)[:3]
    for step, by_rank in done.items():
        assert len({crc for crc, _ in by_rank.values()}) == 1, (step, by_rank)


def events(tmp_path, name):
    with open(tmp_path / f"{name}-events.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_host_killed_mid_all_reduce_leaves_the_survivors_training_in_the_same_processes(tmp_path, marker, hosts):
    store = elastix.TCPStore(hosts.gateway, 0, is_master=True, wait_for_workers=False)
    endpoint = f"{hosts.gateway}:{store.port}"

    def node(i, name=None):
        python = hosts.command(i, "env", f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", "SLOW_HOST=host1", sys.executable)
        args = node_args("2:3", endpoint, hosts.addr(i), FAST_RDZV, PROGRAM, run_id="inproc", max_restarts=0)
        name = name or f"h{i}"
        return agent(
            tmp_path, marker, name, "run", "--event-log", tmp_path / f"{name}-events.jsonl", *args, python=python
        )

    agents = [node(i) for i in range(3)]
    three, first = wait_for(lambda: started(tmp_path, 3), timeout=90, what="three nodes training")
    wait_for(lambda: trained(tmp_path, three, 3, 10), timeout=60, what="10 steps on every rank")
    pids = {record["host"]: record["pid"] for record in first}
    # host 1 comes late to every all_reduce: the others are inside one, waiting for it, when it dies
    assert hosts.kill(1), "host 1 had no process to kill"
    two, after = wait_for(lambda: started(tmp_path, 2, after=three), timeout=60, what="the survivors re-forming")
    # the same processes, called again: nothing was restarted
    assert {record["host"]: record["pid"] for record in after} == {h: pids[h] for h in ("host0", "host2")}, after
    assert all(record["call"] == 2 for record in after), after
    # one step, restored whole from the agents' memory, on both ranks
    assert len({record["step"] for record in after}) == 1 and after[0]["step"] is not None, after
    assert all(record["exact"] for record in after) and {r["source"] for r in after} <= {"memory", "peer"}, after
    wait_for(lambda: trained(tmp_path, two, 2, 10), timeout=60, what="the survivors training again")
    assert_replicas_agree(tmp_path, two, after[0]["step"])
    kept = [e for e in events(tmp_path, "h0") if e["event"] == "workers_kept"]
    assert kept and kept[0]["pids"] == [pids["host0"]] and "stopped responding" in kept[0]["why"], kept
    # a node joins on the dead host's address: it takes the state from a survivor's memory,
    # and the survivors re-form again in their processes
    joiner = node(1, name="joiner")
    grown, joined = wait_for(lambda: started(tmp_path, 3, after=two), timeout=90, what="the job growing back to 3")
    by_host = {record["host"]: record for record in joined}
    assert by_host["host1"]["source"] == "peer" and by_host["host1"]["call"] == 1, joined
    assert {h: by_host[h]["pid"] for h in ("host0", "host2")} == {h: pids[h] for h in ("host0", "host2")}, joined
    assert len({record["step"] for record in joined}) == 1 and all(r["exact"] for r in joined), joined
    # and nothing was lost to it: the survivors finished the step they computed and stopped in
    # its save (before logging it), the step the agents agreed on; the job went on from there
    assert joined[0]["step"] == max(steps(tmp_path, two)) + 1, (joined, sorted(steps(tmp_path, two))[-3:])
    assert all(left(tmp_path, two, r["rank"], r["pid"]) == "Reforming" for r in after), after
    assert f"stopped after its save of step {joined[0]['step']}" in agents[0].output()
    # only the joiner took a copy across the network: a survivor given a rank new to the job
    # restores a replica its own node holds
    assert all("took rank" not in agents[i].output() for i in (0, 2)), (agents[0].output(), agents[2].output())
    wait_for(lambda: trained(tmp_path, grown, 3, 5), timeout=60, what="three nodes training again")
    assert_replicas_agree(tmp_path, grown, joined[0]["step"])
    finish_all(tmp_path, [agents[0], agents[2], joiner], marker)


def test_a_join_interrupts_workers_that_cannot_stop_at_a_step(tmp_path, marker):
    # workers that never save cannot stop after a save: the members do not wait for one (20 s)
    # but interrupt them as for any re-form, and the job grows at once
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"

    def node(i):
        args = node_args("2:3", endpoint, f"127.0.0.{i + 1}", FAST_RDZV, PROGRAM, run_id="no-save")
        return agent(tmp_path, marker, f"n{i}", "run", *args, python=("env", "NO_SAVE=1", sys.executable))

    agents = [node(0), node(1)]
    zero, first = wait_for(lambda: started(tmp_path, 2), timeout=90, what="two ranks training")
    wait_for(lambda: trained(tmp_path, zero, 2, 3), timeout=60, what="three steps of two ranks")
    agents.append(node(2))
    grown, joined = wait_for(lambda: started(tmp_path, 3, after=zero), timeout=60, what="the job growing to 3")
    kept = {record["pid"] for record in first}
    assert kept <= {record["pid"] for record in joined}, (first, joined)
    for record in first:
        assert left(tmp_path, zero, record["rank"], record["pid"]) == "Reforming", record
    for member in agents[:2]:
        assert "this node's workers cannot stop at a step" in member.output()
        assert "stop after their checkpoint save" not in member.output()
    wait_for(lambda: trained(tmp_path, grown, 3, 2), timeout=60, what="three ranks training")
    finish_all(tmp_path, agents, marker)


def test_a_worker_that_raises_mid_update_is_restarted_and_its_peers_are_not(tmp_path, marker):
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    agents = []
    for i in range(2):
        args = node_args(2, endpoint, f"127.0.0.{i + 1}", FAST_RDZV, PROGRAM, run_id="raise", max_restarts=1)
        args[args.index("--nproc-per-node") + 1] = 2
        agents.append(
            agent(
                tmp_path,
                marker,
                f"n{i}",
                "run",
                "--event-log",
                tmp_path / f"n{i}-events.jsonl",
                *args,
                python=("env", "FAIL_RANK=1", "FAIL_AT=20", sys.executable),
            )
        )
    zero, first = wait_for(lambda: started(tmp_path, 4), timeout=90, what="four ranks training")
    pids = {record["rank"]: record["pid"] for record in first}
    one, after = wait_for(lambda: started(tmp_path, 4, after=zero), timeout=60, what="the job after rank 1 failed")
    by_rank = {record["rank"]: record for record in after}
    # rank 1 raised with its parameters half updated: a new process; ranks 0, 2, 3 kept theirs
    assert by_rank[1]["pid"] != pids[1] and by_rank[1]["call"] == 1, after
    assert all(by_rank[r]["pid"] == pids[r] and by_rank[r]["call"] == 2 for r in (0, 2, 3)), after
    assert len({record["step"] for record in after}) == 1 and after[0]["step"] == 19, after
    assert all(record["exact"] for record in after), after
    wait_for(lambda: trained(tmp_path, one, 4, 5), timeout=60, what="four ranks training again")
    assert_replicas_agree(tmp_path, one, 19)
    # a real restart, charged once; the failed worker's error is in the log
    n0 = events(tmp_path, "n0")
    assert [e["restart_count"] for e in n0 if e["event"] == "failure_reported"] == [1], n0
    assert any(e["event"] == "workers_kept" and e["pids"] == [pids[0]] for e in n0), n0
    assert "rank 1 failed mid-update at step 20" in agents[0].output()
    finish_all(tmp_path, agents, marker)


def left(tmp_path, round_, rank, pid):
    """What ended that call of the training function (the exception's type), if one did."""
    path = tmp_path / f"left_{round_}_{rank}_{pid}.txt"
    return path.read_text() if path.exists() else None


def sleeping_rank_job(tmp_path, marker, run_id, *env):
    """Two nodes; rank 0 goes into a long compute at step 5; once it does, rank 1's worker is
    SIGKILLed. Returns the store (the agents' rendezvous: it must outlive them), the agents, the
    first round, rank 0's first start and the next round's records by rank."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    agents = []
    for i in range(2):
        args = node_args(2, endpoint, f"127.0.0.{i + 1}", FAST_RDZV, PROGRAM, run_id=run_id, max_restarts=1)
        python = ("env", "SLEEP_RANK=0", "SLEEP_AT=5", *env, sys.executable)
        agents.append(agent(tmp_path, marker, f"n{i}", "run", *args, python=python))
    zero, first = wait_for(lambda: started(tmp_path, 2), timeout=90, what="two ranks training")
    by_rank = {record["rank"]: record for record in first}
    wait_for(lambda: (tmp_path / "sleeping").exists(), timeout=60, what="rank 0 in its long step")
    os.kill(by_rank[1]["pid"], signal.SIGKILL)
    _, after = wait_for(lambda: started(tmp_path, 2, after=zero), timeout=60, what="the job after rank 1 died")
    return store, agents, zero, by_rank[0], {record["rank"]: record for record in after}


def test_a_reform_interrupts_a_worker_in_the_middle_of_its_compute(tmp_path, marker):
    # rank 0 would compute for an hour: only the interruption brings it into the next round
    _store, agents, zero, rank0, after = sleeping_rank_job(tmp_path, marker, "interrupt")
    assert after[0]["pid"] == rank0["pid"] and after[0]["call"] == 2, after
    assert left(tmp_path, zero, 0, rank0["pid"]) == "Reforming"
    assert after[1]["pid"] != rank0["pid"] and after[0]["step"] == after[1]["step"] == 4, after
    assert all(record["exact"] for record in after.values()), after
    finish_all(tmp_path, agents, marker)


def test_without_interrupt_the_worker_finishes_its_compute_and_its_collective_fails(tmp_path, marker):
    _store, agents, zero, rank0, after = sleeping_rank_job(tmp_path, marker, "no-interrupt", "INTERRUPT=0", "SLEEP_S=3")
    assert after[0]["pid"] == rank0["pid"] and after[0]["call"] == 2, after
    # it ran its step to the end: the all_reduce after it was what failed
    assert left(tmp_path, zero, 0, rank0["pid"]) not in (None, "Reforming")
    assert after[0]["step"] == after[1]["step"] == 4, after
    finish_all(tmp_path, agents, marker)

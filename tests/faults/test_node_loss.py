"""A node dying while its peers' workers are in a collective is a lost node, as in real jobs:
the survivors' workers fail first (their all_reduce breaks), long before any heartbeat lapses.
The agents ask the other members' agents directly, report the dead one lost, charge no restart,
and re-form at once without waiting for a last call. Hosts are network namespaces; a host's
death kills every process in it (agent, workers, the store it may serve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agents import WORKERS, agent, assert_nothing_left, finish_all, node_args, rounds_of, starts, wait_for, wait_round
from training import first_step_time, steps_in, train_node

# torch's defaults (a node is lost after 15 s of silence, a last call of 30 s), so that a
# re-form that waited for either would show
CONF = "join_timeout=60s"


def trained(tmp_path, round_, since=0.0, steps=30):
    wait_for(lambda: steps_in(tmp_path, round_, since) >= steps, timeout=30, what=f"{steps} steps in round {round_}")


@pytest.mark.parametrize("rendezvous", ["c10d", "etcd"], indirect=True)
def test_a_host_killed_mid_all_reduce_is_a_lost_node_and_the_others_train_on(tmp_path, marker, hosts, rendezvous):
    backend, endpoint = rendezvous
    agents = [train_node(tmp_path, marker, hosts, i, "2:3", endpoint, CONF, "loss", backend=backend) for i in range(3)]
    three = wait_round(tmp_path, 3)
    trained(tmp_path, three)  # the three are training: their all_reduces run back to back
    killed_at = time.time()
    assert hosts.kill(2), "host 2 had no process to kill"
    two = wait_round(tmp_path, 2, after=three, what="the two survivors re-forming")
    trained(tmp_path, two, since=killed_at, steps=10)
    print(
        f"node loss mid-all_reduce ({backend}): training again {first_step_time(tmp_path, two) - killed_at:.2f}s after"
    )
    # no restart charged: with --max-restarts 0 the job goes on, with the count still 0
    assert {r["restart"] for r in starts(tmp_path) if r["round"] == two} == {0}, starts(tmp_path)
    survivors = agents[:2]
    assert any("presence port refused the probe" in a.output() for a in survivors), [a.output() for a in survivors]
    # the survivors' broken all_reduces are folded, two lines each, before the agent names the loss
    for a in survivors:
        assert "Traceback (most recent call last)" not in a.output(), a.output()
    assert any("a collective broke at" in a.output() for a in survivors), [a.output() for a in survivors]
    # elastix status: running, but with fewer nodes than before the loss, which it names
    where = ["--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "loss"]
    status = subprocess.run(
        [*hosts.python(0, "-m", "elastix", "status"), *where, "--json"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 3, status.stdout + status.stderr  # degraded
    report = json.loads(status.stdout)
    assert report["health"] == "degraded" and len(report["members"]) == 2, report
    # (etcd ranks nodes by entry order: host 2 need not have been rank 2)
    assert any(f"{hosts.addr(2)}_" in (lost["node"] or "") for lost in report["lost"]), json.dumps(report, indent=1)
    finish_all(tmp_path, survivors, marker)
    assert len(rounds_of(tmp_path, 2)) == 1, "one re-form for one loss"
    assert_nothing_left(marker)


# heartbeats that lapse only after 5 minutes, and steps whose compute outlasts the tests: a
# loss is found by the member watching the lost one, or not within the tests' waits at all
SLOW_HEARTBEATS = "keep_alive_interval=60s,keep_alive_max_attempt=5,join_timeout=60s"
WATCHED = "closed the connection this node watches it by"


@pytest.mark.parametrize("rendezvous", ["c10d", "etcd"], indirect=True)
def test_a_host_killed_while_the_workers_compute_is_found_lost_by_the_member_watching_it(
    tmp_path, marker, hosts, rendezvous
):
    backend, endpoint = rendezvous
    env = ("COMPUTE_S=600",)
    agents = [
        train_node(tmp_path, marker, hosts, i, "2:3", endpoint, SLOW_HEARTBEATS, "watch", backend=backend, env=env)
        for i in range(3)
    ]
    three = wait_round(tmp_path, 3)
    hosts.kill(1)  # (with c10d, host 0 serves the store)
    two = wait_round(
        tmp_path, 2, after=three, what="the survivors re-forming (no collective broke, no heartbeat lapsed)"
    )
    survivors = [agents[0], agents[2]]
    outputs = [a.output() for a in survivors]
    assert any(WATCHED in out for out in outputs), outputs
    assert any("presence port refused the probe" in out for out in outputs), outputs
    assert {r["restart"] for r in starts(tmp_path) if r["round"] == two} == {0}, starts(tmp_path)
    finish_all(tmp_path, survivors, marker)


def test_watched_members_that_compute_and_end_are_never_taken_for_lost(tmp_path, marker, hosts):
    endpoint = f"{hosts.addr(0)}:29400"
    env = ("COMPUTE_S=2",)
    agents = [
        train_node(tmp_path, marker, hosts, i, 3, endpoint, SLOW_HEARTBEATS, "healthy", env=env) for i in range(3)
    ]
    three = wait_round(tmp_path, 3)
    trained(tmp_path, three, steps=3 * 3)  # three steps of long compute, each watched
    finish_all(tmp_path, agents, marker)  # the agents end at different moments: no loss
    assert rounds_of(tmp_path, 3) == [three], starts(tmp_path)
    for a in agents:
        assert WATCHED not in a.output() and "re-forming" not in a.output(), a.output()


def test_a_loss_that_leaves_too_few_nodes_ends_the_job_naming_the_lost_node(tmp_path, marker, hosts):
    endpoint = f"{hosts.addr(0)}:29400"
    agents = [train_node(tmp_path, marker, hosts, i, 3, endpoint, "join_timeout=8s", "loss") for i in range(3)]
    trained(tmp_path, wait_round(tmp_path, 3), steps=10)
    hosts.kill(2)
    for a in agents[:2]:
        assert a.finish(timeout=60) == 1, a.output()
        last = a.output().strip().splitlines()[-1]
        # the error says what is missing, and which node was lost
        assert "needs at least 3" in last and f"lost before: node {hosts.addr(2)}_" in last, a.output()
        assert "(group rank 2)" in last and "in round 0" in last, last
    assert_nothing_left(marker)


def test_the_store_host_killed_mid_all_reduce_moves_the_job_to_the_next_site(tmp_path, marker, hosts):
    # each host serves a site; the state lives at the first, on host 0 (with three sites the
    # two others are a majority: with two, the first one's side alone may run the job)
    endpoint = ",".join(f"{hosts.addr(i)}:29400" for i in range(3))
    agents = [train_node(tmp_path, marker, hosts, i, "2:3", endpoint, CONF, "loss") for i in range(3)]
    three = wait_round(tmp_path, 3)
    trained(tmp_path, three)
    killed_at = time.time()
    hosts.kill(0)  # its agent, its workers and the store holding the job's state
    two = wait_round(tmp_path, 2, after=three, what="the survivors re-forming at the second site")
    trained(tmp_path, two, since=killed_at, steps=10)
    print(f"store host lost mid-all_reduce: training again {first_step_time(tmp_path, two) - killed_at:.2f}s after")
    assert {r["restart"] for r in starts(tmp_path) if r["round"] == two} == {0}, starts(tmp_path)
    finish_all(tmp_path, agents[1:], marker)
    assert_nothing_left(marker)


def at_exit_barrier(out_dir, i):
    """Host i's workers succeeded: its agent is at the exit barrier (its event log says so)."""
    path = out_dir / f"events_h{i}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return any(e["event"] == "workers_stopped" and e.get("why") == "succeeded" for e in events)


def test_a_host_killed_while_the_others_wait_at_the_exit_barrier_is_not_waited_for(tmp_path, marker, hosts):
    endpoint = f"{hosts.addr(0)}:29400"
    finish = os.path.join(WORKERS, "finish_after.py")
    agents = []
    for i in range(3):
        python = hosts.command(i, "env", "FINISH_AFTER_2=120", sys.executable)
        args = node_args(3, endpoint, hosts.addr(i), CONF, finish, run_id="barrier", max_restarts=0)
        events = ["--event-log", tmp_path / f"events_h{i}.jsonl"]
        agents.append(agent(tmp_path, marker, f"h{i}", "run", *events, *args, python=python))
    # the group ranks follow the addresses: host 2's node is the one still working
    wait_for(lambda: all("working" in a.output() for a in agents), what="the workers working")
    wait_for(lambda: all(at_exit_barrier(tmp_path, i) for i in (0, 1)), what="hosts 0 and 1 at the exit barrier")
    hosts.kill(2)
    for a in agents[:2]:
        assert a.finish(timeout=60) == 0, a.output()  # well before the 300 s barrier timeout
    # one survivor found it gone and closed the job as succeeded; the other left on the close
    assert any("(group rank 2) is gone; not waiting for it" in a.output() for a in agents[:2])
    assert_nothing_left(marker)

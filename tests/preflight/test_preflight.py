"""`elastix run --preflight` on three namespace hosts (tests/netns.py) training with an external
store: a healthy job is checked and trains with every node; a host whose link is slowed (a
token bucket of 16 Mbit/s, or 50 ms of delay where the kernel has netem) is named, leaves where
--nnodes allows (exit 1, saying why) while the others re-form and train without it, and stays,
warned about, where --nnodes does not. The check of a healthy job on 127.0.0.x runs as a
non-root user too (.ci/nonroot-tests)."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import pytest

import elastix
from agents import FAST_RDZV, WORKERS, agent, assert_nothing_left, node_args, wait_round
from netns import Hosts

PROGRAM = f"{WORKERS}/store_member.py"


@contextmanager
def job(tmp_path, marker, nnodes, gateway, addr, command):
    """Three agents of a job checked before it trains (`--preflight`), node i at `addr(i)`, its
    command line made by `command(i, *argv)`, with a store at `gateway`; killed at the end."""
    store = elastix.TCPStore(gateway, 0, is_master=True, wait_for_workers=False)
    agents = []
    for i in range(3):
        args = node_args(nnodes, f"{gateway}:{store.port}", addr(i), FAST_RDZV, PROGRAM, run_id="pf")
        events = tmp_path / f"h{i}-events.jsonl"
        python = command(i, "env", f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", sys.executable)
        agents.append(agent(tmp_path, marker, f"h{i}", "run", "--preflight", "--event-log", events, *args,
                            python=python))  # fmt: skip
    try:
        yield agents
    finally:
        for a in agents:
            a.kill()


def on_hosts(tmp_path, marker, hosts, nnodes):
    return job(tmp_path, marker, nnodes, hosts.gateway, hosts.addr, hosts.command)


def events_of(tmp_path, i, name):
    path = tmp_path / f"h{i}-events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name]


def finish(tmp_path, agents, marker, expect):
    (tmp_path / "stop").touch()
    for a, code in zip(agents, expect):
        assert a.finish() == code, a.output()
    assert_nothing_left(marker)


def all_three_train(tmp_path, agents, marker):
    wait_round(tmp_path, 3, what="the three nodes training after the check")
    finish(tmp_path, agents, marker, [0, 0, 0])


def test_a_healthy_job_is_checked_and_trains_with_every_node(tmp_path, marker, hosts):
    with on_hosts(tmp_path, marker, hosts, "2:3") as agents:
        all_three_train(tmp_path, agents, marker)
    for i in range(3):
        [check] = events_of(tmp_path, i, "preflight")
        assert (check["nodes"], check["links"], check["decision"]) == ([], [], "go on"), check
    table = next(a.output() for a in agents if "pre-flight check of 3 nodes" in a.output())
    assert "LATENCY" in table and "MB/s" in table


def test_the_check_runs_on_loopback_nodes_without_privileges(tmp_path, marker):
    with job(tmp_path, marker, 3, "127.0.0.1", lambda i: f"127.0.0.{i + 1}", lambda _i, *argv: list(argv)) as agents:
        all_three_train(tmp_path, agents, marker)
    [check] = events_of(tmp_path, 0, "preflight")
    assert check["decision"] == "go on", check


@pytest.mark.parametrize("how", ["throttle", "delay"])
def test_a_host_with_a_slow_link_is_named_and_left_out(tmp_path, marker, hosts, how):
    missing = Hosts.qdisc_missing(how)
    if missing:
        pytest.skip(missing)
    hosts.slow_link(1, how)
    with on_hosts(tmp_path, marker, hosts, "2:3") as agents:
        # the slow host leaves, saying why; the others train without it
        assert agents[1].finish() == 1, agents[1].output()
        said = agents[1].output()
        assert "this node leaves the job: the pre-flight check named it: slow on every link" in said, said
        wait_round(tmp_path, 2, what="the two other nodes training without it")
        finish(tmp_path, [agents[0], agents[2]], marker, [0, 0])
    [check] = events_of(tmp_path, 0, "preflight")
    assert [(n["member"], n["node"]) for n in check["nodes"]] == [(1, hosts.addr(1))], check
    assert check["decision"] == "leave out"
    [left] = events_of(tmp_path, 1, "left_out")
    assert left["why"].startswith("the pre-flight check named it")
    assert "re-forming without " + hosts.addr(1) in agents[0].output()


def test_a_named_host_stays_where_nnodes_needs_it(tmp_path, marker, hosts):
    missing = Hosts.qdisc_missing("throttle")
    if missing:
        pytest.skip(missing)
    hosts.slow_link(1, "throttle")
    with on_hosts(tmp_path, marker, hosts, "3") as agents:
        all_three_train(tmp_path, agents, marker)
    [check] = events_of(tmp_path, 2, "preflight")
    assert [n["member"] for n in check["nodes"]] == [1]
    assert check["decision"] == "keep: --nnodes allows no fewer than 3 nodes (2 would be left)", check
    assert "the nodes named stay in the job" in agents[2].output()

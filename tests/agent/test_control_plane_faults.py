"""Faults of the control plane, end to end with real agents, workers and stores: the store
restarting, the node hosting it dying, a node cut off by the network, the store host stopped,
the failing node being the store host. Each ends in "the job goes on" or a clear error within
bounded time, with nothing left running.

Nodes are agents on 127.0.0.x addresses, or in network namespaces (tests/netns.py) where a
link must be cut."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agents import WORKERS, agent, assert_nothing_left, finish_all, node_args, rounds_of, starts, wait_for, wait_round
from conftest import alive, held_port, marked_processes, reserved_port

# A node is lost after 2 s without a heartbeat; one beat may take 1 s; short last calls.
FAST = (
    "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=1s,last_call_timeout=500ms,join_timeout=60s"
)
LOOP = os.path.join(WORKERS, "elastic_loop.py")


def run_args(nnodes, endpoint, addr, conf=FAST, *worker_args):
    return ["run", *node_args(nnodes, endpoint, addr, conf, LOOP, *worker_args, run_id="faults", max_restarts=3)]


def store_server(port, tmp_path):
    log = open(tmp_path / f"store-{time.monotonic_ns()}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastix", "store", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_for(lambda: "listening" in open(log.name).read() or proc.poll() is not None, what="the store listening")
    assert proc.poll() is None, open(log.name).read()
    return proc


@pytest.fixture
def free_port():
    """A port held for the test (the store restarts on it), as conftest.reserved_port."""
    with reserved_port() as port:
        yield port


def test_a_store_that_restarts_empty_mid_run_is_found_again_and_the_job_completes(tmp_path, marker, free_port):
    store = store_server(free_port, tmp_path)
    endpoint = f"127.0.0.1:{free_port}"
    agents = [agent(tmp_path, marker, f"n{i}", *run_args(2, endpoint, f"127.0.0.{i}")) for i in (1, 2)]
    try:
        first = wait_round(tmp_path, 2)
        store.kill()
        store.wait()
        store = store_server(free_port, tmp_path)  # same address, no state
        again = wait_round(tmp_path, 2, after=first, what="the nodes re-forming on the restarted store")
        records = [r for r in starts(tmp_path) if r["round"] == again]
        assert {r["restart"] for r in records} == {0}, "a store restart spends no restart"
        # and a job that finishes while the store is away still succeeds
        store.kill()
        store.wait()
        (tmp_path / "stop").touch()
        workers = [r["pid"] for r in records]
        wait_for(lambda: not any(map(alive, workers)), timeout=30, what="the workers ending while the store is away")
        store = store_server(free_port, tmp_path)
        for a in agents:
            assert a.finish() == 0, a.output()
    finally:
        store.kill()
        store.wait()
    assert_nothing_left(marker)


def test_a_store_that_never_comes_back_is_waited_for_aloud_then_named_in_the_error(tmp_path, marker, free_port):
    store = store_server(free_port, tmp_path)
    endpoint = f"127.0.0.1:{free_port}"
    conf = FAST.replace("join_timeout=60s", "join_timeout=15s")  # the warning repeats every 10 s
    agents = [agent(tmp_path, marker, f"n{i}", *run_args(2, endpoint, f"127.0.0.{i}", conf)) for i in (1, 2)]
    try:
        wait_round(tmp_path, 2)
    finally:
        store.kill()  # for good: every node loses it
        store.wait()
    for a in agents:
        assert a.finish(timeout=60) == 1, a.output()
        out = a.output()
        # it stops its workers saying what it knows (its own contact), not what the others do
        assert "has not answered this node for" in out and "Connection refused" in out, out
        assert "count this one as lost" not in out, out
        # and waits aloud: the first warning, then again while the store stays away, with the deadline
        assert f"cannot connect to the store at {endpoint}" in out, out
        assert f"still no store at {endpoint} after" in out and "giving up in" in out, out
        assert f"{free_port}" in out.strip().splitlines()[-1], out
    assert_nothing_left(marker)


def test_losing_the_node_that_hosts_the_store_moves_it_to_the_next_listed_node(tmp_path, marker, request):
    # each site's port held on its own address for the test (the agents bind with SO_REUSEADDR);
    # three sites, one per node: the two left after the first one's loss are a majority
    holders = [held_port(f"127.0.0.{i + 1}") for i in range(3)]
    request.addfinalizer(lambda: [holder.close() for holder in holders])
    endpoint = ",".join(f"127.0.0.{i + 1}:{holder.getsockname()[1]}" for i, holder in enumerate(holders))
    # rank 1 fails once: the job-wide restart count (1) must survive the move
    args = lambda i: run_args("2:4", endpoint, f"127.0.0.{i}", FAST, "--fail-once", 1)  # noqa: E731
    agents = {i: agent(tmp_path, marker, f"n{i}", *args(i)) for i in (1, 2, 3)}

    def restarted_round():
        return [r for r in rounds_of(tmp_path, 3) if {x["restart"] for x in starts(tmp_path) if x["round"] == r} == {1}]

    three = wait_for(restarted_round, what="three nodes running after the first restart")[0]
    host = agents.pop(1)
    host.proc.kill()  # SIGKILL the agent hosting the store: its worker dies with it
    host.proc.wait()
    lost_at = time.monotonic()
    two = wait_round(tmp_path, 2, after=three, what="the two survivors re-forming on the next site")
    recovery = time.monotonic() - lost_at
    assert {r["restart"] for r in starts(tmp_path) if r["round"] == two} == {1}, "the restart count moved along"
    assert any("127.0.0.2" in a.output() and "now at" in a.output() for a in agents.values()), [
        a.output() for a in agents.values()
    ]
    # a node started later (serving no site) tries the list in order and finds the job at its new site
    agents[4] = agent(tmp_path, marker, "n4", *args(4))
    wait_round(tmp_path, 3, after=two, what="the late node joining the moved job")
    print(f"host loss: running again on 2 nodes {recovery:.2f}s after the SIGKILL")
    finish_all(tmp_path, agents.values(), marker)


def test_a_stopped_store_host_is_the_one_blamed_and_the_job_completes(tmp_path, marker, free_port):
    endpoint = f"127.0.0.1:{free_port}"
    host = agent(tmp_path, marker, "n1", *run_args(3, endpoint, "127.0.0.1", FAST + ",is_host=true"))
    others = [
        agent(tmp_path, marker, f"n{i}", *run_args(3, endpoint, f"127.0.0.{i}", FAST + ",is_host=false"))
        for i in (2, 3)
    ]
    agents = [host, *others]
    first = wait_round(tmp_path, 3)
    host.proc.send_signal(signal.SIGSTOP)
    time.sleep(4)  # twice the time after which a node counts as lost
    host.proc.send_signal(signal.SIGCONT)
    wait_round(tmp_path, 3, after=first, what="the job running again after the store host resumed")
    for a in others:
        out = a.output()
        assert f"the rendezvous store at {endpoint} has not answered" in out, out
        assert "127.0.0.2" not in _lost_lines(out) and "127.0.0.3" not in _lost_lines(out), out
    assert "127.0.0.2" not in _lost_lines(host.output()) and "127.0.0.3" not in _lost_lines(host.output())
    finish_all(tmp_path, agents, marker)


def _lost_lines(output):
    return "\n".join(line for line in output.splitlines() if "node lost" in line or "stopped responding" in line)


def test_when_the_failing_node_hosts_the_store_every_node_prints_the_root_cause(tmp_path, marker, free_port):
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, time\nif os.environ['GROUP_RANK'] == '0':\n    time.sleep(0.5)\n"
        "    raise ValueError('the data is corrupt')\ntime.sleep(60)\n"
    )
    endpoint = f"127.0.0.1:{free_port}"

    def args(addr, is_host):
        argv = run_args(2, endpoint, addr, FAST + f",is_host={is_host}")
        argv[argv.index("--max-restarts") + 1] = 0
        return [*argv[:-1], script]

    host = agent(tmp_path, marker, "n1", *args("127.0.0.1", "true"))
    other = agent(tmp_path, marker, "n2", *args("127.0.0.2", "false"))
    assert host.finish() == 1, host.output()
    assert other.finish() == 1, other.output()
    for a in (host, other):
        assert "ValueError: the data is corrupt" in a.output(), a.output()
    assert "the job was closed after a failure on another node" in other.output()
    # the close ends the run: its workers are stopped, not restarted
    assert "closed; stopping the workers" in other.output(), other.output()
    assert "restarting the workers" not in other.output(), other.output()
    assert_nothing_left(marker)


def test_a_node_cut_off_by_the_network_stops_its_workers_and_comes_back_when_healed(tmp_path, marker, hosts):
    endpoint = f"{hosts.addr(0)}:29400"  # the agent on host 0 hosts the store
    agents = [
        agent(tmp_path, marker, f"h{i}", *run_args("2:3", endpoint, hosts.addr(i)), python=hosts.python(i))
        for i in range(3)
    ]
    three = wait_round(tmp_path, 3)
    cut_worker = next(r["pid"] for r in starts(tmp_path) if r["round"] == three and r["group_rank"] == 2)
    hosts.cut(2)
    cut_at = time.monotonic()
    two = wait_round(tmp_path, 2, after=three, what="the majority re-forming without the cut node")
    wait_for(lambda: cut_worker not in marked_processes(marker), timeout=30, what="the cut node stopping its worker")
    noticed = time.monotonic() - cut_at
    assert "has not answered this node for" in agents[2].output(), agents[2].output()
    hosts.heal(2)
    healed_at = time.monotonic()
    back = wait_round(tmp_path, 3, after=two, what="the healed node re-joining")
    print(
        f"partition: cut node stopped its worker within {noticed:.2f}s; back {time.monotonic() - healed_at:.2f}s after the heal"
    )
    # one re-form for the cut, one for the heal
    assert len([r for r in rounds_of(tmp_path, 2) + rounds_of(tmp_path, 3) if r > three]) == 2, starts(tmp_path)
    assert back > two
    finish_all(tmp_path, agents, marker)


def test_a_link_down_for_less_than_the_loss_window_costs_no_re_form(tmp_path, marker, hosts):
    endpoint = f"{hosts.addr(0)}:29400"
    agents = [
        agent(tmp_path, marker, f"h{i}", *run_args(3, endpoint, hosts.addr(i)), python=hosts.python(i))
        for i in range(3)
    ]
    three = wait_round(tmp_path, 3)
    hosts.cut(2)
    time.sleep(0.5)  # a quarter of the 2 s after which a node counts as lost
    hosts.heal(2)
    time.sleep(4)  # long enough for a wrong loss report to have re-formed the job
    assert [r for r in rounds_of(tmp_path, 3) + rounds_of(tmp_path, 2) if r > three] == [], starts(tmp_path)
    finish_all(tmp_path, agents, marker)

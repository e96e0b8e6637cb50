"""elastix.rendezvous: the c10d (dynamic) and static backends, from Python, with nodes as
threads and as separate processes on 127.0.0.x addresses."""

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import elastix
from conftest import free_port
from elastix.rendezvous import RendezvousHandler, create_handler

FAST = {
    "last_call_timeout": "300ms",
    "keep_alive_interval": "100ms",
    "keep_alive_max_attempt": 3,
    "join_timeout": "30s",
}


def handlers(n, min_nodes, max_nodes, run_id, port=None, **conf):
    """n handlers of one job; the first hosts the store (port 0 unless given)."""
    conf = {**FAST, **conf}
    first = RendezvousHandler(
        "c10d", f"127.0.0.1:{port or 0}", run_id, min_nodes, max_nodes, local_addr="127.0.0.1", conf=conf
    )
    port = first.hosted_port
    others = [
        RendezvousHandler(
            "c10d",
            f"127.0.0.1:{port}",
            run_id,
            min_nodes,
            max_nodes,
            local_addr="127.0.0.1",
            conf={**conf, "is_host": "false"},
        )
        for _ in range(n - 1)
    ]
    return [first, *others]


def rendezvous_all(nodes):
    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), nodes))


def assert_consistent(infos, world_size):
    assert sorted(info.rank for info in infos) == list(range(world_size))
    assert {info.world_size for info in infos} == {world_size}
    assert len({info.bootstrap_store_info for info in infos}) == 1
    assert len({info.round for info in infos}) == 1


def test_formation_gives_distinct_ranks_and_a_shared_round_store():
    nodes = handlers(3, 3, 3, "formation")
    infos = rendezvous_all(nodes)
    assert_consistent(infos, 3)
    by_rank = sorted(infos, key=lambda info: info.rank)
    by_rank[0].store.set("hello", "from rank 0")
    assert by_rank[2].store.get("hello") == b"from rank 0"
    # the workers' store named by the bootstrap info is a live TCPStore server
    master = infos[0].bootstrap_store_info
    worker_store = elastix.TCPStore(master.master_addr, master.master_port)
    worker_store.set("x", "y")
    assert nodes[0].get_backend() == "c10d" and nodes[0].get_run_id() == "formation"
    assert nodes[0].use_agent_store


def test_last_call_and_a_late_node_that_makes_the_job_re_form():
    nodes = handlers(2, 1, 3, "late")
    start = time.monotonic()
    infos = rendezvous_all(nodes)
    assert time.monotonic() - start >= 0.3, "min < max waits for the last call"
    assert_consistent(infos, 2)
    late = RendezvousHandler(
        "c10d",
        f"127.0.0.1:{nodes[0].hosted_port}",
        "late",
        1,
        3,
        local_addr="127.0.0.1",
        conf={**FAST, "is_host": "false"},
    )
    with ThreadPoolExecutor(1) as pool:
        late_info = pool.submit(late.next_rendezvous)
        assert [node.wait_for_change(10) for node in nodes] == ["nodes_waiting", "nodes_waiting"]
        assert nodes[0].num_nodes_waiting() == 1
        again = rendezvous_all(nodes)
        assert_consistent([*again, late_info.result(30)], 3)


def test_close_refuses_joins_and_is_seen_by_members():
    nodes = handlers(1, 1, 1, "closing")
    rendezvous_all(nodes)
    nodes[0].set_closed()
    assert nodes[0].is_closed()
    assert nodes[0].wait_for_change(5) == "closed"
    with pytest.raises(elastix.errors.RendezvousClosedError, match="closed"):
        nodes[0].next_rendezvous()


def test_a_timeout_says_who_joined_and_what_is_missing():
    nodes = handlers(2, 3, 3, "short", join_timeout="500ms")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(node.next_rendezvous) for node in nodes]
        for future in futures:
            with pytest.raises(TimeoutError) as info:
                future.result(30)
            assert isinstance(info.value, elastix.errors.RendezvousTimeoutError)
            message = str(info.value)
            assert "2 node(s) joined" in message and "1 more node(s) missing" in message and "127.0.0.1_" in message


def test_bad_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="unknown key"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 1, 1, conf="heartbeat=5")
    with pytest.raises(ValueError, match="min_nodes"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 3, 2)
    with pytest.raises(ValueError, match="unknown"):
        RendezvousHandler("zookeeper", "127.0.0.1:0", "bad", 1, 1)
    with pytest.raises(ValueError, match=r"(is )?not a duration"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 1, 1, conf={"join_timeout": "soon"})


def test_static_backend():
    port = free_port()
    # The handlers outlive both joins: rank 0's handler serves the store, and dropping it
    # early would cut rank 1 off before its wait is answered (agents hold it for the job).
    handlers = [
        create_handler("static", f"127.0.0.1:{port}", "fixed", 2, 2, rank=rank, timeout="20s") for rank in range(2)
    ]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(handler.next_rendezvous) for handler in handlers]
        infos = [future.result(30) for future in futures]
    for handler in handlers:
        handler.shutdown()
    assert [info.rank for info in infos] == [0, 1]
    assert {info.bootstrap_store_info.master_port for info in infos} == {port}


NODE_SCRIPT = r"""
import json, sys, elastix.rendezvous as r
addr, port, run_id, min_nodes, max_nodes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
conf = {"last_call_timeout": "300ms", "keep_alive_interval": "100ms", "keep_alive_max_attempt": 3, "join_timeout": "30s"}
h = r.RendezvousHandler("c10d", f"127.0.0.1:{port}", run_id, min_nodes, max_nodes, local_addr=addr, conf=conf)
while True:
    info = h.next_rendezvous()
    print(json.dumps({"round": info.round, "rank": info.rank, "world_size": info.world_size}), flush=True)
    change = h.wait_for_change(60)
    print(json.dumps({"change": change}), flush=True)
    if change in (None, "closed"):
        break
"""


def start_node(addr, port, run_id, min_nodes, max_nodes):
    return subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, addr, str(port), run_id, str(min_nodes), str(max_nodes)],
        stdout=subprocess.PIPE,
        text=True,
    )


def read_json(proc):
    line = proc.stdout.readline()
    assert line, f"node exited early (code {proc.poll()})"
    return json.loads(line)


def wait_listening(port, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError(f"nothing listens on port {port}")


def test_processes_on_several_addresses_form_and_survive_a_killed_node():
    port = free_port()
    procs = [start_node("127.0.0.2", port, "procs", 2, 3)]
    try:
        wait_listening(port)  # the first node hosts the store; the others find it taken
        procs += [start_node(f"127.0.0.{i}", port, "procs", 2, 3) for i in (3, 4)]
        first = [read_json(proc) for proc in procs]
        assert sorted(info["rank"] for info in first) == [0, 1, 2]
        assert {info["world_size"] for info in first} == {3}
        # ranks follow the node addresses: 127.0.0.2 < 127.0.0.3 < 127.0.0.4
        assert [info["rank"] for info in first] == [0, 1, 2]
        # kill a node that does not host the store; its heartbeats stop
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(10)
        changes = [read_json(proc)["change"] for proc in procs[:2]]
        assert all(change.startswith(("node_lost", "round_superseded")) for change in changes), changes
        second = [read_json(proc) for proc in procs[:2]]
        assert sorted(info["rank"] for info in second) == [0, 1]
        assert {info["world_size"] for info in second} == {2}
        assert second[0]["round"] > first[0]["round"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_ctrl_c_interrupts_a_blocked_rendezvous():
    script = """
import sys, time, elastix.rendezvous as r
h = r.RendezvousHandler("c10d", "127.0.0.1:0", "alone", 2, 2)
print("ready", flush=True)
start = time.monotonic()
try:
    h.next_rendezvous()
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - start, 1), flush=True)
    sys.exit(0)
sys.exit(3)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.startswith("interrupted"), out


def test_over_a_torch_tcpstore_server():
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    nodes = [
        RendezvousHandler(
            "c10d",
            f"127.0.0.1:{server.port}",
            "on-torch",
            3,
            3,
            local_addr="127.0.0.1",
            conf={**FAST, "is_host": "false"},
        )
        for _ in range(3)
    ]
    infos = rendezvous_all(nodes)
    assert_consistent(infos, 3)
    # a late node on torch's server, too
    late = RendezvousHandler(
        "c10d",
        f"127.0.0.1:{server.port}",
        "on-torch-late",
        1,
        2,
        local_addr="127.0.0.1",
        conf={**FAST, "is_host": "false"},
    )
    assert late.next_rendezvous().world_size == 1

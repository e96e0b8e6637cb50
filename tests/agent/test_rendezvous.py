"""elastix.agent.rendezvous: the c10d (dynamic) and static backends, from Python, with nodes as
threads and as separate processes on 127.0.0.x addresses."""

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

import elastix
import torch_gate
from agents import wait_for
from conftest import blocked
from elastix.agent.rendezvous import RendezvousHandler, create_handler

# A live node is lost only after 2 s without a heartbeat, which a loaded machine does not
# reach; every wait is bounded by 60 s, which only a broken rendezvous runs into.
FAST = {
    "last_call_timeout": "300ms",
    "keep_alive_interval": "250ms",
    "keep_alive_max_attempt": 8,
    "join_timeout": "60s",
}
# A last call that outlasts any test: a round that forms all the same did not wait for it.
ENDLESS_LAST_CALL = {"last_call_timeout": "3600s"}


def joiner(port, run_id, min_nodes, max_nodes, **conf):
    """A node that uses the rendezvous store at `port` (it does not host one)."""
    conf = {**FAST, **conf, "is_host": "false"}
    return RendezvousHandler(
        "c10d", f"127.0.0.1:{port}", run_id, min_nodes, max_nodes, local_addr="127.0.0.1", conf=conf
    )


def wait_for_key(port, run_id, key):
    """Waits until a node has written the rendezvous key `key` (e.g. "r0/arrival/1")."""
    observer = elastix.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    observer.wait([f"elastix/rdzv/{run_id}/{key}"])


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
    # the first node's last call never ends; the second's ends the round (min 1 < max 3)
    first = RendezvousHandler(
        "c10d", "127.0.0.1:0", "late", 1, 3, local_addr="127.0.0.1", conf={**FAST, **ENDLESS_LAST_CALL}
    )
    port = first.hosted_port
    second = joiner(port, "late", 1, 3)
    with ThreadPoolExecutor(3) as pool:
        first_info = pool.submit(first.next_rendezvous)
        wait_for_key(port, "late", "r0/arrival/0")
        start = time.monotonic()
        second_info = second.next_rendezvous()
        assert time.monotonic() - start >= 0.3, "min < max waits for the last call"
        infos = [first_info.result(60), second_info]
        assert_consistent(infos, 2)
        round_ = infos[0].round
        late = joiner(port, "late", 1, 3, **ENDLESS_LAST_CALL)
        late_info = pool.submit(late.next_rendezvous)
        assert [node.wait_for_change(60) for node in (first, second)] == ["nodes_waiting", "nodes_waiting"]
        assert first.num_nodes_waiting() == 1
        # the first member and the late node come back and wait (no last call of their own);
        # the second member's arrival completes the round of three
        first_again = pool.submit(first.next_rendezvous)
        wait_for_key(port, "late", f"r{round_ + 1}/arrival/1")
        second_again = second.next_rendezvous()
        assert_consistent([first_again.result(60), second_again, late_info.result(60)], 3)


def test_close_refuses_joins_and_is_seen_by_members():
    nodes = handlers(1, 1, 1, "closing")
    rendezvous_all(nodes)
    nodes[0].set_closed()
    assert nodes[0].is_closed()
    assert nodes[0].wait_for_change(5) == "closed"
    with pytest.raises(elastix.errors.RendezvousClosedError, match="closed"):
        nodes[0].next_rendezvous()


PATIENT_NODE = r"""
import sys, elastix.agent.rendezvous as r
conf = {"join_timeout": "60s", "is_host": "false"}
h = r.RendezvousHandler("c10d", f"127.0.0.1:{sys.argv[1]}", "short", 3, 3, local_addr="127.0.0.1", conf=conf)
h.next_rendezvous()
"""


def test_a_timeout_says_who_joined_and_what_is_missing():
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True)
    # a patient node in a process of its own (killed at the end), then one that gives up soon
    patient = subprocess.Popen([sys.executable, "-c", PATIENT_NODE, str(store.port)])
    try:
        wait_for_key(store.port, "short", "r0/arrival/0")
        hasty = joiner(store.port, "short", 3, 3, join_timeout="1s")
        with pytest.raises(TimeoutError) as info:
            hasty.next_rendezvous()
    finally:
        patient.kill()
        patient.wait(30)
    assert isinstance(info.value, elastix.errors.RendezvousTimeoutError)
    message = str(info.value)
    assert "2 node(s) joined" in message and "1 more node(s) missing" in message, message
    assert f"127.0.0.1_{patient.pid}_" in message, "the node that joined is named"


def test_bad_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="unknown key"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 1, 1, conf="heartbeat_timout=5")
    with pytest.raises(ValueError, match="min_nodes"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 3, 2)
    with pytest.raises(ValueError, match="unknown"):
        RendezvousHandler("zookeeper", "127.0.0.1:0", "bad", 1, 1)
    with pytest.raises(ValueError, match=r"(is )?not a duration"):
        RendezvousHandler("c10d", "127.0.0.1:0", "bad", 1, 1, conf={"join_timeout": "soon"})


def test_static_backend():
    # The handlers outlive both joins: rank 0's handler serves the store, and dropping it
    # early would cut rank 1 off before its wait is answered (agents hold it for the job).
    # Rank 0 given port 0 serves at once, on a port the kernel picked.
    first = create_handler("static", "127.0.0.1:0", "fixed", 2, 2, rank=0, timeout="60s")
    port = first.hosted_port
    handlers = [first, create_handler("static", f"127.0.0.1:{port}", "fixed", 2, 2, rank=1, timeout="60s")]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(handler.next_rendezvous) for handler in handlers]
        infos = [future.result(60) for future in futures]
    for handler in handlers:
        handler.shutdown()
    assert [info.rank for info in infos] == [0, 1]
    assert {info.bootstrap_store_info.master_port for info in infos} == {port}


NODE_SCRIPT = r"""
import json, sys, elastix.agent.rendezvous as r
addr, port, run_id, min_nodes, max_nodes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# rounds form when full (no last call); a live node is lost only after 2 s of silence
conf = {"last_call_timeout": "3600s", "keep_alive_interval": "250ms", "keep_alive_max_attempt": 8, "join_timeout": "60s"}
h = r.RendezvousHandler("c10d", f"127.0.0.1:{port}", run_id, min_nodes, max_nodes, local_addr=addr, conf=conf)
print(json.dumps({"hosted_port": h.hosted_port}), flush=True)
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


def test_processes_on_several_addresses_form_and_survive_a_killed_node():
    # the first node hosts the store on a port the kernel picks and says which; the others
    # are pointed at it and find it taken on this machine, so they use it
    procs = [start_node("127.0.0.2", 0, "procs", 2, 3)]
    try:
        port = read_json(procs[0])["hosted_port"]
        assert port
        procs += [start_node(f"127.0.0.{i}", port, "procs", 2, 3) for i in (3, 4)]
        assert [read_json(proc)["hosted_port"] for proc in procs[1:]] == [None, None]
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
import sys, time, elastix.agent.rendezvous as r
h = r.RendezvousHandler("c10d", "127.0.0.1:0", "alone", 2, 2)
start = time.monotonic()
try:
    print("ready", flush=True)  # in the try: a signal that comes early is caught too
    h.next_rendezvous()
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - start, 1), flush=True)
    sys.exit(0)
sys.exit(3)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # its main thread blocked in the rendezvous, where the signal is meant to land (a signal
        # that came earlier would be caught all the same)
        wait_for(lambda: blocked(proc.pid), timeout=30, what="the script blocked in the rendezvous")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=45)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.startswith("interrupted"), out


@pytest.mark.torch
def test_over_a_torch_tcpstore_server():
    dist = torch_gate.need()
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


def test_conf_dicts_mean_the_same_in_every_api():
    """RendezvousHandler(conf=...) and LaunchConfig.rdzv_configs share one serializer: a
    timedelta is a duration in both, and a key is refused by both in the same words."""
    from elastix.agent.launcher import LaunchConfig, agent_config

    conf = {"join_timeout": timedelta(seconds=30), "last_call_timeout": timedelta(milliseconds=500), "is_host": True}
    handler = RendezvousHandler("c10d", "127.0.0.1:0", "conf-dicts", 1, 1, conf=conf)
    try:
        assert handler.next_rendezvous().world_size == 1
    finally:
        handler.shutdown()
    launched = agent_config(LaunchConfig(1, 1, 1, rdzv_endpoint="127.0.0.1:0", rdzv_configs=conf), "/bin/true", [])
    assert launched["rdzv_conf"] == {"join_timeout": 30.0, "last_call_timeout": 0.5, "is_host": True}
    bad = {"join_timeout": "soon"}
    with pytest.raises(ValueError) as direct:
        RendezvousHandler("c10d", "127.0.0.1:0", "conf-dicts", 1, 1, conf=bad)
    assert "--rdzv-conf join_timeout=soon" in str(direct.value)
    with pytest.raises(ValueError, match="expected a string, a number, a bool or a timedelta"):
        RendezvousHandler("c10d", "127.0.0.1:0", "conf-dicts", 1, 1, conf={"join_timeout": object()})

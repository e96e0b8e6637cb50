"""The metrics endpoints (`elastix run --metrics-port`, `elastix-store --metrics-port`), scraped
from live processes and read with the Prometheus project's own text parser."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from datetime import timedelta

import pytest

import elastix
from agents import WORKERS, agent, assert_nothing_left, wait_for

parser = pytest.importorskip("prometheus_client.parser", reason="the test extra's prometheus_client parses the scrape")

LOOP = os.path.join(WORKERS, "elastic_loop.py")
# a scrape goes to this machine only, whatever proxy the environment names
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(port):
    with DIRECT.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    return {family.name: family for family in parser.text_string_to_metric_families(text)}


def value(families, family, sample=None, **labels):
    """The value of the one sample of `family` (named `sample`, default the family's own name or
    its `_total`) whose labels include `labels`."""
    found = [
        s.value
        for s in families[family].samples
        if (s.name == sample if sample else s.name in (family, family + "_total"))
        and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (family, labels, families[family].samples)
    return found[0]


def metrics_port(logs):
    """The port a process logged it serves metrics on."""
    found = re.search(r"metrics on http://[^ ]*:(\d+)/metrics", logs())
    return int(found.group(1)) if found else None


def test_agent_metrics_count_rounds_restarts_and_worker_exits(tmp_path, marker):
    args = ["run", "--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--metrics-port", 0]
    node = agent(tmp_path, marker, "a", *args, LOOP, "--fail-once", 1)
    try:
        port = wait_for(lambda: metrics_port(node.output), what="the metrics endpoint")
        # the first attempt: 2 starts; rank 1 fails; the second attempt: 2 more
        wait_for(lambda: len([p for p in os.listdir(tmp_path) if p.startswith("start_")]) >= 4, what="a restart")
        families = wait_for(lambda: (lambda f: f if value(f, "elastix_agent_workers") == 2 else None)(scrape(port)))
        assert value(families, "elastix_agent_rounds") >= 2
        assert value(families, "elastix_agent_restarts") == 1
        assert value(families, "elastix_agent_reforms", reason="worker_failure") == 1
        assert value(families, "elastix_agent_reforms", reason="node_lost") == 0
        assert value(families, "elastix_agent_worker_exits", exit="1") == 1
        assert (value(families, "elastix_job_restarts_used"), value(families, "elastix_job_restarts_allowed")) == (1, 1)
        rendezvous = "elastix_agent_rendezvous_duration_seconds"
        assert value(families, rendezvous, sample=rendezvous + "_count") >= 2
        assert families[rendezvous].type == "histogram"
        # the agent's own rendezvous requests, and those the store it hosts served
        assert value(families, "elastix_agent_store_requests", op="compare_set") >= 1
        assert value(families, "elastix_store_requests", op="ADD") >= 1
        assert families["elastix_agent_heartbeat_age_seconds"].type == "gauge"  # one node: no heartbeats
        assert value(families, "elastix_agent_dropped_log_lines") == 0
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        node.kill()
    assert_nothing_left(marker)


HANGS_ONCE = """
import os, time
import elastix
out, restart = os.environ["OUT_DIR"], os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(out, f"start_{restart}"), "w").close()
elastix.heartbeat()
if restart == "0":
    time.sleep(600)  # hung: no more beats
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
    elastix.heartbeat()
    time.sleep(0.05)
"""


def test_hung_workers_and_worker_heartbeat_ages_are_exposed(tmp_path, marker):
    script = tmp_path / "hangs_once.py"
    script.write_text(HANGS_ONCE)
    flags = ["--standalone", "--max-restarts", 1, "--worker-timeout", 1, "--metrics-port", 0]
    node = agent(tmp_path, marker, "a", "run", *flags, script)
    try:
        port = wait_for(lambda: metrics_port(node.output), what="the metrics endpoint")
        wait_for(lambda: (tmp_path / "start_1").exists(), what="the hung worker's restart")
        age = "elastix_agent_worker_heartbeat_age_seconds"
        families = wait_for(lambda: (lambda f: f if age in f else None)(scrape(port)), what="a worker heartbeat age")
        assert value(families, "elastix_agent_hung_workers") == 1
        assert value(families, "elastix_agent_restarts") == 1
        assert 0 <= value(families, age, local_rank="0") < 60
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        node.kill()
    assert_nothing_left(marker)


def start_store(*args):
    argv = [sys.executable, "-m", "elastix", "store", "--host", "127.0.0.1", "--port", "0", *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_store_metrics_count_requests_by_operation():
    proc = start_store("--metrics-port", 0)
    try:
        store_port = int(proc.stdout.readline().rsplit(":", 1)[1])
        metrics = int(re.search(r":(\d+)/metrics", proc.stdout.readline()).group(1))
        client = elastix.TCPStore("127.0.0.1", store_port, timeout=timedelta(seconds=10))
        client.set("warm", "up")
        # a SET has no reply: the GET's reply says the server has served it before the scrape
        assert client.get("warm") == b"up"
        before = scrape(metrics)
        for i in range(10):
            client.set(f"k{i}", b"v")
        for _ in range(5):
            client.add("n", 1)
        after = scrape(metrics)
        sets = value(after, "elastix_store_requests", op="SET") - value(before, "elastix_store_requests", op="SET")
        assert sets == 10
        assert value(after, "elastix_store_requests", op="ADD") >= 5
        duration = "elastix_store_request_duration_seconds"
        assert value(after, duration, sample=duration + "_count", op="SET") >= 11
        assert value(after, "elastix_store_connections") >= 1
        assert "elastix_agent_rounds" not in after  # a store shows only the store's families
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_metrics_port_in_use_is_a_clear_error(tmp_path, marker):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        store = start_store("--metrics-port", port)
        out, err = store.communicate(timeout=30)
        assert store.returncode == 1, (out, err)
        assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "Traceback" not in err, err

        node = agent(tmp_path, marker, "a", "run", "--standalone", "--metrics-port", port, LOOP)
        assert node.finish(60) != 0
        output = node.output()
        assert f"--metrics-port: cannot serve metrics on 127.0.0.1:{port}" in output, output
        assert "in use" in output and "Traceback" not in output, output
    assert not [p for p in os.listdir(tmp_path) if p.startswith("start_")], "no worker starts"
    assert_nothing_left(marker)


def test_a_standalone_agent_serves_metrics_on_loopback_through_silent_clients(tmp_path, marker):
    """--standalone binds the endpoint to loopback (--metrics-addr says otherwise), and silent
    connections, from eight addresses and many from one, do not black out a scrape."""
    node = agent(tmp_path, marker, "a", "run", "--standalone", "--metrics-port", 0, LOOP)
    silent = []
    try:
        port = wait_for(lambda: metrics_port(node.output), what="the metrics endpoint")
        assert f"serving metrics on http://127.0.0.1:{port}/metrics" in node.output(), node.output()
        for source in [f"127.0.0.{i}" for i in range(2, 10)] + ["127.0.0.2"] * 16:
            sock = socket.socket()
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))  # and says nothing
            silent.append(sock)
        assert value(scrape(port), "elastix_agent_workers") >= 0
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        for sock in silent:
            sock.close()
        node.kill()
    assert_nothing_left(marker)


def test_metrics_addr_picks_the_address_the_endpoint_binds(tmp_path, marker):
    args = ["run", "--standalone", "--metrics-port", 0, "--metrics-addr", "0.0.0.0", LOOP]
    node = agent(tmp_path, marker, "a", *args)
    try:
        port = wait_for(lambda: metrics_port(node.output), what="the metrics endpoint")
        assert f"serving metrics on http://0.0.0.0:{port}/metrics" in node.output(), node.output()
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        node.kill()
    assert_nothing_left(marker)

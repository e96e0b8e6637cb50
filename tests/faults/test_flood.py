"""Strangers flooding a job before they authenticate, as they really come: a fourth namespace
host without the secret keeps hundreds of silent connections open to every port the job's hosts
listen on (the rendezvous store, the workers' store, the collectives' listeners, the presence
ports, the metrics endpoints, the workers' RPC listeners), found again every second as a port
scan would, and reopens whatever is closed. The agents (and so their workers) run with a soft
and hard open-file limit of 1024, a common default. A node joins while the flood is on; the job
forms once, trains with all_reduce over TCP on every step and an RPC call to the next rank every
10 steps, and completes: no member is refused, no node is lost, nothing re-forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agents import assert_nothing_left, starts, wait_for, wait_round
from training import steps_in, train_node

FLOOD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flood.py")
# heartbeats every second, a node lost after 3 missed: an agent the flood starved would show
CONF = "keep_alive_interval=1s,keep_alive_max_attempt=3,join_timeout=60s"


@pytest.fixture
def four_hosts():
    from netns import hosts_for_a_test

    yield from hosts_for_a_test(4)


@pytest.mark.parametrize(
    "shape, flood_flags",
    [
        ("silent", ("--per-port", "1200", "--rate", "1500")),
        # one byte below 0x80, as a plain torch client starts, then silence: refused as a plain
        # client, which must not hold a descriptor past the door's bounds
        ("one byte", ("--per-port", "1200", "--rate", "600", "--say", "00")),
    ],
)
def test_a_flood_from_a_stranger_host_neither_stops_nor_reshapes_the_job(
    tmp_path, marker, four_hosts, shape, flood_flags
):
    hosts = four_hosts
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(mode=0o700)
    secret = secrets_dir / "job.secret"
    subprocess.run([sys.executable, "-m", "elastix", "secret", str(secret)], check=True, capture_output=True)
    stats = tmp_path / "flood.json"
    flood = subprocess.Popen(
        [
            *hosts.command(3, sys.executable, FLOOD),
            *("--scan", ",".join(hosts.names[:3]), *flood_flags),
            *("--until", str(tmp_path / "flood_stop"), "--deadline", "300", "--stats", str(stats)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def flood_stats():
        try:
            return json.loads(stats.read_text())
        except (OSError, ValueError):
            return {}

    try:
        node = dict(
            nnodes=3,
            endpoint=f"{hosts.addr(0)}:29400",
            conf=CONF,
            run_id="flood",
            env=(f"ELASTIX_AUTH_TOKEN_FILE={secret}", "TRAIN_RPC=1"),
            flags=("--metrics-port", "0"),
            wrap=("prlimit", "--nofile=1024:1024"),
        )
        agents = [train_node(tmp_path, marker, hosts, i, **node) for i in range(2)]
        store = f"{hosts.addr(0)}:29400"
        wait_for(
            lambda: store in flood_stats().get("targets", []) and flood_stats()["closed_by_server"] > 500,
            timeout=60,
            what=f"the flood ({shape}) on the rendezvous store, shed by it",
        )
        agents.append(train_node(tmp_path, marker, hosts, 2, **node))  # joins during the flood
        formed = wait_round(tmp_path, 3)
        # every listener of the round found and flooded while the ranks train
        shed_before = flood_stats()["closed_by_server"]
        wait_for(
            lambda: len(flood_stats()["targets"]) >= 14 and flood_stats()["closed_by_server"] > shed_before + 2000,
            timeout=90,
            what="the flood on every listener (presence, metrics, 2 stores, collectives and RPC: 3+3+2+3+3)",
        )
        wait_for(lambda: steps_in(tmp_path, formed) >= 3 * 40, timeout=90, what="40 steps on every rank")
        (tmp_path / "stop").touch()
        codes = [a.finish(timeout=120) for a in agents]
    finally:
        (tmp_path / "flood_stop").touch()
        flood.wait(timeout=60)
    assert codes == [0, 0, 0], "\n\n".join(a.output() for a in agents)
    records = starts(tmp_path)
    assert {r["round"] for r in records} == {formed} and {r["restart"] for r in records} == {0}, records
    assert len(records) == 3, "one start per node: nothing re-formed or restarted"
    for a in agents:
        assert "lost" not in a.output() and "refused during authentication" not in a.output(), a.output()
    done = flood_stats()
    print(f"flood ({shape}): {json.dumps(done)}")
    # the stranger reached every kind of listener, and the servers shed what it held
    assert len(done["targets"]) >= 14, done
    assert_nothing_left(marker)

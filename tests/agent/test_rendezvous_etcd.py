"""The etcd v3 backend end to end: real agents and workers on a real 3-member etcd cluster
(tests/etcd_cluster.py), through leader loss, a member gone for good, the whole cluster down,
a stopped agent, and bad input."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agents import WORKERS, agent, assert_nothing_left, finish_all, node_args, rounds_of, starts, wait_for, wait_round
from etcd_cluster import EtcdCluster, Tls
from requirements import need_etcd

# A node is lost after 2 s without a heartbeat; short last calls.
FAST = (
    "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=2s,last_call_timeout=500ms,join_timeout=60s"
)
LOOP = os.path.join(WORKERS, "elastic_loop.py")
RUN_ID = "etcdjob"


def etcd_args(nnodes, endpoints, addr, conf=FAST, script=LOOP):
    return ["run", *node_args(nnodes, endpoints, addr, conf, script, backend="etcd", run_id=RUN_ID, max_restarts=3)]


def nodes(tmp_path, marker, nnodes, endpoints, addrs, conf=FAST):
    return [agent(tmp_path, marker, f"n{i}", *etcd_args(nnodes, endpoints, f"127.0.0.{i}", conf)) for i in addrs]


def restarts_in(out_dir, round_):
    return {r["restart"] for r in starts(out_dir) if r["round"] == round_}


def test_a_two_node_job_completes_and_a_third_node_joins(tmp_path, marker, etcd):
    agents = nodes(tmp_path, marker, "1:3", etcd.endpoints, (1, 2))
    two = wait_round(tmp_path, 2)
    agents += nodes(tmp_path, marker, "1:3", etcd.endpoints, (3,))
    three = wait_round(tmp_path, 3, after=two, what="the job re-formed with the third node")
    assert restarts_in(tmp_path, three) == {0}, "a membership change spends no restart"
    finish_all(tmp_path, agents, marker)
    outside = [key for key in etcd.keys() if not key.startswith(f"/elastix/rdzv/{RUN_ID}/".encode())]
    assert outside == [], "nothing is written outside the run's prefix"


def test_the_leader_lost_mid_rendezvous_and_mid_run_costs_no_restart(tmp_path, marker, etcd, monkeypatch):
    monkeypatch.setenv("ELASTIX_RDZV_PROGRESS_INTERVAL", "200ms")
    first = nodes(tmp_path, marker, 2, etcd.endpoints, (1,))
    wait_for(lambda: "waiting for 1 more node(s)" in first[0].output(), what="node 1 joined, waiting for node 2")
    leader = etcd.leader()
    etcd.kill(leader)
    agents = first + nodes(tmp_path, marker, 2, etcd.endpoints, (2,))
    formed = wait_round(tmp_path, 2, what="the round formed across the leader change")
    etcd.start(leader)  # back, as a follower
    etcd.wait_healthy()
    etcd.kill(etcd.leader())
    time.sleep(3)  # longer than a node takes to count as lost: nobody may be
    assert rounds_of(tmp_path, 2) == [formed], starts(tmp_path)
    finish_all(tmp_path, agents, marker)
    assert {r["restart"] for r in starts(tmp_path)} == {0}


def test_the_job_completes_with_one_member_gone_for_good(tmp_path, marker, etcd):
    etcd.kill(0)  # still listed first
    agents = nodes(tmp_path, marker, 2, etcd.endpoints, (1, 2))
    wait_round(tmp_path, 2)
    finish_all(tmp_path, agents, marker)


def test_with_every_member_down_the_workers_stop_at_their_ttl_and_the_job_re_forms_when_etcd_returns(
    tmp_path, marker, etcd
):
    agents = nodes(tmp_path, marker, 2, etcd.endpoints, (1, 2))
    formed = wait_round(tmp_path, 2)
    for i in range(3):
        etcd.kill(i)
    # every member refusing is no proof that etcd is down for everyone (a firewall that rejects
    # looks the same): each node stops its workers once its lease can no longer be live
    for a in agents:
        wait_for(lambda a=a: "lease can no longer be live" in a.output(), timeout=30, what="the workers stopped")
    for i in range(3):
        etcd.start(i)
    etcd.wait_healthy()
    again = wait_round(tmp_path, 2, after=formed, what="the job re-formed once etcd returned")
    assert restarts_in(tmp_path, again) == {0}, "an etcd outage spends no restart"
    finish_all(tmp_path, agents, marker)


def test_with_every_member_down_past_the_join_timeout_the_agents_stop_with_a_clear_error(tmp_path, marker, etcd):
    conf = FAST.replace("join_timeout=60s", "join_timeout=3s")
    agents = nodes(tmp_path, marker, 2, etcd.endpoints, (1, 2), conf)
    wait_round(tmp_path, 2)
    for i in range(3):
        etcd.kill(i)
    for a in agents:
        assert a.finish(timeout=40) == 1, a.output()
        assert "etcd at 127.0.0.1:" in a.output() and "did not answer" in a.output(), a.output()
    assert_nothing_left(marker)


def test_a_node_whose_agent_is_stopped_past_its_ttl_is_dropped(tmp_path, marker, etcd):
    conf = FAST.replace("keep_alive_interval=250ms,keep_alive_max_attempt=8,", "lease_ttl=2s,")
    agents = nodes(tmp_path, marker, "2:3", etcd.endpoints, (1, 2, 3), conf)
    three = wait_round(tmp_path, 3)
    agents[2].proc.send_signal(signal.SIGSTOP)
    try:
        wait_round(tmp_path, 2, after=three, what="the others re-forming without the stopped node")
    finally:
        agents[2].proc.send_signal(signal.SIGCONT)
    finish_all(tmp_path, agents, marker)


def test_a_node_whose_watch_history_was_compacted_reads_the_round_again(tmp_path, marker, etcd):
    """A waits for B; while A is stopped, etcd restarts (A's watch breaks), B seals the round
    and the history is compacted: A's watch reopens from a compacted revision, and A must
    read the round's outcome afresh (and later its round, likewise)."""
    conf = FAST.replace("keep_alive_interval=250ms,keep_alive_max_attempt=8,", "lease_ttl=20s,")
    (a,) = nodes(tmp_path, marker, 2, etcd.endpoints, (1,), conf)
    member = f"/elastix/rdzv/{RUN_ID}/r/000000000000/m/".encode()
    deadline = time.monotonic() + 30
    while not any(key.startswith(member) for key in etcd.keys()):
        assert time.monotonic() < deadline, a.output()
        time.sleep(0.1)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        for i in range(3):
            etcd.kill(i)
        for i in range(3):
            etcd.start(i)
        etcd.wait_healthy()
        (b,) = nodes(tmp_path, marker, 2, etcd.endpoints, (2,), conf)
        sealed = f"/elastix/rdzv/{RUN_ID}/r/000000000000/s/size".encode()
        while sealed not in etcd.keys():
            assert time.monotonic() < deadline, b.output()
            time.sleep(0.1)
        etcd.compact()
    finally:
        a.proc.send_signal(signal.SIGCONT)
    finish_all(tmp_path, [a, b], marker)
    assert "compacted the history" in a.output(), a.output()
    assert rounds_of(tmp_path, 2) == [0], starts(tmp_path)


def test_an_unreachable_endpoint_list_is_a_clear_error_within_the_join_timeout(tmp_path, marker):
    from conftest import closed_port

    holders = [closed_port(), closed_port()]
    endpoints = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in holders)
    conf = FAST.replace("join_timeout=60s", "join_timeout=2s")
    started = time.monotonic()
    (a,) = nodes(tmp_path, marker, 2, endpoints, (1,), conf)
    assert a.finish(timeout=60) == 1, a.output()
    assert time.monotonic() - started < 30
    assert f"etcd at {endpoints}" in a.output() and "did not answer" in a.output(), a.output()
    for s in holders:
        s.close()


def test_an_endpoint_that_is_not_etcd_is_a_clear_error(tmp_path, marker, rdzv_port):
    conf = FAST.replace("join_timeout=60s", "join_timeout=2s")
    (a,) = nodes(tmp_path, marker, 2, f"127.0.0.1:{rdzv_port}", (1,), conf)
    assert a.finish(timeout=60) == 1, a.output()
    assert f"etcd at 127.0.0.1:{rdzv_port}" in a.output(), a.output()


@pytest.mark.parametrize(
    "conf,needle",
    [
        ("protocol=https,cacert=/nonexistent/ca.pem", "cacert=/nonexistent/ca.pem: cannot read it"),
        ("protocol=https,cacert=/etc/hostname", "cacert=/etc/hostname: not a PEM file"),
        ("cacert=/etc/hostname", "cacert needs protocol=https"),
        ("protocol=ftp", 'protocol="ftp": use http or https'),
        ("lease_ttl=2s,keep_alive_interval=1s", "give one or the other"),
    ],
)
def test_bad_tls_and_conf_are_clear_errors(tmp_path, marker, conf, needle):
    (a,) = nodes(tmp_path, marker, 2, "127.0.0.1:2379", (1,), conf)
    assert a.finish(timeout=30) != 0
    assert needle in a.output(), a.output()


def test_a_prefix_holding_foreign_keys_is_refused_and_left_alone(tmp_path, marker, etcd):
    etcd.put(f"/elastix/rdzv/{RUN_ID}/somebody-else".encode(), b"theirs")
    before = sorted(etcd.keys())
    (a,) = nodes(tmp_path, marker, 2, etcd.endpoints, (1,))
    assert a.finish(timeout=30) != 0
    assert "not an elastix rendezvous" in a.output(), a.output()
    assert sorted(etcd.keys()) == before


def test_etcd_v2_is_refused_with_the_reason(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "elastix", "run", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379", LOOP],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "v2 API is off by default since etcd 3.4" in out.stderr


@pytest.fixture
def tls(tmp_path):
    need_etcd()
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    (tmp_path / "tls").mkdir()
    (tmp_path / "etcd").mkdir()
    return Tls(str(tmp_path / "tls"))


def a_tls_job_runs_and_a_refused_agent_says_so(tmp_path, marker, cluster, conf, refused_conf):
    """Two agents with `conf` complete a job; a third with `refused_conf` stops with etcd's error."""
    try:
        agents = nodes(tmp_path, marker, 2, cluster.endpoints, (1, 2), f"{FAST},{conf}")
        wait_round(tmp_path, 2)
        finish_all(tmp_path, agents, marker)
        quick = FAST.replace("join_timeout=60s", "join_timeout=2s")
        (a,) = nodes(tmp_path, marker, 2, cluster.endpoints, (3,), f"{quick},{refused_conf}")
        assert a.finish(timeout=60) == 1, a.output()
        assert "etcd at 127.0.0.1:" in a.output() and "did not answer" in a.output(), a.output()
    finally:
        cluster.close()


def test_a_job_runs_on_etcd_over_tls_and_a_foreign_ca_is_refused(tmp_path, marker, tls):
    cluster = EtcdCluster(tmp_path / "etcd", members=1, tls=tls)
    (tmp_path / "other").mkdir()
    stranger = Tls(str(tmp_path / "other")).ca  # signed nothing etcd holds
    conf, refused = f"protocol=https,cacert={tls.ca}", f"protocol=https,cacert={stranger}"
    a_tls_job_runs_and_a_refused_agent_says_so(tmp_path, marker, cluster, conf, refused)


def test_mutual_tls_admits_an_agent_with_a_client_certificate_and_refuses_one_without(tmp_path, marker, tls):
    cluster = EtcdCluster(tmp_path / "etcd", members=1, tls=tls, client_certs=True)
    refused = f"protocol=https,cacert={tls.ca}"
    conf = f"{refused},cert={tls.client_cert},key={tls.client_key}"
    a_tls_job_runs_and_a_refused_agent_says_so(tmp_path, marker, cluster, conf, refused)

"""Only members of a job can join, steer or feed it: end to end with real agents, workers and
strangers on 127.0.0.x addresses and in network namespaces. A job with a secret completes; an
agent with a wrong or missing secret is refused with a clear error on both sides while the job
goes on; a stranger's forged write is refused; a plain (torch) client is served by a round's
workers' store only from a member's address; the secret never shows in logs, workers'
environments or files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest

import torch_gate
from agents import WORKERS, agent, assert_nothing_left, finish_all, node_args, rounds_of, starts, wait_for, wait_round
from conftest import reserved_port as reserve
from netns import hosts_for_a_test
from requirements import need_etcd

WORKER = os.path.join(WORKERS, "store_member.py")
FAST = "keep_alive_interval=250ms,keep_alive_max_attempt=8,last_call_timeout=500ms,join_timeout=30s"
# VALIDATE, then PING 7: how every TCPStore client (torch's included) opens a connection
PLAIN_HELLO = bytes([0x00, 0xCE, 0xF7, 0x85, 0x3C, 0x0D, 7, 0, 0, 0])


def secret_file(path, text=None):
    text = text or f"s3cr3t-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return str(path), text


def node(tmp_path, marker, monkeypatch, name, addr, endpoint, secret, nnodes="2:3", python=(sys.executable,)):
    """An agent whose environment names `secret`'s file (or no secret)."""
    monkeypatch.delenv("ELASTIX_AUTH_TOKEN", raising=False)
    if secret is None:
        monkeypatch.delenv("ELASTIX_AUTH_TOKEN_FILE", raising=False)
    else:
        monkeypatch.setenv("ELASTIX_AUTH_TOKEN_FILE", secret)
    args = node_args(nnodes, endpoint, addr, FAST, WORKER, run_id="authjob")
    return agent(tmp_path, marker, name, "run", *args, python=python)


@pytest.fixture
def reserved_port():
    with reserve() as port:
        yield port


@pytest.fixture
def secured(tmp_path):
    """The job secret's file and text, and `elastix-store --auth-token-file` serving it on
    127.0.0.1 (its port): the rendezvous store the test's agents meet at."""
    path, text = secret_file(tmp_path / "secret")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIX_AUTH")}
    # its log lines (stderr) apart: they may come before the address line (stdout)
    with open(tmp_path / "store.log", "w") as log:
        store = subprocess.Popen(
            ["elastix-store", "--host", "127.0.0.1", "--port", "0", "--auth-token-file", path],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    try:
        first = store.stdout.readline()
        assert "listening on" in first, first + (tmp_path / "store.log").read_text()
        yield path, text, int(first.strip().rsplit(":", 1)[1])
    finally:
        store.terminate()
        store.wait(timeout=30)


def plain_client_served(host, port, python=()):
    """Whether a client without the secret (a torch client's opening) gets its PING echoed."""
    code = (
        "import socket,sys\n"
        f"s = socket.create_connection(({host!r}, {port}), timeout=10)\n"
        f"s.sendall({PLAIN_HELLO!r})\n"
        "try:\n    echo = s.recv(4)\nexcept OSError:\n    echo = b''\n"
        "sys.exit(0 if echo == bytes([7, 0, 0, 0]) else 3)\n"
    )
    argv = [*python, "-c", code] if python else [sys.executable, "-c", code]
    return subprocess.run(argv, timeout=30).returncode == 0


def files_holding(root, text):
    hits = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            try:
                with open(path, "rb") as f:
                    if text.encode() in f.read():
                        hits.append(path)
            except OSError:
                pass
    return hits


def test_a_job_with_a_secret_completes_and_the_secret_never_shows(tmp_path, marker, monkeypatch, secured):
    path, text, port = secured
    endpoint = f"127.0.0.1:{port}"
    agents = [node(tmp_path, marker, monkeypatch, f"n{i}", f"127.0.0.{i + 1}", endpoint, path) for i in range(2)]
    formed = wait_round(tmp_path, 2)
    for record in [r for r in starts(tmp_path) if r["round"] == formed]:
        environ = started_with(tmp_path, record["pid"]).split(b"\0")
        assert f"ELASTIX_AUTH_TOKEN_FILE={path}".encode() in environ, "workers are pointed at the file"
        assert not any(text.encode() in entry for entry in environ), "the secret itself never reaches a worker"
    finish_all(tmp_path, agents, marker)
    for a in agents:
        assert text not in a.output()
    assert files_holding(tmp_path, text) == [path], "no log, record or error file holds the secret"


def started_with(out_dir, pid):
    """The environment worker `pid` (tests/worker_programs/store_member.py) started with: /proc shows it
    to root alone once the worker loaded the secret, so the worker copies it out first."""
    with open(out_dir / f"environ_{pid}", "rb") as f:
        return f.read()


def job_with_the_secret_in_the_environment(tmp_path, marker, monkeypatch, port, run_id):
    """A one-node job whose agent has the secret in ELASTIX_AUTH_TOKEN (and hosts the
    rendezvous store): the agent, the secret, and its worker's environment once it runs."""
    text = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("ELASTIX_AUTH_TOKEN", text)
    monkeypatch.delenv("ELASTIX_AUTH_TOKEN_FILE", raising=False)
    args = node_args("1", f"127.0.0.1:{port}", "127.0.0.1", FAST, WORKER, run_id=run_id)
    a = agent(tmp_path, marker, "n0", "run", *args)
    formed = wait_round(tmp_path, 1)
    (record,) = [r for r in starts(tmp_path) if r["round"] == formed]
    started = started_with(tmp_path, record["pid"])
    environ = dict(entry.split(b"=", 1) for entry in started.split(b"\0") if b"=" in entry)
    return a, text, environ


def test_a_secret_from_the_environment_reaches_workers_only_as_a_private_file(
    tmp_path, marker, monkeypatch, reserved_port
):
    a, text, environ = job_with_the_secret_in_the_environment(tmp_path, marker, monkeypatch, reserved_port, "envjob")
    assert b"ELASTIX_AUTH_TOKEN" not in environ
    given = environ[b"ELASTIX_AUTH_TOKEN_FILE"].decode()
    assert os.stat(given).st_mode & 0o077 == 0
    with open(given) as f:
        assert f.read() == text
    finish_all(tmp_path, [a], marker)
    assert "environment variables leak" in a.output()
    assert text not in a.output()
    assert not os.path.exists(given), "the agent removes the file it wrote"


def test_a_killed_agents_private_copy_of_the_secret_is_removed_by_its_watchdog(
    tmp_path, marker, monkeypatch, reserved_port
):
    a, text, environ = job_with_the_secret_in_the_environment(tmp_path, marker, monkeypatch, reserved_port, "killed")
    given = environ[b"ELASTIX_AUTH_TOKEN_FILE"].decode()
    assert os.stat(os.path.dirname(given)).st_mode & 0o077 == 0, "the copy's directory is private"
    # the cleanup watchdog: forked from the agent, so it shares the agent's command line
    with open(f"/proc/{a.proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    watchdogs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == cmdline and int(pid) != a.proc.pid:
                    watchdogs.append(int(pid))
        except OSError:
            pass
    assert len(watchdogs) == 1, watchdogs
    try:
        with open(f"/proc/{watchdogs[0]}/environ", "rb") as f:
            assert text.encode() not in f.read(), "the watchdog's environment holds no secret"
    except PermissionError:
        assert os.geteuid() != 0  # undumpable, as the agent it was forked from: hidden from this user

    a.proc.kill()
    a.proc.wait(10)
    wait_for(lambda: not os.path.exists(os.path.dirname(given)), timeout=30, what="the watchdog removing the copy")
    assert_nothing_left(marker)


def test_an_agent_with_a_wrong_or_missing_secret_is_refused_and_the_job_goes_on(
    tmp_path, marker, monkeypatch, reserved_port
):
    path, _ = secret_file(tmp_path / "secret")
    wrong, _ = secret_file(tmp_path / "wrong")
    endpoint = f"127.0.0.1:{reserved_port}"  # the first agent hosts the rendezvous store
    agents = [node(tmp_path, marker, monkeypatch, f"n{i}", f"127.0.0.{i + 1}", endpoint, path) for i in range(2)]
    formed = wait_round(tmp_path, 2)
    intruder = node(tmp_path, marker, monkeypatch, "wrong", "127.0.0.3", endpoint, wrong)
    assert intruder.finish(timeout=60) == 1, intruder.output()
    assert "does not hold this job's secret" in intruder.output(), intruder.output()
    stranger = node(tmp_path, marker, monkeypatch, "none", "127.0.0.4", endpoint, None)
    assert stranger.finish(timeout=60) == 1, stranger.output()
    assert "requires the job's secret" in stranger.output(), stranger.output()
    host_log = next(a.output() for a in agents if "refused a connection from" in a.output())
    # both came from 127.0.0.1 (a client does not bind its --local-addr): said once a minute
    assert host_log.count("refused a connection from 127.0.0.1") == 1, host_log
    finish_all(tmp_path, agents, marker)
    assert rounds_of(tmp_path, 2) == [formed], "the job ran on, without a re-form"
    assert rounds_of(tmp_path, 3) == []


def test_a_strangers_forged_write_to_the_rendezvous_store_is_refused(tmp_path, marker, monkeypatch, secured):
    path, _, rdzv_port = secured
    endpoint = f"127.0.0.1:{rdzv_port}"
    agents = [node(tmp_path, marker, monkeypatch, f"n{i}", f"127.0.0.{i + 1}", endpoint, path) for i in range(2)]
    formed = wait_round(tmp_path, 2)
    # a torch-style client opening the rendezvous store: closed before any request is served
    assert not plain_client_served("127.0.0.1", rdzv_port)
    # an elastix client without the secret: told why, nothing written
    code = (
        "import elastix\n"
        "try:\n"
        f"    elastix.TCPStore('127.0.0.1', {rdzv_port}, timeout=10).set('/elastix/rdzv/authjob/closed', 'x')\n"
        "except elastix.AuthenticationError as err:\n"
        "    print('refused:', err)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIX_AUTH")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "refused:" in out.stdout and "requires the job's secret" in out.stdout, out.stdout + out.stderr
    # the store has no such key (a client with the secret looks): no forged close can end the job
    look = f"import elastix\nprint(elastix.TCPStore('127.0.0.1', {rdzv_port}, timeout=10).check(['/elastix/rdzv/authjob/closed']))"
    seen = subprocess.run(
        [sys.executable, "-c", look],
        env={**env, "ELASTIX_AUTH_TOKEN_FILE": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen.stdout.strip() == "False", seen.stdout + seen.stderr
    assert all(a.proc.poll() is None for a in agents), "the job runs on"
    finish_all(tmp_path, agents, marker)
    assert rounds_of(tmp_path, 2) == [formed]


@pytest.fixture
def hosts():
    yield from hosts_for_a_test(2)


def test_a_workers_store_serves_plain_clients_from_members_only(tmp_path, marker, monkeypatch, hosts):
    """A one-node job on host 0: a plain (torch) client is served on host 0 (the member's
    address, from which its agent authenticated) and refused from host 1 (a stranger)."""
    path, _ = secret_file(tmp_path / "secret")
    addr = hosts.addr(0)
    a = node(tmp_path, marker, monkeypatch, "n0", addr, f"{addr}:29400", path, nnodes="1", python=hosts.python(0))
    formed = wait_round(tmp_path, 1)
    (record,) = [r for r in starts(tmp_path) if r["round"] == formed]
    host, port = record["master"]
    assert host == addr
    assert plain_client_served(host, port, python=hosts.python(0)), "a member's torch worker connects"
    assert not plain_client_served(host, port, python=hosts.python(1)), "a stranger's plain client is refused"
    finish_all(tmp_path, [a], marker)
    assert "refused a connection from" in a.output() and hosts.addr(1) in a.output(), a.output()


def test_a_secret_file_others_can_read_is_refused(tmp_path, marker, monkeypatch, reserved_port):
    path, text = secret_file(tmp_path / "secret")
    os.chmod(path, 0o644)
    a = node(tmp_path, marker, monkeypatch, "n0", "127.0.0.1", f"127.0.0.1:{reserved_port}", path, nnodes="1")
    assert a.finish(timeout=60) != 0
    assert "chmod 600" in a.output() and text not in a.output(), a.output()


def test_without_a_secret_a_reachable_agent_says_who_can_reach_the_job(tmp_path, marker, monkeypatch, rdzv_port):
    endpoint = f"127.0.0.1:{rdzv_port}"
    a = node(tmp_path, marker, monkeypatch, "n0", socket.gethostname(), endpoint, None, nnodes="1")
    wait_round(tmp_path, 1)
    finish_all(tmp_path, [a], marker)
    assert "no job secret: anyone who can reach" in a.output(), a.output()


@pytest.mark.torch
def test_torch_workers_init_process_group_gloo_in_a_job_with_a_secret(tmp_path, marker, monkeypatch, secured):
    """torch's clients cannot prove the secret: on members' hosts the workers' store serves them."""
    torch_gate.need()
    path, _, port = secured
    script = os.path.join(WORKERS, "gloo_sum.py")
    monkeypatch.setenv("ELASTIX_AUTH_TOKEN_FILE", path)
    agents = [
        agent(
            tmp_path,
            marker,
            f"n{i}",
            "run",
            *node_args("2", f"127.0.0.1:{port}", f"127.0.0.{i + 1}", FAST, str(script), run_id="gloojob"),
        )
        for i in range(2)
    ]
    for a in agents:
        assert a.finish(timeout=180) == 0, a.output()
    assert [open(tmp_path / f"sum_{r}").read() for r in (0, 1)] == ["3.0", "3.0"]


@pytest.mark.torch
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_torch_workers_across_hosts_in_a_job_with_a_secret(tmp_path, marker, monkeypatch, hosts, backend):
    """Two namespace hosts: MASTER_ADDR is rank 0's host address, not loopback, and host 1's
    agent authenticated to the rendezvous only (c10d's store, or etcd). Rank 0 lets the round's
    members' plain (torch) clients into its workers' store, and init_process_group("gloo")
    completes."""
    torch_gate.need()
    path, _ = secret_file(tmp_path / "secret")
    monkeypatch.setenv("ELASTIX_AUTH_TOKEN_FILE", path)
    if backend == "etcd":
        need_etcd()
        from etcd_cluster import EtcdCluster

        (tmp_path / "etcd").mkdir()
        cluster = EtcdCluster(tmp_path / "etcd", client_host=hosts.gateway)
        endpoint, conf = cluster.endpoints, "lease_ttl=2s,join_timeout=30s"
    else:
        cluster, endpoint, conf = None, f"{hosts.addr(0)}:29400", FAST
    script = os.path.join(WORKERS, "gloo_sum.py")
    try:
        agents = [
            agent(
                tmp_path,
                marker,
                f"h{i}",
                "run",
                *node_args("2", endpoint, hosts.addr(i), conf, script, run_id="gloohosts", backend=backend),
                python=hosts.command(i, "env", "GLOO_SOCKET_IFNAME=eth0", sys.executable),
            )
            for i in range(2)
        ]
        for a in agents:
            assert a.finish(timeout=120) == 0, a.output()
    finally:
        if cluster is not None:
            cluster.close()
    assert [open(tmp_path / f"sum_{r}").read() for r in (0, 1)] == ["3.0", "3.0"]
    assert "refused a connection" not in "".join(a.output() for a in agents)

"""`elastix run` end to end: real scripts, real processes, several agents as nodes on
127.0.0.x addresses. Every process a test starts is bounded in time and killed at the end,
and tests check the process table for anything left behind."""

import glob
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import torch_gate
from agents import (
    FAST_RDZV,
    WORKERS,
    assert_nothing_left,
    elastix_run,
    finish,
    finish_each,
    node_args,
    starts,
    wait_for,
)
from conftest import closed_port, ignores, marked_processes, reserved_port


def test_each_rank_gets_the_environment_contract(tmp_path, marker):
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 3, os.path.join(WORKERS, "report_env.py"), out_dir=tmp_path, marker=marker
    )
    code, _out, err = finish(proc)
    assert code == 0, err
    envs = sorted((json.load(open(p)) for p in glob.glob(str(tmp_path / "*.json"))), key=lambda e: int(e["RANK"]))
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    for env in envs:
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default" and env["ROLE_RANK"] == env["RANK"]
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["ELASTIX_RANK"] == env["RANK"]
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/{env['LOCAL_RANK']}/error.json")
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs}) == 1
    assert_nothing_left(marker)


def test_a_worker_that_fails_once_is_restarted_and_the_job_succeeds(tmp_path, marker):
    proc = elastix_run(
        "--standalone",
        "--nproc-per-node",
        2,
        "--max-restarts",
        1,
        os.path.join(WORKERS, "elastic_loop.py"),
        "--fail-once",
        1,
        out_dir=tmp_path,
        marker=marker,
    )
    wait_for(lambda: len([s for s in starts(tmp_path) if s["restart"] == 1]) == 2, what="the restarted workers")
    (tmp_path / "stop").touch()
    code, _out, err = finish(proc)
    assert code == 0, err
    assert sorted((s["restart"], s["rank"]) for s in starts(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_nothing_left(marker)


def test_no_restarts_left_fails_with_the_root_cause(tmp_path, marker):
    script = tmp_path / "crash.py"
    script.write_text(
        "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('the data is corrupt')\nimport time; time.sleep(60)\n"
    )
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 2, "--max-restarts", 0, script, out_dir=tmp_path, marker=marker
    )
    code, _out, err = finish(proc)
    assert code == 1
    root = err.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "ValueError: the data is corrupt" in root
    assert "crash.py FAILED" in err
    assert_nothing_left(marker)


def test_workers_that_fail_together_are_all_listed_root_cause_first(tmp_path, marker):
    # ranks 0 and 2 fail at the same moment (rank 2 a little later); rank 1 keeps working
    script = tmp_path / "both.py"
    script.write_text(
        "import os, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 0:\n    raise SystemExit(3)\n"
        "if rank == 2:\n    time.sleep(0.05)\n    raise RuntimeError('rank two broke too')\n"
        "time.sleep(60)\n"
    )
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 3, "--max-restarts", 0, script, out_dir=tmp_path, marker=marker
    )
    code, _out, err = finish(proc)
    assert code == 1
    failures, root = err.split("Root Cause (first observed failure):")
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 3" in root, err
    assert "rank      : 2 (local_rank: 2)" in failures.split("Failures:")[1], err
    assert "rank two broke too" in failures, err
    assert "rank      : 1 (local_rank: 1)" not in err, "a worker that was stopped did not fail"
    assert_nothing_left(marker)


def test_the_console_event_log_handler_writes_torchelastic_events(tmp_path, marker):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(4 if os.environ['RANK'] == '1' else 0)\n")
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 2, "--max-restarts", 0, "--event-log-handler", "console",
        "--logs-specs", "default", "--rdzv-conf", "use_libuv=1,heartbeat=5", script,
        out_dir=tmp_path, marker=marker,
    )  # fmt: skip
    code, _out, err = finish(proc)
    assert code == 1, err
    events = [json.loads(line) for line in err.splitlines() if line.startswith('{"name": "torchelastic.')]
    by_source = {(e["source"], e["metadata"]["global_rank"]): e for e in events}
    assert by_source[("WORKER", 1)]["name"] == "torchelastic.worker.status.FAILED"
    assert by_source[("WORKER", 1)]["metadata"]["exit_code"] == 4
    assert by_source[("WORKER", 0)]["metadata"]["state"] in ("SUCCEEDED", "FAILED", "STOPPED")
    assert by_source[("AGENT", None)]["name"] == "torchelastic.worker.status.FAILED"
    assert "use_libuv=1: accepted for torch compatibility" in err, err
    assert_nothing_left(marker)


def test_master_port_stays_the_same_across_restarts(tmp_path, marker):
    script = tmp_path / "port.py"
    # in the first attempt rank 0 fails once rank 1 has written its port (the agent stops the
    # others at once); the second attempt succeeds
    script.write_text(
        "import os, time\n"
        "restart, rank = os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['RANK']\n"
        "out = os.environ['OUT_DIR']\n"
        "open(os.path.join(out, f'port_{restart}_{rank}'), 'w').write(os.environ['MASTER_PORT'])\n"
        "if restart == '0':\n"
        "    deadline = time.monotonic() + 30\n"
        "    while rank == '0' and not os.path.exists(os.path.join(out, 'port_0_1')) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    raise SystemExit(1) if rank == '0' else time.sleep(60)\n"
    )
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 2, "--max-restarts", 1, script, out_dir=tmp_path, marker=marker
    )
    code, _out, err = finish(proc)
    assert code == 0, err
    ports = {(tmp_path / f"port_{restart}_{rank}").read_text() for restart in (0, 1) for rank in (0, 1)}
    assert len(ports) == 1, f"MASTER_PORT changed across the restart: {ports}"
    assert_nothing_left(marker)


def test_a_worker_killed_by_a_signal_is_named(tmp_path, marker):
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"
    )
    proc = elastix_run("--standalone", "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker)
    code, _out, err = finish(proc)
    assert code == 1
    assert re.search(r"exitcode  : -9 \(pid: \d+\) \(SIGKILL\)", err), err
    assert_nothing_left(marker)


def test_sigterm_to_the_agent_stops_hung_workers_and_leaves_nothing(tmp_path, marker):
    # a restart budget: idle standby workers are running too, and must go as well
    proc = elastix_run(
        "--standalone",
        "--nproc-per-node",
        2,
        "--shutdown-timeout",
        1,
        "--max-restarts",
        1,
        os.path.join(WORKERS, "elastic_loop.py"),
        "--hang",
        out_dir=tmp_path,
        marker=marker,
    )
    wait_for(lambda: len(starts(tmp_path)) == 2, what="the workers")
    workers = [r["pid"] for r in starts(tmp_path)]
    wait_for(lambda: all(ignores(pid, signal.SIGTERM) for pid in workers), what="the workers ignoring SIGTERM")
    proc.send_signal(signal.SIGTERM)
    code, _out, _err = finish(proc, timeout=30)
    assert code == 128 + signal.SIGTERM
    assert_nothing_left(marker)


STANDBY_PROBE = r"""
import json, os, sys
rank, restart = os.environ["RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open("/proc/self/environ", "rb") as f:  # the environment the process started with
    from_standby = b"ELASTIX_STANDBY_FD=" in f.read()
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read().decode()
record = {"world_size": os.environ["WORLD_SIZE"], "argv": sys.argv[1:], "from_standby": from_standby,
          "cmdline": cmdline, "seen_env": "ELASTIX_STANDBY_FD" in os.environ}
path = os.path.join(os.environ["OUT_DIR"], f"probe_{restart}_{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
if restart == 0 and rank == "1":
    import time
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "probe_0_0.json")) and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 0 reports before this rank's failure stops it
    sys.exit(1)
"""


@pytest.mark.parametrize("standbys", [True, False])
def test_restarted_workers_start_from_warm_standbys_unless_turned_off(tmp_path, marker, standbys):
    script = tmp_path / "probe.py"
    script.write_text(STANDBY_PROBE)
    flags = [] if standbys else ["--no-standby-workers"]
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 2, "--max-restarts", 1, *flags, script, "a", out_dir=tmp_path, marker=marker
    )
    code, _out, err = finish(proc)
    assert code == 0, err
    probes = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("probe_*.json")}
    assert sorted(probes) == ["probe_0_0.json", "probe_0_1.json", "probe_1_0.json", "probe_1_1.json"]
    for name, probe in probes.items():
        assert probe["world_size"] == "2" and probe["argv"] == ["a"] and not probe["seen_env"]
        # the first attempt always starts cold; the restart from the standbys when on
        assert probe["from_standby"] == (standbys and name.startswith("probe_1_")), name
        # what ps shows is the cold start's command line
        assert probe["cmdline"] == probes[f"probe_0_{name[-6]}.json"]["cmdline"], name
    assert_nothing_left(marker)  # idle standbys included


def two_node_args(port, nnodes, addr):
    return node_args(
        nnodes, f"127.0.0.1:{port}", addr, FAST_RDZV, os.path.join(WORKERS, "elastic_loop.py"), run_id="two-nodes"
    )


def test_two_agents_on_one_machine_form_one_job(tmp_path, marker, rdzv_port):
    port = rdzv_port
    agents = [elastix_run(*two_node_args(port, 2, f"127.0.0.{i}"), out_dir=tmp_path, marker=marker) for i in (1, 2)]
    records = wait_for(lambda: starts(tmp_path) if len(starts(tmp_path)) == 2 else None, what="both nodes' workers")
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert {r["world_size"] for r in records} == {2}
    assert sorted(r["group_rank"] for r in records) == [0, 1]
    (tmp_path / "stop").touch()
    for agent in agents:
        code, _out, err = finish(agent)
        assert code == 0, err
    assert_nothing_left(marker)


def test_an_endpoint_without_a_node_rank_forms_a_multi_node_job(tmp_path, marker):
    """torchrun's drop-in form, `--nnodes 2 --rdzv-endpoint host:port` on each node and nothing
    else: the nodes meet with c10d (torchrun's static default would wait for --node-rank)."""
    script = os.path.join(WORKERS, "report_env.py")
    with reserved_port() as port:
        agents = [
            elastix_run(
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--local-addr",
                f"127.0.0.{i}",
                script,
                out_dir=tmp_path,
                marker=marker,
            )
            for i in (1, 2)
        ]
        results = finish_each(agents)
    for code, _out, err in results:
        assert code == 0, err
    assert any("meet there with the c10d rendezvous" in err for _, _, err in results)
    records = [json.loads(path.read_text()) for path in tmp_path.glob("*_*.json")]
    assert sorted(r["RANK"] for r in records) == ["0", "1"] and {r["WORLD_SIZE"] for r in records} == {"2"}
    assert_nothing_left(marker)


def test_a_static_node_says_whom_it_waits_for(tmp_path, marker, monkeypatch):
    monkeypatch.setenv("ELASTIX_RDZV_PROGRESS_INTERVAL", "200ms")
    script = os.path.join(WORKERS, "report_env.py")
    log = tmp_path / "rank0.log"
    with reserved_port() as port, open(log, "w") as rank0_err:
        static = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, script]
        first = elastix_run("--node-rank", "0", *static, out_dir=tmp_path, marker=marker, stderr=rank0_err)
        waiting = f"waiting for node rank(s) [1] of 2 at 127.0.0.1:{port}, deadline in"
        wait_for(lambda: waiting in log.read_text(), what="rank 0 saying it waits for rank 1")
        second = elastix_run("--node-rank", "1", *static, out_dir=tmp_path, marker=marker)
        (code, _, _), (code1, _, err1) = finish(first), finish(second)
    err = log.read_text()
    assert code == 0 and code1 == 0, err + err1
    assert "static rendezvous: node rank 0 of 2 serving the job's store at 127.0.0.1:" in err, err
    assert "node rank 1 of 2 meeting the others at" in err1, err1


def test_a_node_that_dies_mid_run_is_dropped_and_the_other_re_forms(tmp_path, marker, rdzv_port):
    port = rdzv_port
    survivor = elastix_run(*two_node_args(port, "1:2", "127.0.0.1"), out_dir=tmp_path, marker=marker)
    doomed = elastix_run(*two_node_args(port, "1:2", "127.0.0.2"), out_dir=tmp_path, marker=marker)
    wait_for(
        lambda: (
            any(r["world_size"] == 2 for r in starts(tmp_path))
            and len([r for r in starts(tmp_path) if r["world_size"] == 2]) == 2
        ),
        what="a two-node round",
    )
    doomed.kill()  # SIGKILL: no goodbye; its worker dies with it (parent-death signal)
    doomed.communicate()
    alone = wait_for(
        lambda: [r for r in starts(tmp_path) if r["world_size"] == 1 and r["round"] > 0],
        what="the survivor re-forming alone",
    )
    assert alone[0]["rank"] == 0
    (tmp_path / "stop").touch()
    code, _out, err = finish(survivor)
    assert code == 0, err
    assert_nothing_left(marker)


def test_a_third_node_joins_a_running_job(tmp_path, marker, rdzv_port):
    args = lambda addr: two_node_args(rdzv_port, "2:3", addr)  # noqa: E731
    agents = [elastix_run(*args("127.0.0.1"), out_dir=tmp_path, marker=marker)]
    agents.append(elastix_run(*args("127.0.0.2"), out_dir=tmp_path, marker=marker))
    wait_for(lambda: len([r for r in starts(tmp_path) if r["world_size"] == 2]) == 2, what="the two-node round")
    agents.append(elastix_run(*args("127.0.0.3"), out_dir=tmp_path, marker=marker))
    three = wait_for(
        lambda: (lambda rs: rs if len(rs) == 3 else None)([r for r in starts(tmp_path) if r["world_size"] == 3]),
        what="the three-node round",
    )
    assert sorted(r["rank"] for r in three) == [0, 1, 2]
    assert {r["restart"] for r in three} == {0}, "a membership change does not spend the restart budget"
    (tmp_path / "stop").touch()
    for agent in agents:
        code, _out, err = finish(agent)
        assert code == 0, err
    assert_nothing_left(marker)


@pytest.mark.torch
def test_torch_init_process_group_gloo_under_elastix_run(tmp_path, marker):
    torch_gate.need()
    script = os.path.join(WORKERS, "gloo_sum.py")
    proc = elastix_run("--standalone", "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker)
    code, _out, err = finish(proc, timeout=180)
    assert code == 0, err
    assert [open(tmp_path / f"sum_{r}").read() for r in (0, 1)] == ["3.0", "3.0"]
    assert_nothing_left(marker)


def test_the_agent_handles_signals_on_every_launch_and_gives_the_handlers_back(tmp_path, marker):
    # each launch's worker sends SIGTERM to the launching process (the agent): both launches
    # must end as interrupted, and the process must keep running with its own handlers
    script = tmp_path / "twice.py"
    script.write_text(
        "import signal, elastix\n"
        "from elastix.errors import SignalException\n"
        "config = elastix.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_endpoint='localhost:0')\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        elastix.launch(config, '/bin/sh', ['-c', 'kill -TERM $PPID; sleep 30'])\n"
        "        print('not interrupted', flush=True)\n"
        "    except SignalException as err:\n"
        "        print('interrupted', err.sigval, flush=True)\n"
        "print('handlers', signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    env = {**os.environ, "ELASTIX_TEST_MARKER": marker}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [f"interrupted {int(signal.SIGTERM)}"] * 2 + ["handlers True True"], (
        result.stdout
    )
    assert_nothing_left(marker)


def test_sigterm_is_honoured_while_the_store_is_still_unreachable(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the workers must not start')\n")
    with closed_port() as sock:
        port = sock.getsockname()[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "elastix", "run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false,join_timeout=120s", str(script)],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # the agent is retrying the connection (it says so), far from its join timeout
            for _ in range(100):
                line = agent.stderr.readline()
                if "cannot connect to the store" in line or not line:
                    break
            assert "cannot connect to the store" in line, line
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=30) == 128 + signal.SIGTERM
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def test_a_standalone_job_leaves_no_connection_for_its_store_to_wait_for(tmp_path, marker):
    """At the end, the store an agent hosts stays up while other nodes' agents are still
    connected (up to 5 s). A one-node job's own connections (its workers' progress publisher
    included) are closed by then, so the store never waits them out."""
    script = tmp_path / "beats.py"
    script.write_text(
        "import time, elastix\nfor step in range(30):\n    elastix.heartbeat(step=step)\n    time.sleep(0.01)\n"
    )
    flags = ("--standalone", "--nproc-per-node", 2, "--log-level", "debug")
    code, _out, err = finish(elastix_run(*flags, script, out_dir=tmp_path, marker=marker))
    assert code == 0, err
    assert "still open after" not in err, err
    assert_nothing_left(marker)


def listening_addresses(pids):
    """The local addresses of the TCP sockets in LISTEN state that processes `pids` hold (from
    /proc/PID/fd and /proc/net/tcp, tcp6)."""
    inodes = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(fields[1].split(":")[0])
                # each 32-bit word is in host (little-endian) order
                address = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
                ip = ipaddress.ip_address(address)
                found.append(str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip))
    return found


def test_a_standalone_job_listens_on_loopback_only(tmp_path, marker):
    """Every listener of a --standalone job (the agent's stores and presence port, the workers'
    collectives and RPC) is reachable from this machine alone."""
    script = tmp_path / "listens.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            import numpy as np
            import elastix.collectives as ec
            import elastix.rpc as rpc
            ec.init_process_group()
            rpc.init_rpc(f"w{ec.get_rank()}")
            x = np.ones(1024)
            ec.all_reduce(x)
            open(os.path.join(os.environ["OUT_DIR"], f"ready_{ec.get_rank()}"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
                if time.monotonic() > deadline:
                    raise SystemExit("the test never asked this worker to stop")
                time.sleep(0.05)
            rpc.shutdown()
            """
        )
    )
    proc = elastix_run("--standalone", "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker)
    try:
        wait_for(lambda: len(glob.glob(str(tmp_path / "ready_*"))) == 2, what="the workers ready")
        addresses = listening_addresses(marked_processes(marker))
        assert addresses, "the job listens somewhere (its store at least)"
        outside = [address for address in addresses if address not in ("127.0.0.1", "::1")]
        assert outside == [], f"listeners on {outside} (all: {addresses})"
    finally:
        (tmp_path / "stop").touch()
        code, _out, err = finish(proc)
    assert code == 0, err
    assert_nothing_left(marker)


def test_an_endpoint_that_is_not_a_store_is_an_error_within_seconds(tmp_path, marker):
    """A web server on the endpoint's port (one that answers bytes it cannot parse at once, as
    nginx does): the agent says what answered there and stops, rather than retrying until the
    join timeout."""
    import socketserver
    import threading

    class BadRequest(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(64)
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), BadRequest)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        script = tmp_path / "never.py"
        script.write_text("raise SystemExit('never started')\n")
        flags = ("--nnodes", 2, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}")
        proc = elastix_run(*flags, "--rdzv-conf", "join_timeout=600", script, out_dir=tmp_path, marker=marker)
        code, _out, err = finish(proc, timeout=120)
    finally:
        server.shutdown()
    assert code != 0 and "never started" not in err, err
    assert f"127.0.0.1:{port} is not a TCPStore server" in err and "HTTP (a web server)" in err, err
    assert_nothing_left(marker)


@pytest.mark.parametrize(
    "backend, endpoint, needle",
    [
        # (192.0.2.1, a documentation address, is never contacted: the error comes first)
        ("c10d", "192.0.2.1:0", "port 0 names no server to reach"),
        ("etcd", "127.0.0.1:0", "port 0 names no etcd member"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_anything_waits(tmp_path, marker, backend, endpoint, needle):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never started')\n")
    flags = ("--nnodes", 2, "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.2")
    code, _out, err = finish(elastix_run(*flags, script, out_dir=tmp_path, marker=marker), timeout=60)
    assert code != 0 and needle in err, err
    code, _out, err = finish(
        elastix_run("--standalone", "--rdzv-conf", "read_timeout=0.001ms", script, out_dir=tmp_path, marker=marker),
        timeout=60,
    )
    assert code == 2 and "shorter than a store round trip" in err, err
    assert_nothing_left(marker)

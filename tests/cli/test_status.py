"""`elastix status` against live runs: a 2-node job seen whole, then degraded after one agent is
killed, then finished (on the c10d store and on etcd); and bad input (unknown run ID,
unreachable store or etcd, the static backend) as clear errors with their exit codes, never a
traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from agents import WORKERS, agent, assert_nothing_left, node_args, wait_for, wait_round
from conftest import closed_port

LOOP = os.path.join(WORKERS, "elastic_loop.py")
# the test's own store holds the rendezvous (no agent hosts it); a node is lost after 2 s
CONF = "is_host=false,keep_alive_interval=250ms,keep_alive_max_attempt=8,last_call_timeout=300ms,join_timeout=60s"
HEALTHY, ERROR, USAGE, DEGRADED, NOT_FOUND, FAILED = 0, 1, 2, 3, 4, 5


def status(*args, timeout=60):
    argv = [sys.executable, "-m", "elastix", "status", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def report(endpoint, run_id):
    """The JSON report and the exit code."""
    done = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--json")
    assert "Traceback" not in done.stderr, done.stderr
    return (json.loads(done.stdout) if done.stdout else None), done.returncode


def test_status_shows_both_nodes_then_the_lost_one_after_a_kill(tmp_path, marker, rdzv_port):
    endpoint, run_id = f"127.0.0.1:{rdzv_port}", "status-2n"
    nodes = [
        agent(tmp_path, marker, name, "run", *node_args("1:2", endpoint, addr, CONF, LOOP, run_id=run_id))
        for name, addr in (("a", "127.0.0.2"), ("b", "127.0.0.3"))
    ]
    try:
        first = wait_round(tmp_path, 2)

        def both_published():
            now, code = report(endpoint, run_id)
            members = now["members"] if now else []
            ready = len(members) == 2 and all(m["host"] and m["heartbeat_age_s"] is not None for m in members)
            return (now, code) if ready and now["round"] == first else None

        now, code = wait_for(both_published, what="both members' status and heartbeats")
        assert (now["health"], now["state"], code) == ("healthy", "running", HEALTHY), now
        assert sorted(m["addr"] for m in now["members"]) == ["127.0.0.2", "127.0.0.3"]  # ranks: arrival order
        assert [m["ranks"] for m in now["members"]] == [[0], [1]]
        assert all(m["uptime_s"] is not None and m["uptime_s"] >= 0 for m in now["members"]), now["members"]
        assert now["restarts"] == {"used": 0, "allowed": 0}
        assert (now["min_nodes"], now["max_nodes"], now["problems"]) == (1, 2, [])

        human = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id)
        assert human.returncode == HEALTHY, human.stderr
        assert "HEALTHY" in human.stdout and "127.0.0.2" in human.stdout and "127.0.0.3" in human.stdout, human.stdout
        assert " UP " in human.stdout, human.stdout

        nodes[1].proc.send_signal(signal.SIGKILL)
        nodes[1].proc.wait(10)
        wait_round(tmp_path, 1, after=first, what="the survivor re-forming alone")

        def lost_reported():
            now, code = report(endpoint, run_id)
            return (now, code) if now and now["round"] > first and now["state"] == "running" else None

        now, code = wait_for(lost_reported, what="a status of the re-formed round")
        assert (now["health"], code) == ("degraded", DEGRADED), now
        assert [m["addr"] for m in now["members"]] == ["127.0.0.2"]
        assert [lost["node"].split("_")[0] for lost in now["lost"]] == ["127.0.0.3"], now["lost"]
        assert any("127.0.0.3" in problem for problem in now["problems"]), now["problems"]
        human = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id)
        assert human.returncode == DEGRADED and "DEGRADED" in human.stdout and "lost:" in human.stdout, human.stdout

        (tmp_path / "stop").touch()
        assert nodes[0].finish() == 0, nodes[0].output()
        now, code = report(endpoint, run_id)
        assert (now["state"], now["health"], code) == ("succeeded", "healthy", HEALTHY), now
    finally:
        for node in nodes:
            node.kill()
    assert_nothing_left(marker)


def test_a_failure_is_shown_with_its_root_cause_and_the_budget(tmp_path, marker, rdzv_port):
    endpoint, run_id = f"127.0.0.1:{rdzv_port}", "status-failure"
    args = node_args(1, endpoint, "127.0.0.2", CONF, LOOP, "--fail-once", 0, run_id=run_id, max_restarts=2)
    node = agent(tmp_path, marker, "a", "run", *args)
    try:
        wait_for(lambda: len([p for p in os.listdir(tmp_path) if p.startswith("start_")]) >= 2, what="a restart")

        def failure_shown():
            now, _ = report(endpoint, run_id)
            return now if now and now["last_failure"] and now["state"] == "running" else None

        now = wait_for(failure_shown, what="the failure in the status")
        assert now["restarts"] == {"used": 1, "allowed": 2}
        failure = now["last_failure"]
        assert (failure["rank"], failure["exitcode"], failure["signal"], failure["hung"]) == (0, 1, None, None)
        human = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id).stdout
        assert "last failure: round" in human and "exit code 1" in human and "restarts: 1 of 2 used" in human, human
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        node.kill()
    assert_nothing_left(marker)


def test_status_on_etcd_shows_both_nodes_then_the_lost_one(tmp_path, marker, etcd):
    run_id, conf = "status-etcd", "keep_alive_interval=250ms,keep_alive_max_attempt=8,last_call_timeout=300ms"
    backend = ("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", run_id)
    nodes = [
        agent(
            tmp_path,
            marker,
            name,
            "run",
            *node_args("1:2", etcd.endpoints, addr, conf, LOOP, run_id=run_id, backend="etcd"),
        )
        for name, addr in (("a", "127.0.0.2"), ("b", "127.0.0.3"))
    ]

    def etcd_report():
        done = status(*backend, "--json")
        assert "Traceback" not in done.stderr, done.stderr
        return (json.loads(done.stdout) if done.stdout else None), done.returncode

    try:
        first = wait_round(tmp_path, 2)

        def both_published():
            now, code = etcd_report()
            ready = now and now["round"] == first and all(m["host"] for m in now["members"])
            return (now, code) if ready and len(now["members"]) == 2 else None

        now, code = wait_for(both_published, what="both members' status on etcd")
        assert (now["backend"], now["health"], code) == ("etcd", "healthy", HEALTHY), now
        assert sorted(m["addr"] for m in now["members"]) == ["127.0.0.2", "127.0.0.3"]  # ranks: arrival order

        def workers_published():
            now, _code = etcd_report()
            ranks = now and sorted(w["rank"] for m in now["members"] for w in m["workers"])
            return now if ranks == [0, 1] else None

        wait_for(workers_published, what="each member's workers' progress on etcd")

        nodes[1].proc.send_signal(signal.SIGKILL)
        nodes[1].proc.wait(10)
        wait_round(tmp_path, 1, after=first, what="the survivor re-forming alone")

        def lost_reported():
            now, code = etcd_report()
            ready = now and now["round"] > first and now["state"] == "running" and now["members"][0]["host"]
            return (now, code) if ready else None

        now, code = wait_for(lost_reported, what="a status of the re-formed round")
        assert (now["health"], code) == ("degraded", DEGRADED), now
        assert [lost["node"].split("_")[0] for lost in now["lost"]] == ["127.0.0.3"], now["lost"]
        human = status(*backend)
        assert "DEGRADED" in human.stdout and "(etcd)" in human.stdout and "127.0.0.3" in human.stdout, human.stdout

        unknown = status("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "nope")
        assert unknown.returncode == NOT_FOUND and "no job with run ID 'nope'" in unknown.stderr, unknown.stderr
        (tmp_path / "stop").touch()
        assert nodes[0].finish() == 0, nodes[0].output()
    finally:
        for node in nodes:
            node.kill()
    assert_nothing_left(marker)


def watch_it(args):
    """`elastix status --watch`: reports one after another into a pipe, a screen redrawn on a
    real pseudo-terminal; Ctrl-C (SIGINT) ends it with 130."""
    import pty
    import select
    import time

    def read_until_two_reports(fd):
        seen, deadline = b"", time.monotonic() + 60
        while seen.count(b"HEALTHY") < 2 and time.monotonic() < deadline:
            if select.select([fd], [], [], 1)[0]:
                seen += os.read(fd, 4096)
        return seen

    argv = [sys.executable, "-m", "elastix", "status", *args, "--watch", "0.2"]
    piped = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    controller, terminal = pty.openpty()
    shown = subprocess.Popen(argv, stdout=terminal, stderr=subprocess.PIPE)
    os.close(terminal)
    try:
        lines = read_until_two_reports(piped.stdout.fileno())
        screen = read_until_two_reports(controller)
    finally:
        for proc in (piped, shown):
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 130
        os.close(controller)
    assert lines.count(b"HEALTHY") >= 2 and lines.count(b"--- ") >= 2, lines
    assert screen.count(b"\x1b[H\x1b[2J") >= 2 and b"--- " not in screen, screen


def test_a_standalone_job_prints_its_run_id_and_a_status_command_that_works(tmp_path, marker):
    """A --standalone job makes its run ID up: the agent prints it with a command to paste."""
    import shlex

    from agents import Agent

    argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "1", LOOP]
    a = Agent(argv, tmp_path, marker, "standalone")
    try:
        shown = wait_for(
            lambda: [line for line in a.output().splitlines() if "to watch the job: elastix status" in line],
            what="the status command in the agent's log",
        )
        command = shlex.split(shown[0].split("to watch the job: ", 1)[1])
        assert command[:2] == ["elastix", "status"] and "--rdzv-id" in command, shown
        done = status(*command[2:])
        assert done.returncode == HEALTHY and "HEALTHY" in done.stdout, done.stdout + done.stderr
        watch_it(command[2:])
    finally:
        (tmp_path / "stop").touch()
        assert a.finish() == 0, a.output()
    assert_nothing_left(marker)


HANGS_ONCE = """
import os, threading, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    threading.Event().wait()  # a plain program, blocked: the agent finds it hung
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    time.sleep(0.05)
"""


def test_a_hung_worker_is_shown_as_hung(tmp_path, marker, rdzv_port):
    endpoint, run_id = f"127.0.0.1:{rdzv_port}", "status-hung"
    script = tmp_path / "hangs_once.py"
    script.write_text(HANGS_ONCE)
    args = node_args(1, endpoint, "127.0.0.2", CONF, script, run_id=run_id, max_restarts=1)
    node = agent(tmp_path, marker, "a", "run", "--worker-timeout", "1", "--log-dir", tmp_path / "logs", *args)
    try:

        def failure_shown():
            now, _ = report(endpoint, run_id)
            return now["last_failure"] if now and now.get("last_failure") and now["state"] == "running" else None

        failure = wait_for(failure_shown, what="the hang in the status")
        assert failure["signal"] == "SIGKILL" and "its main thread has not run" in failure["hung"], failure
        human = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id).stdout
        assert "(local rank 0) on 127.0.0.2, hung: its main thread has not run" in human, human
        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        node.kill()
    assert_nothing_left(marker)


def test_without_a_run_id_status_lists_the_runs_the_store_holds(tmp_path, marker, rdzv_port):
    endpoint = f"127.0.0.1:{rdzv_port}"
    assert status("--rdzv-endpoint", endpoint).returncode == NOT_FOUND, "no runs yet"
    (tmp_path / "one").mkdir()
    first = agent(
        tmp_path / "one", marker, "a", "run", *node_args("1", endpoint, "127.0.0.2", CONF, LOOP, run_id="alpha")
    )
    (tmp_path / "two").mkdir()
    try:
        wait_round(tmp_path / "one", 1)
        only = status("--rdzv-endpoint", endpoint)  # one run: its report
        assert only.returncode == HEALTHY and only.stdout.startswith("job alpha at "), only.stdout + only.stderr
        second = agent(
            tmp_path / "two", marker, "b", "run", *node_args("1", endpoint, "127.0.0.3", CONF, LOOP, run_id="beta")
        )
        wait_round(tmp_path / "two", 1)
        listed = status("--rdzv-endpoint", endpoint)
        assert listed.returncode == HEALTHY, listed.stdout + listed.stderr
        lines = listed.stdout.splitlines()
        assert lines[0].startswith(f"runs at {endpoint} (c10d)"), lines
        assert [line.split()[1] for line in lines[1:]] == ["alpha", "beta"] and "HEALTHY" in lines[1], lines
        as_json = json.loads(status("--rdzv-endpoint", endpoint, "--json").stdout)
        assert as_json["runs"] == ["alpha", "beta"], as_json
    finally:
        for out in (tmp_path / "one", tmp_path / "two"):
            (out / "stop").touch()
    assert first.finish() == 0 and second.finish() == 0, first.output() + second.output()
    assert_nothing_left(marker)


def test_bad_input_is_a_clear_error_with_its_exit_code(rdzv_port):
    unknown = status("--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "no-such-job")
    assert unknown.returncode == NOT_FOUND, unknown
    assert "no job with run ID 'no-such-job'" in unknown.stderr, unknown.stderr

    # nothing listens (the job ended, or has not started), and no job here used the endpoint
    with closed_port() as sock:
        port = sock.getsockname()[1]
        nothing = status("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x")
    assert nothing.returncode == NOT_FOUND, nothing
    assert nothing.stderr.strip() == (
        f"elastix status: no job with run ID 'x' at 127.0.0.1:{port} (finished or not started): nothing listens "
        "there, and no job that ended on this machine used it"
    ), nothing.stderr

    with closed_port() as sock:
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        no_etcd = status("--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "x", "--timeout", "1")
    assert no_etcd.returncode == ERROR and f"cannot reach etcd at {endpoint}" in no_etcd.stderr, no_etcd.stderr
    assert "Traceback" not in no_etcd.stderr
    static = status("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x")
    assert static.returncode == ERROR and "keeps no shared state" in static.stderr, static.stderr

    missing = status("--rdzv-id", "x")
    assert missing.returncode == USAGE and "--rdzv-endpoint is required" in missing.stderr
    bad_conf = status("--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-conf", "bogus_key=1")
    assert bad_conf.returncode == ERROR and "bogus_key" in bad_conf.stderr and "Traceback" not in bad_conf.stderr


def test_a_bad_setting_is_an_error_even_where_a_finished_job_used_the_endpoint(tmp_path, rdzv_port, monkeypatch):
    # a job that ended on this machine once used the same port (the kernel hands ports out again)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    (tmp_path / "elastix" / "finished").mkdir(parents=True)
    record = {"v": 1, "run_id": "old", "backend": "c10d", "endpoint": f"127.0.0.1:{rdzv_port}",
              "store": f"127.0.0.1:{rdzv_port}", "state": "SUCCEEDED", "exit_code": 0,
              "finished": "2026-11-29T00:00:00Z", "host": "h", "pid": 1}  # fmt: skip
    (tmp_path / "elastix" / "finished" / "old.json").write_text(json.dumps(record))
    bad_conf = status("--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-conf", "bogus_key=1")
    assert bad_conf.returncode == ERROR and "bogus_key" in bad_conf.stderr, bad_conf
    # while a store that cannot be reached is answered from what this machine remembers
    with closed_port() as sock:
        port = sock.getsockname()[1]
    record["endpoint"] = record["store"] = f"127.0.0.1:{port}"
    (tmp_path / "elastix" / "finished" / "old.json").write_text(json.dumps(record))
    for run_id in ([], ["--rdzv-id", "old"]):
        gone = status("--rdzv-endpoint", f"127.0.0.1:{port}", *run_id, "--timeout", "1")
        assert gone.returncode == 0 and "SUCCEEDED" in gone.stdout, gone


def test_status_authenticates_as_the_agents_do(tmp_path, marker, monkeypatch):
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("status-s3cr3t-of-this-test\n")
    for name in ("ELASTIX_AUTH_TOKEN", "ELASTIX_AUTH_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    argv = [sys.executable, "-m", "elastix", "store", "--host", "127.0.0.1", "--port", "0", "--auth-token-file", path]
    store = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    node = None
    try:
        endpoint, run_id = f"127.0.0.1:{int(store.stdout.readline().rsplit(':', 1)[1])}", "status-auth"
        conf = f"{CONF},auth_token_file={path}"
        node = agent(tmp_path, marker, "a", "run", *node_args(1, endpoint, "127.0.0.2", conf, LOOP, run_id=run_id))
        wait_round(tmp_path, 1)

        refused = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--timeout", 2)
        assert refused.returncode == ERROR, refused
        assert "elastix status: error:" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr

        given = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", f"auth_token_file={path}")
        assert given.returncode == HEALTHY and "127.0.0.2" in given.stdout, (given.stdout, given.stderr)
        monkeypatch.setenv("ELASTIX_AUTH_TOKEN_FILE", str(path))
        from_env = status("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--json")
        assert from_env.returncode == HEALTHY and json.loads(from_env.stdout)["members"][0]["addr"] == "127.0.0.2"

        (tmp_path / "stop").touch()
        assert node.finish() == 0, node.output()
    finally:
        if node is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(10)
        store.terminate()
        store.wait(30)
    assert_nothing_left(marker)


PROGRESS = """
import os, threading, time
if os.environ["RANK"] == "0":
    import numpy as np
    import elastix

    ckpt = elastix.checkpoint.open()
    for step in range(100000):  # beats with its step, and saves it, until the test stops it
        elastix.heartbeat(step=step)
        ckpt.save(step, {"w": np.zeros(512, dtype=np.float64)})
        time.sleep(0.01)
        if os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
            break
else:  # a plain program that never imports elastix: watched all the same, never beats
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
        if time.monotonic() > deadline:
            raise SystemExit("the test never asked this worker to stop")
        time.sleep(0.05)
"""


def test_each_workers_progress_is_shown_beats_step_and_last_seen(tmp_path, marker):
    import shlex

    from agents import Agent

    script = tmp_path / "progress.py"
    script.write_text(PROGRESS)
    argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "2"]
    a = Agent([*argv, "--worker-timeout", "60", str(script)], tmp_path, marker, "standalone")
    try:
        shown = wait_for(
            lambda: [line for line in a.output().splitlines() if "to watch the job: elastix status" in line],
            what="the status command in the agent's log",
        )
        command = shlex.split(shown[0].split("to watch the job: ", 1)[1])[2:]

        def stepping():
            done = status(*command, "--json")
            workers = json.loads(done.stdout)["members"][0]["workers"] if done.returncode == HEALTHY else []
            ranks = {worker["rank"]: worker for worker in workers}
            return workers if len(workers) == 2 and ranks[0]["step"] and ranks[0].get("checkpoint") else None

        beating, plain = sorted(wait_for(stepping, what="rank 0's steps in the status"), key=lambda w: w["rank"])
        assert beating["beats"] >= 1 and beating["step"] >= 1 and beating["seen_age_s"] < 30, beating
        assert plain["beats"] == 0 and plain["step"] is None and plain["checkpoint"] is None, plain
        # the checkpoint its agent holds: the step saved, its size, how fresh
        held = beating["checkpoint"]
        assert held["step"] >= 1 and held["bytes"] == 512 * 8 and held["saved_age_s"] < 30, held
        # the plain program is seen through the kernel: its main thread wakes every 50 ms
        assert plain["seen_age_s"] is not None and plain["doing"] in ("running", "waiting"), plain
        human = status(*command).stdout
        table = human.split("  workers:\n")[1].splitlines()
        header = ["RANK", "GROUP", "RANK", "BEATS", "STEP", "LAST", "SEEN", "MAIN", "THREAD", "PACE", "CHECKPOINT"]
        assert table[0].split() == header, human
        assert table[1].split()[:2] == ["0", "0"] and " ago " in table[1] and "step " in table[1], human
        assert "4.0KB" in table[1], human
        assert table[2].split()[:4] == ["1", "0", "0", "-"] and table[2].split()[-3] in ("running", "waiting"), human
        assert table[2].split()[-2:] == ["-", "-"], human  # one node: no pace to judge; no checkpoint
    finally:
        (tmp_path / "stop").touch()
        assert a.finish() == 0, a.output()
    assert_nothing_left(marker)


FAILS = "raise SystemExit('the loss exploded')\n"


def test_a_finished_job_is_reported_as_its_agents_noted_it(tmp_path, marker):
    """The README's kind of job: --standalone, its store gone with its agent. `elastix status`
    with the command the agent printed says how it ended, and where its logs are."""
    import shlex

    from agents import Agent

    failing = tmp_path / "fails.py"
    failing.write_text(FAILS)
    for program, code, state in ((LOOP, HEALTHY, "SUCCEEDED"), (str(failing), FAILED, "FAILED")):
        (tmp_path / "stop").touch()  # the loop ends at once
        argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "1", program]
        a = Agent(argv, tmp_path, marker, f"standalone-{state}")
        a.finish()
        shown = [line for line in a.output().splitlines() if "to watch the job: elastix status" in line]
        command = shlex.split(shown[0].split("to watch the job: ", 1)[1])
        done = status(*command[2:])
        assert done.returncode == code, done.stdout + done.stderr
        run_id = command[command.index("--rdzv-id") + 1]
        assert done.stdout.startswith(f"job {run_id}: finished {state} at "), done.stdout
        assert f"(agent pid {a.proc.pid}): {state}" in done.stdout, done.stdout
        if state == "FAILED":
            assert "root cause: rank 0 (host" in done.stdout and "the loss exploded" in done.stdout, done.stdout
        as_json = json.loads(status(*command[2:], "--json").stdout)
        assert as_json["health"] == "finished" and as_json["finished"][0]["state"] == state, as_json
        # another run at that endpoint: nothing is known of it
        other = status(*command[2 : command.index("--rdzv-id")], "--rdzv-id", "another-run")
        assert other.returncode == NOT_FOUND and "(finished or not started)" in other.stderr, other.stderr
    assert_nothing_left(marker)

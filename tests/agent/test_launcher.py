"""elastix.launch / LaunchConfig / elastic_launch, the function worker, and the data model.

The Rust agent is replaced by a small fake that runs the AgentConfig's command line once per
local rank with torch's rank variables, so function payloads make a real round trip."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

import elastix
from elastix import _core
from elastix.agent.failures import ChildFailedError, ProcessFailure
from elastix.agent.launcher import LaunchConfig, agent_config, elastic_launch, entrypoint_name, launch, write_payload
from elastix.agent.logs_specs import DefaultLogsSpecs, Std
from elastix.agent.spec import RunResult, WorkerSpec, WorkerState
from elastix.errors import SignalException

TORCH_FIELDS = [
    ("min_nodes", None), ("max_nodes", None), ("nproc_per_node", None), ("logs_specs", None),
    ("run_id", ""), ("role", "default_role"), ("rdzv_endpoint", ""), ("rdzv_backend", "c10d"),
    ("rdzv_configs", {}), ("rdzv_timeout", -1), ("max_restarts", 3), ("monitor_interval", 0.1),
    ("start_method", "spawn"), ("log_line_prefix_template", None), ("metrics_cfg", {}),
    ("local_addr", None), ("event_log_handler", "null"), ("numa_options", None),
    ("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"), ("duplicate_stdout_filters", None),
    ("duplicate_stderr_filters", None), ("virtual_local_rank", False), ("shutdown_timeout", 30.0),
]  # fmt: skip


# --- functions run by workers (module level, so they pickle by reference) --------------------


def worker_identity(tag, scale):
    return {"tag": tag, "rank": int(os.environ["RANK"]) * scale, "local_rank": os.environ["LOCAL_RANK"]}


def worker_fails_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    return "ok"


def worker_exits_cleanly():
    sys.exit(0)


# --- a fake agent ----------------------------------------------------------------------------


@pytest.fixture
def fake_agent(monkeypatch, tmp_path):
    """run_agent that starts every local rank's command with RANK etc. and reports like the agent."""
    calls = []

    def run_agent(text):
        config = json.loads(text)
        calls.append(config)
        n = config["local_world_size"]
        procs = []
        for lr in range(n):
            error_file = tmp_path / f"error_{lr}.json"
            env = {**os.environ, **config["env"], "RANK": str(lr), "LOCAL_RANK": str(lr),
                   "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "TORCHELASTIC_ERROR_FILE": str(error_file)}  # fmt: skip
            args = [a.replace("${local_rank}", str(lr)) for a in config["args"]]
            procs.append(
                (lr, error_file, subprocess.Popen([config["entrypoint"], *args], env=env, stderr=subprocess.PIPE))
            )
        failures = []
        for lr, error_file, proc in procs:
            _, err = proc.communicate(timeout=60)
            if proc.returncode != 0:
                failures.append({
                    "global_rank": lr, "local_rank": lr, "host": "node0", "pid": proc.pid,
                    "exitcode": proc.returncode, "signal": None, "timestamp": time.time(),
                    "error_file": str(error_file) if error_file.exists() else None,
                    "message": err.decode().strip().splitlines()[-1] if err else "",
                })  # fmt: skip
        state = "FAILED" if failures else "SUCCEEDED"
        return json.dumps({
            "state": state, "exit_code": 1 if failures else 0, "restart_count": 0, "group_rank": 0,
            "group_world_size": 1, "log_dir": None, "global_ranks": list(range(n)),
            "failures": failures, "summary": "summary text" if failures else None,
        })  # fmt: skip

    monkeypatch.setattr(_core, "run_agent", run_agent, raising=False)
    return calls


# --- LaunchConfig ----------------------------------------------------------------------------


def test_launch_config_fields_and_defaults(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", raising=False)
    config = LaunchConfig(1, 2, 4)
    names = [f.name for f in dataclasses.fields(LaunchConfig)]
    assert names[: len(TORCH_FIELDS)] == [name for name, _ in TORCH_FIELDS]  # torch's order
    assert names[len(TORCH_FIELDS) :] == [
        "exit_barrier_timeout",
        "standby_workers",
        "worker_timeout",
        "preflight",
        "exclude_stragglers",
    ]
    for name, default in TORCH_FIELDS[4:]:
        assert getattr(config, name) == default, name
    assert isinstance(config.logs_specs, DefaultLogsSpecs)
    assert config.rdzv_configs == {}  # no timeout=900 injected
    assert config.exit_barrier_timeout == 300.0 and config.standby_workers is True
    assert LaunchConfig(1, 1, 1, rdzv_timeout=60).rdzv_configs == {"timeout": 60}


def test_launch_config_timeouts_from_env(monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    monkeypatch.setenv("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", "9")
    config = LaunchConfig(1, 1, 1)
    assert (config.shutdown_timeout, config.exit_barrier_timeout) == (7.0, 9.0)
    assert LaunchConfig(1, 1, 1, shutdown_timeout=2).shutdown_timeout == 2.0
    assert LaunchConfig(1, 1, 1, shutdown_timeout="500ms").shutdown_timeout == 0.5  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--shutdown-timeout: soon is not a duration"):
        LaunchConfig(1, 1, 1, shutdown_timeout="soon")  # type: ignore[arg-type]
    # refused when the config is made, as torch does
    with pytest.raises(ValueError, match="shutdown_timeout must be non-negative, got -1"):
        LaunchConfig(1, 1, 1, shutdown_timeout=-1)


@pytest.mark.parametrize("kwargs,needle", [
    ({"event_log_handler": "console"}, "event_log_handler"),
    ({"numa_options": object()}, "numa_options"),
    ({"monitor_interval": 0}, "monitor_interval"),
    ({"start_method": "thread"}, "start_method"),
])  # fmt: skip
def test_launch_config_refuses_what_elastix_does_not_do(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LaunchConfig(1, 1, 1, **kwargs)


def test_agent_config_errors_name_the_flag():
    cases = [
        (LaunchConfig(3, 2, 1), "--nnodes: MIN \\(3\\) is greater than MAX \\(2\\)"),
        (LaunchConfig(1, 1, 1, max_restarts=-1), "--max-restarts: must be at least 0, got -1"),
        (LaunchConfig(1, 1, 1, rdzv_configs={"join_timeout": "-5"}), '--rdzv-conf join_timeout=-5: "-5" is not'),
        (LaunchConfig(1, 1, 1, rdzv_backend="etcd-v2"), "--rdzv-backend etcd-v2: etcd's v2 API is off"),
        (LaunchConfig(1, 1, 1, rdzv_configs={"heartbeat_timout": 10}), 'unknown key "heartbeat_timout"'),
    ]
    for config, needle in cases:
        with pytest.raises(ValueError, match=needle):
            agent_config(config, "/bin/true", [])


def test_agent_config_from_launch_config():
    config = LaunchConfig(
        1, 3, 2, run_id="job", role="trainer", rdzv_endpoint="h:29400",
        rdzv_configs={"join_timeout": 60, "is_host": True, "rank": 4},
        logs_specs=DefaultLogsSpecs(log_dir="/tmp/logs", redirects=Std.ERR, tee={1: Std.OUT}, local_ranks_filter={1}),
        log_line_prefix_template="[${rank}]", signals_to_handle="SIGTERM,SIGUSR1", max_restarts=5,
    )  # fmt: skip
    out = agent_config(config, "/bin/prog", ["a", "${local_rank}"])
    assert out["rdzv_conf"] == {"join_timeout": 60, "is_host": True}  # rank only matters to static
    assert (out["run_id"], out["role"], out["local_world_size"]) == ("job", "trainer", 2)
    assert (out["entrypoint"], out["args"]) == ("/bin/prog", ["a", "${local_rank}"])
    assert (out["min_nodes"], out["max_nodes"], out["max_restarts"]) == (1, 3, 5)
    assert out["redirects"] == [2, 2] and out["tee"] == [0, 1] and out["local_ranks_filter"] == [1]
    assert out["log_dir"] == "/tmp/logs" and out["line_prefix"] == "[{rank}]"
    assert out["signals_to_handle"] == ["SIGTERM", "SIGUSR1"]
    assert out["env"] == {}  # the API does not set OMP_NUM_THREADS (torch: only the CLI does)
    assert (out["preflight"], out["exclude_stragglers"]) == (None, False)
    checked = agent_config(LaunchConfig(1, 2, 1, preflight=True, exclude_stragglers=True), "/bin/prog", [])
    assert checked["preflight"] == [sys.executable, "-m", "elastix.preflight"] and checked["exclude_stragglers"]


def test_agent_config_static_and_empty_run_id():
    out = agent_config(LaunchConfig(2, 2, 1, rdzv_backend="static", rdzv_endpoint="10.0.0.1:1234",
                                    rdzv_configs={"rank": 1}), "/bin/true", [])  # fmt: skip
    assert (out["master_addr"], out["master_port"], out["node_rank"]) == ("10.0.0.1", 1234, 1)
    assert out["run_id"].isdigit()  # torch: str(uuid4().int) for an empty run_id
    with pytest.raises(ValueError, match="HOST:PORT"):
        agent_config(LaunchConfig(1, 1, 1, rdzv_backend="static"), "/bin/true", [])
    with pytest.raises(ValueError, match="rank"):
        agent_config(LaunchConfig(2, 2, 1, rdzv_backend="static", rdzv_endpoint="h:1"), "/bin/true", [])
    with pytest.raises(ValueError, match="v2 API is off by default"):
        agent_config(LaunchConfig(1, 1, 1, rdzv_backend="etcd-v2"), "/bin/true", [])


def test_entrypoint_name():
    assert entrypoint_name(worker_identity, []) == "worker_identity"
    assert entrypoint_name(sys.executable, ["-u", "train.py", "--x"]) == "train.py"
    assert entrypoint_name("/bin/prog", []) == "/bin/prog"
    assert entrypoint_name(sys.executable, ["-u"]) == ""
    assert entrypoint_name(None, []) == ""  # type: ignore[arg-type]  (torch's test_get_entrypoint_name)


# --- launch with the fake agent --------------------------------------------------------------


def test_launch_function_round_trip(fake_agent):
    result = launch(LaunchConfig(1, 1, 2), worker_identity, ("t", 10))
    assert result.state == WorkerState.SUCCEEDED and not result.is_failed()
    assert result.return_values == {
        0: {"tag": "t", "rank": 0, "local_rank": "0"},
        1: {"tag": "t", "rank": 10, "local_rank": "1"},
    }
    (config,) = fake_agent
    assert config["entrypoint"] == sys.executable
    assert config["args"][:3] == ["-u", "-m", "elastix.worker.function_worker"]
    assert not os.path.exists(config["args"][3])  # the payload directory is cleaned up


def test_elastic_launch_returns_values_and_raises_child_failed(fake_agent):
    assert elastic_launch(LaunchConfig(1, 1, 2), worker_exits_cleanly)() == {0: None, 1: None}
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(LaunchConfig(1, 1, 2), worker_fails_on_rank_1)()
    err = info.value
    assert list(err.failures) == [1]
    rank, failure = err.get_first_failure()
    assert (rank, failure.exitcode, failure.host) == (1, 1, "node0")
    assert failure.error_file.endswith("error_1.json")
    text = str(err)
    assert "worker_fails_on_rank_1 FAILED" in text and "ValueError: rank 1 cannot go on" in text
    assert "Root Cause (first observed failure):" in text and "<NO_OTHER_FAILURES>" in text


def test_launch_script_and_binary(fake_agent, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, sys; sys.exit(0 if sys.argv[1] == os.environ['LOCAL_RANK'] else 4)\n")
    result = launch(LaunchConfig(1, 1, 2), str(script), ["${local_rank}"])
    assert result.return_values == {0: None, 1: None}
    assert fake_agent[-1]["args"] == ["-u", str(script), "${local_rank}"]
    result = launch(LaunchConfig(1, 1, 1), "/bin/sh", ["-c", "exit 3"])
    assert result.is_failed() and result.failures[0].exitcode == 3 and result.exit_code == 1


def test_launch_raises_signal_exception_when_interrupted(monkeypatch):
    report = {"state": "INTERRUPTED", "exit_code": 128 + 15, "restart_count": 0, "group_rank": 0,
              "group_world_size": 1, "log_dir": None, "global_ranks": [0], "failures": [], "summary": None}  # fmt: skip
    monkeypatch.setattr(_core, "run_agent", lambda text: json.dumps(report), raising=False)
    with pytest.raises(SignalException) as info:
        launch(LaunchConfig(1, 1, 1), "/bin/true")
    assert info.value.sigval == signal.SIGTERM


def test_elastic_launch_without_worker_failures_raises_the_summary(monkeypatch):
    report = {"state": "FAILED", "exit_code": 1, "restart_count": 0, "group_rank": None, "group_world_size": None,
              "log_dir": None, "global_ranks": [], "failures": [], "summary": "rendezvous timed out"}  # fmt: skip
    monkeypatch.setattr(_core, "run_agent", lambda text: json.dumps(report), raising=False)
    with pytest.raises(RuntimeError, match="rendezvous timed out"):
        elastic_launch(LaunchConfig(1, 1, 1), "/bin/true")()


# --- the function worker as a real subprocess -------------------------------------------------


def run_function_worker(args, rank, tmp_path, cwd=None):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
           "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"err{rank}.json")}  # fmt: skip
    return subprocess.run([sys.executable, "-u", "-m", "elastix.worker.function_worker", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=cwd)  # fmt: skip


def test_function_worker_payload_round_trip(tmp_path):
    payload, results = tmp_path / "payload.pkl", tmp_path / "results"
    results.mkdir()
    write_payload(str(payload), worker_identity, ("x", 3))
    out = run_function_worker([str(payload), str(results)], 2, tmp_path, cwd="/")
    assert out.returncode == 0, out.stderr
    assert pickle.loads((results / "2.pkl").read_bytes()) == {"tag": "x", "rank": 6, "local_rank": "2"}
    assert sorted(p.name for p in results.iterdir()) == ["2.pkl"]


def test_function_worker_failure_writes_error_file_and_no_result(tmp_path):
    payload, results = tmp_path / "payload.pkl", tmp_path / "results"
    results.mkdir()
    write_payload(str(payload), worker_fails_on_rank_1, ())
    out = run_function_worker([str(payload), str(results)], 1, tmp_path)
    assert out.returncode == 1 and "rank 1 cannot go on" in out.stderr
    data = json.loads((tmp_path / "err1.json").read_text())
    assert data["message"]["message"] == "ValueError: rank 1 cannot go on"
    assert "worker_fails_on_rank_1" in data["message"]["extraInfo"]["py_callstack"]
    assert list(results.iterdir()) == []


def test_function_defined_in_a_main_script(tmp_path):
    """Like spawn: the launcher's __main__ is loaded again in the worker, without its main block."""
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\nfrom elastix.agent.launcher import write_payload\n\n"
        "def square(x):\n    return x * x\n\n"
        "if __name__ == '__main__':\n    write_payload(sys.argv[1], square, (7,))\n    print('main block ran')\n"
    )
    payload, results = tmp_path / "payload.pkl", tmp_path / "results"
    results.mkdir()
    subprocess.run([sys.executable, str(script), str(payload)], check=True, timeout=60)
    out = run_function_worker([str(payload), str(results)], 0, tmp_path, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "main block ran" not in out.stdout
    assert pickle.loads((results / "0.pkl").read_bytes()) == 49


def test_unpicklable_entrypoint_is_a_clear_error():
    with pytest.raises(TypeError, match="picklable"):
        write_payload(os.devnull, lambda: 1, ())


def test_run_path_mode(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\nassert __name__ == '__main__'\nprint('args', sys.argv)\n"
        "if sys.argv[1] == 'fail':\n    raise RuntimeError('from script')\nsys.exit(0)\n"
    )
    out = run_function_worker(["--run-path", str(script), "ok", "--flag"], 0, tmp_path)
    assert out.returncode == 0 and f"args ['{script}', 'ok', '--flag']" in out.stdout
    assert not (tmp_path / "err0.json").exists()
    out = run_function_worker(["--run-path", str(script), "fail"], 0, tmp_path)
    assert out.returncode == 1
    data = json.loads((tmp_path / "err0.json").read_text())["message"]
    assert data["message"] == "RuntimeError: from script"
    # the root cause starts at the user's script, not in elastix's wrapper or runpy
    callstack = data["extraInfo"]["py_callstack"].splitlines()
    assert callstack[0] == "Traceback (most recent call last):" and str(script) in callstack[1]
    assert "record.py" not in data["extraInfo"]["py_callstack"]


# --- data model and ChildFailedError ---------------------------------------------------------


def test_worker_state_and_spec():
    assert [s.value for s in WorkerState] == [
        "UNKNOWN",
        "INIT",
        "HEALTHY",
        "UNHEALTHY",
        "STOPPED",
        "SUCCEEDED",
        "FAILED",
    ]
    assert WorkerState.FAILED == "FAILED"
    assert WorkerState.is_running(WorkerState.HEALTHY) and not WorkerState.is_running(WorkerState.STOPPED)
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint="/usr/bin/prog")
    assert (spec.max_restarts, spec.monitor_interval, spec.get_entrypoint_name()) == (3, 0.1, "prog")
    assert WorkerSpec("r", 1, entrypoint=worker_identity).get_entrypoint_name() == "worker_identity"
    with pytest.deprecated_call():
        assert WorkerSpec("r", 1, fn=worker_identity).entrypoint is worker_identity
    with pytest.raises(ValueError):
        WorkerSpec("r", 0, entrypoint="x")
    with pytest.raises(ValueError):
        WorkerSpec("r", 1)


def test_run_result_from_report():
    report = {"state": "FAILED", "exit_code": 1, "restart_count": 2, "group_rank": 1, "group_world_size": 2,
              "log_dir": "/l", "global_ranks": [2, 3], "summary": "s",
              "failures": [{"global_rank": 3, "local_rank": 1, "host": "h", "pid": 9, "exitcode": -9,
                            "signal": "SIGKILL", "timestamp": 1.5, "error_file": None, "message": ""}]}  # fmt: skip
    result = RunResult.from_report(report)
    assert result.is_failed() and result.return_values == {}
    assert (result.restart_count, result.group_rank, result.log_dir, result.summary) == (2, 1, "/l", "s")
    failure = result.failures[3]
    assert (failure.local_rank, failure.pid, failure.exitcode, failure.signal) == (1, 9, -9, "SIGKILL")
    assert failure.error_file == "<N/A>" and failure.message == "Signal 9 (SIGKILL) received by PID 9"
    ok = RunResult.from_report({**report, "state": "SUCCEEDED", "failures": []})
    assert ok.return_values == {2: None, 3: None} and not ok.is_failed()


def test_process_failure_torch_style(tmp_path):
    failure = ProcessFailure(local_rank=0, pid=5, exitcode=1, error_file=str(tmp_path / "none.json"))
    assert failure.error_file == str(tmp_path / "none.json") and "@elastix.record" in failure.message
    assert ProcessFailure(0, 5, 1, "").error_file == "<N/A>"
    error_file = tmp_path / "e.json"
    error_file.write_text(
        json.dumps({"message": {"message": "E: m", "extraInfo": {"py_callstack": "tb", "timestamp": "42"}}})
    )
    failure = ProcessFailure(0, 5, 1, str(error_file))
    assert failure.timestamp == 42.0 and failure.message["message"] == "E: m"  # torch: the dict
    assert failure.signal_name() == "<N/A>"
    assert ProcessFailure(0, 5, -15, None).signal_name() == "SIGTERM"


def test_child_failed_error_layout(tmp_path):
    error_file = tmp_path / "error.json"
    callstack = 'Traceback (most recent call last):\n  File "t.py", line 1\nValueError: bad\n'
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: bad",
                    "extraInfo": {"py_callstack": callstack, "timestamp": "1700000000"},
                }
            }
        )
    )
    root = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(error_file), message="ValueError: bad",
                          timestamp=1700000000.25, host="node0")  # fmt: skip
    other = ProcessFailure(local_rank=0, pid=10, exitcode=-15, timestamp=1700000001.0, host="node0")
    err = ChildFailedError("train.py", {0: other, 1: root})
    assert err.get_first_failure() == (1, root)
    t_other, t_root = other.timestamp_isoformat(), root.timestamp_isoformat()
    assert t_root == time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(1700000000))
    expected = "\n".join([
        "",
        "=" * 60,
        "train.py FAILED",
        "-" * 60,
        "Failures:",
        "[0]:",
        f"  time      : {t_other}",
        "  host      : node0",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -15 (pid: 10) (SIGTERM)",
        "  error_file: <N/A>",
        "  traceback : Signal 15 (SIGTERM) received by PID 10",
        "-" * 60,
        "Root Cause (first observed failure):",
        "[1]:",
        f"  time      : {t_root}",
        "  host      : node0",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 11)",
        f"  error_file: {error_file}",
        "  traceback : Traceback (most recent call last):",
        "    File \"t.py\", line 1",
        "  ValueError: bad",
        "  ",
        "=" * 60,
    ])  # fmt: skip
    assert str(err) == expected
    short = ChildFailedError("x", {0: ProcessFailure(0, 1, 2, None, message="m", host="h")})
    lines = str(short).split("\n")
    block = lines[lines.index("Root Cause (first observed failure):") + 1 : -1]
    assert "  <NO_OTHER_FAILURES>" in lines and lines[1] == "=" * max(len(line) for line in block)
    with pytest.raises(ValueError):
        ChildFailedError("x", {})


def test_package_exports():
    for name in ("launch", "LaunchConfig", "record", "RunResult", "WorkerSpec", "WorkerState",
                 "elastic_launch", "ChildFailedError", "ProcessFailure", "TCPStore"):  # fmt: skip
        assert name in elastix.__all__ and getattr(elastix, name) is not None
    assert elastix.LaunchConfig is LaunchConfig and elastix.WorkerState is WorkerState

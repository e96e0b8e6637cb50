"""The agent never blocks on output: a stdout nobody reads does not stop restarts, SIGTERM
handling or heartbeats (worker lines are dropped and counted instead), and log files that
cannot be written (a full disk) are reported once and make the run exit non-zero."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from agents import FAST_RDZV, assert_nothing_left, elastix_run, finish, wait_for

LOGS_INCOMPLETE = 3

# Each attempt records its start, writes more to stdout than a pipe and the agent's queue
# hold (10 MB), records that, then behaves as $SPAM_THEN says: "fail-first" exits 1 in the first
# attempt and hangs in later ones; "work" works for a few seconds (several heartbeat timeouts)
# and succeeds; "exit" succeeds at once.
SPAM = r"""
import os, sys, time
out, rank = os.environ["OUT_DIR"], os.environ["RANK"]
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
tag = f"{os.environ['ELASTIX_ROUND']}_{rank}_{restart}"
def record(name):
    with open(os.path.join(out, f"{name}_{tag}"), "w") as f:
        f.write(str(os.getpid()))
record("start")
line = "x" * 199 + "\n"
for _ in range(50000):
    sys.stdout.write(line)
sys.stdout.flush()
record("spammed")
then = os.environ["SPAM_THEN"]
if then == "fail-first":
    if restart == 0:
        sys.exit(1)
    time.sleep(3600)
elif then == "work":
    time.sleep(3)
"""


@pytest.fixture
def spam(tmp_path):
    script = tmp_path / "spam.py"
    script.write_text(SPAM)
    return script


@pytest.fixture
def stalled_stdout():
    """The write end of a pipe nobody reads (the reader stays open: writes block, not fail)."""
    read_end, write_end = os.pipe()
    yield write_end
    os.close(write_end)
    os.close(read_end)


def start_agent(*args, out_dir, marker, stdout, then):
    env = {**os.environ, "OUT_DIR": str(out_dir), "ELASTIX_TEST_MARKER": marker, "SPAM_THEN": then}
    return subprocess.Popen(
        [sys.executable, "-m", "elastix", "run", *map(str, args)],
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def recorded(out_dir, name):
    return sorted(p.name for p in out_dir.glob(f"{name}_*"))


def test_a_stalled_stdout_does_not_stop_restarts_or_sigterm(tmp_path, marker, spam, stalled_stdout):
    proc = start_agent(
        "--standalone",
        "--nproc-per-node",
        1,
        "--max-restarts",
        1,
        "--shutdown-timeout",
        1,
        spam,
        out_dir=tmp_path,
        marker=marker,
        stdout=stalled_stdout,
        then="fail-first",
    )
    # the first attempt fails after filling stdout; the restarted one fills it again
    wait_for(lambda: recorded(tmp_path, "spammed") == ["spammed_0_0_0", "spammed_1_0_1"], what="the restarted worker")
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, err
    assert "restart 1 of 1" in err
    assert "lines of worker output were dropped because stdout was not being read" in err
    assert_nothing_left(marker)  # the process table: the workers (and standbys) are gone


def test_a_stalled_stdout_does_not_stop_heartbeats(tmp_path, marker, spam, stalled_stdout, rdzv_port):
    port = rdzv_port
    common = ["--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    common += ["--rdzv-id", "stalled", "--rdzv-conf", FAST_RDZV]
    # node A's stdout is read (discarded); node B's is stalled
    nodes = [
        start_agent(
            *common,
            "--local-addr",
            addr,
            spam,
            out_dir=tmp_path,
            marker=marker,
            stdout=stdout,
            then="work",
        )
        for addr, stdout in (("127.0.0.1", subprocess.DEVNULL), ("127.0.0.2", stalled_stdout))
    ]
    results = [finish(node, timeout=120) for node in nodes]
    for code, _out, err in results:
        assert code == 0, err
        assert "stopped responding" not in err, err
    # one round, no restart: B's agent kept heartbeating while its stdout was stalled
    assert recorded(tmp_path, "start") == ["start_0_0_0", "start_0_1_0"]
    assert "lines of worker output were dropped because stdout was not being read" in results[1][2]
    assert_nothing_left(marker)


@contextlib.contextmanager
def small_tmpfs(path):
    """A 64 KiB tmpfs at `path` (a full disk after a few lines of logs), unmounted at the end."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_log_disk_is_reported_once_and_the_run_exits_non_zero(tmp_path, marker, spam):
    with small_tmpfs(tmp_path / "logs") as logs:
        proc = start_agent(
            "--standalone",
            "--nproc-per-node",
            2,
            "--log-dir",
            logs,
            "--redirects",
            3,
            spam,
            out_dir=tmp_path,
            marker=marker,
            stdout=subprocess.DEVNULL,
            then="exit",
        )
        code, _out, err = finish(proc, timeout=120)
    assert code == LOGS_INCOMPLETE, err
    assert err.count("log files incomplete: ") == 1, err  # once, however many lines were lost
    assert "the workers succeeded, but their log files are incomplete" in err
    assert "No space left on device" in err
    assert_nothing_left(marker)


RUN_AGENT = r"""
import json, sys
from elastix.agent.call import run_agent
from elastix.cli.run_config import config_from_args
from elastix.cli.run_flags import build_parser
report = run_agent(config_from_args(build_parser("test").parse_args(sys.argv[2:])))
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""


def test_the_outcome_carries_dropped_lines_and_write_errors(tmp_path, marker, spam, stalled_stdout):
    report_path = tmp_path / "report.json"
    with small_tmpfs(tmp_path / "logs") as logs:
        args = ["--standalone", "--nproc-per-node", 1, "--log-dir", logs, "--tee", 1, spam]
        env = {**os.environ, "OUT_DIR": str(tmp_path), "ELASTIX_TEST_MARKER": marker, "SPAM_THEN": "exit"}
        proc = subprocess.Popen(
            [sys.executable, "-c", RUN_AGENT, str(report_path), *map(str, args)],
            env=env,
            stdout=stalled_stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
        code, _out, err = finish(proc, timeout=120)
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert report["state"] == "SUCCEEDED" and report["exit_code"] == LOGS_INCOMPLETE
    assert report["dropped_output_lines"] > 0
    assert len(report["output_errors"]) == 1, report["output_errors"]
    assert report["output_errors"][0].endswith("stdout.log: No space left on device (os error 28)")
    assert_nothing_left(marker)


def test_run_results_carry_the_output_fields():
    from elastix.agent.spec import RunResult

    report = {"state": "SUCCEEDED", "exit_code": 3, "dropped_output_lines": 7, "output_errors": ["a.log: full"]}
    result = RunResult.from_report(report)
    assert (result.exit_code, result.dropped_output_lines, result.output_errors) == (3, 7, ["a.log: full"])
    assert RunResult.from_report({"state": "SUCCEEDED"}).output_errors == []


def test_duplicate_filters_copy_teed_lines_with_their_prefix(tmp_path, marker):
    script = tmp_path / "fruit.py"
    script.write_text(
        "import os, sys\n"
        "rank = os.environ['LOCAL_RANK']\n"
        "print(f'apple {rank}'); print('pear'); print(f'or,ange {rank}')\n"
        "print(f'apple on stderr {rank}', file=sys.stderr)\n"
    )
    logs = tmp_path / "logs"
    proc = elastix_run(
        "--standalone", "--nproc-per-node", 2, "--tee", "1", "--log-dir", logs,
        "--duplicate-stdout-filters", "apple,or,,ange", "--duplicate-stderr-filters", "apple",
        script, out_dir=tmp_path, marker=marker,
    )  # fmt: skip
    code, out, err = finish(proc)
    assert code == 0, err
    (attempt,) = logs.glob("*/attempt_0")
    copied = sorted((attempt / "filtered_stdout.log").read_text().splitlines())
    assert copied == ["[default0]:apple 0", "[default0]:or,ange 0", "[default1]:apple 1", "[default1]:or,ange 1"]
    # stderr is not tee'd: nothing to duplicate (torchrun's rule), and the agent said so
    assert (attempt / "filtered_stderr.log").read_text() == ""
    assert "no rank tees stderr" in err
    assert "[default0]:pear" in out


def test_a_temporary_log_directory_goes_after_a_clean_run_and_stays_after_failures(tmp_path, marker, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where the agent makes its temporary log directory
    ok, fail_once = tmp_path / "ok.py", tmp_path / "fail_once.py"
    ok.write_text("print('fine')\n")
    fail_once.write_text("import os, sys\nsys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n")
    code, _out, err = finish(elastix_run("--standalone", ok, out_dir=tmp_path, marker=marker))
    assert code == 0 and list(temp.iterdir()) == [], err
    code, _out, err = finish(
        elastix_run("--standalone", "--max-restarts", 1, fail_once, out_dir=tmp_path, marker=marker)
    )
    [kept] = list(temp.iterdir())
    assert code == 0 and "succeeded after 1 restart(s); the logs of every attempt" in err and str(kept) in err, err
    assert sorted(p.name for p in kept.iterdir()) == ["attempt_0", "attempt_1"]
    assert_nothing_left(marker)

"""One logging pipeline: elastix run logs to stderr at --log-level / ELASTIX_LOG_LEVEL (RUST_LOG
for the core's detail), a waiting node says whom it waits for, an unreachable or unresolvable
endpoint is a warning within seconds, and a library user gets the core's events in Python's
logging."""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import closed_port, run_python

OK = "print('worker ran')\n"


@pytest.fixture
def ok_script(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text(OK)
    return str(path)


def elastix_run(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "elastix", "run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z (ERROR|WARN |INFO |DEBUG|TRACE) \[127\.0\.0\.1\] \S")


def test_every_agent_line_has_one_form_whoever_wrote_it(rdzv_port, ok_script):
    """Python's lines (a configuration warning) and the core's share a timestamp style, the
    level names and the node's name, so that several nodes' logs merge; no Rust Debug output."""
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}"]
    args += ["--local-addr", "127.0.0.1", "--node-rank", "1", "--max-restarts", "1", ok_script]
    done = elastix_run(*args, env={"ELASTIX_LOG_LEVEL": "info"})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines and all(LINE.match(line) for line in lines), done.stderr
    assert any("WARN  [127.0.0.1] --node-rank only applies to --rdzv-backend static" in line for line in lines)
    assert any("rendezvous complete: round 0, 1 node(s); this node is rank 0" in line for line in lines), lines
    for debug_output in ("Some(", "None", "NodeDesc {", "world_size="):
        assert debug_output not in done.stderr, done.stderr


def test_a_waiting_node_says_whom_it_waits_for_where_and_until_when(rdzv_port, ok_script):
    args = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}"]
    args += ["--rdzv-id", "lonely", "--rdzv-conf", "is_host=false,join_timeout=3s", ok_script]
    shown = elastix_run(*args, env={"ELASTIX_LOG_LEVEL": "info", "ELASTIX_RDZV_PROGRESS_INTERVAL": "500ms"})
    assert shown.returncode == 1, shown.stderr
    assert "INFO  [vm] waiting for 1 more node(s): 1 joined (".replace("vm", socket.gethostname()) in shown.stderr, (
        shown.stderr
    )
    assert f"of 2..2 at 127.0.0.1:{rdzv_port}, run ID lonely, deadline in " in shown.stderr, shown.stderr
    assert "timed out after 3s (join_timeout)" in shown.stderr, shown.stderr
    # the level is honoured: at warn, the progress lines are not shown, the failure is
    quiet = elastix_run("--log-level", "warn", *args, env={"ELASTIX_RDZV_PROGRESS_INTERVAL": "500ms"})
    assert quiet.returncode == 1 and "waiting for" not in quiet.stderr, quiet.stderr
    assert "agent failed: rendezvous" in quiet.stderr and " ERROR [" in quiet.stderr, quiet.stderr


def test_an_unreachable_endpoint_is_a_warning_with_its_address(ok_script):
    with closed_port() as sock:
        port = sock.getsockname()[1]
        out = elastix_run(
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", "is_host=false,join_timeout=3s", ok_script,
            env={"RUST_LOG": "debug"},
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"] elastix_core::store::client::connect: cannot connect to the store at 127.0.0.1:{port}" in out.stderr
    assert "Connection refused" in out.stderr
    assert "DEBUG" in out.stderr, "RUST_LOG=debug shows the core's debug events"


def test_an_unresolvable_endpoint_is_a_warning_not_silence(ok_script):
    out = elastix_run(
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "nonexistent.invalid:29400",
        "--rdzv-conf", "join_timeout=3s", ok_script,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert '] cannot resolve the rendezvous endpoint "nonexistent.invalid"' in out.stderr, out.stderr
    assert " WARN  [" in out.stderr, out.stderr


def test_a_bad_level_is_a_usage_error(ok_script):
    out = elastix_run("--log-level", "loud", ok_script)
    assert out.returncode == 2 and "--log-level: invalid log level" in out.stderr, out.stderr
    out = elastix_run(ok_script, env={"ELASTIX_LOG_LEVEL": "loud"})
    assert out.returncode == 2 and "invalid log level" in out.stderr, out.stderr


def test_a_library_user_gets_the_core_events_in_python_logging():
    code = r"""
import logging, sys
from datetime import timedelta
import elastix
from conftest import closed_port

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("elastix").addHandler(Keep())
logging.getLogger("elastix").setLevel(logging.INFO)
elastix.reset_log_cache()
with closed_port() as sock:
    try:
        elastix.TCPStore("127.0.0.1", sock.getsockname()[1], timeout=timedelta(seconds=2))
    except TimeoutError:
        pass
warned = [r for r in records if r.levelno == logging.WARNING and "cannot connect to the store" in r.getMessage()]
print(warned[0].name if warned else "none")
"""
    out = run_python(code, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "elastix.elastix_core.store.client.connect", out.stdout + out.stderr

"""The Slurm cluster of tests/slurm_cluster.py itself: `srun -N 2` starts one task on each
namespace host under its own name, with Slurm's environment; tasks on different hosts reach
each other by host name; `scancel --signal` reaches the processes of a step on every host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from agents import assert_nothing_left, wait_for
from slurm_cluster import slurm_for_tests

# One task per node: prints what Slurm told it; the first node's task listens on PORT, the
# others connect to it by its host name (the first of the job's nodes) and send their own.
PORT = 29555
ENV_AND_TCP = r"""
import json, os, socket, subprocess, sys, time
first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True, timeout=10).stdout.split()[0]
report = {key: os.environ.get(key) for key in
          ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID", "SLURMD_NODENAME", "ELASTIX_TEST_MARKER")}
report.update(host=socket.gethostname(), python=sys.executable, first=first)
deadline = time.monotonic() + 15
if os.environ["SLURM_NODEID"] == "0":
    with socket.create_server(("0.0.0.0", PORT)) as server:
        server.settimeout(15)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(15)
            report["heard"] = connection.makefile().readline().strip()
else:
    while True:
        try:
            with socket.create_connection((first, PORT), timeout=2) as connection:
                connection.sendall((socket.gethostname() + "\n").encode())
            report["sent_to"] = first
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
print(json.dumps(report), flush=True)
""".replace("PORT", str(PORT))

# Writes ready-HOST, then waits for SIGUSR1 and writes usr1-HOST with its pid.
TRAP_USR1 = r"""
import os, signal, socket, sys, time
out, host = sys.argv[1], socket.gethostname()
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
with open(os.path.join(out, f"ready-{host}"), "w") as f:
    f.write(os.environ["SLURM_JOB_ID"])
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
if got:
    with open(os.path.join(out, f"usr1-{host}"), "w") as f:
        f.write(str(os.getpid()))
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from slurm_for_tests(tmp_path_factory.mktemp("slurm"), nodes=2)


def test_srun_runs_a_task_on_each_host(slurm, marker):
    done = slurm.srun("-N", "2", "--ntasks-per-node=1", "hostname", env={"ELASTIX_TEST_MARKER": marker})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == slurm.node_names == ["n1", "n2"]

    done = slurm.srun(
        *("-N", "2", "--ntasks-per-node=1", "python", "-c", ENV_AND_TCP),
        env={"ELASTIX_TEST_MARKER": marker},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reports = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["SLURM_NODEID"])
    assert [r["SLURM_NODEID"] for r in reports] == ["0", "1"]
    assert [r["host"] for r in reports] == [r["SLURMD_NODENAME"] for r in reports] == ["n1", "n2"]
    for report in reports:
        assert report["SLURM_JOB_NODELIST"] == "n[1-2]"
        assert report["SLURM_NNODES"] == "2"
        assert report["first"] == "n1"
        assert report["ELASTIX_TEST_MARKER"] == marker  # the test's environment reaches tasks
        # the same interpreter, whichever of its names (python, python3) started the tests
        assert os.path.realpath(report["python"]) == os.path.realpath(sys.executable)
    assert reports[0]["heard"] == "n2"  # n2 reached n1 by name, across the namespaces
    assert reports[1]["sent_to"] == "n1"
    assert_nothing_left(marker)


def test_scancel_signal_reaches_a_process_on_each_host(slurm, marker, tmp_path):
    with open(tmp_path / "srun.log", "w") as log:
        step = slurm.popen(
            *("-N", "2", "--ntasks-per-node=1", "python", "-c", TRAP_USR1, str(tmp_path)),
            env={"ELASTIX_TEST_MARKER": marker},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        ready = [tmp_path / f"ready-{name}" for name in slurm.node_names]
        wait_for(lambda: all(path.exists() and path.read_text() for path in ready), 20, "both tasks ready")
        job = ready[0].read_text()
        assert ready[1].read_text() == job
        started = time.monotonic()
        cancel = slurm.run("scancel", "--signal=USR1", job, timeout=10)
        assert cancel.returncode == 0, cancel.stderr
        usr1 = [tmp_path / f"usr1-{name}" for name in slurm.node_names]
        wait_for(lambda: all(path.exists() and path.read_text() for path in usr1), 10, "SIGUSR1 on both hosts")
        assert time.monotonic() - started < 5
        assert step.wait(timeout=15) == 0, (tmp_path / "srun.log").read_text()
    finally:
        if step.poll() is None:
            slurm.cancel_all()
            step.kill()
            step.wait()
    assert_nothing_left(marker)

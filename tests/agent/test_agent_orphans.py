"""Nothing a worker starts outlives the agent: not when the agent is SIGKILLed, not when the
workers exit cleanly and leave something behind. Real agents, real processes; every process a
test starts carries a marker in its environment, and only those are killed at the end."""

import glob
import os
import signal
import subprocess
import sys

import pytest

from agents import wait_for
from conftest import alive, marked_processes

# Each worker starts the descendants named in DESCENDANTS and records their pids as
# <kind>_<local rank>.pid in OUT_DIR (written whole, then renamed), then runs or exits.
WORKER = r"""
import os, subprocess, sys, time

out, rank = os.environ["OUT_DIR"], os.environ["LOCAL_RANK"]

def record(kind, pid):
    path = os.path.join(out, f"{kind}_{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.rename(path + ".tmp", path)

# a program that records its own pid, after it moved to a session of its own
SETSID = "import os, sys, time; os.setsid(); {record}; time.sleep(300)"
# a classic daemon: fork, setsid, fork again; its parent exits, so init inherits it
DAEMON = "import os, sys, time\nif os.fork(): os._exit(0)\nos.setsid()\nif os.fork(): os._exit(0)\n{record}\ntime.sleep(300)"
RECORD = "p = sys.argv[1]; open(p + '.tmp', 'w').write(str(os.getpid())); os.rename(p + '.tmp', p)"

record("worker", os.getpid())
for kind in os.environ["DESCENDANTS"].split(","):
    if kind == "group":  # stays in the worker's process group, like DataLoader workers
        record(kind, subprocess.Popen(["sleep", "300"]).pid)
    elif kind == "own_group":
        record(kind, subprocess.Popen(["sleep", "300"], preexec_fn=lambda: os.setpgid(0, 0)).pid)
    elif kind in ("setsid", "daemon"):
        code = (SETSID if kind == "setsid" else DAEMON).format(record=RECORD)
        child = subprocess.Popen([sys.executable, "-c", code, os.path.join(out, f"{kind}_{rank}.pid")])
        if kind == "daemon":
            child.wait()
if os.environ.get("EXIT_AFTER_START"):
    # wait until every descendant has said where it is, then succeed
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(out) if n.endswith(f"_{rank}.pid")]) < 1 + len(os.environ["DESCENDANTS"].split(",")):
        if time.monotonic() > deadline:
            sys.exit("the descendants never said where they are")
        time.sleep(0.01)
    sys.exit(0)
time.sleep(300)
"""

NPROC = 2


def cgroup_parent():
    """Where the agent, started by this process, makes its job cgroup; None if it cannot
    (the same checks as the agent's)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line[3:].strip() for line in f if line.startswith("0::"))
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split(" - ") for line in f]
        point = next(
            fields.split()[4] for fields, fs in mounts if fs.split()[0] == "cgroup2" and fields.split()[3] == "/"
        )
        parent = os.path.join(point, own.lstrip("/"))
        if not os.access(os.path.join(parent, "cgroup.procs"), os.W_OK):
            return None
        probe = os.path.join(parent, f"elastix-probe-{os.getpid()}")
        os.mkdir(probe)
        try:
            return parent if os.path.exists(os.path.join(probe, "cgroup.kill")) else None
        finally:
            os.rmdir(probe)
    except (OSError, StopIteration):
        return None


CGROUP_PARENT = cgroup_parent()
needs_cgroup = pytest.mark.skipif(CGROUP_PARENT is None, reason="no writable cgroup v2 with cgroup.kill here")


def recorded(out_dir):
    pids = {}
    for path in glob.glob(os.path.join(out_dir, "*.pid")):
        with open(path) as f:
            pids[os.path.basename(path)[: -len(".pid")]] = int(f.read())
    return pids


@pytest.fixture
def agent(tmp_path, marker):
    """Starts `elastix run --standalone --nproc-per-node 2 worker.py` with the given
    descendants; every process with the test's marker is killed at the end (the marker
    fixture)."""
    procs = []

    def start(descendants, exit_after_start=False):
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        out_dir = tmp_path / "out"
        out_dir.mkdir()
        env = {
            **os.environ,
            "OUT_DIR": str(out_dir),
            "ELASTIX_TEST_MARKER": marker,
            "DESCENDANTS": ",".join(descendants),
        }
        if exit_after_start:
            env["EXIT_AFTER_START"] = "1"
        # output to files, not pipes: a test never waits on a descendant holding a pipe open
        with open(tmp_path / "agent.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", str(NPROC), str(script)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        return proc, out_dir, marker

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def log_of(tmp_path):
    return (tmp_path / "agent.log").read_text()


def assert_all_gone(pids, marker, tmp_path, within=10.0):
    try:
        wait_for(
            lambda: not any(alive(pid) for pid in pids.values()) and not marked_processes(marker), within, "cleanup"
        )
    except AssertionError:
        left = {kind: pid for kind, pid in pids.items() if alive(pid)}
        raise AssertionError(f"left behind: {left}, marked: {marked_processes(marker)}\n{log_of(tmp_path)}") from None


def assert_no_cgroup_left(agent_pid):
    if CGROUP_PARENT is not None:
        job = os.path.join(CGROUP_PARENT, f"elastix-{agent_pid}")
        wait_for(lambda: not os.path.exists(job), 10, f"the removal of {job}")


def sigkill_agent_and_check(agent, tmp_path, descendants):
    proc, out_dir, marker = agent(descendants)
    expected = NPROC * (1 + len(descendants))
    try:
        wait_for(lambda: len(recorded(out_dir)) == expected or proc.poll() is not None, 60, "the workers' pid files")
    except AssertionError:
        raise AssertionError(f"recorded: {recorded(out_dir)}\n{log_of(tmp_path)}") from None
    assert proc.poll() is None, log_of(tmp_path)
    pids = recorded(out_dir)
    assert all(alive(pid) for pid in pids.values())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert_all_gone(pids, marker, tmp_path)
    assert_no_cgroup_left(proc.pid)


def test_sigkill_of_the_agent_kills_what_stayed_in_the_workers_process_groups(agent, tmp_path):
    # the cleanup watchdog alone covers these, with or without a cgroup
    sigkill_agent_and_check(agent, tmp_path, ["group"])


@needs_cgroup
def test_sigkill_of_the_agent_kills_what_left_the_workers_process_groups(agent, tmp_path):
    sigkill_agent_and_check(agent, tmp_path, ["group", "own_group", "setsid", "daemon"])


@needs_cgroup
def test_a_clean_exit_leaves_no_setsid_grandchild_behind(agent, tmp_path):
    descendants = ["setsid", "daemon"]
    proc, out_dir, marker = agent(descendants, exit_after_start=True)
    assert proc.wait(timeout=90) == 0, log_of(tmp_path)
    pids = recorded(out_dir)
    assert len(pids) == NPROC * (1 + len(descendants)), pids
    assert_all_gone(pids, marker, tmp_path)
    assert_no_cgroup_left(proc.pid)

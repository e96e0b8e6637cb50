"""Nothing a worker starts outlives the agent: not when the agent is SIGKILLed, not when the
workers exit cleanly and leave something behind. Real agents, real processes; every process a
test starts carries a marker in its environment, and only those are killed at the end."""

import fcntl
import glob
import os
import signal
import subprocess
import sys
import time

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

    def start(descendants, exit_after_start=False, before=""):
        """`before`: Python code run first in the agent's process (whose pid the agent keeps:
        it execs the launcher)."""
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
        launch = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", str(NPROC), str(script)]
        if before:
            launch = [sys.executable, "-c", f"import os, sys\n{before}\nos.execv(sys.executable, {launch!r})"]
        with open(tmp_path / "agent.log", "w") as log:
            proc = subprocess.Popen(
                launch,
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


def job_cgroups(agent_pid):
    """The job cgroups named for `agent_pid`: `elastix-<pid>` and `elastix-<pid>-<n>`."""
    names = os.listdir(CGROUP_PARENT)
    return {name for name in names if name == f"elastix-{agent_pid}" or name.startswith(f"elastix-{agent_pid}-")}


def assert_no_cgroup_left(agent_pid, kept=()):
    if CGROUP_PARENT is not None:
        wait_for(lambda: job_cgroups(agent_pid) == set(kept), 10, f"the removal of the job cgroup of {agent_pid}")


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


def make_cgroup(name, leaf=True, age=0.0):
    """A job cgroup as an agent leaves it: a directory with leaf 0, `age` seconds old."""
    path = os.path.join(CGROUP_PARENT, name)
    os.mkdir(path)
    if leaf:
        os.mkdir(os.path.join(path, "0"))
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def remove_cgroup(path):
    for leaf in glob.glob(os.path.join(path, "*/")):
        os.rmdir(leaf)
    os.rmdir(path)


@needs_cgroup
def test_a_taken_job_cgroup_name_is_not_reused_and_what_dead_agents_left_is_swept(agent, tmp_path, marker):
    """The cgroup file system outlives containers and is shared by them: the agent neither
    takes nor removes a job cgroup a live agent elsewhere may own (its name taken; one locked;
    a fresh one; one with a process in it), and removes one that an agent killed with its
    watchdog left (old, unlocked, empty)."""
    tag = f"test-{os.getpid()}"
    stale = make_cgroup(f"elastix-{tag}-stale", age=600)
    locked = make_cgroup(f"elastix-{tag}-locked", age=600)
    fresh = make_cgroup(f"elastix-{tag}-fresh")
    busy = make_cgroup(f"elastix-{tag}-busy", leaf=False)
    sleeper = subprocess.Popen(["sleep", "300"])  # this test's own: it kills it
    lock = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(os.path.join(busy, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        os.utime(busy, (time.time() - 600, time.time() - 600))
        # the agent's own name, taken (with a leaf in it, so that it cannot just be removed)
        take_own_name = f"os.mkdir({CGROUP_PARENT!r} + f'/elastix-{{os.getpid()}}')\n" + (
            f"os.mkdir({CGROUP_PARENT!r} + f'/elastix-{{os.getpid()}}/0')"
        )
        proc, out_dir, _ = agent(["setsid"], exit_after_start=True, before=take_own_name)
        taken = os.path.join(CGROUP_PARENT, f"elastix-{proc.pid}")
        try:
            assert proc.wait(timeout=90) == 0, log_of(tmp_path)
            log = log_of(tmp_path)
            assert f"elastix-{tag}-stale" in log and "removed 1 job cgroup(s)" in log, log
            assert not os.path.exists(stale)
            assert all(os.path.isdir(path) for path in (locked, fresh, busy, taken))
            # it ran in a cgroup of its own, next to the taken one: its setsid grandchildren died with it
            assert "no cgroup for this job" not in log, log
            assert_all_gone(recorded(out_dir), marker, tmp_path)
            assert_no_cgroup_left(proc.pid, kept={f"elastix-{proc.pid}"})
        finally:
            remove_cgroup(taken)
    finally:
        os.close(lock)
        sleeper.kill()
        sleeper.wait()
        for path in (stale, locked, fresh, busy):
            if os.path.exists(path):
                wait_for(lambda p=path: not open(os.path.join(p, "cgroup.procs")).read(), 10, "the sleeper's exit")
                remove_cgroup(path)

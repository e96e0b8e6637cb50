"""Naming the slow rank (rust/core/src/agent/stragglers): three namespace hosts, one rank each,
training with steps of CPU work and an all_reduce (tests/worker_programs/paced_loop.py). A host
with half the CPU of the others is named from its ranks' pace, within 20 steps; a healthy job,
and a job whose every host is limited alike, name no one; under --exclude-stragglers the named
node leaves at the next re-form.

Every host of the named test has a CPU quota, the slow one half the others': three hosts on a
machine of two cores must not share what is left, or whatever else the machine runs decides
how fast each host is (a host limited to half a core is no slower than the others when each
gets less than half)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import pytest

import elastix
from agents import WORKERS, agent, finish_all, node_args, wait_for

PROGRAM = os.path.join(WORKERS, "paced_loop.py")
RDZV = "join_timeout=60s,is_host=false,last_call_timeout=1s"
STEP_CPU = 0.15  # seconds of CPU work per step on an unlimited core
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NAMED = re.compile(r"^(\S+Z) WARN .*rank (\d+) on (\S+) is a straggler")


def products_for(seconds: float) -> int:
    """How many of the worker's matrix products take `seconds` of this machine's CPU: timed as
    the worker runs them (one BLAS thread) and on the CPU's clock, so whatever else the machine
    runs meanwhile (another test's teardown) does not shorten the steps, which would fit more of
    them in the windows the judging takes."""
    timing = (
        "import time, numpy as np\n"
        "a = np.random.default_rng(0).random((256, 256))\n"
        "each = []\n"
        "for _ in range(5):\n"
        "    began = time.process_time()\n"
        "    for _ in range(10):\n"
        "        a @ a\n"
        "    each.append((time.process_time() - began) / 10)\n"
        "print(min(each))\n"
    )
    done = subprocess.run([sys.executable, "-c", timing], env={**os.environ, **ONE_THREAD}, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return max(1, round(seconds / float(done.stdout)))


class CpuLimit:
    """A cgroup that holds what runs in it to `share` of one CPU: cgroup v2's cpu.max where the
    cpu controller is there, else v1's CFS quota. Removed (emptied first) on close."""

    def __init__(self, share: float) -> None:
        name = f"elastix-test-{secrets.token_hex(4)}"
        unified = Path("/sys/fs/cgroup")
        if (
            "cpu" in (unified / "cgroup.controllers").read_text().split()
            if (unified / "cgroup.controllers").exists()
            else False
        ):
            (unified / "cgroup.subtree_control").write_text("+cpu")
            self.dir = unified / name
            self.dir.mkdir()
            (self.dir / "cpu.max").write_text(f"{int(share * 100000)} 100000")
        elif (Path("/sys/fs/cgroup/cpu") / "cpu.cfs_quota_us").exists():
            self.dir = Path("/sys/fs/cgroup/cpu") / name
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text("100000")
            (self.dir / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
        else:
            pytest.skip("no cgroup cpu controller to limit a host's CPU with")

    def wrap(self, argv: list) -> list:
        """argv, started inside the cgroup (all it starts stays in it)."""
        join = f'echo $$ > {self.dir / "cgroup.procs"} && exec "$@"'
        return ["sh", "-c", join, "sh", *argv]

    def close(self) -> None:
        for _ in range(100):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its processes are still exiting


def start_job(tmp_path, marker, hosts, stack, shares=None, nnodes=3, max_restarts=0, more=()):
    """Three agents, one per host; host i's processes held to shares[i] of a CPU where given."""
    shares = shares or {}
    store = elastix.TCPStore(hosts.gateway, 0, is_master=True, wait_for_workers=False)
    endpoint = f"{hosts.gateway}:{store.port}"
    products = products_for(STEP_CPU)
    agents = []
    for i in range(3):
        env = [f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", f"PRODUCTS={products}"]
        env += [f"{name}={value}" for name, value in ONE_THREAD.items()]
        command = hosts.command(i, "env", *env, sys.executable)
        if i in shares:  # joined before entering the host: `ip netns exec` mounts a sysfs of its own
            limit = CpuLimit(shares[i])
            stack.callback(limit.close)
            command = limit.wrap(command)
        events = tmp_path / f"h{i}-events.jsonl"
        args = node_args(nnodes, endpoint, hosts.addr(i), RDZV, PROGRAM, run_id="pace", max_restarts=max_restarts)
        agents.append(agent(tmp_path, marker, f"h{i}", "run", *more, "--event-log", events, *args, python=command))
    stack.callback(lambda: [a.kill() for a in agents])
    return agents, endpoint, store


def steps_of(tmp_path, rank):
    path = tmp_path / f"steps_{rank}.txt"
    if not path.exists():
        return []
    return [float(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]


def named(agents):
    """(when, rank, node) of every straggler named in the agents' logs."""
    found = []
    for a in agents:
        for line in a.output().splitlines():
            hit = NAMED.match(line)
            if hit:
                at = datetime.fromisoformat(hit.group(1).replace("Z", "+00:00")).timestamp()
                found.append((at, int(hit.group(2)), hit.group(3)))
    return found


def test_a_host_with_half_the_cpu_of_the_others_is_named_within_20_steps(tmp_path, marker, hosts):
    with ExitStack() as stack:
        agents, endpoint, _store = start_job(tmp_path, marker, hosts, stack, shares={0: 0.4, 1: 0.2, 2: 0.4})
        [(at, rank, node)] = wait_for(lambda: named(agents), timeout=120, what="a straggler named")
        # the limited host's rank, named within 20 steps of training
        assert node == hosts.addr(1), (rank, node)
        first = min(steps_of(tmp_path, 0))
        steps = sum(1 for t in steps_of(tmp_path, 0) if first <= t <= at)
        assert steps <= 20, f"named after {steps} steps"
        # elastix status shows it, among the job's problems and in its ranks' table
        shown = wait_for(lambda: status(endpoint, "STRAGGLER"), timeout=30, what="elastix status showing it")
        assert f"rank {rank} on node" in shown and "is a straggler" in shown, shown
        finish_all(tmp_path, agents, marker)
    logs = [json.loads(line) for i in range(3) for line in open(tmp_path / f"h{i}-events.jsonl")]
    event = next(e for e in logs if e["event"] == "straggler")
    assert event["rank"] == rank and event["score"] < 0.75 and event["waited_in"] == "all_reduce", event


def test_exclude_stragglers_makes_the_named_node_leave_at_the_next_re_form(tmp_path, marker, hosts):
    with ExitStack() as stack:
        shares = {0: 0.4, 1: 0.2, 2: 0.4}
        agents, endpoint, _store = start_job(tmp_path, marker, hosts, stack, shares=shares, nnodes="2:3",
                                             max_restarts=1, more=["--exclude-stragglers"])  # fmt: skip
        [(_at, rank, node)] = wait_for(lambda: named(agents), timeout=120, what="a straggler named")
        assert node == hosts.addr(1)
        # its own agent knows (it shows it in elastix status): the judge's word reaches the
        # others within a window
        wait_for(lambda: status(endpoint, "STRAGGLER"), timeout=30, what="the straggler's agent showing it")
        # a failure elsewhere re-forms the job: the straggler's node leaves, the others go on
        [started] = events_of(tmp_path, 0, "workers_started")
        os.kill(started["pids"][0], signal.SIGKILL)
        assert agents[1].finish() == 1, agents[1].output()
        assert f"this node leaves the job: --exclude-stragglers: rank {rank} is a straggler" in agents[1].output()
        wait_for(lambda: [e for e in events_of(tmp_path, 0, "round_formed") if e["group_world_size"] == 2],
                 timeout=60, what="the two other nodes re-formed")  # fmt: skip
        finish_all(tmp_path, [agents[0], agents[2]], marker)
    [left] = events_of(tmp_path, 1, "left_out")
    assert "--exclude-stragglers" in left["why"]


def events_of(tmp_path, i, name):
    path = tmp_path / f"h{i}-events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name]


@pytest.mark.parametrize("shares", [{}, {0: 0.2, 1: 0.2, 2: 0.2}], ids=["healthy", "every-host-limited-alike"])
def test_a_healthy_job_and_a_job_wide_slowdown_name_no_one(tmp_path, marker, hosts, shares):
    with ExitStack() as stack:
        agents, endpoint, _store = start_job(tmp_path, marker, hosts, stack, shares=shares)
        wait_for(lambda: len(steps_of(tmp_path, 0)) >= 1, timeout=90, what="training")
        began = time.monotonic()
        # 6 windows of judging (a rank is named after 2): none is named
        while time.monotonic() - began < 12:
            assert named(agents) == [], [a.output() for a in agents]
            time.sleep(0.5)
        # every rank is scored (steps of over half a second are judged over several windows)
        shown = wait_for(lambda: scored(endpoint), timeout=30, what="every rank's score in elastix status")
        assert "STRAGGLER" not in shown and named(agents) == [], shown
        finish_all(tmp_path, agents, marker)
    assert len(steps_of(tmp_path, 0)) >= 6


def scored(endpoint):
    """elastix status once every rank shows a pace score."""
    shown = status(endpoint, "PACE") or ""
    rows = shown.split("  workers:\n")[-1].splitlines()[1:]
    return shown if len(rows) == 3 and all(re.search(r"\s(0\.\d\d|1\.00)\s", row) for row in rows) else None


def status(endpoint, needle):
    shown = subprocess.run(
        [sys.executable, "-m", "elastix", "status", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
         "--rdzv-id", "pace"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return shown.stdout if needle in shown.stdout else None

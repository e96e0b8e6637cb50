"""Helpers for tests that run several `elastix run` agents as nodes and follow their workers
through the records that tests/worker_programs/elastic_loop.py leaves (one per start)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

from conftest import REPO, marked_processes

WORKERS = os.path.join(REPO, "tests", "worker_programs")


def node_args(nnodes, endpoint, addr, conf, program, *program_args, run_id, backend="c10d", max_restarts=None):
    """`elastix run`'s flags (after `run`) for one node of a multi-node job."""
    restarts = [] if max_restarts is None else ["--max-restarts", max_restarts]
    return [
        *("--nnodes", nnodes, "--nproc-per-node", 1, "--rdzv-backend", backend),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--local-addr", addr),
        *restarts,
        *("--rdzv-conf", conf, program, *program_args),
    ]


def assert_nothing_left(marker, within=5.0):
    deadline = time.monotonic() + within
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_processes(marker) == [], "processes were left behind"


def starts(out_dir):
    records = []
    for path in glob.glob(os.path.join(out_dir, "start_*.json")):
        with open(path) as f:
            records.append(json.load(f))
    return records


def wait_for(predicate, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Agent:
    """One `elastix run`, its output in a file (a pipe nobody reads could stall it)."""

    def __init__(self, argv, out_dir, marker, name):
        self.log = out_dir / f"{name}.log"
        env = {**os.environ, "OUT_DIR": str(out_dir), "ELASTIX_TEST_MARKER": marker}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def output(self):
        return self.log.read_text()

    def kill(self):
        """Kills it if it still runs (a test's cleanup after a failure)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def finish(self, timeout=90):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the agent did not finish in {timeout}s:\n{self.output()}") from None


def agent(tmp_path, marker, name, *args, python=(sys.executable,)):
    argv = [*python, "-m", "elastix", *map(str, args)]
    return Agent(argv, tmp_path, marker, name)


def started(out_dir, world_size, after=-1):
    """The first round after `after` in which `world_size` ranks all reported their start
    (start_*.json), and their records; None before."""
    by_round = {}
    for record in starts(out_dir):
        if record["world_size"] == world_size and record["round"] > after:
            by_round.setdefault(record["round"], []).append(record)
    whole = sorted(r for r, found in by_round.items() if len(found) == world_size)
    return (whole[0], by_round[whole[0]]) if whole else None


def rounds_of(out_dir, world_size):
    """Rounds in which every one of `world_size` nodes started its worker."""
    by_round = {}
    for record in starts(out_dir):
        if record["world_size"] == world_size:
            by_round.setdefault(record["round"], []).append(record)
    return sorted(r for r, records in by_round.items() if len(records) == world_size)


def wait_round(out_dir, world_size, after=-1, what=None):
    found = wait_for(
        lambda: [r for r in rounds_of(out_dir, world_size) if r > after][:1],
        timeout=60,
        what=what or f"a round of {world_size} nodes after round {after}",
    )
    return found[0]


def finish_all(tmp_path, agents, marker):
    (tmp_path / "stop").touch()
    for a in agents:
        code = a.finish()
        assert code == 0, a.output()
    assert_nothing_left(marker)


# Short last calls so that membership changes happen within a test's time; a live node is
# lost only after 2 s without a heartbeat, which a loaded machine does not reach. The agents
# use the test's own rendezvous store (is_host=false), as torchrun users do with a standalone
# store: it listens before any agent starts, on a port the kernel picked.
FAST_RDZV = "keep_alive_interval=250ms,keep_alive_max_attempt=8,last_call_timeout=500ms,join_timeout=60s,is_host=false"


def elastix_run(*args, out_dir, marker, **popen):
    env = {**os.environ, "OUT_DIR": str(out_dir), "ELASTIX_TEST_MARKER": marker}
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, "-m", "elastix", "run", *map(str, args)], env=env, text=True, **popen)


def finish_each(procs, timeout=90):
    """finish() of several `elastix run`s that depend on each other, within one deadline; if
    one does not finish, every one is killed and the error shows all their outputs."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            shown = []
            for i, other in enumerate(procs):
                other.kill()
                out, err = other.communicate()
                shown.append(f"--- elastix run #{i} (exit {other.returncode})\nstdout:\n{out}\nstderr:\n{err}")
            raise AssertionError(f"elastix run did not finish in {timeout}s\n" + "\n".join(shown)) from None
    return results


def finish(proc, timeout=90):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"elastix run did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}") from None
    return proc.returncode, out, err

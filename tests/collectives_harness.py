"""Runs a function in N worker processes with the environment ``elastix run`` gives workers.

The test process hosts the store (an elastix TCPStore master on a free port) and starts one
Python process per rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True, so ``init_process_group()``
with no arguments connects to that store. Each worker imports the module that defines the
function (by file path) and calls it with the keyword arguments given; the function's return
value (JSON) comes back in ``Result.value``. Every worker runs in its own process group, is
bounded by ``timeout`` and is killed (the whole group) at the end, whatever happens.

``hosts=[...]`` gives ranks a fake host identity (ELASTIX_COLLECTIVES_HOST_ID), so ranks of one
machine talk TCP as if they were on different hosts.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import elastix

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

_RUNNER = r"""
import importlib.util, json, os, sys
path, name, kwargs, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
sys.path.insert(0, os.path.dirname(path))  # its neighbours, as pytest imports them
spec = importlib.util.spec_from_file_location("_collectives_worker_module", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
value = getattr(module, name)(**kwargs)
with open(out + ".tmp", "w") as f:
    json.dump(value, f)
os.replace(out + ".tmp", out)
"""


@dataclass
class Result:
    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    value: Any = None
    killed: bool = False

    def describe(self) -> str:
        return (
            f"--- rank {self.rank}: exit {self.returncode}{' (killed: timeout)' if self.killed else ''}\n"
            f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"
        )


@dataclass
class Workers:
    """Started workers; ``wait()`` collects them (killing any still running at the deadline)."""

    procs: List[subprocess.Popen]
    outs: List[str]
    logs: List[tuple]
    deadline: float
    store: Any
    tmp: tempfile.TemporaryDirectory
    results: List[Result] = field(default_factory=list)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[rank]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self) -> List[Result]:
        killed = [False] * len(self.procs)
        for i, proc in enumerate(self.procs):
            left = self.deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.01, left))
            except subprocess.TimeoutExpired:
                killed[i] = True
        self.stop()
        results = []
        for i, proc in enumerate(self.procs):
            out_f, err_f = self.logs[i]
            out_f.seek(0)
            err_f.seek(0)
            value = None
            if os.path.exists(self.outs[i]):
                with open(self.outs[i]) as f:
                    value = json.load(f)
            results.append(Result(i, proc.returncode, out_f.read(), err_f.read(), value, killed[i]))
            out_f.close()
            err_f.close()
        self.tmp.cleanup()
        self.results = results
        return results

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            # the process group too (a worker's children)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def make_store(timeout: float = 30.0):
    return elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=timeout))


def worker_env(
    rank: int,
    world_size: int,
    port: int,
    *,
    local_rank: Optional[int] = None,
    local_world_size: Optional[int] = None,
    group_rank: int = 0,
    host: Optional[str] = None,
    restart: int = 0,
    extra: Optional[Dict[str, str]] = None,
) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "GROUP_RANK": str(group_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([TESTS, os.path.join(REPO, "python"), env.get("PYTHONPATH", "")]),
        }
    )
    if host is not None:
        env["ELASTIX_COLLECTIVES_HOST_ID"] = host
    if extra:
        env.update(extra)
    return env


def start(
    fn: Optional[Callable],
    world_size: int,
    *,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 60.0,
    hosts: Optional[Sequence[str]] = None,
    env: Optional[Dict[str, str]] = None,
    argv: Optional[Sequence[str]] = None,
    store=None,
    restart: int = 0,
) -> Workers:
    """Starts ``fn(**kwargs)`` (or ``python argv...`` when ``argv`` is given) on every rank."""
    store = store if store is not None else make_store()
    tmp = tempfile.TemporaryDirectory(prefix="elastix-cc-test-")
    procs, outs, logs = [], [], []
    try:
        for rank in range(world_size):
            host = hosts[rank] if hosts else None
            if hosts:
                local = [r for r in range(world_size) if hosts[r] == host]
                lr, lws, gr = local.index(rank), len(local), sorted(set(hosts), key=list(hosts).index).index(host)
            else:
                lr, lws, gr = rank, world_size, 0
            e = worker_env(
                rank,
                world_size,
                store.port,
                local_rank=lr,
                local_world_size=lws,
                group_rank=gr,
                host=host,
                restart=restart,
                extra=env,
            )
            out = os.path.join(tmp.name, f"rank{rank}.json")
            if argv is not None:
                cmd = [sys.executable, *argv]
            else:
                cmd = [sys.executable, "-c", _RUNNER, inspect.getfile(fn), fn.__name__, json.dumps(kwargs or {}), out]
            out_f = tempfile.TemporaryFile(mode="w+")
            err_f = tempfile.TemporaryFile(mode="w+")
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=e,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    start_new_session=True,
                    cwd=REPO,
                    text=True,
                )
            )
            outs.append(out)
            logs.append((out_f, err_f))
    except BaseException:
        Workers(procs, outs, logs, 0, store, tmp).wait()
        raise
    return Workers(procs, outs, logs, time.monotonic() + timeout, store, tmp)


def run(fn: Callable, world_size: int, *, check: bool = True, **options) -> List[Result]:
    """Runs ``fn`` on ``world_size`` ranks and returns their results; with ``check``, fails
    (showing every rank's output) unless all exited 0."""
    results = start(fn, world_size, **options).wait()
    if check and any(r.returncode != 0 for r in results):
        raise AssertionError("worker(s) failed:\n" + "\n".join(r.describe() for r in results))
    return [r.value for r in results] if check else results


def init(**kwargs):
    """In a worker: init_process_group from the environment, with a short timeout."""
    import elastix.collectives as ec

    kwargs.setdefault("timeout", timedelta(seconds=float(os.environ.get("ELASTIX_TEST_CC_TIMEOUT", "20"))))
    ec.init_process_group(**kwargs)
    return ec


__all__ = ["run", "start", "init", "make_store", "worker_env", "Result", "Workers"]

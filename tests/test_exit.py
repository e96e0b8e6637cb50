"""A program that finished its work exits 0, never by a signal.

Threads that Python did not start (the store server's and RPC's tokio workers, the thread that
drops Python objects) reach Python through the logging bridge or to drop objects; one that did
so after the interpreter was finalised crashed the process (SIGSEGV in PyGILState_Ensure), so
a supervisor saw a finished job as crashed. Each test repeats a launch many times, since the
crash is a race with the process's exit: before the exit gate, the plain launch crashed in
about 1 in 20 rank-0 processes here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

import pytest

from conftest import reserved_port

LAUNCHES = 50  # 100 ranks each: a 1-in-20 crash is missed with odds of 0.6%
LAUNCH_TIMEOUT = 60.0

# Two ranks launched the plain way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as srun,
# mpirun or a user's own launcher do): rank 0 hosts the store; distinct host identities make
# the ranks talk TCP.
COLLECTIVES_WORKER = r"""
import numpy as np
import elastix.collectives as ec
ec.init_process_group()
x = np.ones(1000, np.float32)
for _ in range(5):
    ec.all_reduce(x)
assert float(x[0]) == 32.0, x[0]
"""

# The same under `elastix run`: the host identity is set from LOCAL_RANK before the import.
AGENT_WORKER = (
    r"""
import os
os.environ["ELASTIX_COLLECTIVES_HOST_ID"] = "host" + os.environ["LOCAL_RANK"]
"""
    + COLLECTIVES_WORKER
)

# RPC: a few calls each way; every other launch leaves without shutdown() (the atexit path).
RPC_WORKER = r"""
import os
import elastix, elastix.rpc as rpc
rank = int(os.environ["RANK"])
rpc.init_rpc(f"w{rank}")
for i in range(5):
    assert rpc.rpc_sync(f"w{1 - rank}", max, args=(i, 2)) == max(i, 2)
if os.environ["SHUTDOWN"] == "1":
    rpc.shutdown()
else:  # no call may reach a peer that already left: meet in the store first
    store = elastix.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if store.add("done", 1) == 2:
        store.set("all done", "1")
    store.wait(["all done"])
    if rank == 1:  # the store lives in rank 0: it leaves last
        store.set("left", "1")
    else:
        store.wait(["left"])
"""

# rank 0 hosts a store and has nothing left to do; rank 1 still has requests to make
STORE_HOST_LEAVES_FIRST = r"""
import os, time
import elastix
import atexit
rank = int(os.environ["RANK"])
store = elastix.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=2, is_master=rank == 0)
if rank == 0:
    store.set("result", "42")
    # runs at exit, before elastix's own hook (registered at import; atexit runs in reverse)
    atexit.register(lambda: store.set("exiting", "1"))
else:
    store.wait(["exiting"])  # rank 0 is exiting: only its exit's wait keeps the store up
    assert store.get("result") == b"42"
    store.set("read", "1")
"""


def _wait_all(procs: List[subprocess.Popen], what: str) -> List[str]:
    """Waits for `procs` (killing their groups at the deadline); the problems seen."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    problems = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            problems.append(f"{what} rank {rank}: still running after {LAUNCH_TIMEOUT:.0f} s\n{out[-2000:]}")
            continue
        if proc.returncode != 0:
            how = (
                f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
            )
            problems.append(f"{what} rank {rank}: {how}\n{out[-2000:]}")
    return problems


def _run_plain(code: str, extra: Dict[int, Dict[str, str]], what: str) -> List[str]:
    """Runs `code` as ranks 0 and 1 of a plain launch; the problems seen."""
    with reserved_port() as port:  # held until the launch ends
        procs = []
        for rank in (0, 1):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **extra.get(rank, {}),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        return _wait_all(procs, what)


def _assert_clean(problems: List[str]) -> None:
    assert not problems, f"{len(problems)} process(es) did not exit 0:\n" + "\n".join(problems[:5])


def test_plain_launch_with_tcp_collectives_never_ends_by_a_signal():
    problems = []
    for i in range(LAUNCHES):
        hosts = {rank: {"ELASTIX_COLLECTIVES_HOST_ID": f"host{rank}"} for rank in (0, 1)}
        problems += _run_plain(COLLECTIVES_WORKER, hosts, f"launch {i}")
    _assert_clean(problems)


def test_rpc_workers_never_end_by_a_signal_with_or_without_shutdown():
    problems = []
    for i in range(LAUNCHES):
        shutdown = {"SHUTDOWN": str(i % 2)}
        problems += _run_plain(RPC_WORKER, {0: shutdown, 1: shutdown}, f"launch {i}")
    _assert_clean(problems)


def test_a_process_serving_a_store_lets_the_others_finish_before_it_exits():
    for i in range(5):
        _assert_clean(_run_plain(STORE_HOST_LEAVES_FIRST, {}, f"launch {i}"))


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "cold"])
def test_elastix_run_workers_never_end_by_a_signal(tmp_path, standby):
    script = tmp_path / "worker.py"
    script.write_text(AGENT_WORKER)
    flags = [] if standby else ["--no-standby-workers"]
    problems = []
    for i in range(LAUNCHES // 2):
        argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "2", *flags, str(script)]
        agent = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        problems += _wait_all([agent], f"elastix run {i}")
    _assert_clean(problems)

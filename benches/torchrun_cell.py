"""torchrun in the fault matrix (tests/faults/matrix.py): the same hosts, faults, phases and
invariants, with torch's launcher and benches/workers/torch_train_loop.py as the workers.

torchrun has no site list, and its etcd rendezvous speaks etcd's v2 API, so its cells are
`c10d` (the store served by host 0's agent) and `store` (a standalone torch TCPStore on host 0).
Its keep-alive takes whole seconds: keep_alive_interval=1 x 2 gives the matrix's 2 s window.
What elastix writes as events, torchrun only logs: the cell reads its INFO log instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "faults"), os.path.join(HERE, "..", "tests")]
import matrix  # noqa: E402
from agents import Agent, wait_for  # noqa: E402

BACKENDS = ("c10d", "store")
CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=30"
WORKER = os.path.join(HERE, "workers", "torch_train_loop.py")
# a standalone torch store, as `elastix store` is one for elastix's `store` cells
STORE = (
    "import sys, time, torch.distributed as dist\n"
    "store = dist.TCPStore(sys.argv[1], 29400, is_master=True, wait_for_workers=False)\n"
    "print('listening', flush=True)\n"
    "time.sleep(3600)\n"
)


# torchrun itself, with its rendezvous's progress (logged at DEBUG) shown: the rendezvous phase
# is reached when two nodes have added themselves to the round
TORCHRUN = (
    "import logging, runpy, sys\n"
    "logging.basicConfig(format='%(message)s')\n"
    "logging.getLogger('torch.distributed.elastic.rendezvous.dynamic_rendezvous').setLevel(logging.DEBUG)\n"
    "sys.argv[0] = 'torchrun'\n"
    "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n"
)


def applicable(fault: str, phase: str, backend: str) -> bool:
    return backend in BACKENDS and matrix.applicable(fault, phase, backend)


class TorchrunCell(matrix.Cell):
    def __init__(self, python: str, fault: str, phase: str, backend: str, workdir: Path, hosts, marker: str):
        super().__init__(fault, phase, backend, workdir, hosts, marker)
        self.python = python

    def _rendezvous(self) -> Tuple[str, str, str]:
        if self.backend == "store":
            self._start_store()
        return f"{self.hosts.addr(0)}:29400", CONF, "c10d"

    def _start_store(self) -> None:
        log = open(self.workdir / f"store-{len(list(self.workdir.glob('store-*.log')))}.log", "w")
        argv = self.hosts.command(0, self.python, "-c", STORE, self.hosts.addr(0))
        self.store = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: "listening" in Path(log.name).read_text(), timeout=60, what="the torch store listening")

    def _start(self, i: int, endpoint: str, conf: str, backend: str) -> None:
        # torch hosts the rendezvous store where the endpoint is this machine's host name, which
        # a namespace host's address is not: is_host says which node serves it
        is_host = self.backend == "c10d" and i == 0
        env = [f"HOST_ID=host{i}", "LOGLEVEL=INFO", "GLOO_SOCKET_IFNAME=eth0"]
        if self.phase == "exit-barrier" and i == self.victim:
            env.append(f"LINGER={matrix.LINGER}")
        max_restarts = 1 if self.fault == "worker-kill" else 0
        argv = self.hosts.command(
            i,
            *("env", *env, self.python, "-c", TORCHRUN),
            *("--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", backend),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", "matrix", "--local-addr", self.hosts.addr(i)),
            *("--max-restarts", str(max_restarts), "--rdzv-conf", f"{conf},is_host={int(is_host)}", WORKER),
        )
        self.agents[i] = Agent(argv, self.workdir, self.marker, f"h{i}")

    def _arrived(self, i: int) -> bool:
        return "added itself to the participants" in self.agents[i].output()

    def _at_exit_barrier(self, i: int) -> bool:
        return "seconds for other agents to finish" in self.agents[i].output()

    def _restarts_charged(self) -> int:
        # torchrun logs "... FAILED. n/m attempts left; will restart worker group" per charge
        return max((self.agents[i].output().count("attempts left") for i in self.agents), default=0)

    def _why(self, i: int) -> Optional[str]:
        for line in reversed(self.agents[i].output().strip().splitlines()[-80:]):
            if "Error" in line or "FAILED" in line:
                return line.strip()
        return None


def run_cell(python: str, fault: str, phase: str, backend: str, workdir: Path, hosts, marker: str) -> matrix.Verdict:
    return TorchrunCell(python, fault, phase, backend, workdir, hosts, marker).run()

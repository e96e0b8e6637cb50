"""The fault matrix: a fault (what breaks) in a phase (when) on a backend (where the rendezvous
lives), run end to end with real agents and training workers on three network-namespace hosts,
and judged by invariants read from the agents' event logs (tests/faults/invariants.py, where
each is defined and tried on doctored logs) and from what the run leaves behind:

1. at most one round (its number and its workers' store) trains at any instant, from the loss
   window + 2 s after the fault;
2. every node still running ends, within a bound, with exit 0, or with an error that names the
   fault;
3. a restart is charged (a `failure_reported`, `restart` or `round_formed` event whose count
   went up) only for a worker's own failure;
4. a node, host or worker lost while training is trained past within RECOVERY_BOUND, well
   under torch's 30 s last call;
5. nothing is left running.

A cell ends `survived` (every invariant holds, the surviving nodes exit 0), `clean error`
(every invariant holds; a node exited non-zero saying why), or `invariant broken` (what broke).
tests/faults/test_matrix.py runs a sample of the cells (in CI); benches/fault_matrix.py runs
every one and prints the table.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from agents import marked_processes, starts, wait_for
from invariants import judge, read_log
from training import steps, train_node

FAULTS = {
    "worker-kill": "SIGKILL of one worker",
    "agent-kill": "SIGKILL of one agent",
    "host-kill": "SIGKILL of every process on one host",
    "agent-stop": "SIGSTOP of one agent for twice the loss window",
    "short-cut": "one host's link cut for half the loss window",
    "long-cut": "one host's link cut for three loss windows",
    "store-host-stop": "SIGSTOP of the agent serving the rendezvous store for twice the loss window",
    "store-host-cut": "the link of the host serving the rendezvous store cut for three loss windows",
    "store-restart": "the standalone store killed and started again, empty",
    "etcd-leader-kill": "the etcd leader killed",
}
PHASES = {
    "rendezvous": "after two nodes wrote to the rendezvous, before the round forms",
    "training": "while the workers train with all_reduce",
    "exit-barrier": "while two nodes wait at the exit barrier for the third",
}
BACKENDS = {
    "c10d": "c10d, the store served by host 0's agent",
    "sites": "c10d with three sites, one per host",
    "store": "c10d on a standalone elastix store on host 0",
    "etcd": "etcd, a cluster of three on this machine",
}

# a node counts as lost after 2 s of silence: the loss window
LOSS_WINDOW = 2.0
C10D_CONF = "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=1s,join_timeout=30s"
ETCD_CONF = "lease_ttl=2s,heartbeat_timeout=1s,join_timeout=30s"
# how long every node still running has to end once the job is told to stop
END_BOUND = 90.0
LINGER = 12.0  # the exit-barrier phase: the victim's node keeps its workers this long
# from a fault in training to the first step of the round formed after it, for the faults that
# lose a member (a regression to torch's 30 s last call fails it)
RECOVERY_BOUND = LOSS_WINDOW + 10.0
RECOVERS = ("worker-kill", "agent-kill", "host-kill")


def applicable(fault: str, phase: str, backend: str) -> bool:
    if fault == "store-restart":
        return backend == "store"
    if fault == "etcd-leader-kill":
        return backend == "etcd"
    if fault.startswith("store-host-"):
        return backend == "c10d"  # the one store, served by host 0's agent
    if backend == "store":
        return False  # the standalone store's own cell is store-restart; the rest is as c10d
    return not (fault == "worker-kill" and phase == "rendezvous")  # no worker runs yet


def cells() -> List[Tuple[str, str, str]]:
    return [(f, p, b) for f in FAULTS for p in PHASES for b in BACKENDS if applicable(f, p, b)]


@dataclass
class Verdict:
    fault: str
    phase: str
    backend: str
    outcome: str = "survived"
    problems: List[str] = field(default_factory=list)
    # from the fault to the first step of a round formed after it (None: no round needed one)
    recovery_s: Optional[float] = None
    exits: Dict[str, Optional[int]] = field(default_factory=dict)

    def broken(self, problem: str) -> None:
        self.outcome = "invariant broken"
        self.problems.append(problem)

    def describe(self) -> str:
        recovery = "" if self.recovery_s is None else f", back training in {self.recovery_s:.2f}s"
        problems = "".join(f"\n  - {p}" for p in self.problems)
        return f"{self.fault} / {self.phase} / {self.backend}: {self.outcome}{recovery}{problems}"


class Cell:
    """One run of the matrix: three training nodes on `hosts`, a fault, and the verdict."""

    def __init__(self, fault: str, phase: str, backend: str, workdir: Path, hosts, marker: str):
        assert applicable(fault, phase, backend), (fault, phase, backend)
        self.fault, self.phase, self.backend = fault, phase, backend
        self.workdir, self.hosts, self.marker = workdir, hosts, marker
        self.verdict = Verdict(fault, phase, backend)
        # the host hit: the store's for the store host's faults, else the one that arrives
        # second mid-rendezvous, else the last one
        self.victim = 0 if fault.startswith("store-host-") else 1 if phase == "rendezvous" else 2
        self.agents: Dict[int, object] = {}
        self.killed: set = set()  # hosts whose agent the fault killed
        self.store: Optional[subprocess.Popen] = None
        self.etcd = None
        self.fault_at = 0.0

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> Verdict:
        try:
            endpoint, conf, rdzv_backend = self._rendezvous()
            if self.phase == "rendezvous":
                conf = conf.replace("join_timeout", "last_call_timeout=5,join_timeout")
            for i in self._start_order():
                if self.phase == "rendezvous" and i == 2:
                    continue  # the third node comes once the fault is in
                self._start(i, endpoint, conf, rdzv_backend)
                if i == self.victim and self.phase == "exit-barrier" and self.backend == "etcd":
                    # joined first, the victim is rank 0 and serves the workers' store: the
                    # others' exit barrier loses its store with the host
                    wait_for(
                        lambda: "waiting for" in self.agents[self.victim].output(), timeout=30, what="the victim joined"
                    )
            before = self._reach_phase()
            if self.phase == "rendezvous":
                self._inject()
                self._start(2, endpoint, conf, rdzv_backend)
            else:
                self._inject()
            self._recover(before)
            self._finish()
            self._judge()
        except Exception as err:  # a wait that timed out, a setup that failed: the cell broke
            self.verdict.broken(f"{type(err).__name__}: {err}")
        finally:
            self._teardown()
        return self.verdict

    def _start_order(self) -> List[int]:
        if self.phase == "exit-barrier" and self.backend == "etcd":
            return [self.victim] + [i for i in range(3) if i != self.victim]
        return list(range(3))

    def _rendezvous(self) -> Tuple[str, str, str]:
        addr = self.hosts.addr
        if self.backend == "c10d":
            return f"{addr(0)}:29400", C10D_CONF, "c10d"
        if self.backend == "sites":
            return ",".join(f"{addr(i)}:29400" for i in range(3)), C10D_CONF, "c10d"
        if self.backend == "store":
            self._start_store()
            return f"{addr(0)}:29400", C10D_CONF + ",is_host=false", "c10d"
        from etcd_cluster import EtcdCluster

        data = self.workdir / "etcd"
        data.mkdir(exist_ok=True)
        self.etcd = EtcdCluster(data, client_host=self.hosts.gateway)
        return self.etcd.endpoints, ETCD_CONF, "etcd"

    def _start_store(self) -> None:
        log = open(self.workdir / f"store-{len(list(self.workdir.glob('store-*.log')))}.log", "w")
        argv = self.hosts.python(0, "-m", "elastix", "store", "--host", self.hosts.addr(0), "--port", "29400")
        self.store = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: "listening" in Path(log.name).read_text(), timeout=30, what="the store listening")

    def _start(self, i: int, endpoint: str, conf: str, backend: str) -> None:
        env = ["ELASTIX_RDZV_PROGRESS_INTERVAL=300ms"]
        if self.phase == "exit-barrier" and i == self.victim:
            env.append(f"LINGER={LINGER}")
        flags = ["--event-log", str(self.workdir / f"events_h{i}.jsonl")]
        max_restarts = 1 if self.fault == "worker-kill" else 0
        self.agents[i] = train_node(
            self.workdir, self.marker, self.hosts, i, "2:3", endpoint, conf, "matrix", max_restarts, backend, env, flags
        )

    def _reach_phase(self) -> Dict[Tuple[int, int], int]:
        """Waits for the phase the fault is for; returns the steps trained so far."""
        if self.phase == "rendezvous":
            # both arrived, and wait for a third for the last call
            wait_for(lambda: all(self._arrived(i) for i in (0, 1)), timeout=30, what="the last call")
            return {}
        wait_for(lambda: self._training(3), timeout=60, what="the three nodes training")
        if self.phase == "exit-barrier":
            (self.workdir / "stop").touch()
            wait_for(
                lambda: all(self._at_exit_barrier(i) for i in range(3) if i != self.victim),
                timeout=60,
                what="the other nodes at the exit barrier",
            )
        return steps(self.workdir)

    def _training(self, world_size: int) -> bool:
        rounds = {r["round"] for r in starts(self.workdir) if r["world_size"] == world_size}
        return any(count >= 10 for (round_, _), count in steps(self.workdir).items() if round_ in rounds)

    # -- what the launcher says (torchrun's cell reads these from its logs instead) -----------

    def _arrived(self, i: int) -> bool:
        """Host i joined the round and waits for more nodes."""
        return "last call" in self.agents[i].output()

    def _at_exit_barrier(self, i: int) -> bool:
        return any(e["event"] == "workers_stopped" and e.get("why") == "succeeded" for e in self._events(i))

    def _last_line(self, i: int) -> str:
        return (self.agents[i].output().strip().splitlines() or [""])[-1]

    def _events(self, i: int) -> List[dict]:
        return read_log(self.workdir / f"events_h{i}.jsonl")

    # -- the fault --------------------------------------------------------------------------

    def _inject(self) -> None:
        self.fault_at = time.time()
        victim = self.victim
        agent = self.agents.get(victim)
        if self.fault == "worker-kill":
            host = f"host{victim}"
            pid = max((r for r in starts(self.workdir) if r.get("host") == host), key=lambda r: r["round"])["pid"]
            os.kill(pid, signal.SIGKILL)
        elif self.fault == "agent-kill":
            agent.proc.kill()
            self.killed.add(victim)
        elif self.fault == "host-kill":
            self.hosts.kill(victim)
            self.killed.add(victim)
        elif self.fault in ("agent-stop", "store-host-stop"):
            agent.proc.send_signal(signal.SIGSTOP)
            time.sleep(2 * LOSS_WINDOW)  # the fault: stopped for two loss windows
            agent.proc.send_signal(signal.SIGCONT)
        elif self.fault in ("short-cut", "long-cut", "store-host-cut"):
            self.hosts.cut(victim)
            # the fault: cut for half a loss window (short) or three (long)
            time.sleep(LOSS_WINDOW / 2 if self.fault == "short-cut" else 3 * LOSS_WINDOW)
            self.hosts.heal(victim)
        elif self.fault == "store-restart":
            self.store.kill()
            self.store.wait()
            self._start_store()
        elif self.fault == "etcd-leader-kill":
            self.etcd.kill(self.etcd.leader())
        else:
            raise ValueError(f"unknown fault {self.fault!r}")

    def _recover(self, before: Dict[Tuple[int, int], int]) -> None:
        """Waits until the job trains again (at the exit barrier: nothing to wait for)."""
        if self.phase == "exit-barrier":
            return
        old = {round_ for round_, _ in before}
        # these faults leave the round as it is; the others end it (a lost or stopped node, a
        # worker's failure, a store that lost the state)
        same_round = self.fault in ("short-cut", "etcd-leader-kill")

        def training_again() -> bool:
            after = steps(self.workdir, self.fault_at)
            return any(count >= 5 and (same_round or round_ not in old) for (round_, _), count in after.items())

        def ended() -> bool:  # every node still running gave up: nothing will train again
            return all(a.proc.poll() is not None for i, a in self.agents.items() if i not in self.killed)

        wait_for(lambda: training_again() or ended(), timeout=60, what="training again after the fault")
        firsts = []
        for (round_, rank), _ in steps(self.workdir, self.fault_at).items():
            if round_ in old:
                continue
            lines = [line for line in (self.workdir / f"steps_{round_}_{rank}.txt").read_text().splitlines() if line]
            firsts.append(float(lines[0].split()[0]))
        if firsts:
            self.verdict.recovery_s = max(0.0, min(firsts) - self.fault_at)

    def _finish(self) -> None:
        (self.workdir / "stop").touch()
        deadline = time.monotonic() + END_BOUND + (LINGER if self.phase == "exit-barrier" else 0)
        for i, agent in self.agents.items():
            if i in self.killed:
                continue
            left = max(1.0, deadline - time.monotonic())
            try:
                self.verdict.exits[f"h{i}"] = agent.proc.wait(left)
            except subprocess.TimeoutExpired:
                self.verdict.exits[f"h{i}"] = None
                self.verdict.broken(f"host {i}'s agent did not end within the bound")

    # -- the invariants ---------------------------------------------------------------------

    def _judge(self) -> None:
        v = self.verdict
        logs = {f"h{i}": self._events(i) for i in self.agents}
        settle = self.fault_at + LOSS_WINDOW + 2.0
        allowed = 1 if self.fault == "worker-kill" else 0
        died = {f"h{i}": self.fault_at for i in self.killed}
        last_lines = {f"h{i}": self._last_line(i) for i in self.agents}
        for problem in judge(logs, self.fault, settle, allowed, v.exits, last_lines, died):
            v.broken(problem)
        for name, code in v.exits.items():
            if code not in (0, None):
                if v.outcome == "survived":
                    v.outcome = "clean error"  # non-zero, and (judged above) naming the fault
                v.problems.append(f"{name} exited {code}: {last_lines[name][-200:]}")
        if self.fault in RECOVERS and self.phase == "training":
            if v.recovery_s is None or v.recovery_s > RECOVERY_BOUND:
                v.broken(f"not training again within {RECOVERY_BOUND:.0f}s of the fault (recovery: {v.recovery_s})")
        # nothing left running
        deadline = time.monotonic() + 10
        while marked_processes(self.marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked_processes(self.marker)
        if left:
            v.broken(f"processes left running: {left}")

    def _teardown(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGCONT)
                agent.proc.kill()
                agent.proc.wait()
        for pid in marked_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.store is not None and self.store.poll() is None:
            self.store.kill()
            self.store.wait()
        if self.etcd is not None:
            self.etcd.close()


def run_cell(fault: str, phase: str, backend: str, workdir: Path, hosts, marker: str) -> Verdict:
    return Cell(fault, phase, backend, workdir, hosts, marker).run()


__all__ = ["FAULTS", "PHASES", "BACKENDS", "applicable", "cells", "run_cell", "Verdict", "LOSS_WINDOW"]

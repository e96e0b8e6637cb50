"""Goodput under faults: the share of the wall-clock time that ends up in the final model.

Three nodes on namespace hosts (one rank each, a state of --state-mb MB per rank, steps of
--step-s of compute and an all_reduce) train for --minutes; every --fault-every seconds one
fault, in turn: a worker killed (SIGKILL), a whole host killed (every process in its namespace;
a new node then takes its place), a node's launcher stopped (SIGTERM, as a preemption; it
comes back). goodput = useful steps x fault-free step time / wall time, where the useful steps
are the steps of the final model and the fault-free step time is the mean step of a run with
no checkpoint and no fault. Side by side:

* elastix: `elastix run`, elastix.checkpoint.save every step (the agent's memory, a copy at the
  next node's agent; pipelined: the copy overlaps the next step's compute, or with --block
  inside the loop), --checkpoint-dir for what memory cannot give back; the loop inside
  elastix.elastic.run (the survivors of a fault re-form in process), and as a plain script
  (every re-form restarts the workers);
* torchrun + torch.save every K steps (rank 0, to a directory the nodes share), for each K of
  --torch-every (the best is the one to compare with);
* torchrun + torch's DCP async_save every K steps, where torch has it.

Both launchers use one standalone store outside the hosts (`elastix store`, which torch's
clients speak to) and their default heartbeats. Also printed: how long a save blocks the loop
against a plain copy of the same state, the restore time after each fault, and the step-time
overhead of the checkpoints. torch comes from this interpreter or $TORCH_PYTHON.

    python benches/goodput.py [--minutes 10] [--fault-every 60] [--state-mb 256] [--step-s 1]
                              [--torch-every 5,20,60] [--no-torch] [--block] [--keep]

Needs root and iproute2 (network namespaces).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from netns import Hosts  # noqa: E402
from peer_torch import torch_python  # noqa: E402

WORKER = os.path.join(HERE, "workers", "goodput_worker.py")
NODES = 3
FAULTS = ("worker killed", "host killed", "SIGTERM")


class Job:
    """One configuration's nodes on the hosts, their faults, and what their workers logged."""

    def __init__(self, hosts: Hosts, store: str, out: str, launcher: List[str], worker: List[str]) -> None:
        self.hosts, self.store, self.out = hosts, store, out
        self.launcher, self.worker = launcher, worker
        self.nodes: Dict[int, subprocess.Popen] = {}
        self.faults: List[tuple] = []

    def start(self, i: int) -> None:
        log = open(os.path.join(self.out, f"node{i}.log"), "a")
        argv = [*self.launcher, "--local-addr", self.hosts.addr(i), *self.worker]
        # the hosts share a host name, which gloo resolves to loopback: it takes the host's link
        env = {
            **os.environ,
            "OUT_DIR": self.out,
            "ELASTIX_COLLECTIVES_HOST_ID": f"host{i}",
            "GLOO_SOCKET_IFNAME": "eth0",
        }
        self.nodes[i] = subprocess.Popen(self.hosts.command(i, *argv), env=env, stdout=log, stderr=subprocess.STDOUT)

    def fault(self, kind: str, i: int) -> None:
        self.faults.append((time.time(), kind, i))
        if kind == "worker killed":
            with open(os.path.join(self.out, f"pid-host{i}.txt")) as f:
                _signal(int(f.read()), signal.SIGKILL)
            return
        if kind == "host killed":
            self.hosts.kill(i)
            self.nodes[i].wait(30)
        else:  # SIGTERM: the node's launcher stops its workers and exits, then comes back
            self.nodes[i].send_signal(signal.SIGTERM)
            try:
                self.nodes[i].wait(60)
            except subprocess.TimeoutExpired:
                self.hosts.kill(i)
        self.start(i)

    def stop(self) -> None:
        open(os.path.join(self.out, "stop"), "w").close()
        deadline = time.monotonic() + 120
        for i, node in self.nodes.items():
            try:
                node.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.hosts.kill(i)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def lines(out: str, name: str) -> List[List[str]]:
    found = []
    for path in glob.glob(os.path.join(out, f"{name}-*.txt")):
        with open(path) as f:
            found.extend(line.split() for line in f if line.strip())
    return found


def mean_step(out: str, before: float = float("inf"), rank: int = 0) -> Optional[float]:
    """The mean time between consecutive steps of `rank` (before `before`): the checkpoints'
    cost included, even when only one step in K saves."""
    with open(os.path.join(out, f"steps-{rank}.txt")) as f:
        steps = sorted((float(t), int(s)) for t, s in (line.split() for line in f if line.strip()) if float(t) < before)
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if b[1] == a[1] + 1]
    return statistics.mean(gaps) if gaps else None


def memcpy_floor(state_mb: int) -> float:
    """The least time a plain copy of one rank's state takes here (into memory already
    touched), measured by this driver before the jobs run: the floor a save is compared with,
    kept out of the jobs' wall time."""
    import numpy as np

    state = np.full(state_mb * (1 << 20) // 4, 0.5, np.float32)
    floor = np.ones_like(state)  # touched: the copy pays no page faults
    copies = []
    for _ in range(3):
        began = time.perf_counter()
        np.copyto(floor, state)
        copies.append(time.perf_counter() - began)
    return min(copies)


def run(hosts: Hosts, store: str, name: str, launcher: List[str], worker: List[str], args, faults: bool) -> dict:
    out = tempfile.mkdtemp(prefix=f"{name.replace(' ', '_').replace('=', '')}-", dir=args.root)
    job = Job(hosts, store, out, launcher, worker)
    for i in range(NODES):
        job.start(i)
    began = time.time()
    wall = args.minutes * 60 if faults else args.calibrate
    turn = 0
    while time.time() - began < wall:
        next_fault = began + (turn + 1) * args.fault_every
        time.sleep(max(0.0, min(next_fault, began + wall) - time.time()))
        if faults and time.time() < began + wall - 5:
            job.fault(FAULTS[turn % len(FAULTS)], 1 + turn % (NODES - 1))
            turn += 1
    job.stop()
    ended = time.time()
    first_fault = job.faults[0][0] if job.faults else float("inf")
    saves = lines(out, "saves")
    ended_early = not os.path.exists(os.path.join(out, "final.txt"))
    if ended_early:  # the job died: its final model is its newest checkpoint
        useful = max((int(s[1]) + 1 for s in saves), default=0)
    else:
        useful = int(open(os.path.join(out, "final.txt")).read()) + 1
    return {
        "name": name,
        "useful": useful,
        "ended_early": ended_early,
        "wall": ended - began,
        "began": began,
        "step": mean_step(out, first_fault),
        # rank 0's: with torch.save only rank 0 writes
        "saves": [float(line.split()[0]) for line in open(os.path.join(out, "saves-0.txt"))]
        if os.path.exists(os.path.join(out, "saves-0.txt"))
        else [],
        "memcpy": args.memcpy,
        "restores": [(int(s[0]), float(s[1])) for s in lines(out, "starts") if int(s[0]) >= 0],
        "lost": steps_lost(out, job.faults),
        "faults": job.faults,
        "out": out,
    }


def steps_lost(out: str, faults: List[tuple]) -> Dict[str, List[int]]:
    """Per kind of fault: the steps trained before it that the next restore did not give back."""
    steps = sorted((float(t), int(s)) for t, s in lines(out, "steps"))
    starts = sorted((float(s[2]), int(s[0])) for s in lines(out, "starts") if len(s) > 2)
    lost: Dict[str, List[int]] = {}
    for at, kind, _host in faults:
        reached = max((step for t, step in steps if t < at), default=-1)
        after = [restored for t, restored in starts if t > at]
        if after:
            lost.setdefault(kind, []).append(max(0, reached - after[0]))
    return lost


def seconds_lost(out: str, faults: List[tuple], ended: float, ideal: float) -> Dict[str, List[float]]:
    """Per kind of fault: the wall time from it to the next fault (or the end) that did not
    become steps of the model, at the fault-free step time: the fault's whole cost (the step
    it cut short, finding the loss, re-forming, a replacement's start and join, the steps it
    lost), with the checkpoints' cost per step over that window."""
    steps = sorted((float(t), int(s)) for t, s in lines(out, "steps"))

    def newest(at: float) -> int:
        before = [step for t, step in steps if t <= at]
        return before[-1] if before else -1

    found: Dict[str, List[float]] = {}
    bounds = [at for at, _, _ in faults] + [ended]
    for (at, kind, _host), until in zip(faults, bounds[1:]):
        made = newest(until) - newest(at)
        found.setdefault(kind, []).append(until - at - made * ideal)
    return found


def report(result: dict, ideal: float) -> None:
    lost_seconds = seconds_lost(result["out"], result["faults"], result["began"] + result["wall"], ideal)
    goodput = result["useful"] * ideal / result["wall"]
    saves = result["saves"]
    save = statistics.median(saves) if saves else None
    line = f"{result['name']:<28} goodput {goodput:6.1%}  ({result['useful']} steps in {result['wall']:.0f}s)"
    if result["ended_early"]:
        line += " [the job died: its newest checkpoint counts]"
    if result["step"]:
        line += f"  step {result['step']:.3f}s ({result['step'] / ideal - 1:+.1%} vs no checkpoint)"
    if save is not None and result["memcpy"]:
        line += f"  save blocks {save * 1000:.0f} ms = {save / result['memcpy']:.2f}x a memcpy"
    restores = [took for _, took in result["restores"]]
    if restores:
        line += f"  restore median {statistics.median(restores):.2f}s max {max(restores):.2f}s"
    print(line, flush=True)
    for kind, counts in result["lost"].items():
        took = ", ".join(f"{seconds:.1f}" for seconds in lost_seconds.get(kind, []))
        print(f"    steps lost after a {kind}: {counts}; wall seconds lost until the next fault: {took}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--fault-every", type=float, default=60)
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--torch-every", default="5,20,60")
    parser.add_argument("--calibrate", type=float, default=20, help="seconds of the fault-free run")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-elastix", action="store_true", help="torchrun's configurations only")
    parser.add_argument("--no-restart", action="store_true", help="elastix in process only (no plain-script run)")
    parser.add_argument("--block", action="store_true", help="elastix's saves block for their copy (not pipelined)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' logs and checkpoints (else removed)")
    args = parser.parse_args()
    # every run's logs and the checkpoints (GBs a run) in one directory, removed at the end
    args.root = tempfile.mkdtemp(prefix="goodput-")
    why = Hosts.available()
    if why:
        sys.exit(f"goodput: needs network namespaces ({why})")
    args.memcpy = memcpy_floor(args.state_mb)
    hosts = Hosts(NODES)
    store_proc = None
    try:
        store_proc = subprocess.Popen(
            [sys.executable, "-m", "elastix", "store", "--host", hosts.gateway, "--port", "29500"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        store = f"{hosts.gateway}:29500"
        time.sleep(1)
        common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", store]
        conf = ["--rdzv-conf", "is_host=false,join_timeout=120", "--max-restarts", "100"]
        worker = ["--state-mb", str(args.state_mb), "--step-s", str(args.step_s)]
        elastix = [sys.executable, "-m", "elastix", "run", *common, *conf, "--rdzv-id"]
        ckpt_dir = tempfile.mkdtemp(prefix="checkpoints-", dir=args.root)
        print(
            f"goodput: {NODES} namespace hosts, {args.state_mb} MB per rank, steps of {args.step_s}s compute, "
            f"{args.minutes} min, a fault every {args.fault_every:.0f}s ({', '.join(FAULTS)}, in turn)",
            flush=True,
        )
        calibration = run(
            hosts,
            store,
            "no checkpoint, no fault",
            [*elastix, "calibrate"],
            [WORKER, "--mode", "none", *worker],
            args,
            False,
        )
        ideal = calibration["step"]
        print(f"fault-free step (no checkpoint, no fault; the mean): {ideal:.3f}s", flush=True)
        if not args.no_elastix:
            for mode, name in (("elastix", "elastix, in process"), ("elastix-restart", "elastix, restarts")):
                if mode == "elastix-restart" and args.no_restart:
                    continue
                launcher = [*elastix, f"goodput-{mode}", "--checkpoint-dir", ckpt_dir]
                block = ["--block"] if args.block else []
                mine = run(hosts, store, name, launcher, [WORKER, "--mode", mode, *worker, *block], args, True)
                report(mine, ideal)
        torch = None if args.no_torch else torch_python()
        if torch is None:
            print("torchrun: skipped (no torch here or in $TORCH_PYTHON)", flush=True)
            return
        torchrun = [torch, "-m", "torch.distributed.run", *common, *conf]
        for mode in ("torch-save", "torch-dcp"):
            for every in [int(k) for k in args.torch_every.split(",")]:
                name = f"torchrun + {'torch.save' if mode == 'torch-save' else 'DCP async_save'} K={every}"
                result = run(
                    hosts,
                    store,
                    name,
                    [*torchrun, "--rdzv-id", f"{mode}-{every}"],
                    [WORKER, "--mode", mode, "--every", str(every), *worker],
                    args,
                    True,
                )
                report(result, ideal)
    finally:
        if store_proc is not None:
            store_proc.kill()
        hosts.close()
        if args.keep:
            print(f"goodput: the runs' logs and checkpoints are in {args.root}", flush=True)
        else:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Recovery with training workers: time from a fault to the job training again (the first
all_reduce step of the new round), on three network-namespace hosts, elastix beside torchrun
in the same scenarios (torchrun's workers: gloo all_reduce; where torch can be run).

* node-loss: host 2 SIGKILLed (every process) mid-all_reduce; --nnodes 2:3, the store on
  host 0; with the rendezvous defaults (a node is lost after 15 s, a 30 s last call) and with
  a 3 s loss window (keep_alive_interval=1s, keep_alive_max_attempt=3). torchrun gets
  --max-restarts 3 (it recovers only by restarting).
* store-host loss: host 0 (agent, workers, the store) SIGKILLed mid-all_reduce. elastix:
  `--rdzv-endpoint` lists every host (three sites: the two left are a majority; with two, the
  first one's side alone may run the job); torchrun takes one endpoint (host 0).
* partition: host 2's link cut for 10 s with the 3 s loss window; time until the two others
  train without it, and from the heal until all three train again.

Needs root and iproute2. torch is looked for in this interpreter, or in the one
$TORCH_PYTHON names (a venv of its own).

    python benches/collective_faults_bench.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "faults"), os.path.join(HERE, "..", "tests")]
from agents import marked_processes  # noqa: E402
from netns import Hosts  # noqa: E402
from peer_torch import torch_python  # noqa: E402
from training import TRAIN  # noqa: E402

WINDOW_3S = "keep_alive_interval=1,keep_alive_max_attempt=3"  # bare seconds: torch reads ints
WITHIN = 90.0  # a scenario that has not recovered by then: "not within 90 s"
CUT = 10.0  # how long the partition lasts

# torchrun's worker: the same loop as tests/worker_programs/train_loop.py, on torch.distributed (gloo);
# each step is logged as "<time> <step> <world size>" to steps_torch_<pid>.txt
TORCH_WORKER = r"""
import os, time, torch, torch.distributed as dist
out = os.environ["OUT_DIR"]
dist.init_process_group("gloo")
world = dist.get_world_size()
grad = torch.ones(64 * 1024)
log = open(os.path.join(out, f"steps_torch_{os.getpid()}.txt"), "a", buffering=1)
step, deadline = 0, time.monotonic() + 600
while time.monotonic() < deadline:
    grad.fill_(1.0)
    grad[-1] = float(os.path.exists(os.path.join(out, "stop")))
    dist.all_reduce(grad)
    log.write(f"{time.time():.3f} {step} {world}\n")
    step += 1
    if grad[-1] > 0:
        break
dist.destroy_process_group()
"""


class Side:
    """One launcher's nodes on the hosts of a scenario."""

    def __init__(self, name: str, hosts: Hosts, out: Path, python: str):
        self.name, self.hosts, self.out, self.python = name, hosts, out, python
        self.marker = uuid.uuid4().hex
        self.procs: List[subprocess.Popen] = []

    def start(self, i: int, nnodes: str, endpoint: str, conf: str, max_restarts: int) -> None:
        env = ["OUT_DIR=" + str(self.out), "ELASTIX_TEST_MARKER=" + self.marker]
        if self.name == "elastix":
            env.append(f"ELASTIX_COLLECTIVES_HOST_ID=host{i}")
            argv = [self.python, "-m", "elastix", "run"]
            script = TRAIN
        else:
            env.append("GLOO_SOCKET_IFNAME=eth0")  # the namespace host's one link
            argv = [self.python, "-m", "torch.distributed.run"]
            script = str(self.out / "torch_worker.py")
            (self.out / "torch_worker.py").write_text(TORCH_WORKER)
            # torch hosts the store where the endpoint names this machine's hostname, which a
            # namespace host's address is not: say which node hosts it
            is_host = f"is_host={int(endpoint.startswith(self.hosts.addr(i) + ':'))}"
            conf = f"{conf},{is_host}" if conf else is_host
        argv += [
            *("--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
            *("--rdzv-id", "bench", "--local-addr", self.hosts.addr(i), "--max-restarts", str(max_restarts)),
            *(["--rdzv-conf", conf] if conf else []),
            script,
        ]
        log = open(self.out / f"{self.name}_h{i}.log", "w")
        self.procs.append(
            subprocess.Popen(self.hosts.command(i, "env", *env, *argv), stdout=log, stderr=subprocess.STDOUT)
        )

    def steps(self, world_size: int, after: float) -> List[float]:
        """Times of the steps taken at `world_size` after `after`."""
        times = []
        if self.name == "elastix":
            sizes = {}
            for path in glob.glob(str(self.out / "start_*.json")):
                record = json.loads(Path(path).read_text())
                sizes[record["round"]] = record["world_size"]
            for path in glob.glob(str(self.out / "steps_*_*.txt")):
                round_ = int(os.path.basename(path)[len("steps_") :].split("_")[0])
                if sizes.get(round_) == world_size:
                    times += [float(line.split()[0]) for line in open(path) if line.strip()]
        else:
            for path in glob.glob(str(self.out / "steps_torch_*.txt")):
                for line in open(path):
                    parts = line.split()
                    if len(parts) == 3 and int(parts[2]) == world_size:
                        times.append(float(parts[0]))
        return sorted(t for t in times if t > after)

    def trains(self, world_size: int, after: float = 0.0, within: float = WITHIN) -> Optional[float]:
        """Seconds from `after` to the first step at `world_size` (None: none within `within`)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = self.steps(world_size, after)
            if len(found) >= 3:  # a few steps: training, not a straggler
                return found[0] - after
            time.sleep(0.05)
        return None

    def close(self) -> None:
        (self.out / "stop").touch()
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in marked_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def node_loss(side: Side, conf: str) -> Optional[float]:
    endpoint = f"{side.hosts.addr(0)}:29400"
    for i in range(3):
        side.start(i, "2:3", endpoint, conf, 3)
    if side.trains(3) is None:
        raise RuntimeError(f"{side.name}: the three nodes never trained")
    killed = time.time()
    side.hosts.kill(2)
    return side.trains(2, after=killed)


def store_host_loss(side: Side, conf: str) -> Optional[float]:
    addr = side.hosts.addr
    endpoint = ",".join(f"{addr(i)}:29400" for i in range(3)) if side.name == "elastix" else f"{addr(0)}:29400"
    for i in range(3):
        side.start(i, "2:3", endpoint, conf, 3)
    if side.trains(3) is None:
        raise RuntimeError(f"{side.name}: the three nodes never trained")
    killed = time.time()
    side.hosts.kill(0)
    return side.trains(2, after=killed)


def partition(side: Side, conf: str) -> List[Optional[float]]:
    endpoint = f"{side.hosts.addr(0)}:29400"
    for i in range(3):
        side.start(i, "2:3", endpoint, conf, 3)
    if side.trains(3) is None:
        raise RuntimeError(f"{side.name}: the three nodes never trained")
    cut = time.time()
    side.hosts.cut(2)
    without = side.trains(2, after=cut, within=CUT)
    time.sleep(max(0.0, cut + CUT - time.time()))
    healed = time.time()
    side.hosts.heal(2)
    return [without, side.trains(3, after=healed)]


def show(seconds: List[Optional[float]], within: float) -> str:
    found = [s for s in seconds if s is not None]
    if not found:
        return f"not within {within:.0f} s"
    text = f"{statistics.median(found):.2f} s" + (f" (max {max(found):.2f})" if len(found) > 1 else "")
    missing = len(seconds) - len(found)
    return text + (f", {missing} of {len(seconds)} never" if missing else "")


def run(name: str, python: str, scenario: Callable, conf: str, repeat: int, keep: bool) -> List[List[Optional[float]]]:
    results = []
    for _ in range(repeat):
        hosts = Hosts(3)
        out = Path(tempfile.mkdtemp(prefix=f"elastix-bench-{name}-"))
        side = Side(name, hosts, out, python)
        try:
            found = scenario(side, conf)
            results.append(found if isinstance(found, list) else [found])
        finally:
            side.close()
            hosts.close()
            if keep:
                print(f"  logs of {name} {scenario.__name__} {conf or 'defaults'}: {out}", file=sys.stderr)
            else:
                shutil.rmtree(out, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep-logs", action="store_true", help="keep each run's logs and say where")
    args = parser.parse_args()
    why = Hosts.available()
    if why:
        print(f"collective faults bench: {why}", file=sys.stderr)
        return 2
    torch = torch_python()
    sides = [("elastix", sys.executable)] + ([("torchrun", torch)] if torch else [])
    scenarios = [
        ("node lost mid-all_reduce, defaults (15 s window, 30 s last call)", node_loss, "", 0, WITHIN),
        ("node lost mid-all_reduce, 3 s loss window", node_loss, WINDOW_3S, 0, WITHIN),
        ("store host lost mid-all_reduce, 3 s loss window", store_host_loss, WINDOW_3S, 0, WITHIN),
        ("partition (10 s), 3 s window: the other two train without the cut node", partition, WINDOW_3S, 0, CUT),
        ("partition healed: all three train again", partition, WINDOW_3S, 1, WITHIN),
    ]
    print(f"{'scenario':<78} | " + " | ".join(f"{name:<22}" for name, _ in sides))
    cache = {}
    for label, scenario, conf, index, within in scenarios:
        row = []
        for name, python in sides:
            key = (name, scenario.__name__, conf)
            if key not in cache:
                cache[key] = run(name, python, scenario, conf, args.repeat, args.keep_logs)
            row.append(show([found[index] for found in cache[key]], within))
        print(f"{label:<78} | " + " | ".join(f"{cell:<22}" for cell in row), flush=True)
    if not torch:
        print("\ntorch is not installed here (nor at $TORCH_PYTHON): torchrun's column is not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())

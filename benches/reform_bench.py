"""Re-forming in process against restarting: how long after a node dies the survivors train
again, and what the elastic loop costs per step when nothing fails.

Three nodes (`elastix run`, one rank each, on 127.0.0.1-3, a standalone store) train a model that
takes --build-s to build (benches/workers/reform_worker.py); node 3 is killed whole (its agent
and worker, SIGKILL to the process group) mid-training, --repeats times for each way of running
the same job:

* in process: the training function runs in elastix.elastic.run; the survivors' processes
  abort their collectives, join the new round and go on;
* restart: the same script without it; the agents restart the survivors' workers (from warm
  standby interpreters), which build the model again and restore from the agents' memory.

Printed per way: death -> next step on the survivors, and loss known (the survivors' agent
logs the loss) -> next step, median and max; then the step time of each way with no fault
(median of --steps steps, two nodes, --overhead-runs runs of each, alternating) with
--overhead-step-s of compute per step and with none, and the overhead of the elastic loop.

    python benches/reform_bench.py [--build-s 5] [--repeats 3] [--steps 300] [--overhead-runs 7] [--no-loss]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import elastix

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from agents import wait_for  # noqa: E402

WORKER = os.path.join(HERE, "workers", "reform_worker.py")
RDZV = "keep_alive_interval=250ms,keep_alive_max_attempt=8,last_call_timeout=500ms,join_timeout=120s,is_host=false"
LOSS_LINE = re.compile(r"^(\S+Z) .*stopped responding")


def start(out: str, i: int, nodes: str, endpoint: str, worker_args: List[str]) -> subprocess.Popen:
    argv = [
        *(sys.executable, "-m", "elastix", "run", "--nnodes", nodes, "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "reform"),
        *("--local-addr", f"127.0.0.{i + 1}", "--rdzv-conf", RDZV, "--max-restarts", "0"),
        *(WORKER, *worker_args),
    ]
    log = open(os.path.join(out, f"node{i}.log"), "w")
    env = {**os.environ, "OUT_DIR": out}
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def steps(out: str) -> List[Tuple[float, int, int]]:
    """(time, round, step) of every step any rank logged."""
    found = []
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        with open(path) as f:
            found.extend((float(t), int(r), int(s)) for t, r, s in (line.split() for line in f if line.strip()))
    return sorted(found)


def loss_known(out: str) -> Optional[float]:
    """When node 1's agent logged the loss (unix time)."""
    with open(os.path.join(out, "node0.log")) as f:
        for line in f:
            found = LOSS_LINE.match(line)
            if found:
                return datetime.datetime.fromisoformat(found.group(1).replace("Z", "+00:00")).timestamp()
    return None


def stop(out: str, nodes: Dict[int, subprocess.Popen]) -> None:
    open(os.path.join(out, "stop"), "w").close()
    for node in nodes.values():
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def one_loss(elastic: bool, build_s: float) -> Tuple[float, float]:
    """(death -> next step, loss known -> next step) of one node killed, in seconds."""
    out = tempfile.mkdtemp(prefix="reform-")
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    worker = [*(["--elastic"] if elastic else []), "--build-s", str(build_s)]
    nodes = {i: start(out, i, "2:3", endpoint, worker) for i in range(3)}
    wait_for(lambda: len({s[2] for s in steps(out) if s[2] >= 20}) > 0, 120 + 3 * build_s, "20 steps")
    first_round = steps(out)[-1][1]
    os.killpg(nodes[2].pid, signal.SIGKILL)
    died = time.time()
    nodes.pop(2).wait()
    after = wait_for(
        lambda: [s for s in steps(out) if s[1] > first_round], 120 + 3 * build_s, "the survivors' next step"
    )
    known = loss_known(out) or died
    stop(out, nodes)
    return after[0][0] - died, after[0][0] - known


def step_time(elastic: bool, count: int, compute_s: float) -> float:
    """Median step time of two nodes with no fault, each step `compute_s` of compute too."""
    out = tempfile.mkdtemp(prefix="reform-steps-")
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = [*(["--elastic"] if elastic else []), "--build-s", "0", "--step-s", str(compute_s)]
    nodes = {i: start(out, i, "2", f"127.0.0.1:{store.port}", worker) for i in range(2)}
    wait_for(lambda: len(steps(out)) >= 2 * count, 300, f"{count} steps")
    stop(out, nodes)
    with open(glob.glob(os.path.join(out, "steps-*.txt"))[0]) as f:
        times = [float(line.split()[0]) for line in f if line.strip()]
    return statistics.median(b - a for a, b in zip(times[10:], times[11:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--overhead-runs", type=int, default=7)
    parser.add_argument("--overhead-step-s", type=float, default=0.05, help="compute per step of the overhead runs")
    parser.add_argument("--no-loss", action="store_true", help="the step-time overhead only")
    args = parser.parse_args()
    print(f"a node killed mid-training, 3 nodes -> 2; a model that takes {args.build_s:.0f} s to build", flush=True)
    results = {}
    for elastic, name in () if args.no_loss else ((True, "in process"), (False, "restart")):
        runs = [one_loss(elastic, args.build_s) for _ in range(args.repeats)]
        results[name] = runs
        death, known = [r[0] for r in runs], [r[1] for r in runs]
        print(
            f"{name:<11} death -> next step: median {statistics.median(death):.3f} s, max {max(death):.3f} s; "
            f"loss known -> next step: median {statistics.median(known) * 1000:.0f} ms, max {max(known) * 1000:.0f} ms",
            flush=True,
        )
    if results:
        known_in_process = statistics.median(r[1] for r in results["in process"])
        ratio = statistics.median(r[1] for r in results["restart"]) / known_in_process
        print(f"restart / in process (loss known -> next step): {ratio:.1f}x", flush=True)
    # one run's median step swings by tens of percent on a shared machine: runs alternate, and
    # the medians of the runs are compared; with no compute the noise is all there is
    for compute_s in (args.overhead_step_s, 0.0) if args.overhead_runs else ():
        times: Dict[bool, List[float]] = {False: [], True: []}
        for _ in range(args.overhead_runs):
            for elastic in (False, True):
                times[elastic].append(step_time(elastic, args.steps, compute_s))
        plain, elastic = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"step time with no fault ({compute_s * 1000:.0f} ms compute, a 4 MB all_reduce and a checkpoint save, "
            f"2 nodes; median of {args.overhead_runs} alternating runs): plain {plain * 1000:.2f} ms, elastic loop "
            f"{elastic * 1000:.2f} ms ({elastic / plain - 1:+.1%}); runs: plain {fmt(times[False])}, "
            f"elastic {fmt(times[True])}",
            flush=True,
        )


def fmt(seconds: List[float]) -> str:
    return " ".join(f"{s * 1000:.2f}" for s in seconds)


if __name__ == "__main__":
    main()

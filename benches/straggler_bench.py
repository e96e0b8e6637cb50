"""Naming slow ranks: how many steps until a rank that turns 1.5x and 2x slower is named, and how
many ranks a healthy job names over a long run (the target is none).

Four nodes (`elastix run`, one rank each, on 127.0.0.1-4, a standalone store) train with steps of
--step-s of "compute" (a sleep, with +-20% noise per step) and two all_reduces
(benches/workers/straggler_worker.py). For each slowdown, rank 2 turns that much slower at step
--slow-from; printed: the steps from then until the round's first agent names it, and which
rank it named. Then a healthy job for --healthy-minutes: every rank named is a false alarm. The
scoring adds nothing to a step: the flight recorder it reads was there already, and the agents
read it every 100 ms whatever the workers do; the agents' CPU time over the healthy run is
printed beside the workers'.

    python benches/straggler_bench.py [--step-s 0.1] [--healthy-minutes 10]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

import elastix

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "straggler_worker.py")
NODES = 4
RDZV = "join_timeout=60s,is_host=false,last_call_timeout=1s"
NAMED = re.compile(r"^(\S+Z) WARN .*rank (\d+) on (\S+) is a straggler")


def start(out: str, worker_args: List[str]) -> Tuple[List[subprocess.Popen], object]:
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = []
    for i in range(NODES):
        argv = [
            *(sys.executable, "-m", "elastix", "run", "--nnodes", str(NODES), "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "pace"),
            *("--local-addr", f"127.0.0.{i + 1}", "--rdzv-conf", RDZV, WORKER, *worker_args),
        ]
        log = open(os.path.join(out, f"node{i}.log"), "w")
        nodes.append(subprocess.Popen(argv, env={**os.environ, "OUT_DIR": out}, stdout=log, stderr=subprocess.STDOUT))
    return nodes, store


def stop(out: str, nodes: List[subprocess.Popen]) -> None:
    open(os.path.join(out, "stop"), "w").close()
    for node in nodes:
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            node.kill()


def steps(out: str, rank: int) -> List[Tuple[float, int]]:
    path = os.path.join(out, f"steps-{rank}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(float(t), int(s)) for t, s in (line.split() for line in f if line.strip())]


def named(out: str) -> List[Tuple[float, int]]:
    found = []
    for path in glob.glob(os.path.join(out, "node*.log")):
        with open(path) as f:
            for line in f:
                hit = NAMED.match(line)
                if hit:
                    at = datetime.datetime.fromisoformat(hit.group(1).replace("Z", "+00:00")).timestamp()
                    found.append((at, int(hit.group(2))))
    return sorted(found)


def detection(slow: float, step_s: float, slow_from: int) -> Tuple[Optional[int], Optional[int]]:
    """(steps from the slowdown to the naming, the rank named), or Nones if none in 60 s."""
    out = tempfile.mkdtemp(prefix="straggler-")
    worker = ["--step-s", str(step_s), "--slow", str(slow), "--slow-rank", "2", "--slow-from", str(slow_from)]
    nodes, _store = start(out, worker)
    deadline = time.monotonic() + 120
    while not named(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = named(out)
    stop(out, nodes)
    if not found:
        return None, None
    at, rank = found[0]
    return sum(1 for t, s in steps(out, 0) if s >= slow_from and t <= at), rank


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--slow-from", type=int, default=50)
    parser.add_argument("--healthy-minutes", type=float, default=10)
    args = parser.parse_args()
    print(f"{NODES} nodes, steps of {args.step_s * 1000:.0f} ms +-20% and two all_reduces", flush=True)
    for slow in (1.5, 2.0):
        count, rank = detection(slow, args.step_s, args.slow_from)
        what = "not named within 120 s" if count is None else f"named after {count} steps (rank {rank}; slow: 2)"
        print(f"rank 2 turns {slow:.1f}x slower: {what}", flush=True)
    out = tempfile.mkdtemp(prefix="straggler-healthy-")
    nodes, _store = start(out, ["--step-s", str(args.step_s)])
    time.sleep(args.healthy_minutes * 60)
    agents_cpu = sum(cpu_seconds(node.pid) for node in nodes)
    total = len(steps(out, 0))
    false_alarms = named(out)
    stop(out, nodes)
    print(
        f"healthy job, {args.healthy_minutes:.0f} min ({total} steps): {len(false_alarms)} rank(s) named "
        f"(false alarms; target 0); the {NODES} agents used {agents_cpu:.1f} s of CPU in all "
        f"({agents_cpu / (args.healthy_minutes * 60) / NODES:.2%} of a core each)",
        flush=True,
    )


if __name__ == "__main__":
    main()

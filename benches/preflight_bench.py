"""The pre-flight check's cost at start-up: four nodes (`elastix run`, one rank each, on
127.0.0.1-4, each its own host for the collectives, a standalone store) start a job whose
worker exits at once, with and without `--preflight`; printed: the median wall time of each
(from the launch to every agent's exit), the time the check adds (target: at most 3 s on 4
nodes) and the ratio. The check's own figures (its table) are printed from the last run.

    python benches/preflight_bench.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List

import elastix

NODES = 4
RDZV = "join_timeout=60s,is_host=false,last_call_timeout=200ms"


def launch(script: str, flags: List[str], log_dir: str) -> float:
    """Seconds from starting the four agents to the last one's exit."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    began = time.perf_counter()
    nodes = []
    for i in range(NODES):
        argv = [
            *(sys.executable, "-m", "elastix", "run", *flags, "--nnodes", str(NODES), "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "pf"),
            *("--local-addr", f"127.0.0.{i + 1}", "--rdzv-conf", RDZV, script),
        ]
        env = {**os.environ, "ELASTIX_COLLECTIVES_HOST_ID": f"host{i}"}
        log = open(os.path.join(log_dir, f"node{i}.log"), "w")
        nodes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [node.wait(timeout=300) for node in nodes]
    taken = time.perf_counter() - began
    if any(codes):
        raise SystemExit(f"a node failed ({codes}): see {log_dir}")
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="elastix-preflight-bench-")
    script = os.path.join(work, "noop.py")
    with open(script, "w") as f:
        f.write("pass\n")
    times: dict = {"without": [], "with --preflight": []}
    for _ in range(args.runs):  # alternated: a busy moment of the machine falls on both alike
        times["without"].append(launch(script, [], work))
        times["with --preflight"].append(launch(script, ["--preflight"], work))
    without, checked = (statistics.median(times[k]) for k in times)
    print(f"{NODES} nodes, {args.runs} runs each (median; min-max)")
    for name, values in times.items():
        print(f"  {name:<18} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})")
    print(f"  the check adds    {checked - without:6.2f} s (target: at most 3 s); ratio {checked / without:.2f}x")
    with open(os.path.join(work, "node0.log")) as log:
        table = [line.rstrip() for line in log if "pre-flight check of" in line or line.startswith("  ")]
    print("\n".join(table))


if __name__ == "__main__":
    main()

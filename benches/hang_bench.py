"""Hang detection benchmark: what heartbeats and timers cost a worker, and how soon the agent
finds a worker hung.

* heartbeat: `elastix.heartbeat()` in a worker of `elastix run` (the slot is live), per call.
* timer block: `with elastix.timer.expires(after=60): pass` in such a worker, per block; side
  by side with torch's `with expires(after=60, client=FileTimerClient(...))` against a running
  `FileTimerServer` (torch's timer for torchrun workers), when torch is installed.
* detection: a worker beats, then stops; with `--worker-timeout T`, the agent reports how
  long the worker had been silent when it found it hung; minus T, that is the detection
  latency (median and max over runs).

    python benches/hang_bench.py [--calls 1000000] [--runs 5] [--timeout 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap

COST_WORKER = textwrap.dedent(
    """
    import sys, time, elastix
    calls = int(sys.argv[1])
    start = time.perf_counter_ns()
    for _ in range(calls):
        elastix.heartbeat()
    beat = (time.perf_counter_ns() - start) / calls
    blocks = calls // 10
    start = time.perf_counter_ns()
    for _ in range(blocks):
        with elastix.timer.expires(after=60):
            pass
    timer = (time.perf_counter_ns() - start) / blocks
    print(f"RESULT {beat:.1f} {timer:.1f}", flush=True)
    """
)

HUNG_WORKER = textwrap.dedent(
    """
    import time, elastix
    elastix.heartbeat()
    time.sleep(600)
    """
)


def elastix_run(script: str, *args: str, flags=()) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "elastix", "run", "--standalone", *flags, script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def elastix_costs(calls: int, workdir: str) -> "tuple[float, float]":
    script = os.path.join(workdir, "cost.py")
    with open(script, "w") as f:
        f.write(COST_WORKER)
    done = elastix_run(script, str(calls))
    found = re.search(r"RESULT (\S+) (\S+)", done.stdout)
    if not found:
        raise SystemExit(f"the cost worker failed:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)), float(found.group(2))


def torch_timer_cost(blocks: int, workdir: str) -> "float | None":
    try:
        from torch.distributed.elastic.timer import FileTimerClient, FileTimerServer, expires
    except ImportError:
        return None
    import time

    path = os.path.join(workdir, "torch_timer")
    server = FileTimerServer(path, run_id="bench", max_interval=0.1)
    server.start()
    try:
        client = FileTimerClient(path)
        start = time.perf_counter_ns()
        for _ in range(blocks):
            with expires(after=60, client=client):
                pass
        return (time.perf_counter_ns() - start) / blocks
    finally:
        server.stop()


def detection(runs: int, timeout: float, workdir: str) -> "list[float]":
    script = os.path.join(workdir, "hung.py")
    with open(script, "w") as f:
        f.write(HUNG_WORKER)
    latencies = []
    for _ in range(runs):
        done = elastix_run(script, flags=["--worker-timeout", str(timeout)])
        found = re.search(r"no heartbeat for (\d+\.\d+)s", done.stderr)
        if not found:
            raise SystemExit(f"no hang was reported:\n{done.stderr}")
        latencies.append(float(found.group(1)) - timeout)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastix-hang-bench-") as workdir:
        beat, timer = elastix_costs(args.calls, workdir)
        # torch sends each acquire and release through a FIFO its server drains every 0.1 s: few
        theirs = torch_timer_cost(100, workdir)
        latencies = detection(args.runs, args.timeout, workdir)
    print(f"{'':<32}{'elastix':>12}{'torch':>12}{'ratio':>8}")
    print(f"{'heartbeat() per call':<32}{beat:>10.0f}ns{'(none)':>12}")
    if theirs is None:
        print(f"{'timer block per enter+exit':<32}{timer:>10.0f}ns{'n/a':>12}   (torch not installed)")
    else:
        print(f"{'timer block per enter+exit':<32}{timer:>10.0f}ns{theirs:>10.0f}ns{theirs / timer:>7.0f}x")
    print(
        f"detection after --worker-timeout {args.timeout:g}s: median {statistics.median(latencies) * 1000:.0f} ms, "
        f"max {max(latencies) * 1000:.0f} ms over {len(latencies)} runs (reported with 10 ms resolution)"
    )


if __name__ == "__main__":
    main()

"""Agent overhead benchmark: the CPU the agent process itself uses while it supervises idle
workers, with its metrics endpoint on and scraped, next to the same run with metrics off and to
torchrun's agent (when torch is installed) in the same run.

The agent's own utime + stime (/proc/PID/stat, its children excluded) over a window that starts
once every worker runs; the figure is a share of one core.

    python benches/agent_cpu_bench.py [--workers 8] [--seconds 20] [--scrape-every 5]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

IDLE_WORKER = r"""
import os, time
out = os.environ["OUT_DIR"]
open(os.path.join(out, "started_" + os.environ["LOCAL_RANK"]), "w").close()
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.5)
"""
TICKS = os.sysconf("SC_CLK_TCK")
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` itself, in seconds (clock-tick resolution: 10 ms, usually)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # fields 14 and 15 of stat(5)


def cpu_seconds_precise(pid: int) -> float:
    """Time on CPU of the live threads of `pid`, in seconds, to the nanosecond (schedstat); a
    thread that ends within the window takes its time with it, so this can under-count."""
    total = 0
    for stat in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(stat) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def measure(command: list[str], workers: int, seconds: float, scrape_every: float | None) -> tuple[float, float, int]:
    """The agent's CPU share of one core over `seconds` (utime + stime, and the threads'
    schedstat), and how many scrapes were served."""
    out = tempfile.mkdtemp(prefix="elastix-agent-cpu-")
    with open(os.path.join(out, "worker.py"), "w") as f:
        f.write(IDLE_WORKER)
    log_path = os.path.join(out, "agent.log")
    env = {**os.environ, "OUT_DIR": out}
    argv = [*command, "--standalone", "--nproc-per-node", str(workers), os.path.join(out, "worker.py")]
    with open(log_path, "w") as log:
        agent = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    scrapes = 0
    try:
        started = os.path.join(out, "started_*")
        wait_until(lambda: len(glob.glob(started)) == workers, 120, "the workers to start")
        port = None
        if scrape_every is not None:
            found = wait_until(
                lambda: re.search(r"metrics on http://[^ ]*:(\d+)/", open(log_path).read()), 30, "metrics"
            )
            port = int(found.group(1))
        time.sleep(2)  # warm-up: standby interpreters and log setup are behind us
        before, precise, start = cpu_seconds(agent.pid), cpu_seconds_precise(agent.pid), time.monotonic()
        next_scrape = start
        while time.monotonic() - start < seconds:
            if port is not None and time.monotonic() >= next_scrape:
                with DIRECT.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                    reply.read()
                scrapes += 1
                next_scrape += scrape_every or seconds
            time.sleep(0.05)
        used, used_precise = cpu_seconds(agent.pid) - before, cpu_seconds_precise(agent.pid) - precise
        elapsed = time.monotonic() - start
    finally:
        open(os.path.join(out, "stop"), "w").close()
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        shutil.rmtree(out, ignore_errors=True)
    return used / elapsed, max(used_precise, 0.0) / elapsed, scrapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--scrape-every", type=float, default=5.0, help="seconds between scrapes (Prometheus: 15)")
    args = parser.parse_args()
    elastix = [sys.executable, "-m", "elastix", "run"]
    runs = {
        "elastix, metrics on": ([*elastix, "--metrics-port", "0"], args.scrape_every),
        "elastix, metrics off": (elastix, None),
    }
    torchrun = shutil.which("torchrun")
    if torchrun:
        runs["torchrun"] = ([torchrun], None)
    print(f"agent CPU while supervising {args.workers} idle workers, over {args.seconds:.0f} s (share of one core)")
    figures = {}
    for name, (command, scrape_every) in runs.items():
        ticks, share, scrapes = measure(command, args.workers, args.seconds, scrape_every)
        figures[name] = max(share, ticks)
        served = f", {scrapes} scrapes served" if scrape_every is not None else ""
        print(
            f"  {name:<22} {share * 100:7.4f}% (schedstat); {ticks * 100:6.3f}% (utime+stime, {1000 / TICKS:.0f} ms ticks){served}"
        )
    if "torchrun" in figures and figures["elastix, metrics on"] > 0:
        print(f"  torchrun / elastix (metrics on): {figures['torchrun'] / figures['elastix, metrics on']:.1f}x")
    elif "torchrun" not in figures:
        print("  torchrun: not installed (pip install -e '.[bench]' for the comparison)")
    verdict = "meets" if figures["elastix, metrics on"] < 0.01 else "MISSES"
    print(f"target < 1% of one core with metrics on: {verdict}")


if __name__ == "__main__":
    main()

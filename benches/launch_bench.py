"""Launcher benchmark: the overhead of starting a job, and how fast a failed job is running
again; `elastix run` against `torchrun` (when torch is installed) in the same run.

* launch: wall time of `--standalone --nproc-per-node 2` on a no-op script (median of runs),
  next to a plain `python noop.py` for the floor.
* restart: a worker exits 1; time from that exit to the moment every worker of the next
  attempt is running (its first line), median over several restarts.

    python benches/launch_bench.py [--launches 10] [--restarts 10] [--no-standby-workers]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RESTART_WORKER = r"""
import os, sys, time
started = time.time()
out, rank = os.environ["OUT_DIR"], os.environ["RANK"]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(out, f"start_{attempt}_{rank}"), "w").write(repr(started))
if attempt < int(os.environ["RESTARTS"]) and rank == "1":
    time.sleep(0.3)  # let every worker of this attempt come up first
    open(os.path.join(out, f"fail_{attempt}"), "w").write(repr(time.time()))
    sys.exit(1)
time.sleep(0.5 if attempt < int(os.environ["RESTARTS"]) else 0)
"""


def launchers(elastix_flags: list[str]) -> dict[str, list[str]]:
    found = {"elastix": [sys.executable, "-m", "elastix", "run", *elastix_flags]}
    torchrun = shutil.which("torchrun")
    if torchrun:
        found["torchrun"] = [torchrun]
    return found


def time_launch(command: list[str], script: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(
            [*command, "--standalone", "--nproc-per-node", "2", script],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_plain_python(script: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, script], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_restarts(command: list[str], script: str, restarts: int) -> list[float]:
    out = tempfile.mkdtemp(prefix="elastix-restart-bench-")
    try:
        env = {**os.environ, "OUT_DIR": out, "RESTARTS": str(restarts)}
        subprocess.run(
            [*command, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), script],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=600,
        )
        latencies = []
        for attempt in range(restarts):
            failed = float(open(os.path.join(out, f"fail_{attempt}")).read())
            next_starts = [float(open(p).read()) for p in glob.glob(os.path.join(out, f"start_{attempt + 1}_*"))]
            latencies.append(max(next_starts) - failed)
        return latencies
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument(
        "--no-standby-workers", action="store_true", help="restart elastix's workers cold, as torchrun does"
    )
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="elastix-launch-bench-")
    noop = os.path.join(work, "noop.py")
    open(noop, "w").write("")
    restart = os.path.join(work, "restart.py")
    open(restart, "w").write(RESTART_WORKER)
    found = launchers(["--no-standby-workers"] if args.no_standby_workers else [])
    if "torchrun" not in found:
        print("torchrun not found: elastix figures only (pip install -e '.[bench]' for the comparison)")
    print(f"plain `python noop.py`: {time_plain_python(noop, args.launches) * 1000:.1f} ms")
    launch = {name: time_launch(cmd, noop, args.launches) for name, cmd in found.items()}
    restarts = {name: time_restarts(cmd, restart, args.restarts) for name, cmd in found.items()}
    print(f"{'launcher':>9} | {'launch 2 no-op workers':>22} | {'restart median':>14} | {'restart p90':>11}")
    for name in found:
        lat = sorted(restarts[name])
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        print(
            f"{name:>9} | {launch[name] * 1000:>19.1f} ms | {statistics.median(lat) * 1000:>11.1f} ms | {p90 * 1000:>8.1f} ms"
        )
    if "torchrun" in found:
        print(f"launch ratio elastix/torchrun: {launch['elastix'] / launch['torchrun']:.3f}x (target <= 0.1x)")
        speedup = statistics.median(restarts["torchrun"]) / statistics.median(restarts["elastix"])
        print(f"restart: elastix is {speedup:.1f}x faster than torchrun (target >= 5x, <= 50 ms median)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

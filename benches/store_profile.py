#!/usr/bin/env python3
"""Where each store server's time per request goes: the profile behind benches/store_bench.py's
CPU per request, for elastix-store, the embedded server, torch's libuv server and the floor
(benches/floors/epoll_store.c), under the same closed-loop load (elastix-loadgen).

Per server and connection count, over one loadgen run: CPU per request (the loadgen's
measure, as store_bench prints it) split into user and kernel time as /proc saw the run, and
wake-ups per request (voluntary context switches of every thread: the times one slept and was
woken); then, in a second run under `strace -c -f`
(which slows the server, so its counts are read as ratios, not times), the system calls per
request and the three most frequent. strace missing: that part is left out, saying so.

    python benches/store_profile.py [--duration 3] [--connections 1,256]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store_bench  # the servers and the load, shared with the benchmark

TICK = os.sysconf("SC_CLK_TCK")


def counters(pid: int) -> dict:
    """CPU seconds (user, kernel) and voluntary context switches of every thread of `pid`."""
    user = kernel = wakeups = 0.0
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task}/status") as f:
                status = f.read()
        except OSError:
            continue  # a thread that ended meanwhile
        user += int(fields[11]) / TICK
        kernel += int(fields[12]) / TICK
        switches = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        wakeups += int(switches.group(1)) if switches else 0
    return {"user": user, "kernel": kernel, "wakeups": wakeups}


def requests_of(result: dict, args) -> float:
    return result["ops_per_s"] * args.duration


def measured(loadgen, pid: int, port: int, conns: int, args) -> dict:
    """Per request: user and kernel CPU (the loadgen's measured window, split as /proc saw the
    whole run split) and wake-ups."""
    before = counters(pid)
    result = store_bench.load(loadgen, port, pid, conns, args)
    after = counters(pid)
    spent = {k: after[k] - before[k] for k in before}
    cpu = store_bench.cpu_us_per_request(result) / 1e6
    user_share = spent["user"] / max(spent["user"] + spent["kernel"], 1e-9)
    n = requests_of(result, args) * (1 + args.warmup / args.duration)  # the wake-ups span the warm-up too
    return {"user": cpu * user_share, "kernel": cpu * (1 - user_share), "wakeups": spent["wakeups"] / n}


def syscalls(loadgen, pid: int, port: int, conns: int, args) -> tuple[float, str] | None:
    """System calls per request under strace, and the three most frequent."""
    if shutil.which("strace") is None:
        return None
    out = tempfile.mktemp(prefix="elastix-strace-")
    tracer = subprocess.Popen(["strace", "-c", "-f", "-o", out, "-p", str(pid)], stderr=subprocess.DEVNULL)
    try:
        result = store_bench.load(loadgen, port, pid, conns, args)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=60)
    rows = []
    with open(out) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                rows.append((int(parts[3]), parts[-1]))
    os.unlink(out)
    rows.sort(reverse=True)
    n = requests_of(result, args)
    top = ", ".join(f"{name} {calls / n:.2f}" for calls, name in rows[:3])
    return sum(calls for calls, _ in rows) / n, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--connections", default="1,256")
    ap.add_argument("--loadgen-threads", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    store_bin, loadgen = store_bench.binaries()
    have_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    children = store_bench.Children()
    try:
        servers, _version = store_bench.start_servers(children, store_bin, args, have_torch)
        print(f"per request, {args.duration:g} s runs, {os.cpu_count()} CPUs (syscalls counted under strace)")
        head = f"{'conns':>5}  {'server':<14} {'user':>8} {'kernel':>8} {'wake-ups':>8} {'syscalls':>8}  most frequent"
        print(head + "\n" + "-" * len(head))
        for conns in [int(c) for c in args.connections.split(",")]:
            for i, (name, (proc, port)) in enumerate(servers.items()):
                found = measured(loadgen, proc.pid, port, conns, args)
                traced = syscalls(loadgen, proc.pid, port, conns, args)
                calls, top = traced if traced else (float("nan"), "(no strace here)")
                print(
                    f"{conns if i == 0 else '':>5}  {name:<14} {found['user'] * 1e6:6.2f}us {found['kernel'] * 1e6:6.2f}us "
                    f"{found['wakeups']:8.3f} {calls:8.2f}  {top}",
                    flush=True,
                )
        return 0
    finally:
        children.stop_all()


if __name__ == "__main__":
    sys.exit(main())

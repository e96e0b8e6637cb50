#!/usr/bin/env python3
"""Where each store server's time per request goes: the profile behind benches/store_bench.py's
CPU per request, for elastix-store, the embedded server, torch's libuv server and the floor
(benches/floors/epoll_store.c), under the same closed-loop load (elastix-loadgen).

Per server and connection count, over one loadgen run: CPU per request (the loadgen's
measure, as store_bench prints it) split into user and kernel time as /proc saw the run, and
wake-ups per request (voluntary context switches of every thread: the times one slept and was
woken); then, in a second run under `strace -c -f`
(which slows the server, so its counts are read as ratios, not times), the system calls per
request and the three most frequent. strace missing: that part is left out, saying so. Then,
in a third run under `perf record -g`, the share of the server's time in each path: the send
(and within it the loopback's delivery of the reply into the client), the receive, sleeping
and waking, and user code. perf missing: left out, saying so.

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


# Where a server's time goes, as perf's call graphs attribute it (each a share of all its samples,
# a path counted with everything it calls): the kernel functions that begin each path.
PATHS = {
    "send": "tcp_sendmsg",
    "delivery": "net_rx_action",  # loopback: the reply's receive into the client, run by the sender
    "receive": "tcp_recvmsg",
    "sleep+wake": "schedule",
}


def paths(loadgen, pid: int, port: int, conns: int, args) -> dict | None:
    """Shares of the server's samples under perf: each path of PATHS, and user time."""
    if shutil.which("perf") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="elastix-perf-") as recorded:
        out = os.path.join(recorded, "perf.data")
        recorder = subprocess.Popen(
            ["perf", "record", "-q", "-g", "-p", str(pid), "-o", out],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            store_bench.load(loadgen, port, pid, conns, args)
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)
        report = ["perf", "report", "-i", out, "--stdio", "-g", "none"]
        try:
            by_symbol = subprocess.run(
                [*report, "--children", "--sort", "sym"], capture_output=True, text=True, check=True
            ).stdout
            by_dso = subprocess.run([*report, "--no-children", "--sort", "dso"], capture_output=True, text=True).stdout
        except subprocess.CalledProcessError:
            return None
    children = {}
    for line in by_symbol.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+[\d.]+%\s+\[[k.]\]\s+(\S+)", line)
        if found:
            children.setdefault(found.group(2), float(found.group(1)))
    shares = {name: children.get(symbol, 0.0) for name, symbol in PATHS.items()}
    user = 0.0
    for line in by_dso.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if found and "kernel" not in found.group(2):
            user += float(found.group(1))
    shares["user"] = user
    return shares


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
        print_paths(loadgen, servers, args)
        return 0
    finally:
        children.stop_all()


def print_paths(loadgen, servers: dict, args) -> None:
    """A third run of each server under perf: the shares of its time by path."""
    if shutil.which("perf") is None:
        print("\n(no perf here: where the time goes by path is left out)")
        return
    print("\nshare of each server's time (perf call graphs; delivery is part of send)")
    names = [*PATHS, "user"]
    head = f"{'conns':>5}  {'server':<14} " + " ".join(f"{name:>10}" for name in names)
    print(head + "\n" + "-" * len(head))
    for conns in [int(c) for c in args.connections.split(",")]:
        for i, (name, (proc, port)) in enumerate(servers.items()):
            shares = paths(loadgen, proc.pid, port, conns, args)
            cells = " ".join(f"{shares[n]:9.1f}%" for n in names) if shares else "(perf failed)"
            print(f"{conns if i == 0 else '':>5}  {name:<14} {cells}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Hang detection benchmark: what heartbeats and timers cost a worker, and how soon the agent
finds a worker hung.

* heartbeat: `elastix.heartbeat()` in a worker of `elastix run` (the slot is live), per call.
* timer block: `with elastix.timer.expires(after=60): pass` in such a worker, per block; side
  by side with torch's `with expires(after=60, client=FileTimerClient(...))` against a running
  `FileTimerServer` (torch's timer for torchrun workers), when torch is installed.
* detection: a worker beats, then stops; with `--worker-timeout T`, the agent reports how
  long the worker had been silent when it found it hung; minus T, that is the detection
  latency (median and max over runs). The same for a plain program that never imports
  elastix and blocks (the agent reads its main thread's runs and its CPU from /proc).
* automatic progress: a plain program's tight Python loop (`--loop` iterations, best of 5
  passes) and its process's CPU time, without `--worker-timeout` and with `--worker-timeout 1`
  (nothing runs in the worker for it: the agent reads /proc every 100 ms).
* false alarms (`--soak SECONDS`, 600 for the README's figure): three healthy plain workers
  under `--worker-timeout 2` for that long, each waiting a lot in its own way: short sleeps of
  up to 1.5 s, I/O (fsync'd writes, a socket fed by another thread, up to 1.5 s a wait), and
  compute (NumPy, with a C call of 3 s that burns CPU now and then). Every worker found hung is
  a false alarm (the job restarts it and goes on); the figure is their count.

    python benches/hang_bench.py [--calls 1000000] [--runs 5] [--timeout 1] [--loop 20000000] [--soak 600]
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

PLAIN_HUNG_WORKER = "import threading\nthreading.Event().wait()\n"

LOOP_WORKER = textwrap.dedent(
    """
    import sys, time
    n = int(sys.argv[1])
    best = float("inf")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(5):
        start = time.perf_counter()
        x = 0
        for i in range(n):
            x += i
        best = min(best, time.perf_counter() - start)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"RESULT {best:.4f} {cpu / wall:.4f}", flush=True)
    """
)


SOAK_WORKER = textwrap.dedent(
    """
    import hashlib, os, random, socket, sys, threading, time
    import numpy as np
    end = time.monotonic() + float(sys.argv[1])
    kind = int(os.environ["LOCAL_RANK"]) % 3
    rng = random.Random(kind)
    if kind == 1:
        a, b = socket.socketpair()
        def feed():
            while True:
                time.sleep(rng.uniform(0.0, 1.5))
                b.send(b"x")
        threading.Thread(target=feed, daemon=True).start()
        path = os.path.join(os.environ["OUT_DIR"], f"io_{os.getpid()}")
    step = 0
    while time.monotonic() < end:
        if kind == 0:  # sleep-heavy
            time.sleep(rng.uniform(0.01, 1.5))
        elif kind == 1:  # I/O-heavy
            a.recv(1)
            with open(path, "wb") as f:
                f.write(os.urandom(1 << 20))
                f.flush()
                os.fsync(f.fileno())
        else:  # compute-heavy, now and then one long C call
            x = np.random.rand(256, 256)
            for _ in range(20):
                x = x @ x
                x /= np.abs(x).max()
            if step % 50 == 49:
                hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 1_500_000)
        step += 1
    print(f"SOAKED {kind} {step}", flush=True)
    """
)


def elastix_run(script: str, *args: str, flags=(), timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "elastix", "run", "--standalone", *flags, script, *args]
    env = {**os.environ, "OUT_DIR": os.path.dirname(script)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def false_alarms(seconds: float, workdir: str) -> "tuple[int, str]":
    """Workers found hung among three healthy ones over `seconds` (each one found restarts)."""
    script = os.path.join(workdir, "soak.py")
    with open(script, "w") as f:
        f.write(SOAK_WORKER)
    flags = ["--nproc-per-node", "3", "--worker-timeout", "2", "--max-restarts", "1000"]
    done = elastix_run(script, str(seconds), flags=flags, timeout=seconds * 3 + 120)
    return len(re.findall(r"is hung: ", done.stderr)), done.stdout


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


def detection(runs: int, timeout: float, workdir: str, worker: str = HUNG_WORKER) -> "list[float]":
    script = os.path.join(workdir, "hung.py")
    with open(script, "w") as f:
        f.write(worker)
    latencies = []
    for _ in range(runs):
        done = elastix_run(script, flags=["--worker-timeout", str(timeout)])
        found = re.search(r"(?:no heartbeat|used no CPU) for (\d+\.\d+)s", done.stderr)
        if not found:
            raise SystemExit(f"no hang was reported:\n{done.stderr}")
        latencies.append(float(found.group(1)) - timeout)
    return latencies


def loop_costs(iterations: int, runs: int, workdir: str) -> "dict[str, tuple[float, float]]":
    """(best pass seconds, CPU share of the process), medians over runs, per setting."""
    script = os.path.join(workdir, "loop.py")
    with open(script, "w") as f:
        f.write(LOOP_WORKER)
    settings = {"no --worker-timeout": [], "--worker-timeout 1": []}
    for _ in range(runs):
        for setting, flags in (("no --worker-timeout", []), ("--worker-timeout 1", ["--worker-timeout", "1"])):
            done = elastix_run(script, str(iterations), flags=flags)
            found = re.search(r"RESULT (\S+) (\S+)", done.stdout)
            if not found:
                raise SystemExit(f"the loop worker failed:\n{done.stdout}\n{done.stderr}")
            settings[setting].append((float(found.group(1)), float(found.group(2))))
    return {
        setting: (statistics.median(r[0] for r in results), statistics.median(r[1] for r in results))
        for setting, results in settings.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--loop", type=int, default=20_000_000)
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of healthy workers to count false alarms")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastix-hang-bench-") as workdir:
        beat, timer = elastix_costs(args.calls, workdir)
        # torch sends each acquire and release through a FIFO its server drains every 0.1 s: few
        theirs = torch_timer_cost(100, workdir)
        latencies = detection(args.runs, args.timeout, workdir)
        plain = detection(args.runs, args.timeout, workdir, PLAIN_HUNG_WORKER)
        loops = loop_costs(args.loop, args.runs, workdir)
        soak = false_alarms(args.soak, workdir) if args.soak else None
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
    print(
        f"plain blocked program found hung after --worker-timeout {args.timeout:g}s: median "
        f"{statistics.median(plain) * 1000:.0f} ms, max {max(plain) * 1000:.0f} ms over {len(plain)} runs"
    )
    (off, off_cpu), (on, on_cpu) = loops["no --worker-timeout"], loops["--worker-timeout 1"]
    print(f"tight loop of {args.loop} iterations, best of 5 passes (median of {args.runs} runs):")
    print(f"  without --worker-timeout {off:.3f} s, with it {on:.3f} s: {on / off:.3f}x")
    print(f"  the process's CPU share: {off_cpu:.3f} without, {on_cpu:.3f} with")
    if soak is not None:
        alarms, out = soak
        steps = " ".join(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("SOAKED"))
        print(
            f"false alarms over {args.soak:g} s of sleep-, I/O- and compute-heavy healthy workers under "
            f"--worker-timeout 2: {alarms} (kind and steps done: {steps})"
        )


if __name__ == "__main__":
    main()

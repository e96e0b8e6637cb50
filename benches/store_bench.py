#!/usr/bin/env python3
"""Store benchmark: elastix-store (on io_uring, and on epoll), the server embedded in elastix (what an agent or an
`elastix.TCPStore(is_master=True)` serves: io_uring's, and epoll's, which a job with a secret gets), torch's libuv TCPStore server, and the floor: the
least a conventional server pays on this machine (benches/floors/epoll_store.c, one epoll
thread, built here with cc). Same load, same run.

It prints figures and asserts nothing. Every server is driven by elastix-loadgen
(benches/loadgen), which speaks the TCPStore wire protocol itself, at 1, 16 and 256
connections; the servers are measured in turn at each connection count (alternated with
--repeat) so that background load on the machine affects all alike. Beside ops/s and latency it
prints each server's CPU per request (its CPU time over the measured window over the requests
served) and that against the floor's. torch is optional (pip install -e '.[bench]').

    python benches/store_bench.py [--duration 5] [--connections 1,16,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Runs in its own process: torch's libuv server lives on a thread of whoever creates it.
TORCH_SERVER = (
    "import time, torch, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=True)\n"
    "print(s.port, torch.__version__, flush=True)\n"
    "time.sleep(1e9)\n"
)

# The server elastix embeds (an agent's, a master TCPStore's), alone in its process.
EMBEDDED_SERVER = (
    "import time, elastix\n"
    "s = elastix.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(1e9)\n"
)
FLOOR_SOURCE = REPO / "benches" / "floors" / "epoll_store.c"

TARGET_OPS_RATIO = 2.0  # design.md: >= 2x torch's ops/s at 256 connections ...
TARGET_P99_RATIO = 0.5  # ... with p99 <= 0.5x torch's
TARGET_FLOOR = {1: 1.0, 256: 0.85}  # issue 43: CPU per request against the floor's


def binaries() -> tuple[Path, Path]:
    """The release builds of the server and the load generator, built every time: a stale
    binary would measure old code (cargo does nothing when they are current)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    cmd = ["cargo", "build", "--release", "-q", "-p", "elastix-store", "-p", "elastix-loadgen"]
    subprocess.run(cmd, cwd=REPO, check=True)
    return target / "release" / "elastix-store", target / "release" / "elastix-loadgen"


def floor_binary() -> Path | None:
    """The floor server, compiled into a temporary directory; None without a C compiler."""
    built = tempfile.mkdtemp(prefix="elastix-floor-")
    atexit.register(shutil.rmtree, built, ignore_errors=True)  # the binary lives as long as the bench
    out = Path(built) / "epoll_store"
    try:
        subprocess.run(["cc", "-O2", "-o", str(out), str(FLOOR_SOURCE)], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"store_bench: no floor server ({err})", file=sys.stderr)
        return None
    return out


class Children:
    """Every process the benchmark starts, so that all of them are stopped on any exit."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, object]] = []

    def start(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = tempfile.TemporaryFile(mode="w+")  # stderr kept aside, shown if it fails
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.procs.append((proc, log))
        return proc

    def stderr_of(self, proc: subprocess.Popen) -> str:
        for p, log in self.procs:
            if p is proc:
                log.seek(0)
                return log.read()
        return ""

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def first_line(children: Children, proc: subprocess.Popen, what: str, timeout: float) -> str:
    """The first stdout line of a server, which tells its port; fails if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            break
    proc.poll()
    status = "still running" if proc.returncode is None else f"exit status {proc.returncode}"
    raise RuntimeError(
        f"{what} printed no port within {timeout:.0f} s ({status}); its stderr:\n{children.stderr_of(proc)[-2000:]}"
    )


def start_servers(
    children: Children, store_bin: Path, args: argparse.Namespace, have_torch: bool
) -> tuple[dict[str, tuple[subprocess.Popen, int]], str | None]:
    """Every server measured, by name: its process and port; and torch's version."""
    servers = {}
    # elastix-store on each of its servers: io_uring (its default where the kernel allows) and epoll
    for name, io in (("elastix-store", "uring"), ("store (epoll)", "epoll")):
        if io == "uring" and getattr(args, "store_threads", None):
            continue  # one thread is io_uring's: --store-threads measures the epoll server
        store_cmd = [str(store_bin), "--host", "127.0.0.1", "--port", "0", "--log-level", "warn", "--io", io]
        if io == "epoll" and getattr(args, "store_threads", None):
            store_cmd += ["--threads", str(args.store_threads)]
        store = children.start(store_cmd)
        servers[name] = (store, int(first_line(children, store, name, 30).rsplit(":", 1)[1]))
    # the embedded server on each: ELASTIX_STORE_IO picks it, as it would in an agent
    for name, io in (("embedded", "uring"), ("embedded (epoll)", "epoll")):
        embedded = children.start([sys.executable, "-c", EMBEDDED_SERVER], env={**os.environ, "ELASTIX_STORE_IO": io})
        servers[name] = (embedded, int(first_line(children, embedded, name, 60)))
    torch_version = None
    if have_torch:
        torch_proc = children.start([sys.executable, "-c", TORCH_SERVER])
        port, torch_version = first_line(children, torch_proc, "torch TCPStore", 120).split()
        servers["torch"] = (torch_proc, int(port))
    floor_bin = None if getattr(args, "no_floor", False) else floor_binary()
    if floor_bin:
        floor = children.start([str(floor_bin)])
        servers["floor"] = (floor, int(first_line(children, floor, "the floor server", 30)))
    return servers, torch_version


def load(loadgen: Path, port: int, server_pid: int, connections: int, args) -> dict:
    """One elastix-loadgen run; its JSON line, which includes the server's CPU share."""
    cmd = [
        str(loadgen),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--json",
        "--connections",
        str(connections),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.loadgen_threads),
        "--server-pid",
        str(server_pid),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 300)
    if done.returncode != 0:
        raise RuntimeError(f"elastix-loadgen failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(results: list[dict]) -> dict:
    """The run with the median ops/s (the lower middle one for an even count)."""
    return sorted(results, key=lambda r: r["ops_per_s"])[(len(results) - 1) // 2]


def fmt_us(us: float) -> str:
    return f"{us:6.0f} us" if us < 10_000 else f"{us / 1000:6.1f} ms"


def cpu_us_per_request(r: dict) -> float:
    """The server's CPU time over the measured window, per request served."""
    return r["server_cpu_pct"] / 100 / r["ops_per_s"] * 1e6


def table(rows: list[tuple[int, dict[str, dict]]]) -> str:
    head = (
        f"{'connections':>11}  {'server':<16} {'ops/s':>9} {'p50':>9} {'p99':>9} {'server CPU':>10} "
        f"{'loadgen CPU':>11} {'CPU/request':>11} {'x floor':>7} {'ops/s x torch':>13}"
    )
    lines = [head, "-" * len(head)]
    for conns, by_server in rows:
        floor, torch = by_server.get("floor"), by_server.get("torch")
        for i, (name, r) in enumerate(by_server.items()):
            per = cpu_us_per_request(r)
            vs_floor = f"{per / cpu_us_per_request(floor):6.2f}x" if floor else f"{'-':>7}"
            vs_torch = f"{r['ops_per_s'] / torch['ops_per_s']:12.2f}x" if torch else f"{'-':>13}"
            lines.append(
                f"{conns if i == 0 else '':>11}  {name:<16} {r['ops_per_s'] / 1000:8.1f}k {fmt_us(r['p50_us'])} "
                f"{fmt_us(r['p99_us'])} {r['server_cpu_pct']:9.0f}% {r['loadgen_cpu_pct']:10.0f}% "
                f"{per:8.2f} us {vs_floor} {vs_torch}"
            )
    return "\n".join(lines)


def verdict(rows: list[tuple[int, dict[str, dict]]]) -> list[str]:
    """design.md's target against torch, and issue 43's against the floor, printed (a
    benchmark reports, never fails)."""
    said = []
    for conns, by_server in rows:
        e = by_server.get("elastix-store") or by_server["store (epoll)"]
        t, floor = by_server.get("torch"), by_server.get("floor")
        if conns == 256 and t:
            ops, p99 = e["ops_per_s"] / t["ops_per_s"], e["p99_us"] / t["p99_us"]
            met = ops >= TARGET_OPS_RATIO and p99 <= TARGET_P99_RATIO
            said.append(
                f"target at 256 connections (ops/s >= {TARGET_OPS_RATIO}x torch, p99 <= "
                f"{TARGET_P99_RATIO}x torch): {'met' if met else 'NOT met'} "
                f"({ops:.2f}x ops/s, {p99:.2f}x p99)"
            )
        target = TARGET_FLOOR.get(conns)
        if floor and target:
            vs = cpu_us_per_request(e) / cpu_us_per_request(floor)
            said.append(
                f"target at {conns} connection(s) (CPU per request <= {target}x the floor's): "
                f"{'met' if vs <= target else 'NOT met'} ({vs:.2f}x)"
            )
    return said


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per run (5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run (1)")
    ap.add_argument("--connections", default="1,16,256", help="comma-separated (1,16,256)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per server and connection count, alternating; the median is shown (1)",
    )
    ap.add_argument("--loadgen-threads", type=int, default=1, help="load generator threads (1)")
    ap.add_argument(
        "--store-threads", type=int, help="elastix-store worker threads (default: its own default, one per CPU)"
    )
    ap.add_argument("--no-torch", action="store_true", help="leave torch's server out")
    ap.add_argument("--no-floor", action="store_true", help="leave the floor server out")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    counts = [int(c) for c in args.connections.split(",") if c.strip()]
    args.repeat = max(1, args.repeat)
    store_bin, loadgen = binaries()
    have_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    # SIGTERM unwinds like Ctrl-C, so the finally below stops every child either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    children = Children()
    try:
        servers, torch_version = start_servers(children, store_bin, args, have_torch)
        rows, runs = [], []
        for conns in counts:
            measured: dict[str, list[dict]] = {name: [] for name in servers}
            for rep in range(args.repeat):  # in turn, so background load hits all alike
                for name, (proc, port) in servers.items():
                    print(f"{conns} connections, run {rep + 1}/{args.repeat}: {name} ...", file=sys.stderr, flush=True)
                    measured[name].append(load(loadgen, port, proc.pid, conns, args))
            rows.append((conns, {name: median_run(found) for name, found in measured.items()}))
            runs.append({"connections": conns, **measured})

        print(
            f"\nTCPStore server, {args.duration:g} s per run after {args.warmup:g} s warm-up, "
            f"{os.cpu_count()} CPUs; ops are SET/GET/ADD requests, p50/p99 per round trip"
            + (f"; median of {args.repeat} runs by ops/s" if args.repeat > 1 else "")
        )
        if torch_version:
            print(f"torch {torch_version} libuv server")
        elif args.no_torch:
            print("torch not measured (--no-torch)")
        else:
            print("torch is not installed, so there is no comparison (pip install -e '.[bench]')")
        print(table(rows))
        for line in verdict(rows):
            print(line)
        for name in ("elastix-store", "store (epoll)"):
            warnings = children.stderr_of(servers[name][0]).strip() if name in servers else ""
            if warnings:
                print(f"\n{name} stderr:\n" + "\n".join(warnings.splitlines()[-20:]))
        if args.json:
            out = {
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "cpus": os.cpu_count(),
                "repeat": args.repeat,
                "torch_version": torch_version,
                "median": [{"connections": c, **by_server} for c, by_server in rows],
                "runs": runs,
            }
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    except (RuntimeError, subprocess.SubprocessError, OSError) as err:
        print(f"store_bench: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("store_bench: interrupted", file=sys.stderr)
        return 130
    finally:
        children.stop_all()


if __name__ == "__main__":
    sys.exit(main())

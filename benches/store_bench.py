#!/usr/bin/env python3
"""Store benchmark: elastix-store against torch's libuv TCPStore server, same load, same run.

It prints figures and asserts nothing. Both servers are driven by elastix-loadgen
(benches/loadgen), which speaks the TCPStore wire protocol itself, at 1, 16 and 256
connections; the two servers are measured alternately at each connection count so that
background load on the machine affects both alike. torch is optional (pip install -e '.[bench]').

    python benches/store_bench.py [--duration 5] [--connections 1,16,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
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

TARGET_OPS_RATIO = 2.0  # design.md: >= 2x torch's ops/s at 256 connections ...
TARGET_P99_RATIO = 0.5  # ... with p99 <= 0.5x torch's


def binaries() -> tuple[Path, Path]:
    """The release builds of the server and the load generator, built every time: a stale
    binary would measure old code (cargo does nothing when they are current)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    cmd = ["cargo", "build", "--release", "-q", "-p", "elastix-store", "-p", "elastix-loadgen"]
    subprocess.run(cmd, cwd=REPO, check=True)
    return target / "release" / "elastix-store", target / "release" / "elastix-loadgen"


class Children:
    """Every process the benchmark starts, so that all of them are stopped on any exit."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, object]] = []

    def start(self, cmd: list[str]) -> subprocess.Popen:
        log = tempfile.TemporaryFile(mode="w+")  # stderr kept aside, shown if it fails
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
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


def fmt_ops(r: dict | None) -> str:
    return f"{r['ops_per_s'] / 1000:8.1f}k" if r else f"{'-':>9}"


def fmt_us(r: dict | None, key: str) -> str:
    if not r:
        return f"{'-':>9}"
    us = r[key]
    return f"{us:6.0f} us" if us < 10_000 else f"{us / 1000:6.1f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else f"{'-':>6}"


def table(rows: list[tuple[int, dict, dict | None]]) -> str:
    head = (
        f"{'connections':>11} | {'elastix ops/s':>13} {'p50':>9} {'p99':>9} | "
        f"{'torch ops/s':>11} {'p50':>9} {'p99':>9} | {'ops/s e/t':>9} | {'p99 e/t':>7}"
    )
    lines = [head, "-" * len(head)]
    for conns, e, t in rows:
        lines.append(
            f"{conns:>11} | {fmt_ops(e):>13} {fmt_us(e, 'p50_us')} {fmt_us(e, 'p99_us')} | "
            f"{fmt_ops(t):>11} {fmt_us(t, 'p50_us')} {fmt_us(t, 'p99_us')} | "
            f"{ratio(e['ops_per_s'], t and t['ops_per_s']):>9} | "
            f"{ratio(e['p99_us'], t and t['p99_us']):>7}"
        )
    lines.append("")
    lines.append("CPU over each measured window, % of one core (server / loadgen):")
    for conns, e, t in rows:
        torch_cpu = f"torch {t['server_cpu_pct']:.0f}% / {t['loadgen_cpu_pct']:.0f}%" if t else ""
        lines.append(
            f"  {conns:>4} connections: elastix {e['server_cpu_pct']:.0f}% / "
            f"{e['loadgen_cpu_pct']:.0f}%   {torch_cpu}".rstrip()
        )
    return "\n".join(lines)


def verdict(rows: list[tuple[int, dict, dict | None]]) -> str | None:
    """design.md's target at 256 connections, printed (a benchmark reports, never fails)."""
    for conns, e, t in rows:
        if conns == 256 and t:
            ops, p99 = e["ops_per_s"] / t["ops_per_s"], e["p99_us"] / t["p99_us"]
            met = ops >= TARGET_OPS_RATIO and p99 <= TARGET_P99_RATIO
            return (
                f"target at 256 connections (ops/s >= {TARGET_OPS_RATIO}x torch, p99 <= "
                f"{TARGET_P99_RATIO}x torch): {'met' if met else 'NOT met'} "
                f"({ops:.2f}x ops/s, {p99:.2f}x p99)"
            )
    return None


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
    ap.add_argument("--no-torch", action="store_true", help="measure elastix only")
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
        store_cmd = [str(store_bin), "--host", "127.0.0.1", "--port", "0", "--log-level", "warn"]
        if args.store_threads:
            store_cmd += ["--threads", str(args.store_threads)]
        store = children.start(store_cmd)
        store_port = int(first_line(children, store, "elastix-store", 30).rsplit(":", 1)[1])
        torch_proc = torch_port = torch_version = None
        if have_torch:
            torch_proc = children.start([sys.executable, "-c", TORCH_SERVER])
            port, torch_version = first_line(children, torch_proc, "torch TCPStore", 120).split()
            torch_port = int(port)

        rows, runs = [], []
        for conns in counts:
            es, ts = [], []
            for rep in range(args.repeat):  # alternate, so background load hits both alike
                print(f"{conns} connections, run {rep + 1}/{args.repeat}: elastix ...", file=sys.stderr, flush=True)
                es.append(load(loadgen, store_port, store.pid, conns, args))
                if torch_proc:
                    print(f"{conns} connections, run {rep + 1}/{args.repeat}: torch ...", file=sys.stderr, flush=True)
                    ts.append(load(loadgen, torch_port, torch_proc.pid, conns, args))
            rows.append((conns, median_run(es), median_run(ts) if ts else None))
            runs.append({"connections": conns, "elastix": es, "torch": ts or None})

        print(
            f"\nTCPStore server, {args.duration:g} s per run after {args.warmup:g} s warm-up, "
            f"{os.cpu_count()} CPUs; ops are SET/GET/ADD requests, p50/p99 per round trip"
            + (f"; median of {args.repeat} runs by ops/s" if args.repeat > 1 else "")
        )
        if torch_proc:
            print(f"torch {torch_version} libuv server")
        elif args.no_torch:
            print("torch not measured (--no-torch)")
        else:
            print("torch is not installed, so there is no comparison (pip install -e '.[bench]')")
        print(table(rows))
        line = verdict(rows)
        if line:
            print(line)
        warnings = children.stderr_of(store).strip()
        if warnings:
            print("\nelastix-store stderr:\n" + "\n".join(warnings.splitlines()[-20:]))
        if args.json:
            out = {
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "cpus": os.cpu_count(),
                "repeat": args.repeat,
                "torch_version": torch_version,
                "median": [{"connections": c, "elastix": e, "torch": t} for c, e, t in rows],
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

#!/usr/bin/env python3
"""Connect storm benchmark: N clients start at once, as the ranks of a large job do. Each
connects, sends VALIDATE and PING (torch's client handshake), ADDs itself to one counter and
WAITs for the key the last one sets. elastix-loadgen --storm (benches/loadgen) times the
phases: when the slowest client was connected, validated (PING echoed), added and released.

N = 200 runs against elastix-store (on io_uring, and on epoll: "epoll") and torch's libuv
TCPStore server side by side (torch is optional: pip install -e '.[bench]'); larger N against
elastix-store alone (torch's server takes minutes there). A fresh server per storm, so no storm inherits another's connections.
It prints figures and asserts nothing.

    python benches/storm_bench.py [--clients 200,1000,4000,8000,16000] [--torch-clients 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys

from store_bench import TORCH_SERVER, Children, binaries, first_line

HOLD_S = 3.0  # the storm's connections stay open this long after it, for the server's RSS


def storm(loadgen, port: int, server_pid: int, clients: int, threads: int, timeout: float) -> dict:
    """One storm; with the server's resident size while its clients are still connected."""
    cmd = [str(loadgen), "--storm", "--json", "--port", str(port), "--connections", str(clients)]
    # from 16 loopback addresses, as from 16 hosts: one address's ephemeral ports would make
    # the generator's own connects the bottleneck (see benches/loadgen/src/storm.rs)
    cmd += ["--threads", str(threads), "--hold", str(HOLD_S), "--sources", "16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once every client is released; they stay connected
        result = json.loads(line) if line.strip() else None
        if result is not None:
            result["rss_connected_kib"] = rss_kib(server_pid)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"elastix-loadgen --storm failed ({proc.returncode}): {err.strip()[-500:]}")
    return result


def server(children: Children, which: str, store_bin) -> tuple[object, int]:
    """A fresh server: (process, port)."""
    if which in ("elastix", "epoll"):
        io = "uring" if which == "elastix" else "epoll"
        cmd = [str(store_bin), "--host", "127.0.0.1", "--port", "0", "--log-level", "warn", "--io", io]
        proc = children.start(cmd)
        return proc, int(first_line(children, proc, "elastix-store", 30).rsplit(":", 1)[1])
    proc = children.start([sys.executable, "-c", TORCH_SERVER])
    return proc, int(first_line(children, proc, "torch TCPStore", 120).split()[0])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="200,1000,4000,8000,16000", help="storm sizes for elastix-store")
    parser.add_argument("--torch-clients", default="200", help="storm sizes also run against torch's server")
    parser.add_argument("--threads", type=int, default=2, help="client threads of the generator")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on one storm, seconds")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    sizes = [int(n) for n in args.clients.split(",") if n.strip()]
    torch_sizes = {int(n) for n in args.torch_clients.split(",") if n.strip()}
    have_torch = importlib.util.find_spec("torch") is not None
    # the generator and the server each hold one descriptor per client
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    largest = hard - 100
    store_bin, loadgen = binaries()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    try:
        for clients in sizes:
            if clients > largest:
                print(f"{clients} clients: skipped, the open-file limit is {hard}", file=sys.stderr)
                continue
            for which in ("elastix", "epoll", "torch"):
                if which == "torch" and not (have_torch and clients in torch_sizes):
                    continue
                children = Children()
                try:
                    proc, port = server(children, which, store_bin)
                    idle = rss_kib(proc.pid)
                    print(f"{clients} clients against {which} ...", file=sys.stderr, flush=True)
                    result = storm(loadgen, port, proc.pid, clients, args.threads, args.timeout)
                    result.update(server=which, rss_idle_kib=idle)
                    rows.append(result)
                finally:
                    children.stop_all()
    except (RuntimeError, subprocess.SubprocessError, OSError) as err:
        print(f"storm_bench: {err}", file=sys.stderr)
        return 1
    print(f"\nconnect storm, {os.cpu_count()} CPUs, {args.threads} generator threads; ms from the first connect")
    print(
        f"{'server':<8} {'clients':>8} {'connected':>10} {'validated':>10} {'added':>10} {'released':>10} {'RSS/client':>11}"
    )
    for r in rows:
        per = (r["rss_connected_kib"] - r["rss_idle_kib"]) * 1024 / r["clients"]
        print(
            f"{r['server']:<8} {r['clients']:>8} {r['connected_ms']:>10.1f} {r['validated_ms']:>10.1f} "
            f"{r['added_ms']:>10.1f} {r['released_ms']:>10.1f} {per:>9.0f} B"
        )
    for clients in sorted(torch_sizes):
        pair = {r["server"]: r for r in rows if r["clients"] == clients}
        if len(pair) == 2:
            ratio = pair["torch"]["released_ms"] / max(pair["elastix"]["released_ms"], 1e-3)
            print(f"{clients} clients: torch's server releases them {ratio:.0f}x later than elastix-store")
    if not have_torch:
        print("torch is not installed, so there is no comparison (pip install -e '.[bench]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

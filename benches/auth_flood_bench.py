"""A member's connect + authenticate latency, and a rendezvous round's join time, while
strangers without the secret flood the store, against no flood.

    python benches/auth_flood_bench.py [--runs 3] [--connects 1000] [--nodes 128] [--rate 2000]

An `elastix-store` with a job secret listens on 127.0.0.1. The flood (tests/flood.py) keeps up
to 3000 silent connections open to it and reopens each one the store closes, at most `--rate`
new connections a second: from one address (127.0.0.2), then from 16 (127.0.0.2-17, which
together fill the store's places for connections waiting to authenticate), silent, and from
one address sending one byte below 0x80 each (as a plain torch client starts) then silence. Members are
`elastix-rdzv-bench --endpoint ... --secret`: `--connects` timed one after another (TCP connect,
the pair handshake, VALIDATE, PING), and one round of `--nodes` simulated nodes joining at once.
torch's TCPStore has no authentication, so there is no peer to compare with: the ratio is
against the same store without a flood.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "target", "release", "elastix-rdzv-bench")
FLOOD = os.path.join(REPO, "tests", "flood.py")
SECRET = "elastix-rdzv-bench's job secret"  # the one `elastix-rdzv-bench --secret` proves


def bench(*args: str) -> dict:
    out = subprocess.run([BENCH, *args], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connects", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rate", type=float, default=2000.0, help="the flood's new connections a second")
    args = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "elastix-rdzv-bench"], cwd=REPO, check=True)
    work = tempfile.mkdtemp(prefix="elastix-flood-bench-")  # mode 0700
    secret = os.path.join(work, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET)
    port = free_port()
    serve = ["--host", "127.0.0.1", "--port", str(port), "--auth-token-file", secret]
    store = subprocess.Popen(
        [sys.executable, "-m", "elastix", "store", *serve],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = ["--endpoint", f"127.0.0.1:{port}", "--secret"]
    modes = {
        "no flood": ([], []),
        "silent, 1 address": (["127.0.0.2"], []),
        "silent, 16 addresses": ([f"127.0.0.{i}" for i in range(2, 18)], []),
        "one byte, 1 address": (["127.0.0.2"], ["--say", "00"]),
    }
    results: dict[str, dict[str, list]] = {mode: {"median": [], "p90": [], "round": [], "flood": []} for mode in modes}
    try:
        time.sleep(1)  # the store listens
        for run in range(args.runs):
            for index, (mode, (sources, shape)) in enumerate(modes.items()):
                flood = None
                stop = os.path.join(work, f"stop-{run}-{index}")
                stats = os.path.join(work, f"stats-{run}-{index}.json")
                if sources:
                    source_args = [arg for source in sources for arg in ("--source", source)]
                    limits = ["--per-port", "3000", "--rate", str(args.rate), "--deadline", "600", *shape]
                    ends = ["--until", stop, "--stats", stats]
                    flood = subprocess.Popen([sys.executable, FLOOD, f"127.0.0.1:{port}", *source_args, *limits, *ends])
                    time.sleep(3)  # the flood at its steady state
                connects = bench("--nodes", "1", "--connects", str(args.connects), *endpoint)
                round_ = bench("--nodes", str(args.nodes), *endpoint)
                if flood is not None:
                    open(stop, "w").close()
                    flood.wait(60)
                    with open(stats) as f:
                        results[mode]["flood"].append(json.load(f))
                results[mode]["median"].append(connects["median_us"])
                results[mode]["p90"].append(connects["p90_us"])
                results[mode]["round"].append(round_["seconds"])
    finally:
        store.terminate()
        store.wait(30)
    base = {key: statistics.median(results["no flood"][key]) for key in ("median", "p90", "round")}
    print(f"{'':>34} | " + " | ".join(f"{mode:>21}" for mode in modes))
    rows = (("connect + auth, median (us)", "median", "{:.0f}"), ("connect + auth, p90 (us)", "p90", "{:.0f}"))
    rows += ((f"rendezvous round, {args.nodes} nodes (s)", "round", "{:.3f}"),)
    for label, key, fmt in rows:
        cells = []
        for mode in modes:
            value = statistics.median(results[mode][key])
            cells.append(f"{fmt.format(value)} ({value / base[key]:.2f}x)")
        print(f"{label:>34} | " + " | ".join(f"{cell:>21}" for cell in cells))
    for mode in modes:
        for stats in results[mode]["flood"][:1]:
            print(
                f"{mode}: the flood opened {stats['opened']} connections, the store closed {stats['closed_by_server']}"
            )
    print(f"(medians of {args.runs} runs; flood at up to {args.rate:.0f} new connections/s)")


if __name__ == "__main__":
    main()

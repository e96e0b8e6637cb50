"""The job secret's cost: connect + authenticate latency, and one rendezvous round of 128
simulated nodes, with and without a secret, side by side.

    python benches/auth_bench.py [--runs 5] [--connects 2000] [--nodes 128]

Both come from `elastix-rdzv-bench` (its in-process elastix store on loopback): `--connects`
times connections one after another (TCP connect, the HMAC-SHA256 challenge-response when a
secret is set, VALIDATE, PING); a round times N nodes joining at once, each with its own
connections (every one of them authenticated). Runs alternate between the two settings so
that a slower moment of the machine falls on both. torch has no authentication to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "target", "release", "elastix-rdzv-bench")


def bench(*args: str) -> dict:
    out = subprocess.run([BENCH, *args], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--connects", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=128)
    args = parser.parse_args()
    # always: a stale binary would measure old code (cargo does nothing when it is current)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "elastix-rdzv-bench"], cwd=REPO, check=True)
    modes = {"no secret": [], "secret": []}
    connects: dict[str, list[dict]] = {mode: [] for mode in modes}
    rounds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.runs):
        for mode in modes:
            flag = ["--secret"] if mode == "secret" else []
            connects[mode].append(bench("--nodes", "1", "--connects", str(args.connects), *flag))
            rounds[mode].append(bench("--nodes", str(args.nodes), *flag)["seconds"])
    print(f"{'':>34} | {'no secret':>10} | {'secret':>10} | ratio")
    for label, key in (("connect median (us)", "median_us"), ("connect p90 (us)", "p90_us")):
        plain, secret = (statistics.median(run[key] for run in connects[mode]) for mode in modes)
        print(f"{label:>34} | {plain:>10.1f} | {secret:>10.1f} | {secret / plain:.2f}x")
    plain, secret = (statistics.median(rounds[mode]) for mode in modes)
    label = f"rendezvous, {args.nodes} nodes (s)"
    print(f"{label:>34} | {plain:>10.4f} | {secret:>10.4f} | {secret / plain:.2f}x")
    spread = {mode: f"{min(rounds[mode]):.4f}-{max(rounds[mode]):.4f}" for mode in modes}
    print(
        f"(medians of {args.runs} runs; rendezvous min-max: no secret {spread['no secret']}, secret {spread['secret']})"
    )


if __name__ == "__main__":
    main()

"""The whole fault matrix (tests/faults/matrix.py): every fault x phase x backend cell, each run
`--repeat` times on three fresh network-namespace hosts with training workers, and a table of
the outcomes (survived / clean error / invariant broken) with the recovery time (from the fault
to the first step of the round that trains after it), median and max, and what broke.

The loss window is 2 s (keep_alive_interval 250 ms x 8; etcd lease_ttl 2 s). torchrun's column:
its rendezvous runs on none of these backends' fault paths in a comparable way yet; the table
says "not run" (see the README's fault section).

Needs root, iproute2 and (for the etcd cells) etcd on PATH.

    python benches/fault_matrix.py [--repeat 3] [--only FAULT[,FAULT]] [--phase P] [--backend B]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "faults"), os.path.join(HERE, "..", "tests")]
from matrix import BACKENDS, FAULTS, PHASES, cells, run_cell  # noqa: E402
from netns import Hosts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="faults to run, comma-separated (default: all)")
    parser.add_argument("--phase", default="", help="only this phase")
    parser.add_argument("--backend", default="", help="only this backend")
    args = parser.parse_args()
    why = Hosts.available()
    if why:
        print(f"fault matrix: {why}", file=sys.stderr)
        return 2
    wanted = [
        cell
        for cell in cells()
        if (not args.only or cell[0] in args.only.split(","))
        and (not args.phase or cell[1] == args.phase)
        and (not args.backend or cell[2] == args.backend)
        and not (cell[2] == "etcd" and shutil.which("etcd") is None)
    ]
    print(f"fault matrix: {len(wanted)} cells x {args.repeat} run(s); loss window 2 s")
    rows = []
    broken = 0
    for fault, phase, backend in wanted:
        verdicts = []
        for _ in range(args.repeat):
            workdir = Path(tempfile.mkdtemp(prefix="elastix-matrix-"))
            marker = uuid.uuid4().hex  # every process the cell starts carries it (tests/agents.py)
            hosts = Hosts(3)
            started = time.monotonic()
            try:
                verdict = run_cell(fault, phase, backend, workdir, hosts, marker)
            finally:
                hosts.close()
            verdicts.append(verdict)
            print(f"  {verdict.describe()}  [{time.monotonic() - started:.0f}s]", flush=True)
            if verdict.outcome == "invariant broken":
                print(f"    logs kept in {workdir}", flush=True)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        outcomes = sorted({v.outcome for v in verdicts})
        broken += sum(v.outcome == "invariant broken" for v in verdicts)
        times = [v.recovery_s for v in verdicts if v.recovery_s is not None]
        recovery = f"{statistics.median(times):.2f} / {max(times):.2f}" if times else "-"
        rows.append((fault, phase, backend, ", ".join(outcomes), recovery))
    print()
    header = ("fault", "phase", "backend", "elastix", "recovery s (median / max)", "torchrun")
    widths = [max(len(str(row[i])) for row in [header[:5], *rows]) for i in range(5)]
    line = lambda cols: " | ".join(str(c).ljust(w) for c, w in zip(cols, [*widths, 8]))  # noqa: E731
    print(line(header))
    print("-|-".join("-" * w for w in [*widths, 8]))
    for row in rows:
        print(line((*row, "not run")))
    print()
    print("faults:   " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))
    print("phases:   " + "; ".join(f"{k}: {v}" for k, v in PHASES.items()))
    print("backends: " + "; ".join(f"{k}: {v}" for k, v in BACKENDS.items()))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

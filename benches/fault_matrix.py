"""The whole fault matrix (tests/faults/matrix.py): every fault x phase x backend cell, each run
`--repeat` times on three fresh network-namespace hosts with training workers, and a table of
the outcomes (survived / clean error / invariant broken) with the recovery time (from the fault
to the first step of the round that trains after it), median and max, and what broke.

The loss window is 2 s (keep_alive_interval 250 ms x 8; etcd lease_ttl 2 s). Where torch is
installed (here or at $TORCH_PYTHON), torchrun runs the same cells beside elastix
(benches/torchrun_cell.py: c10d and a standalone store; torchrun has no site list and its etcd
rendezvous speaks etcd's v2 API, so those cells say "n/a").

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
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "faults"), os.path.join(HERE, "..", "tests")]
import torchrun_cell  # noqa: E402
from matrix import BACKENDS, FAULTS, PHASES, Verdict, cells, run_cell  # noqa: E402
from netns import Hosts  # noqa: E402
from peer_torch import torch_python  # noqa: E402


def run_repeats(launcher: str, runner: Callable[..., Verdict], cell: tuple, repeat: int) -> List[Verdict]:
    verdicts = []
    for _ in range(repeat):
        workdir = Path(tempfile.mkdtemp(prefix=f"elastix-matrix-{launcher}-"))
        marker = uuid.uuid4().hex  # every process the cell starts carries it (tests/agents.py)
        hosts = Hosts(3)
        started = time.monotonic()
        try:
            verdict = runner(*cell, workdir, hosts, marker)
        finally:
            hosts.close()
        verdicts.append(verdict)
        print(f"  {launcher}: {verdict.describe()}  [{time.monotonic() - started:.0f}s]", flush=True)
        if verdict.outcome == "invariant broken":
            print(f"    logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return verdicts


def summary(verdicts: List[Verdict]) -> tuple:
    """(outcomes, "median / max" recovery seconds)."""
    times = [v.recovery_s for v in verdicts if v.recovery_s is not None]
    recovery = f"{statistics.median(times):.2f} / {max(times):.2f}" if times else "-"
    return ", ".join(sorted({v.outcome for v in verdicts})), recovery


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="faults to run, comma-separated (default: all)")
    parser.add_argument("--phase", default="", help="only this phase")
    parser.add_argument("--backend", default="", help="only this backend")
    parser.add_argument("--no-torch", action="store_true", help="elastix's cells only")
    args = parser.parse_args()
    why = Hosts.available()
    if why:
        print(f"fault matrix: {why}", file=sys.stderr)
        return 2
    torch: Optional[str] = None if args.no_torch else torch_python()
    wanted = [
        cell
        for cell in cells()
        if (not args.only or cell[0] in args.only.split(","))
        and (not args.phase or cell[1] == args.phase)
        and (not args.backend or cell[2] == args.backend)
        and not (cell[2] == "etcd" and shutil.which("etcd") is None)
    ]
    peer = "torchrun beside it" if torch else "torchrun not run (torch not installed here nor at $TORCH_PYTHON)"
    print(f"fault matrix: {len(wanted)} cells x {args.repeat} run(s); loss window 2 s; {peer}")
    rows = []
    broken = 0
    for cell in wanted:
        verdicts = run_repeats("elastix", run_cell, cell, args.repeat)
        broken += sum(v.outcome == "invariant broken" for v in verdicts)
        peer_cell = "not run"
        if torch and torchrun_cell.applicable(*cell):
            runner = lambda *a: torchrun_cell.run_cell(torch, *a)  # noqa: E731
            peer_cell = " ".join(summary(run_repeats("torchrun", runner, cell, args.repeat)))
        elif torch:
            peer_cell = "n/a"
        rows.append((*cell, *summary(verdicts), peer_cell))
    print()
    header = ("fault", "phase", "backend", "elastix", "recovery s (median / max)", "torchrun (recovery s)")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cols: " | ".join(str(c).ljust(w) for c, w in zip(cols, widths))  # noqa: E731
    print(line(header))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    print()
    print("faults:   " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))
    print("phases:   " + "; ".join(f"{k}: {v}" for k, v in PHASES.items()))
    print("backends: " + "; ".join(f"{k}: {v}" for k, v in BACKENDS.items()))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

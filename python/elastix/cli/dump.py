"""``elastix dump``: the Python stacks of every thread of a running job's workers (or of one
rank), from any machine that can reach the job's rendezvous store; the job goes on.

Each agent of the job has its matching workers dump their stacks (``faulthandler``, armed when
a worker imports elastix) and replies through the store. Exit status: 0 every asked worker
answered; 3 some did not (a worker that never imported elastix, a node that did not reply in
time); 4 no such job; 1 the store could not be asked or the job has no running round;
2 a bad command line (a rank not in the job included).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..ops.dump import complete, read, render
from . import status
from .envargs import EnvOption

COMPLETE, ERROR, USAGE, INCOMPLETE, NOT_FOUND = 0, 1, 2, 3, 4
DEFAULT_TIMEOUT = 10.0


def build_parser(prog: str = "elastix dump") -> argparse.ArgumentParser:
    parser = status.build_parser(prog)
    parser.description = (
        "Show the stacks of a running job's workers (every thread) without stopping them. Every option "
        "can also be set as ELASTIX_<NAME> (or torchrun's PET_<NAME>)."
    )
    parser.epilog = (
        "exit status:\n  0 every asked worker answered, 3 some did not, 4 no such job, 1 the store could not "
        "be asked\n  or the job has no running round, 2 a bad command line\n\nexamples:\n"
        "  elastix dump --rdzv-endpoint host0:29400 --rdzv-id job7\n"
        "  elastix dump --rdzv-endpoint host0:29400 --rdzv-id job7 --rank 5"
    )
    parser.add_argument(
        "--rank", action=EnvOption, type=int, default=None, pet=False, metavar="R", help="one global rank only"
    )
    parser.set_defaults(timeout=DEFAULT_TIMEOUT)
    for action in parser._actions:
        if action.dest == "timeout":
            action.help = f"bound on reaching the store and on the replies (default: {DEFAULT_TIMEOUT:g})"
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "elastix dump") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.rdzv_endpoint:
        parser.error("--rdzv-endpoint is required (the job's rendezvous store, HOST:PORT)")
    if args.rank is not None and args.rank < 0:
        parser.error(f"--rank {args.rank}: ranks are 0 or more")
    if args.rdzv_id is None:
        args.rdzv_id = "none"  # `elastix run`'s default, as torchrun's
    if args.rdzv_backend == "static":
        parser.error("--rdzv-backend static: elastix dump asks c10d and etcd jobs (a static job has no shared state)")
    try:
        sys.exit(run(args, prog))
    except KeyboardInterrupt:
        sys.exit(130)


def run(args: argparse.Namespace, prog: str = "elastix dump") -> int:
    from .._logging import setup_cli

    setup_cli("error")
    try:
        dump = read(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf, args.rank, args.timeout)
    except Exception as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE if str(err).startswith("--rank") else ERROR
    if dump is None:
        print(f"{prog}: no job with run ID {args.rdzv_id!r} at {args.rdzv_endpoint}", file=sys.stderr)
        return NOT_FOUND
    print(json.dumps(dump, indent=2) if args.json else render(dump))
    return COMPLETE if complete(dump) else INCOMPLETE


__all__ = ["main", "run", "render"]

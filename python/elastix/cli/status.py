"""``elastix status``: a job's state, read from its rendezvous store (c10d) or etcd cluster from
any machine that can reach it.

Exit status: 0 healthy (running as formed, or finished successfully); 3 degraded (a round still
forming, a member silent or lost, fewer nodes than before a loss); 4 no such job at the
endpoint (nothing listens there, or the store holds no such run); 5 the job was closed after a
failure; 1 the store could not be asked (unreachable, an unusable secret); 2 a bad command
line. A job whose store is gone with it (an agent hosted it) is reported as its agents on this
machine noted its end (elastix/ops/finished.py), with the same exit statuses.

``--json`` prints the report the Rust core reads (``rust/core/src/rendezvous/status``): one
object with a format version ``v``; fields are only ever added.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..ops.status import read, render
from ..ops.status import runs as read_runs
from .envargs import EnvArgumentParser, EnvFlag, EnvOption
from .flags import RDZV_BACKEND, RDZV_CONF, RDZV_ENDPOINT, RDZV_ID

HEALTHY, ERROR, USAGE, DEGRADED, NOT_FOUND, FAILED = 0, 1, 2, 3, 4, 5
EXIT_CODES = {"healthy": HEALTHY, "degraded": DEGRADED, "failed": FAILED}
DEFAULT_TIMEOUT = 5.0

EPILOG = """\
exit status:
  0 healthy, 3 degraded, 4 no such job, 5 the job failed, 1 the store could not be asked,
  2 a bad command line

authentication:
  a store that requires the job secret is asked with it, as `elastix run` would: --rdzv-conf
  auth_token_file=PATH, or ELASTIX_AUTH_TOKEN_FILE / ELASTIX_AUTH_TOKEN

examples:
  elastix status --rdzv-endpoint host0:29400 --rdzv-id job7
  elastix status --rdzv-endpoint host0:29400 --rdzv-id job7 --json | jq .members
  elastix status --rdzv-endpoint host0:29400 --rdzv-id job7 --watch"""


def build_parser(prog: str = "elastix status") -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=prog,
        description="Show a job's state (round, members, heartbeats, restarts, last failure) from its "
        "rendezvous store. Every option can also be set as ELASTIX_<NAME> (or torchrun's PET_<NAME>).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag in (RDZV_ENDPOINT, RDZV_ID, RDZV_BACKEND, RDZV_CONF):  # as `elastix run` takes them
        flag.add_to(parser)
    # without a run ID: the runs the store holds (`elastix run`'s default ID is torch's "none")
    parser.set_defaults(rdzv_id=None)
    parser.add_argument("--json", action=EnvFlag, pet=False, help="print the report as one JSON object")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        default=None,
        type=float,
        metavar="SECONDS",
        help="show the report again every SECONDS (default 2) until interrupted (Ctrl-C); a terminal is "
        "redrawn, other output gets one report after another",
    )
    parser.add_argument(
        "--timeout",
        action=EnvOption,
        type=float,
        default=DEFAULT_TIMEOUT,
        pet=False,
        metavar="SECONDS",
        help=f"bound on reaching the store and on each request (default: {DEFAULT_TIMEOUT:g})",
    )
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "elastix status") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.rdzv_endpoint:
        parser.error("--rdzv-endpoint is required (the job's rendezvous store, HOST:PORT)")
    if args.watch is not None and not args.watch > 0:
        parser.error(f"--watch {args.watch:g}: give a positive number of seconds")
    try:
        if args.rdzv_id is None:
            sys.exit(runs(args, prog))
        sys.exit(run(args, prog) if args.watch is None else watch(args, prog))
    except KeyboardInterrupt:
        sys.exit(130)


def runs(args: argparse.Namespace, prog: str) -> int:
    """Without ``--rdzv-id``: the runs the store holds, a headline each; the report itself when
    there is only one (``--watch`` then watches it)."""
    from .._logging import setup_cli

    setup_cli("error")
    try:
        found = read_runs(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf, args.timeout)
    except ValueError as err:
        return bad_setting(prog, err)
    except Exception as err:
        return gone(args, prog, f"{prog}: error: {err}")
    if len(found) == 1:
        args.rdzv_id = found[0]
        return run(args, prog) if args.watch is None else watch(args, prog)
    if args.json:
        print(json.dumps({"v": 1, "runs": found}))
        return HEALTHY if found else NOT_FOUND
    if not found:
        print(f"{prog}: no runs at {args.rdzv_endpoint} ({args.rdzv_backend})", file=sys.stderr)
        return NOT_FOUND
    print(f"runs at {args.rdzv_endpoint} ({args.rdzv_backend}); --rdzv-id ID shows one:")
    for run_id in found:
        try:
            report = read(args.rdzv_backend, args.rdzv_endpoint, run_id, args.rdzv_conf, args.timeout)
        except Exception as err:
            print(f"  {run_id}: cannot read it ({err})")
            continue
        headline = render(report).splitlines()[0] if report else f"job {run_id}: gone"
        print(f"  {headline}")
    return HEALTHY


def bad_setting(prog: str, err: ValueError) -> int:
    """A setting the store cannot be read with: said as it is, never answered from the jobs
    this machine remembers at the endpoint (another job may have used the same port)."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return ERROR


def gone(args: argparse.Namespace, prog: str, error: str, store_answered: bool = False) -> int:
    """No report from the store: how the job ended, if its agents noted it on this machine;
    else no job, when nothing listens at the endpoint (it ended, or has not started); else
    `error`."""
    from ..ops import finished

    records = finished.recall(args.rdzv_endpoint, args.rdzv_id)
    if records:
        if args.json:
            print(json.dumps({"v": 1, "run_id": records[0].get("run_id"), "found": True, "health": "finished",
                              "finished": records}, indent=2))  # fmt: skip
        else:
            print(finished.render(records))
        return HEALTHY if finished.succeeded(records) else FAILED
    nothing = not store_answered and args.rdzv_backend == "c10d" and finished.nothing_listens(args.rdzv_endpoint)
    if args.json and (store_answered or nothing):
        print(json.dumps({"v": 1, "run_id": args.rdzv_id, "found": False}))
    if nothing:
        which = f"with run ID {args.rdzv_id!r} " if args.rdzv_id else ""
        print(f"{prog}: no job {which}at {args.rdzv_endpoint} (finished or not started): nothing listens there, "
              "and no job that ended on this machine used it", file=sys.stderr)  # fmt: skip
        return NOT_FOUND
    print(error, file=sys.stderr)
    return NOT_FOUND if store_answered else ERROR


def watch(args: argparse.Namespace, prog: str) -> int:
    """The report every ``args.watch`` seconds until interrupted: a terminal is redrawn in place,
    anything else gets the reports one after another, each under a line with the time."""
    import time

    redraw = sys.stdout.isatty()
    while True:
        if redraw:
            sys.stdout.write("\x1b[H\x1b[2J")  # home, clear
        else:
            print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
        run(args, prog)
        sys.stdout.flush()
        time.sleep(args.watch)


def run(args: argparse.Namespace, prog: str = "elastix status") -> int:
    from .._logging import setup_cli

    setup_cli("error")  # the report is the output; reconnect chatter is not
    try:
        status = read(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf, args.timeout)
    except ValueError as err:
        return bad_setting(prog, err)
    except Exception as err:  # the store's: unreachable, refused, timed out
        return gone(args, prog, f"{prog}: error: {err}")
    if status is None:
        return gone(args, prog, f"{prog}: no job with run ID {args.rdzv_id!r} at {args.rdzv_endpoint}: the store "
                                "holds no such run", store_answered=True)  # fmt: skip
    print(json.dumps(status, indent=2) if args.json else render(status))
    return EXIT_CODES.get(status["health"], ERROR)


if __name__ == "__main__":
    main()

"""``elastix status``: a job's state, read from its rendezvous store (c10d) or etcd cluster from
any machine that can reach it.

Exit status: 0 healthy (running as formed, or finished successfully); 3 degraded (a round still
forming, a member silent or lost, fewer nodes than before a loss); 4 no such job at the
endpoint; 5 the job was closed after a failure; 1 the store could not be asked (unreachable,
refused, an unusable secret); 2 a bad command line.

``--json`` prints the report the Rust core reads (``rust/core/src/rendezvous/status``): one
object with a format version ``v``; fields are only ever added.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

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
    from .. import _core
    from .._logging import setup_cli

    setup_cli("error")
    try:
        found = _core.job_runs(args.rdzv_backend, args.rdzv_endpoint, json.dumps(args.rdzv_conf), float(args.timeout))
    except Exception as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return ERROR
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
            report = _core.job_status(
                args.rdzv_backend, args.rdzv_endpoint, run_id, json.dumps(args.rdzv_conf), float(args.timeout)
            )
        except Exception as err:
            print(f"  {run_id}: cannot read it ({err})")
            continue
        headline = render(json.loads(report)).splitlines()[0] if report else f"job {run_id}: gone"
        print(f"  {headline}")
    return HEALTHY


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
    from .. import _core
    from .._logging import setup_cli

    setup_cli("error")  # the report is the output; reconnect chatter is not
    try:
        report = _core.job_status(
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, json.dumps(args.rdzv_conf), float(args.timeout)
        )
    except Exception as err:  # a bad setting (ValueError) or the store's: unreachable, refused, timed out
        print(f"{prog}: error: {err}", file=sys.stderr)
        return ERROR
    if report is None:
        message = f"no job with run ID {args.rdzv_id!r} at {args.rdzv_endpoint}: the store holds no such run"
        if args.json:
            print(json.dumps({"v": 1, "run_id": args.rdzv_id, "found": False}))
        print(f"{prog}: {message}", file=sys.stderr)
        return NOT_FOUND
    status = json.loads(report)
    print(json.dumps(status, indent=2) if args.json else render(status))
    return EXIT_CODES.get(status["health"], ERROR)


def _ranks(ranks: List[int]) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _age(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _uptime(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["    " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


WORKERS_SHOWN = 32  # beyond this many, the ones seen longest ago (--json lists every one)


def _workers(members: List[Dict[str, Any]]) -> List[str]:
    """Each worker's progress, as its agent last published it: heartbeats, the step the last
    one named, and when it was last seen making progress (a beat or a move of its main thread)."""
    workers = [(m["group_rank"], w) for m in members for w in m.get("workers") or []]
    if not workers:
        return []
    shown, more = workers, ""
    if len(workers) > WORKERS_SHOWN:
        never = float("inf")
        shown = sorted(workers, key=lambda mw: never if mw[1]["seen_age_s"] is None else mw[1]["seen_age_s"])
        shown = shown[-WORKERS_SHOWN:]
        more = f" (the {WORKERS_SHOWN} seen longest ago of {len(workers)}; --json lists all)"
    rows = [["RANK", "GROUP RANK", "BEATS", "STEP", "LAST SEEN"]]
    for group_rank, w in sorted(shown, key=lambda mw: mw[1]["rank"]):
        step = "-" if w["step"] is None else str(w["step"])
        rows.append([str(w["rank"]), str(group_rank), str(w["beats"]), step, _age(w["seen_age_s"])])
    return [f"  workers{more}:", *_table(rows)]


def render(status: Dict[str, Any]) -> str:
    """The report for a person: a headline, then what explains it."""
    state = {"running": f"running round {status['round']}", "forming": f"round {status['round']} forming"}
    doing = state.get(status["state"], status["state"])
    where = f"{status['endpoint']} ({status['backend']})"
    lines = [f"job {status['run_id']} at {where}: {status['health'].upper()}, {doing}"]
    restarts = status["restarts"]
    allowed = "?" if restarts["allowed"] is None else restarts["allowed"]
    lines.append(
        f"  nodes: {len(status['members'])} (min {status['min_nodes']}, max {status['max_nodes']}); "
        f"waiting: {status['waiting']}, spares: {status['spares']}; restarts: {restarts['used']} of {allowed} used"
    )
    if status["problems"]:
        lines.append("  problems:")
        lines += [f"    - {problem}" for problem in status["problems"]]
    if status["members"]:
        lines.append("  members:")
        rows = [["GROUP RANK", "NODE", "HOST", "WORKERS", "RANKS", "UP", "HEARTBEAT", "METRICS"]]
        for m in status["members"]:
            workers = "-" if m["local_world_size"] is None else str(m["local_world_size"])
            metrics = "-" if m["metrics_port"] is None else f"{m['addr']}:{m['metrics_port']}"
            row = [str(m["group_rank"]), m["node"], m["host"] or "-", workers, _ranks(m["ranks"])]
            rows.append([*row, _uptime(m.get("uptime_s")), _age(m["heartbeat_age_s"]), metrics])
        lines += _table(rows)
        lines += _workers(status["members"])
    if status["arrived"]:
        lines.append(f"  arrived: {', '.join(status['arrived'])}")
    if status["lost"]:
        lines.append("  lost:")
        for lost in status["lost"]:
            who = lost["node"] or "unknown node"
            lines.append(f"    round {lost['round']}: group rank {lost['group_rank']}, {who}")
    failure = status["last_failure"]
    if failure:
        how = f"signal {failure['signal']}" if failure["signal"] else f"exit code {failure['exitcode']}"
        lines.append(
            f"  last failure: round {failure['round']}, {failure['age_s']:.0f}s ago: rank {failure['rank']} "
            f"(local rank {failure['local_rank']}) on {failure['host']}, {how}"
        )
        lines += [f"    {line}" for line in failure["message"].splitlines()[-10:]]
    if status["closed_reason"] and status["state"] not in ("succeeded",):
        lines.append(f"  closed: {status['closed_reason'].splitlines()[0]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

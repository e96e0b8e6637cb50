"""``elastix timeline``: the event logs of a run's agents (``elastix run --event-log FILE``, one
file per node or several nodes in one) drawn as one self-contained HTML page: a lane per node,
its rounds, failures, hangs, restarts and membership changes on one time axis, with the run's
outcome and root cause.

Exit status: 0 the page was written; 2 bad input (a missing file, a line that is not JSON, no
events) or a bad command line; 1 the page could not be written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

WRITTEN, ERROR, USAGE = 0, 1, 2


def build_parser(prog: str = "elastix timeline") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Draw the event logs of a run's agents (elastix run --event-log FILE) as one HTML page "
        "that needs nothing else to be viewed: a lane per node on one time axis, with the run's outcome and "
        "root cause.",
        epilog="exit status:\n  0 the page was written, 2 bad input or command line, 1 the page could not be "
        "written\n\nexamples:\n  elastix timeline node0-events.jsonl node1-events.jsonl -o job7.html\n"
        "  elastix timeline /shared/job7/*.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logs", nargs="+", metavar="EVENTS.jsonl", help="event logs, merged (one per node, or any)")
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="where to write the page (default: the first log's name, .html)"
    )
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "elastix timeline") -> None:
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    sys.exit(run(args.logs, args.output or os.path.splitext(args.logs[0])[0] + ".html", prog))


def run(logs: List[str], out: str, prog: str = "elastix timeline") -> int:
    from ..ops.timeline import TimelineError, write_page

    try:
        warnings = write_page(logs, out)
    except TimelineError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE
    except OSError as err:
        print(f"{prog}: error: cannot write {out}: {err.strerror or err}", file=sys.stderr)
        return ERROR
    for warning in warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    print(out)
    return WRITTEN

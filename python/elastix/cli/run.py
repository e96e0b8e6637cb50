"""``elastix run`` (also ``python -m elastix run``): torchrun's command line over the Rust agent.

Exit status: 0 when every worker succeeded; 1 when the job failed (the agent has printed the
root cause); 128+N when signal N stopped it; 2 for a bad command line or configuration; 3 when
every worker succeeded but this node's log files could not be written completely (a full disk:
the agent has printed which file and why). Console output nobody reads is dropped rather than
waited for, and the agent says how many lines; that alone does not change the exit status.
When this launcher is itself a worker of another launcher (TORCHELASTIC_ERROR_FILE set), the
root cause's error file is copied to its own, as torchrun's ``@record`` main does.
"""

from __future__ import annotations

import socket
import sys
from typing import Any, Dict, List, Optional

from .._logging import setup_cli
from ..agent.events import check_handler, record_outcome
from .run_config import config_from_args
from .run_flags import build_parser


def main(argv: Optional[List[str]] = None, prog: str = "elastix run") -> None:
    try:
        parser = build_parser(prog)
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        try:
            # the agent names its node so on its own lines; the CLI's lines before it too
            setup_cli(args.log_level, node=args.local_addr or socket.gethostname())
            config = config_from_args(args)
            events = check_handler(args.event_log_handler)
        except ValueError as err:
            parser.error(str(err))
        sys.exit(run(config, prog, events))
    except KeyboardInterrupt:  # before the agent took over SIGINT
        sys.exit(130)


def run(config: Dict[str, Any], prog: str = "elastix run", events: str = "null") -> int:
    """Runs the agent with an AgentConfig dict; returns the exit status. `events`: torchrun's
    --event-log-handler (see elastix.agent.events)."""
    from ..agent.call import AgentUnavailableError, run_agent

    try:
        report = run_agent(config)
    except ValueError as err:  # the agent refused the configuration
        _record_own_error(err)
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except AgentUnavailableError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        _record_own_error(err)
        print(f"{prog}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if report.get("state") == "FAILED":
        _pass_root_cause_up(report)
    record_outcome(events, report, config)
    return int(report["exit_code"])


def _record_own_error(err: BaseException) -> None:
    from ..worker.record import ErrorHandler

    handler = ErrorHandler()
    if handler.error_files():
        handler.record_exception(err)


def _pass_root_cause_up(report: Dict[str, Any]) -> None:
    """Our error file (if a launcher above us set one) gets the first failure's error file, or
    else the agent's summary, so the root cause travels up nested launchers."""
    from ..worker.record import ErrorHandler

    handler = ErrorHandler()
    if not handler.error_files():
        return
    failures = report.get("failures") or []
    if failures:
        root = min(failures, key=lambda f: (f.get("timestamp") or 0.0, f.get("global_rank") or 0))
        if root.get("error_file"):
            try:
                handler.dump_error_file(root["error_file"], int(root.get("exitcode") or 0))
                return
            except (OSError, ValueError):
                pass
    from ..errors import DistError

    summary = report.get("summary") or f"workers failed (exit code {report.get('exit_code')})"
    handler.record_exception(DistError(summary))


if __name__ == "__main__":
    main()

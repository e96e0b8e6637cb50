"""torchrun's ``--event-log-handler``: the run's outcome as torchelastic events.

``null`` (the default) records nothing; ``console`` writes one JSON event per local worker and
one for the agent to stderr when the run ends, in torch's event layout (``name``, ``source``,
``timestamp`` in milliseconds, ``metadata``) under the names torch uses
(``torchelastic.worker.status.<STATE>``), so that tools reading torchrun's event log read
elastix's. ``jsonl`` has the agent write each of its own events (every state change, see
rust/core/src/agent/events.rs) to stderr as it happens; ``--event-log FILE`` appends them to
a file whatever the handler.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any, Dict, List

HANDLERS = ("null", "console", "jsonl")


def check_handler(name: str) -> str:
    if name not in HANDLERS:
        raise ValueError(f"--event-log-handler {name!r}: use one of {', '.join(HANDLERS)}")
    return name


def outcome_events(report: Dict[str, Any], config: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The events for a finished run: one per local worker, then the agent's."""
    now = int(time.time() * 1000)
    state = report.get("state", "UNKNOWN")
    failed = {f["global_rank"]: f for f in report.get("failures") or []}
    common = {
        "run_id": config.get("run_id"),
        "role": config.get("role"),
        "group_rank": report.get("group_rank"),
        "group_world_size": report.get("group_world_size"),
        "agent_restarts": report.get("restart_count", 0),
        "rdzv_backend": config.get("rdzv_backend"),
        "hostname": socket.getfqdn(),
    }
    events = []
    for global_rank in report.get("global_ranks") or []:
        failure = failed.get(global_rank)
        worker_state = "FAILED" if failure else ("SUCCEEDED" if state == "SUCCEEDED" else state)
        metadata = {
            **common,
            "global_rank": global_rank,
            "state": worker_state,
            "exit_code": failure["exitcode"] if failure else None,
            "raw_error": failure["message"] if failure else None,
        }
        events.append(
            {"name": f"torchelastic.worker.status.{worker_state}", "source": "WORKER", "timestamp": now,
             "metadata": metadata}
        )  # fmt: skip
    agent = {**common, "global_rank": None, "state": state, "exit_code": report.get("exit_code")}
    events.append(
        {"name": f"torchelastic.worker.status.{state}", "source": "AGENT", "timestamp": now, "metadata": agent}
    )
    return events


def record_outcome(handler: str, report: Dict[str, Any], config: Dict[str, Any]) -> None:
    if handler == "console":
        for event in outcome_events(report, config):
            print(json.dumps(event), file=sys.stderr, flush=True)

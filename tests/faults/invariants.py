"""The fault matrix's invariants, judged from the agents' JSONL event logs alone (pure functions:
tests/faults/test_invariants.py feeds each one doctored logs it must reject).

1. At most one round trains at any instant. A round is its number *and* its workers' store
   (`master` in `round_formed`): two sides of a partition that each formed a "round 5" are two
   rounds. A round trains from the moment the last of its members started its workers until
   the first one stopped them (a step is an all_reduce over all of them), a member whose agent
   died ending it then.
2. A restart is charged only for a worker's own failure: the job-wide count in every
   `failure_reported`, `restart` and `round_formed` event stays within what the fault allows
   (a charge is its own event, so it shows even when the job then fails).
3. A node that exits non-zero names the fault: its reason (the `job_finished` event's root
   cause, else its last line) holds one of the fault's own words, not merely "error".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# words that name each fault in an agent's last word on it
FAULT_WORDS = {
    "worker-kill": ("sigkill", "signal", "exit code", "exited with"),
    "agent-kill": ("lost", "gone", "no heartbeat", "not coming back"),
    "host-kill": ("lost", "gone", "no heartbeat", "not coming back", "store"),
    "agent-stop": ("lost", "dropped", "stopped", "did not run", "no heartbeat"),
    "short-cut": ("minority", "cut off", "unreachable", "lost", "lease", "did not answer"),
    "long-cut": ("minority", "cut off", "unreachable", "lost", "lease", "did not answer"),
    "store-host-stop": ("store", "lost", "did not run", "no heartbeat"),
    "store-host-cut": ("store", "unreachable", "lost", "cut off"),
    "store-restart": ("store",),
    "etcd-leader-kill": ("etcd", "leader"),
}

Event = Dict[str, object]
RoundKey = Tuple[int, str]


def read_log(path: Path) -> List[Event]:
    """The events of one JSONL log (a line being written is left out)."""
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def at(event: Event) -> float:
    """An event's time, in seconds since the epoch."""
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


@dataclass
class Span:
    round: RoundKey
    start: float
    end: float

    def overlaps(self, other: "Span") -> bool:
        return self.start < other.end and other.start < self.end


def training_spans(logs: Dict[str, Sequence[Event]], died: Optional[Dict[str, float]] = None) -> List[Span]:
    """When each round trained: `logs` by host; `died`: when a host's agent was killed (its
    workers stopped then, though nothing says so in its log)."""
    died = died or {}
    members: Dict[RoundKey, Dict[str, Tuple[float, float]]] = {}
    sizes: Dict[RoundKey, int] = {}
    for host, events in logs.items():
        key: Optional[RoundKey] = None
        for event in events:
            name = event["event"]
            if name == "round_formed":
                key = (int(event["round"]), str(event.get("master", "?")))
                sizes[key] = int(event["group_world_size"])
            elif name == "workers_started" and key is not None and int(event["round"]) == key[0]:
                members.setdefault(key, {})[host] = (at(event), died.get(host, float("inf")))
            elif name in ("workers_stopped", "job_finished") and key is not None and host in members.get(key, {}):
                started, end = members[key][host]
                members[key][host] = (started, min(end, at(event)))
                key = None
    spans = []
    for key, started in members.items():
        if len(started) < sizes[key]:
            continue  # not every member started its workers: the round never trained
        start = max(begin for begin, _ in started.values())
        end = min(stop for _, stop in started.values())
        if start < end:
            spans.append(Span(key, start, end))
    return spans


def rounds_at_once(
    logs: Dict[str, Sequence[Event]], since: float, died: Optional[Dict[str, float]] = None
) -> List[str]:
    """Invariant 1: problems, one per pair of rounds that trained at the same time after `since`."""
    spans = [s for s in training_spans(logs, died) if s.end > since]
    problems = []
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if a.overlaps(b) and a.round != b.round:
                when = max(a.start, b.start, since)
                problems.append(
                    f"rounds {_name(a.round)} and {_name(b.round)} trained at the same time (at {when:.1f})"
                )
    return problems


def restarts_charged(logs: Dict[str, Sequence[Event]]) -> int:
    """The job-wide restart count the events show, at most."""
    counted = ("failure_reported", "restart", "round_formed")
    return max(
        (int(e.get("restart_count") or 0) for events in logs.values() for e in events if e["event"] in counted),
        default=0,
    )


def charged_beyond(logs: Dict[str, Sequence[Event]], fault: str, allowed: int) -> List[str]:
    """Invariant 2: a problem if more restarts were charged than the fault allows."""
    charged = restarts_charged(logs)
    return [f"{charged} restart(s) charged for {fault} (allowed: {allowed})"] if charged > allowed else []


def reason(events: Sequence[Event], last_line: str) -> str:
    """Why a node says it ended: its `job_finished` root cause, else its last line."""
    for event in reversed(events):
        if event["event"] == "job_finished" and event.get("root_cause"):
            return str(event["root_cause"])
    return last_line


def unnamed_faults(exits: Dict[str, Optional[int]], why: Dict[str, str], fault: str) -> List[str]:
    """Invariant 3: problems, one per node that exited non-zero without naming `fault`."""
    words = FAULT_WORDS[fault]
    problems = []
    for host, code in exits.items():
        if code in (0, None):
            continue
        said = why.get(host, "")
        if not any(word in said.lower() for word in words):
            problems.append(f"{host} exited {code} without naming the fault ({fault}): {said[-200:]!r}")
    return problems


def _name(key: RoundKey) -> str:
    return f"{key[0]} (workers' store {key[1]})"


def judge(
    logs: Dict[str, Sequence[Event]],
    fault: str,
    since: float,
    allowed_restarts: int,
    exits: Dict[str, Optional[int]],
    last_lines: Dict[str, str],
    died: Optional[Dict[str, float]] = None,
) -> List[str]:
    """Every invariant at once: the problems found (none: they all hold)."""
    why = {host: reason(logs.get(host, ()), line) for host, line in last_lines.items()}
    return [
        *rounds_at_once(logs, since, died),
        *charged_beyond(logs, fault, allowed_restarts),
        *unnamed_faults(exits, why, fault),
    ]


__all__: Iterable[str] = [
    "FAULT_WORDS",
    "read_log",
    "training_spans",
    "rounds_at_once",
    "restarts_charged",
    "charged_beyond",
    "reason",
    "unnamed_faults",
    "judge",
]

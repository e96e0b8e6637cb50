"""The agents' event logs (``elastix run --event-log FILE``, one JSON object a line) of a run,
merged into one timeline: a lane per node (an agent: host and pid), its rounds as bars and its
failures, hangs, restarts, membership changes and end as marks, with a summary and the root cause
of the run's last failure. ``write_page`` writes it as one self-contained HTML page (the model
as JSON in it, drawn by the page's own script: nothing is fetched when it is viewed).

Unknown events and fields are shown as they are; a line that is not JSON is an error naming
its file and line, except an unfinished last line (an agent stopped while writing it), which is
skipped with a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

Mark = Dict[str, Any]

# the fields every event has; the others are its own and are shown in its details
COMMON = ("event", "time", "run_id", "host", "pid")
POINT_KINDS = {
    "worker_failed": "failure",
    "worker_hung": "hang",
    "restart": "restart",
    "member_lost": "lost",
    "member_joined": "membership",
    "membership_changed": "membership",
    "job_finished": "end",
    "checkpoint_restore": "checkpoint",
    "straggler": "straggler",
    "straggler_cleared": "straggler",
    "preflight": "straggler",
    "left_out": "straggler",
}
LABELS = {
    "global_rank": "rank",
    "global_ranks": "ranks",
    "group_world_size": "nodes in round",
    "pids": "worker pids",
    "exitcode": "exit code",
    "exit_code": "exit code",
}
# the order details are shown in: identity first, the long texts last (unknown fields before them)
ORDER = ["round", "state", "global_rank", "local_rank", "group_rank", "group_world_size", "global_ranks", "pids",
         "worker_pid", "exitcode", "exit_code", "signal", "why", "reason", "node", "restart_count", "max_restarts",
         "root_cause", "headline", "hung", "message"]  # fmt: skip


class TimelineError(Exception):
    """Input that cannot be drawn: a missing or unreadable file, a line that is not JSON, no events."""


@dataclass
class Event:
    fields: Dict[str, Any]
    at: float  # milliseconds since the epoch, by the clock of the agent that wrote it
    source: str  # FILE:LINE


def read_events(paths: Iterable[str]) -> Tuple[List[Event], List[str]]:
    """The events of every file in time order (the same event read twice counts once) and the
    warnings about lines skipped."""
    events: List[Event] = []
    warnings: List[str] = []
    seen = set()
    for path in paths:
        found, skipped = read_file(path)
        warnings += skipped
        for event in found:
            key = json.dumps(event.fields, sort_keys=True)
            if key not in seen:
                seen.add(key)
                events.append(event)
    events.sort(key=lambda event: event.at)  # stable: a node's events keep their written order
    return events, warnings


def read_file(path: str) -> Tuple[List[Event], List[str]]:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise TimelineError(f"{path}: no such file") from None
    except OSError as err:
        raise TimelineError(f"{path}: {err.strerror or err}") from None
    lines = text.split("\n")
    events, warnings = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            fields = json.loads(line)
        except ValueError:
            if number == len(lines):  # no newline after it: the agent stopped mid-write
                warnings.append(f"{where}: skipped an unfinished last line (its agent stopped while writing it?)")
                continue
            raise TimelineError(f"{where}: not a JSON event: {_shorten(line, 60)!r}") from None
        at = _millis(fields.get("time")) if isinstance(fields, dict) else None
        if not isinstance(fields, dict) or not isinstance(fields.get("event"), str) or at is None:
            warnings.append(f"{where}: skipped: not an event with a name and a time")
            continue
        events.append(Event(fields, at, where))
    return events, warnings


def _millis(value: Any) -> Optional[float]:
    """RFC 3339 (as the agents write it: UTC, milliseconds) to milliseconds since the epoch."""
    if not isinstance(value, str):
        return None
    try:  # fromisoformat reads a trailing Z only from Python 3.11
        moment = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp() * 1000


def build(events: List[Event]) -> List[Dict[str, Any]]:
    """One run per run ID, in the order they started."""
    by_run: Dict[str, List[Event]] = {}
    for event in events:
        by_run.setdefault(str(event.fields.get("run_id", "?")), []).append(event)
    return [build_run(run_id, run_events) for run_id, run_events in by_run.items()]


def build_run(run_id: str, events: List[Event]) -> Dict[str, Any]:
    end = events[-1].at
    by_node: Dict[Tuple[str, Any], List[Event]] = {}
    for event in events:
        by_node.setdefault((str(event.fields.get("host", "?")), event.fields.get("pid")), []).append(event)
    lanes = [lane(host, pid, run_id, node_events, end) for (host, pid), node_events in by_node.items()]
    lanes.sort(key=lambda lane: (min(lane["group_ranks"], default=1 << 30), lane["start"]))
    marks = sorted((mark for lane in lanes for mark in lane["marks"]), key=lambda mark: mark["at"])
    failures = [mark for mark in marks if mark["kind"] in ("failure", "hang")]
    losses = [mark for mark in marks if mark["kind"] == "lost"]
    finished = [mark for mark in marks if mark["kind"] == "end"]
    end_lost_lanes(lanes, losses)
    restarts = [mark for mark in marks if mark["kind"] == "restart"]
    judge_restarts(restarts)
    return {
        "run_id": run_id,
        "start": events[0].at,
        "end": end,
        "nodes": len(lanes),
        "outcome": outcome([mark["state"] for mark in finished], len(lanes)),
        "restarts": max((m["restart_count"] for m in restarts if isinstance(m.get("restart_count"), int)), default=0),
        # re-forms for another node's loss or arrival, each counted once (every survivor logs it)
        "reforms": len({mark["round"] for mark in restarts if not mark["charged"]}),
        "failures": sum(mark["kind"] == "failure" for mark in failures),
        "hangs": sum(mark["kind"] == "hang" for mark in failures),
        "root_cause": root_cause(failures, losses, finished),
        "lanes": lanes,
    }


def end_lost_lanes(lanes: List[Dict[str, Any]], losses: List[Mark]) -> None:
    """A node reported lost logged nothing after (it died, or was cut off): its running round
    ends where the first report of its loss is, not at the end of the chart."""
    for loss in losses:
        node = loss.get("node")
        if not isinstance(node, str):
            continue
        for victim in lanes:
            if node.startswith(f"{victim['host']}_{victim['pid']}_") and not victim.get("lost_at"):
                victim["lost_at"] = loss["at"]
                victim["label"][-1] += " · lost"
                for bar in victim["marks"]:
                    if bar["kind"] == "round" and bar["why"] == "not logged" and bar["end"] > loss["at"] >= bar["at"]:
                        bar["end"], bar["why"] = loss["at"], "lost"
                        bar["title"] = bar["title"].replace("stopped: not logged", "lost")
                        bar["details"][1] = ["stopped", f"lost (reported after {(loss['at'] - bar['at']) / 1000:.3f}s)"]


def judge_restarts(restarts: List[Mark]) -> None:
    """Whether each restart counted against --max-restarts: as its agent said (`charged`), or,
    in logs from before that field, whether it raised the job's count."""
    highest = 0
    for mark in restarts:
        count = mark.get("restart_count")
        count = count if isinstance(count, int) and not isinstance(count, bool) else highest
        if not isinstance(mark.get("charged"), bool):
            mark["charged"] = count > highest
        highest = max(highest, count)
        if not mark["charged"]:
            reason = f": {mark['reason']}" if mark.get("reason") else ""
            mark["title"] = f"re-formed, no restart charged{reason}"


def lane(host: str, pid: Any, run_id: str, events: List[Event], run_end: float) -> Dict[str, Any]:
    """One node's lane: its rounds as bars (from its workers' start to their stop) and its
    other events as marks."""
    marks: List[Mark] = []
    formed: Dict[Any, Dict[str, Any]] = {}  # round -> its round_formed fields
    bar: Optional[Mark] = None  # the round whose workers run
    last_round = None  # the round of the last workers started: a failure's
    group_ranks: Set[int] = set()
    ranks: Set[int] = set()
    for event in events:
        fields, name = event.fields, event.fields["event"]
        if isinstance(fields.get("group_rank"), int) and name == "round_formed":
            group_ranks.add(fields["group_rank"])
        if name in ("round_formed", "workers_started", "job_finished") and bar is not None:
            _close(bar, event.at, None)  # a round that logged no stop ends where the next begins
            bar = None
        if name == "round_formed":
            formed[fields.get("round")] = fields
        elif name == "workers_started":
            ranks.update(_ints(fields.get("global_ranks")))
            bar = round_bar(event, formed.get(fields.get("round"), {}))
            last_round = next(iter(_ints([bar["round"]])), None)
            marks.append(bar)
        elif name == "workers_stopped" and bar is not None:
            _close(bar, event.at, fields.get("why"))
            bar = None
        else:
            marks.append(point(event, last_round))
    if bar is not None:
        _close(bar, run_end, None)
    groups = f"group {_plural('rank', group_ranks)} {_ranges(group_ranks)}" if group_ranks else ""
    workers = f"{_plural('rank', ranks)} {_ranges(ranks)}" if ranks else ""
    return {
        "host": host,
        "pid": pid,
        "run_id": run_id,
        "group_ranks": sorted(group_ranks),
        "ranks": sorted(ranks),
        "label": [host, " · ".join(filter(None, [groups, workers])), f"agent pid {pid} · run {run_id}"],
        "start": events[0].at,
        "marks": marks,
    }


def round_bar(started: Event, formed: Dict[str, Any]) -> Mark:
    fields = {**{k: v for k, v in formed.items() if k not in COMMON}, **started.fields}
    round_ = fields.get("round")
    ranks = _ints(fields.get("global_ranks"))
    return {
        "kind": "round",
        "round": round_,
        "at": started.at,
        "label": f"round {round_}",
        "title": f"round {round_}: {_plural('rank', ranks)} {_ranges(ranks)}",
        "details": [["started", started.fields["time"]], *details(fields), ["source", started.source]],
    }


def _close(bar: Mark, at: float, why: Optional[str]) -> None:
    bar["end"] = at
    bar["why"] = why or "not logged"
    bar["title"] += f", stopped: {bar['why']}"
    bar["details"].insert(1, ["stopped", f"{why or 'no stop logged'} after {(at - bar['at']) / 1000:.3f}s"])


def point(event: Event, last_round: Any) -> Mark:
    fields, name = event.fields, event.fields["event"]
    kind = POINT_KINDS.get(name, "other")
    mark = {
        "kind": kind,
        "event": name,
        "at": event.at,
        "end": event.at,
        "title": title(kind, fields),
        "details": [["time", fields["time"]], *details(fields), ["source", event.source]],
    }
    if kind in ("failure", "hang"):
        mark.update(round=last_round, root=fields.get("root_cause") is True, rank=fields.get("global_rank"))
        # broken by another node's loss, as the agent judged: never a root cause
        mark["consequence_of"] = fields.get("consequence_of")
        # the agent's own line (Failure::headline); the mark's title where a log lacks it
        headline = fields.get("headline")
        mark.update(headline=headline if isinstance(headline, str) else mark["title"], message=fields.get("message"))
    elif kind == "end":
        mark.update(state=str(fields.get("state") or "?"), cause=fields.get("root_cause"))
    elif kind == "restart":
        mark.update(
            round=last_round,
            restart_count=fields.get("restart_count"),
            charged=fields.get("charged"),
            reason=fields.get("reason"),
        )
    elif kind == "lost":
        mark.update(round=last_round, node=fields.get("node"))
    return mark


def title(kind: str, f: Dict[str, Any]) -> str:
    reason = f": {f['reason']}" if f.get("reason") else ""
    if kind == "failure":
        signal = f" ({f['signal']})" if f.get("signal") else ""
        return f"rank {f.get('global_rank')} failed: exit code {f.get('exitcode')}{signal}"
    if kind == "hang":
        return f"rank {f.get('global_rank')} hung"
    if kind == "restart":
        return f"restart {f.get('restart_count')} of {f.get('max_restarts')}{reason}"
    if kind == "lost":
        return f"group rank {f.get('group_rank')} lost{reason}"
    if kind == "end":
        return f"job {f.get('state')} (exit code {f.get('exit_code')})"
    if kind == "straggler" and f.get("event") == "straggler":
        slower = (f.get("compute_ms") or 0) / max(f.get("others_ms") or 0, 1e-9)
        return f"rank {f.get('rank')} on {f.get('node')} is a straggler ({slower:.1f}x the others' compute)"
    if f.get("event") == "preflight":
        named = [f"{n.get('node')} ({n.get('why')})" for n in f.get("nodes") or []]
        found = "named " + "; ".join(named) + f": {f.get('decision')}" if named else "every node fine"
        return f"pre-flight check: {found}"
    if f.get("event") == "left_out":
        return f"this node left the job: {f.get('why')}"
    if kind == "straggler":
        return f"rank {f.get('rank')} on {f.get('node')} keeps pace again"
    if kind == "checkpoint":
        taken = f.get("taken") or []
        peers = f", {_plural('rank', taken)} taken from a peer's memory" if taken else ""
        return f"restores step {f.get('step')} from memory{peers}"
    return f"{f['event'].replace('_', ' ')}{reason}"


def details(fields: Dict[str, Any]) -> List[List[str]]:
    """[label, text] of an event's own fields (unknown ones included), absent values left out."""
    own = [(k, v) for k, v in fields.items() if k not in COMMON and v is not None]
    own.sort(key=lambda item: ORDER.index(item[0]) if item[0] in ORDER else len(ORDER) - 2.5)
    return [[LABELS.get(k, k.replace("_", " ")), _text(v)] for k, v in own]


def root_cause(failures: List[Mark], losses: List[Mark], finished: List[Mark]) -> Optional[Dict[str, Any]]:
    """What the run's last troubled round (failures, or a lost member) follows from. A member
    lost in it is the cause of the failures its agents judged its consequence (the survivors'
    broken collectives), which are listed under it, folded; otherwise the failure its agent
    marked the root cause, else the earliest. Without failure or loss events (another node's
    log missing), what the agents' `job_finished` says."""
    troubles = failures + losses
    if troubles:
        last = max(troubles, key=lambda mark: (mark["round"] is not None, mark["round"] or 0))["round"]
        own = [m for m in failures if m["round"] == last and not m.get("consequence_of")]
        lost = [m for m in losses if m["round"] == last]
        if lost and not own:
            mark = lost[0]
            mark["run_root"] = True
            broken = [m for m in failures if m["round"] == last]
            text = None
            if broken:
                lines = [f"{len(broken)} worker failure(s) followed from it (its peers' collectives broke):"]
                text = "\n".join(lines + [f"  {m['headline']}" for m in broken])
            return {"headline": mark["title"], "text": text, "at": mark["at"], "consequences": len(broken)}
        candidates = own or [m for m in failures if m["round"] == last]
        mark = min([m for m in candidates if m["root"]] or candidates, key=lambda m: m["at"])
        mark["run_root"] = True  # the page rings it
        return {"headline": mark["headline"], "text": mark["message"], "at": mark["at"], "consequences": 0}
    causes = [mark["cause"] for mark in finished if mark.get("cause")]
    return {"headline": causes[0], "text": None, "at": None, "consequences": 0} if causes else None


def outcome(states: List[str], nodes: int) -> str:
    """The worst state any node finished in; mixed states and nodes that logged no end are said."""
    if not states:
        return "UNFINISHED (no node logged job_finished)"
    worst = "FAILED" if "FAILED" in states else next((s for s in states if s != "SUCCEEDED"), "SUCCEEDED")
    text = worst
    if len(set(states)) > 1:
        text += " (" + ", ".join(f"{s} on {states.count(s)} node(s)" for s in sorted(set(states))) + ")"
    if nodes > len(states):
        text += f"; {nodes - len(states)} node(s) logged no job_finished"
    return text


def render(runs: List[Dict[str, Any]], sources: List[str], warnings: List[str]) -> str:
    """The page: the template with the model in a JSON script element. Every `<` is escaped, so
    no text from a log (a `</script>` in a message) can end that element."""
    data = json.dumps({"runs": runs, "sources": sources, "warnings": warnings}, ensure_ascii=False)
    template = resources.files("elastix.ops").joinpath("timeline.html").read_text(encoding="utf-8")
    return template.replace("{{DATA}}", data.replace("<", "\\u003c"))


def write_page(paths: List[str], out: str) -> List[str]:
    """Reads the logs, writes the page to `out`; the warnings about skipped lines."""
    events, warnings = read_events(paths)
    if not events:
        raise TimelineError(f"no events in {', '.join(paths)} (written by `elastix run --event-log FILE`)")
    page = render(build(events), list(paths), warnings)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return warnings


def _ranges(numbers: Iterable[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    spans: List[List[int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _ints(values: Any) -> List[int]:
    """The whole numbers of a list (a log is input: a field may hold anything)."""
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)] if isinstance(values, list) else []


def _plural(word: str, items: Any) -> str:
    return word if len(items) == 1 else word + "s"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."

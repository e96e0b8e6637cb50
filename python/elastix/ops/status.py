"""A job's state as ``elastix status`` shows it: the report the Rust core reads from the job's
rendezvous store or etcd (``rust/core/src/rendezvous/status``), as JSON, and its rendering for
a person."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


def read(backend: str, endpoint: str, run_id: str, conf: Dict[str, str], timeout: float) -> Optional[Dict[str, Any]]:
    """The job's report, or None when the store holds no such run."""
    from .. import _core

    report = _core.job_status(backend, endpoint, run_id, json.dumps(conf), float(timeout))
    return None if report is None else json.loads(report)


def runs(backend: str, endpoint: str, conf: Dict[str, str], timeout: float) -> List[str]:
    """The run IDs the store (or the etcd key prefix) holds."""
    from .. import _core

    return list(_core.job_runs(backend, endpoint, json.dumps(conf), float(timeout)))


def _ranks(ranks: List[int]) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _age(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{count}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}GB"


def _checkpoint(held: Optional[Dict[str, Any]]) -> str:
    """A worker's newest checkpoint in its agent's memory, and the newest on disk."""
    if not held:
        return "-"
    took = f" in {held['save_ms']}ms" if held.get("save_ms") is not None else ""
    shown = f"step {held['step']}, {_size(held['bytes'])}, saved {_age(held['saved_age_s'])}{took}"
    if held.get("copied_step") is not None:
        shown += f"; peer: step {held['copied_step']}"
    if held.get("persisted_step") is not None:
        took = f" in {held['persist_ms']}ms" if held.get("persist_ms") is not None else ""
        shown += f"; disk: step {held['persisted_step']}{took}"
    if held.get("restored"):
        shown += f"; restored step {held['restored']['step']} from {held['restored']['source']}"
    return shown


def _pace(pace: Optional[Dict[str, Any]]) -> str:
    """A rank's pace score (the others' compute between collectives over its own), and whether
    it is named a straggler."""
    if not pace:
        return "-"
    return f"{pace['score']:.2f}" + (" STRAGGLER" if pace["straggler"] else "")


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


# what a worker's main thread and processes were doing, as its agent saw them through the kernel
DOING = {"running": "running", "waiting": "waiting", "blocked_busy": "blocked, process busy"}
WORKERS_SHOWN = 32  # beyond this many, the ones seen longest ago (--json lists every one)


def _workers(members: List[Dict[str, Any]]) -> List[str]:
    """Each worker's progress, as its agent last published it: heartbeats, the step the last
    one named, when it was last seen making progress (a beat, or a run of its main thread),
    what its main thread and processes were doing, and its pace against the others'."""
    workers = [(m["group_rank"], w) for m in members for w in m.get("workers") or []]
    if not workers:
        return []
    shown, more = workers, ""
    if len(workers) > WORKERS_SHOWN:
        never = float("inf")
        shown = sorted(workers, key=lambda mw: never if mw[1]["seen_age_s"] is None else mw[1]["seen_age_s"])
        shown = shown[-WORKERS_SHOWN:]
        more = f" (the {WORKERS_SHOWN} seen longest ago of {len(workers)}; --json lists all)"
    rows = [["RANK", "GROUP RANK", "BEATS", "STEP", "LAST SEEN", "MAIN THREAD", "PACE", "CHECKPOINT"]]
    for group_rank, w in sorted(shown, key=lambda mw: mw[1]["rank"]):
        step = "-" if w["step"] is None else str(w["step"])
        doing = DOING.get(w.get("doing") or "", "-")
        held = _checkpoint(w.get("checkpoint"))
        row = [str(w["rank"]), str(group_rank), str(w["beats"]), step, _age(w["seen_age_s"]), doing]
        rows.append([*row, _pace(w.get("pace")), held])
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
        if failure.get("hung"):
            how = f"hung: {failure['hung']}"
        elif failure["signal"]:
            how = f"signal {failure['signal']}"
        else:
            how = f"exit code {failure['exitcode']}"
        lines.append(
            f"  last failure: round {failure['round']}, {failure['age_s']:.0f}s ago: rank {failure['rank']} "
            f"(local rank {failure['local_rank']}) on {failure['host']}, {how}"
        )
        lines += [f"    {line}" for line in failure["message"].splitlines()[-10:]]
    if status["closed_reason"] and status["state"] not in ("succeeded",):
        lines.append(f"  closed: {status['closed_reason'].splitlines()[0]}")
    return "\n".join(lines)

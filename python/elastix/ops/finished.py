"""Jobs that ended on this machine, as their agents noted them (rust/core/src/agent/finished.rs
writes the records): what ``elastix status`` says of a job whose store is gone with it."""

from __future__ import annotations

import glob
import json
import os
import socket
from typing import Any, Dict, List, Optional

Record = Dict[str, Any]


def directory() -> Optional[str]:
    state = os.environ.get("XDG_STATE_HOME") or (
        os.path.join(os.environ["HOME"], ".local", "state") if os.environ.get("HOME") else None
    )
    return os.path.join(state, "elastix", "finished") if state else None


def recall(endpoint: str, run_id: Optional[str] = None) -> List[Record]:
    """The records of jobs at ``endpoint`` (as given to ``elastix run``, or the store it reached),
    of ``run_id`` only if given; the newest job's, one per agent."""
    where = directory()
    if where is None:
        return []
    wanted = _endpoints(endpoint)
    found: List[Record] = []
    for path in glob.glob(os.path.join(where, "*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being written, or not ours to read
        if not isinstance(record, dict) or (run_id is not None and record.get("run_id") != run_id):
            continue
        if wanted & (_endpoints(str(record.get("endpoint", ""))) | _endpoints(str(record.get("store", "")))):
            found.append(record)
    if not found:
        return []
    newest = max(found, key=lambda record: str(record.get("finished", "")))
    same = [r for r in found if r.get("run_id") == newest.get("run_id") and r.get("store") == newest.get("store")]
    return sorted(same, key=lambda record: (str(record.get("host")), int(record.get("pid") or 0)))


def render(records: List[Record]) -> str:
    first = records[0]
    states = sorted({str(record.get("state")) for record in records})
    worst = "FAILED" if "FAILED" in states else states[-1] if states else "?"
    finished = max(str(record.get("finished", "?")) for record in records)
    lines = [
        f"job {first.get('run_id')}: finished {worst} at {finished}, as {len(records)} agent(s) on this machine "
        f"noted it (its store at {first.get('store')} is gone with it)"
    ]
    for record in records:
        logs = f", logs in {record['log_dir']}" if record.get("log_dir") else ""
        lines.append(
            f"  {record.get('host')} (agent pid {record.get('pid')}): {record.get('state')}, "
            f"exit code {record.get('exit_code')}{logs}"
        )
    causes = sorted({str(record["root_cause"]) for record in records if record.get("root_cause")})
    lines += [f"  root cause: {cause}" for cause in causes]
    return "\n".join(lines)


def succeeded(records: List[Record]) -> bool:
    return all(record.get("state") == "SUCCEEDED" for record in records)


def nothing_listens(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether every HOST:PORT of a c10d endpoint refuses a connection: no store there (the
    job ended, or has not started). A timeout or an unresolvable name says nothing."""
    addresses = [_host_port(part) for part in endpoint.split(",") if part.strip()]
    if not addresses or any(address is None for address in addresses):
        return False
    for host, port in addresses:  # type: ignore[misc]
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return True


def _host_port(text: str) -> Optional[tuple]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _endpoints(text: str) -> set:
    """The HOST:PORT parts of an endpoint, with localhost and 127.0.0.1 taken as one."""
    parts = set()
    for part in text.split(","):
        parsed = _host_port(part)
        if parsed:
            host, port = parsed
            parts.add(("127.0.0.1" if host in ("localhost", "127.0.0.1") else host, port))
    return parts

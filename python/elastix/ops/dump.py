"""The stacks of a running job's workers as ``elastix dump`` shows them: what the job's agents
replied through its rendezvous store (``rust/core/src/agent/dumps``), and its rendering."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional


def read(
    backend: str, endpoint: str, run_id: str, conf: Dict[str, str], rank: Optional[int], timeout: float
) -> Optional[Dict[str, Any]]:
    """Every node's reply (of global rank ``rank`` only, if given), or None for no such job."""
    from .. import _core

    report = _core.job_dump(backend, endpoint, run_id, json.dumps(conf), rank, timeout)
    return None if report is None else json.loads(report)


def complete(dump: Dict[str, Any]) -> bool:
    nodes = dump["nodes"]
    workers = [worker for node in nodes for worker in node.get("workers", [])]
    return bool(workers) and not any(node.get("missing") for node in nodes) and all("stacks" in w for w in workers)


def render(dump: Dict[str, Any]) -> str:
    lines = []
    for node in dump["nodes"]:
        if node.get("missing"):
            lines.append(f"=== node {node['node']}: no reply in time")
            continue
        for worker in node.get("workers", []):
            where = f"rank {worker['rank']} (local rank {worker['local_rank']}, pid {worker['pid']}) on {node['host']}"
            if "stacks" in worker:
                lines += [f"=== {where}", worker["stacks"], ""]
            else:
                lines.append(f"=== {where}: no stacks: {worker['error']}")
    return "\n".join(lines).rstrip()

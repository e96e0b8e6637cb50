"""One node's part of the pre-flight check, as its agent starts it (``python -m
elastix.preflight``; the agent sets the variables read in ``main`` and reads the verdict from
the last line this process writes to stdout).
Every node measures its compute and takes part in its pairs' link tests, writing what it
measured to the round's store; the round's first member plans the second round of pairs,
judges, and writes the verdict back for every node. Every wait has a deadline: a dead node's
tests fail, it is named, and a dead first member leaves every node without a verdict (the
agents then go on, warning)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from .._peers import local_address
from ..store import PrefixStore, TCPStore
from . import measure, pairs
from .verdict import Link, Verdict, judge, table

# how long a pair waits for its peer (a dead peer fails the test after this)
PAIR_TIMEOUT_S = 10.0


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, at_most: float = float("inf")) -> float:
        return max(0.0, min(at_most, self.at - time.monotonic()))


def main() -> int:
    env = os.environ
    member, members = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, port = env["ELASTIX_PREFLIGHT_STORE"].rsplit(":", 1)
    host = host.strip("[]")
    # peers reach this node's tests where its route to the store leaves it (as a worker's
    # collectives are reached where its route to MASTER_ADDR leaves)
    env.setdefault("ELASTIX_COLLECTIVES_ADDR", local_address(towards=host))
    deadline = Deadline(float(env.get("ELASTIX_PREFLIGHT_TIMEOUT", "60")))
    root = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=deadline.left()))
    store = PrefixStore(env["ELASTIX_PREFLIGHT_PREFIX"], root)
    node = env.get("ELASTIX_PREFLIGHT_NODE", host)
    store.set(f"node/{member}", json.dumps({"node": node, "compute_ms": measure.compute_ms()}))
    first = pairs.first_round(members)
    _test(store, member, 1, first)
    second: List[pairs.Pair] = []
    first_links: List[Link] = []
    if member == 0:
        first_links = _links(store, 1, first, deadline.left(2 * PAIR_TIMEOUT_S + 5))
        second = pairs.second_round(members, _worst_links(first_links))
        store.set("plan/2", json.dumps(second))
    elif members > 2:
        second = _pairs_of(_read(store, "plan/2", deadline.left(3 * PAIR_TIMEOUT_S + 5)))
    _test(store, member, 2, second)
    if member == 0:
        # judged on the first round's links as the plan saw them
        _judge(store, members, first_links + _links(store, 2, second, deadline.left(2 * PAIR_TIMEOUT_S + 5)), deadline)
    verdict = _read(store, "verdict", deadline.left())
    print(json.dumps(verdict if verdict is not None else {"complete": False}), flush=True)
    return 0


def _test(store: Any, member: int, round_no: int, plan: List[pairs.Pair]) -> None:
    """This node's link tests of a round, each written to the store as it measured it."""
    for i, side in pairs.turns(member, plan):
        try:
            found: Dict[str, Any] = measure.link(PrefixStore(f"pair/{round_no}/{i}", store), side, PAIR_TIMEOUT_S)
        except Exception as err:  # the peer never came or failed: what it says is the finding
            found = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:200]}
        store.set(f"link/{round_no}/{i}/{member}", json.dumps(found))


def _judge(store: Any, members: int, links: List[Link], deadline: Deadline) -> None:
    names: Dict[int, str] = {}
    compute: Dict[int, float] = {}
    for member in range(members):
        report = _read(store, f"node/{member}", deadline.left(1.0))
        if report is not None:
            names[member], compute[member] = report["node"], report["compute_ms"]
    verdict: Verdict = judge(members, names, compute, links)
    shown = table(members, names, compute, links, verdict)
    store.set("verdict", json.dumps({"complete": True, "table": shown, **asdict(verdict)}))


def _links(store: Any, round_no: int, plan: List[pairs.Pair], wait_s: float) -> List[Link]:
    """A round's links as either end measured them (the first to answer); one neither end
    reported within ``wait_s`` failed."""
    deadline = Deadline(wait_s)
    found = []
    for i, (a, b) in enumerate(plan):
        keys = [f"link/{round_no}/{i}/{a}", f"link/{round_no}/{i}/{b}"]
        report = _first_of(store, keys, deadline)
        low, high = min(a, b), max(a, b)
        if report is None:
            found.append(Link(low, high, error="neither end reported"))
        else:
            found.append(Link(low, high, report.get("latency_ms"), report.get("mbps"), report.get("error")))
    return found


def _first_of(store: Any, keys: List[str], deadline: Deadline) -> Optional[Dict[str, Any]]:
    while True:
        for key in keys:
            if store.check([key]):
                return json.loads(store.get(key))
        if deadline.left() <= 0:
            return None
        time.sleep(min(0.02, deadline.left()))


def _read(store: Any, key: str, wait_s: float) -> Optional[Any]:
    return _first_of(store, [key], Deadline(wait_s))


def _worst_links(links: List[Link]) -> Dict[int, float]:
    """Each node's slowest first-round link, as the time a large transfer takes on it (its
    latency and its bandwidth; failed: infinitely slow)."""
    worst: Dict[int, float] = {}
    for link in links:
        rate = (link.mbps or 0.0) * 1e6
        ms = float("inf") if link.error or rate <= 0 else (link.latency_ms or 0.0) + measure.LARGE_BYTES / rate * 1e3
        for end in (link.a, link.b):
            worst[end] = max(worst.get(end, 0.0), ms)
    return worst


def _pairs_of(value: Any) -> List[Tuple[int, int]]:
    return [(int(a), int(b)) for a, b in value or []]

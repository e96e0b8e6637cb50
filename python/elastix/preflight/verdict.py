"""Judging the pre-flight check's measurements (pure: what the nodes measured in, the names
out). A node is named when it is

* dead: it never reported (its process did not start, crashed or hung), or every link to it
  failed (links to two peers or more);
* slow to compute: its product takes more than twice the other nodes' median (DLRover's
  factor), and at least a millisecond more;
* slow on every link: links to at least two peers measured, every one slow or failed, while
  most nodes are not (a slowdown of every link is the network's, not a node's).

A link is slow when its latency is more than twice the typical one and a millisecond more, or
its bandwidth under a third of the typical and a large transfer takes 5 ms more on it
(bandwidth on a shared machine varies more than latency); typical is the median over nodes
of each node's best link, so that one slow node's links do not make slowness typical. A link
of a named node is that node's; a slow link between two unnamed nodes is named as a link (its
two ends cannot be told apart)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .measure import LARGE_BYTES

SLOWER = 2.0
BANDWIDTH_SLOWER = 3.0
COMPUTE_FLOOR_MS = 1.0
LATENCY_FLOOR_MS = 1.0
BANDWIDTH_FLOOR_S = 0.005


@dataclass
class Link:
    """One measured link (``a`` < ``b``, members) in a round of tests: its figures, or why it
    failed."""

    a: int
    b: int
    latency_ms: Optional[float] = None
    mbps: Optional[float] = None
    error: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.a}-{self.b}"


@dataclass
class Named:
    member: int  # -1 for a link
    node: str  # the node's name, or the link's ("a-b")
    why: str


@dataclass
class Verdict:
    nodes: List[Named] = field(default_factory=list)
    # slow links between unnamed nodes
    links: List[Named] = field(default_factory=list)
    # why each measured link is slow or failed, by its place in the list judged (None: fine)
    slow: List[Optional[str]] = field(default_factory=list)


def judge(members: int, names: Dict[int, str], compute_ms: Dict[int, float], links: Sequence[Link]) -> Verdict:
    """``names`` and ``compute_ms``: the nodes that reported, by member."""
    slow = _slow_links(links)
    faults = {member: _fault(member, compute_ms, links, slow) for member in range(members)}
    on_links = [member for member, why in faults.items() if why and why.startswith("slow on every link")]
    if 2 * len(on_links) >= members:
        for member in on_links:  # the network's slowdown, not these nodes'
            faults[member] = None
    verdict = Verdict(slow=slow)
    verdict.nodes = [Named(m, names.get(m, f"member {m}"), why) for m, why in faults.items() if why]
    named = {n.member for n in verdict.nodes}
    for link, why in zip(links, slow):
        seen = {n.node for n in verdict.links}
        if why and link.a not in named and link.b not in named and link.name not in seen:
            verdict.links.append(Named(-1, link.name, why))
    return verdict


def _fault(
    member: int, compute_ms: Dict[int, float], links: Sequence[Link], slow: List[Optional[str]]
) -> Optional[str]:
    if member not in compute_ms:
        return "dead: its check never reported"
    mine = [(link, why) for link, why in zip(links, slow) if member in (link.a, link.b)]
    peers = {link.b if link.a == member else link.a for link, _ in mine}
    # one link failed or slow has two ends: a node is named on its links with two peers or more
    if len(peers) >= 2 and all(link.error for link, _ in mine):
        return f"dead: every link to it failed ({mine[0][0].error})"
    others = [ms for node, ms in compute_ms.items() if node != member]
    if others:
        typical = statistics.median(others)
        ms = compute_ms[member]
        if ms > SLOWER * typical and ms - typical >= COMPUTE_FLOOR_MS:
            return f"slow compute: {ms:.1f} ms a product against the others' {typical:.1f} ms ({ms / typical:.1f}x)"
    if len(peers) >= 2 and all(why for _, why in mine):
        return "slow on every link: " + "; ".join(f"{link.name} {why}" for link, why in mine)
    return None


def _slow_links(links: Sequence[Link]) -> List[Optional[str]]:
    best_latency: Dict[int, float] = {}
    best_mbps: Dict[int, float] = {}
    for link in links:
        if link.error is None:
            for end in (link.a, link.b):
                best_latency[end] = min(best_latency.get(end, float("inf")), link.latency_ms or 0.0)
                best_mbps[end] = max(best_mbps.get(end, 0.0), link.mbps or 0.0)
    latency = statistics.median(best_latency.values()) if best_latency else 0.0
    mbps = statistics.median(best_mbps.values()) if best_mbps else 0.0
    slow: List[Optional[str]] = []
    for link in links:
        ms, rate = link.latency_ms or 0.0, link.mbps or 0.0
        if link.error is not None:
            slow.append(f"failed: {link.error}")
        elif ms > SLOWER * latency and ms - latency >= LATENCY_FLOOR_MS:
            slow.append(f"latency {ms:.2f} ms against {latency:.2f} ms typical")
        elif 0 < rate < mbps / BANDWIDTH_SLOWER and LARGE_BYTES / 1e6 * (1 / rate - 1 / mbps) >= BANDWIDTH_FLOOR_S:
            slow.append(f"bandwidth {rate:.0f} MB/s against {mbps:.0f} MB/s typical")
        else:
            slow.append(None)
    return slow


def table(members: int, names: Dict[int, str], compute_ms: Dict[int, float], links: Sequence[Link],
          verdict: Verdict) -> str:  # fmt: skip
    """What the check found, for the log."""
    named = {n.member: n.why for n in verdict.nodes}
    rows = [f"pre-flight check of {members} nodes (compute: a float32 product on one core; links: all_reduce in pairs)",
            f"  {'MEMBER':<7}{'NODE':<24}{'COMPUTE':>10}  VERDICT"]  # fmt: skip
    for member in range(members):
        ms = compute_ms.get(member)
        shown = f"{ms:.2f} ms" if ms is not None else "-"
        rows.append(f"  {member:<7}{names.get(member, '?'):<24}{shown:>10}  {named.get(member, 'ok')}")
    rows.append(f"  {'LINK':<7}{'LATENCY':>12}{'BANDWIDTH':>14}  VERDICT")
    for link, why in zip(links, verdict.slow):
        measured = link.error is None
        latency = f"{link.latency_ms or 0:.2f} ms" if measured else "-"
        rate = f"{link.mbps or 0:.0f} MB/s" if measured else "-"
        rows.append(f"  {link.name:<7}{latency:>12}{rate:>14}  {why or 'ok'}")
    return "\n".join(rows)

"""Which nodes test their link together. Two rounds: in the first, neighbours (0-1, 2-3, ...;
an odd one out with node 0, after node 0's first test); in the second, the node with the
worst first-round link with the one with the best, the second worst with the second best,
and so on (as DLRover's check does). A link slow in the first round has two ends: the second
round pairs each with a node whose links were good, which tells a slow node (slow again) from a
slow link (both fast again). N nodes need two rounds whatever N is.

Every node runs its tests in the order of the round's list: a pair forms when both of its
nodes get to it, and the order, the same on every node, leaves no cycle to wait in."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

Pair = Tuple[int, int]


def first_round(nodes: int) -> List[Pair]:
    pairs = [(a, a + 1) for a in range(0, nodes - 1, 2)]
    if nodes % 2 and nodes > 2:
        pairs.append((nodes - 1, 0))
    return pairs


def second_round(nodes: int, worst_ms: Dict[int, float]) -> List[Pair]:
    """``worst_ms``: each node's slowest first-round link (a missing node counts as the
    slowest). Two nodes have one link: nothing to pair again."""
    if nodes < 3:
        return []
    order = sorted(range(nodes), key=lambda node: (-worst_ms.get(node, math.inf), node))
    pairs = [(order[i], order[-1 - i]) for i in range(nodes // 2)]
    if nodes % 2:
        pairs.append((order[nodes // 2], order[-1]))
    return pairs


def turns(node: int, pairs: Sequence[Pair]) -> List[Tuple[int, int]]:
    """The (pair's index, ``node``'s side: 0 first, 1 second) of each test ``node`` takes part
    in, in order."""
    return [(i, 0 if a == node else 1) for i, (a, b) in enumerate(pairs) if node in (a, b)]

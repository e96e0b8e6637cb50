"""elastix.preflight.pairs: every node is tested in each round, and the second round pairs
the worst first-round links with the best."""

from __future__ import annotations

import pytest

from elastix.preflight.pairs import first_round, second_round, turns


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5, 8, 9])
def test_every_node_is_tested_in_each_round(nodes):
    first = first_round(nodes)
    second = second_round(nodes, {node: float(node) for node in range(nodes)})
    for plan in (first, second) if nodes > 2 else (first,):
        tested = {node for pair in plan for node in pair}
        assert tested == (set(range(nodes)) if nodes > 1 else set()), plan
        assert all(a != b for a, b in plan)
    assert second == [] or nodes > 2


def test_the_slowest_meet_the_fastest_and_a_missing_node_counts_as_slowest():
    # first round: 0-1 slow (node 1), 2-3 fast
    assert second_round(4, {0: 50.0, 1: 50.0, 2: 0.1, 3: 0.2}) == [(0, 2), (1, 3)]
    assert second_round(3, {0: 50.0, 1: 50.0}) == [(2, 1), (0, 1)]


def test_a_node_takes_its_tests_in_the_rounds_order_on_its_side():
    plan = [(0, 1), (2, 3), (4, 0)]
    assert turns(0, plan) == [(0, 0), (2, 1)]
    assert turns(4, plan) == [(2, 0)]
    assert turns(5, plan) == []

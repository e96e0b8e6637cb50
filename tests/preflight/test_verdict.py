"""elastix.preflight.verdict: slow and dead nodes and slow links are named from what the
nodes measured; noise, a network-wide slowdown and a lone slow link name no node."""

from __future__ import annotations

from elastix.preflight.verdict import Link, judge, table

NAMES = {m: f"10.0.0.{m + 1}" for m in range(4)}


def fast(a, b):
    return Link(a, b, latency_ms=0.1, mbps=1000.0)


def test_a_healthy_job_with_noise_names_no_one():
    compute = {0: 4.0, 1: 5.5, 2: 4.2, 3: 6.0}  # 1.5x: noise
    links = [fast(0, 1), Link(2, 3, 0.3, 500.0), Link(0, 2, 0.15, 700.0), fast(1, 3)]  # 2-3: 2x, under the floors
    verdict = judge(4, NAMES, compute, links)
    assert verdict.nodes == [] and verdict.links == [], verdict
    assert "ok" in table(4, NAMES, compute, links, verdict)


def test_a_node_with_slow_links_is_named_and_its_links_are_its():
    # node 1 behind a 50 ms delay: slow with node 0 (first round) and with node 3 (second)
    links = [Link(0, 1, 100.2, 20.0), fast(2, 3), Link(1, 3, 100.1, 20.0), fast(0, 2)]
    verdict = judge(4, NAMES, {m: 4.0 for m in range(4)}, links)
    [named] = verdict.nodes
    assert (named.member, named.node) == (1, "10.0.0.2") and named.why.startswith("slow on every link"), named
    assert "latency 100.20 ms against 0.10 ms typical" in named.why
    assert verdict.links == []
    shown = table(4, NAMES, {m: 4.0 for m in range(4)}, links, verdict)
    assert "slow on every link" in shown and "latency 100.10 ms" in shown


def test_a_throttled_link_is_slow_by_its_bandwidth():
    links = [Link(0, 1, 0.2, 1.2), fast(2, 3), Link(1, 3, 0.2, 1.1), fast(0, 2)]
    [named] = judge(4, NAMES, {m: 4.0 for m in range(4)}, links).nodes
    assert named.member == 1 and "bandwidth 1 MB/s against 1000 MB/s typical" in named.why, named


def test_a_slow_link_between_good_nodes_is_named_as_a_link():
    links = [Link(0, 1, 80.0, 900.0), fast(2, 3), fast(0, 3), fast(1, 2)]
    verdict = judge(4, NAMES, {m: 4.0 for m in range(4)}, links)
    assert verdict.nodes == []
    assert [(n.member, n.node) for n in verdict.links] == [(-1, "0-1")]


def test_two_nodes_have_no_typical_link_to_name_theirs_against():
    verdict = judge(2, NAMES, {0: 4.0, 1: 4.0}, [Link(0, 1, 80.0, 900.0)])
    assert verdict.nodes == [] and verdict.links == []


def test_slow_compute_is_named_against_the_others_median():
    verdict = judge(4, NAMES, {0: 4.0, 1: 9.5, 2: 4.1, 3: 3.9}, [fast(0, 1), fast(2, 3)])
    [named] = verdict.nodes
    assert named.member == 1 and "slow compute: 9.5 ms" in named.why and "(2.4x)" in named.why
    # microseconds apart is noise, whatever the ratio
    assert judge(2, NAMES, {0: 0.1, 1: 0.3}, [fast(0, 1)]).nodes == []


def test_dead_nodes_never_reported_or_every_link_failed():
    links = [Link(0, 1, error="TimeoutError: no peer"), fast(2, 3), Link(1, 3, error="TimeoutError: no peer")]
    verdict = judge(4, NAMES, {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0}, links)
    assert [(n.member, n.why.split(":")[0]) for n in verdict.nodes] == [(1, "dead")]
    reported = {m: NAMES[m] for m in (0, 2, 3)}
    verdict = judge(4, reported, {0: 4.0, 2: 4.0, 3: 4.0}, [fast(2, 3)])
    assert [(n.member, n.node, n.why) for n in verdict.nodes] == [(1, "member 1", "dead: its check never reported")]


def test_a_network_wide_slowdown_names_no_node():
    # every node's links slow against one fast pair: most nodes slow is the network
    links = [Link(0, 1, 50.0, 10.0), fast(2, 3), Link(0, 2, 50.0, 10.0), Link(1, 3, 50.0, 10.0)]
    verdict = judge(4, NAMES, {m: 4.0 for m in range(4)}, links)
    assert verdict.nodes == [], verdict

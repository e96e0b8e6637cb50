"""Partitions: at most one side runs the job. With a site list, three hosts each serve a
rendezvous site (A, B, C) and the host of the site holding the state is cut off from the two
others: only the side that reaches a majority of the sites may train. On etcd, a node cut off
from the cluster stops its workers once its lease can no longer be live (its TTL), while the
others, whose leases etcd keeps, re-form without it."""

from __future__ import annotations

import time

import pytest

from agents import assert_nothing_left, finish_all, wait_for, wait_round
from training import steps, train_node

# a node counts as lost after 2 s without a beat (the loss window); short last calls
FAST = (
    "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=1s,last_call_timeout=500ms,join_timeout=60s"
)
LOSS_WINDOW = 2.0


def test_a_cut_off_site_host_stops_training_the_majority_trains_on_and_all_meet_after_the_heal(tmp_path, marker, hosts):
    endpoint = ",".join(f"{hosts.addr(i)}:29400" for i in range(3))
    agents = [train_node(tmp_path, marker, hosts, i, "1:3", endpoint, FAST, "partition") for i in range(3)]
    three = wait_round(tmp_path, 3)
    wait_for(lambda: steps(tmp_path), what="the three nodes training")
    hosts.cut(0)  # the host of site A, which holds the state, alone on one side
    cut_at = time.time()
    two = wait_round(tmp_path, 2, after=three, what="the two-site side re-forming")
    wait_for(lambda: "minority side of a partition" in agents[0].output(), timeout=30, what="the cut-off node stopping")
    time.sleep(2.0)  # both sides as they are: the majority trains, the minority waits
    healed_at = time.time()
    hosts.heal(0)
    # only one side trains: from the loss window + 2 s after the cut until the heal
    trained = steps(tmp_path, cut_at + LOSS_WINDOW + 2.0, healed_at)
    assert {round_ for round_, _ in trained} == {two}, f"rounds that trained while cut: {trained} (majority: {two})"
    assert len({rank for _, rank in trained}) == 2, trained
    back = wait_round(tmp_path, 3, after=two, what="the three nodes meeting again after the heal")
    print(f"partition (sites): one job of three again {time.time() - healed_at:.2f}s after the heal (round {back})")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)


@pytest.mark.parametrize("rendezvous", ["etcd"], indirect=True)
def test_a_node_cut_off_from_etcd_stops_training_at_its_lease_ttl_and_comes_back(tmp_path, marker, hosts, rendezvous):
    backend, endpoint = rendezvous
    conf = FAST.replace("keep_alive_interval=250ms,keep_alive_max_attempt=8", "lease_ttl=2s").replace("60s", "120s")
    agents = [train_node(tmp_path, marker, hosts, i, "2:3", endpoint, conf, "cut", backend=backend) for i in range(3)]
    three = wait_round(tmp_path, 3)
    wait_for(lambda: steps(tmp_path), what="the three nodes training")
    hosts.cut(2)
    cut_at = time.time()
    two = wait_round(tmp_path, 2, after=three, what="the two others re-forming as the cut node's lease expires")
    # the cut node stops its workers at its TTL, not at the join timeout (120 s)
    wait_for(lambda: "lease can no longer be live" in agents[2].output(), timeout=30, what="the cut node stopping")
    time.sleep(2.0)
    healed_at = time.time()
    hosts.heal(2)
    trained = steps(tmp_path, cut_at + LOSS_WINDOW + 2.0, healed_at)
    assert {round_ for round_, _ in trained} == {two}, f"rounds that trained while cut: {trained} (the others': {two})"
    back = wait_round(tmp_path, 3, after=two, what="the three nodes meeting again after the heal")
    print(f"partition (etcd): one job of three again {time.time() - healed_at:.2f}s after the heal (round {back})")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)

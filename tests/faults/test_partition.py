"""Partitions: at most one side runs the job, whatever the cut answers. With a site list, every
host serves a rendezvous site and runs a node; the host of the site holding the state (and, with
five sites, one more) is cut off from the others: by a dropped link, or by a firewall that
rejects with TCP resets or ICMP port-unreachable (a refusal looks like a dead agent, so it must
never count a site or a member out), one way, or on a link that flaps. Only the side that
reaches a majority of the sites may train; after the heal all meet again. On etcd, a node cut
off from the cluster stops its workers once its lease can no longer be live (its TTL), while
the others, whose leases etcd keeps, re-form without it."""

from __future__ import annotations

import time

import pytest

from agents import assert_nothing_left, finish_all, rounds_of, starts, wait_for, wait_round
from invariants import read_log, rounds_at_once
from requirements import need
from training import steps, train_node

# a node counts as lost after 2 s without a beat (the loss window); short last calls
FAST = (
    "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=1s,last_call_timeout=500ms,join_timeout=60s"
)
LOSS_WINDOW = 2.0


@pytest.fixture
def five_hosts():
    from netns import hosts_for_a_test

    yield from hosts_for_a_test(5)


def site_nodes(tmp_path, marker, hosts, count, run_id):
    """`count` nodes, each serving a site of the endpoint list, with event logs."""
    endpoint = ",".join(f"{hosts.addr(i)}:29400" for i in range(count))
    return [
        train_node(tmp_path, marker, hosts, i, f"1:{count}", endpoint, FAST, run_id,
                   flags=["--event-log", str(tmp_path / f"events_h{i}.jsonl")])
        for i in range(count)
    ]  # fmt: skip


def hosts_that_trained(tmp_path, start, end):
    """The hosts whose workers stepped between two times."""
    where = {(r["round"], r["rank"]): r["host"] for r in starts(tmp_path)}
    return {where.get(key, f"round {key[0]} rank {key[1]}") for key in steps(tmp_path, start, end)}


def one_side_trains(tmp_path, agents, count, minority, cut, heal, what):
    """The nodes train; `cut()` parts the `minority` hosts from the others; only the others
    train (from the loss window + 2 s on), the cut-off ones say they are the minority; after
    `heal()` all meet again in one round. Returns how long that took."""
    full = wait_round(tmp_path, count)
    wait_for(lambda: steps(tmp_path), what=f"the {count} nodes training")
    cut()
    cut_at = time.time()
    majority = count - len(minority)
    formed = wait_round(tmp_path, majority, after=full, what=f"the {majority}-site side re-forming ({what})")
    for i in minority:
        said = agents[i].output
        wait_for(lambda said=said: "minority side of a partition" in said(), timeout=30, what=f"host {i} stopping")
    settled = cut_at + LOSS_WINDOW + 2.0
    time.sleep(max(0.0, settled + 2.0 - time.time()))  # both sides as they are for a while
    healed_at = time.time()
    heal()
    # only one side trains: from the loss window + 2 s after the cut until the heal
    trained = hosts_that_trained(tmp_path, settled, healed_at)
    assert trained and trained <= {f"host{i}" for i in range(count) if i not in minority}, (what, trained, formed)
    logs = {f"h{i}": read_log(tmp_path / f"events_h{i}.jsonl") for i in range(count)}
    assert rounds_at_once(logs, settled) == [], (what, logs)
    back = wait_round(tmp_path, count, after=formed, what=f"the {count} nodes meeting again after the heal ({what})")
    took = time.time() - healed_at
    print(f"partition ({what}): one job of {count} again {took:.2f}s after the heal (round {back})")
    return took


@pytest.mark.parametrize("how", ["drop", "tcp-reset", "icmp"])
def test_a_cut_off_site_host_stops_training_whatever_the_cut_answers(tmp_path, marker, hosts, how):
    from netns import Hosts

    if how != "drop":
        need("firewalls", Hosts.firewalls_available())
    agents = site_nodes(tmp_path, marker, hosts, 3, "partition")
    # the host of the first site, which holds the state, alone on one side
    if how == "drop":
        cut, heal = (lambda: hosts.cut(0)), (lambda: hosts.heal(0))
    else:
        cut, heal = (lambda: hosts.firewall(0, [1, 2], how)), (lambda: hosts.open_firewall(0))
    one_side_trains(tmp_path, agents, 3, [0], cut, heal, f"3 sites, {how}")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)


def test_with_five_sites_two_cut_off_by_resets_stop_and_three_train_on(tmp_path, marker, five_hosts):
    from netns import Hosts

    need("firewalls", Hosts.firewalls_available())
    hosts = five_hosts
    agents = site_nodes(tmp_path, marker, hosts, 5, "partition5")

    def cut():  # hosts 0 and 1 (the first site, with the state) still reach each other
        for i in (0, 1):
            hosts.firewall(i, [2, 3, 4], "tcp-reset")

    def heal():
        for i in (0, 1):
            hosts.open_firewall(i)

    one_side_trains(tmp_path, agents, 5, [0, 1], cut, heal, "5 sites, tcp-reset")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)


def test_a_one_way_cut_and_a_flapping_link_never_let_two_sides_train(tmp_path, marker, hosts):
    from netns import Hosts

    need("firewalls", Hosts.firewalls_available())
    agents = site_nodes(tmp_path, marker, hosts, 3, "oneway")
    wait_round(tmp_path, 3)
    wait_for(lambda: steps(tmp_path), what="the three nodes training")
    start = time.time()
    # host 1 can no longer open a connection to host 0 (host 0 still reaches host 1): every
    # node still reaches a majority of the sites, and the job must stay one job
    hosts.no_new_connections(1, 0)
    time.sleep(3 * LOSS_WINDOW)  # the fault under test lasts three loss windows
    hosts.open_firewall(1)
    # then host 2's link flaps: down and up every half loss window, five times
    for _ in range(5):
        hosts.cut(2)
        time.sleep(LOSS_WINDOW / 2)
        hosts.heal(2)
        time.sleep(LOSS_WINDOW / 2)
    logs = {f"h{i}": read_log(tmp_path / f"events_h{i}.jsonl") for i in range(3)}
    assert rounds_at_once(logs, start) == [], logs
    # the flapping may have left a re-form under way: the job is stopped only once the newest
    # round is the three nodes' and trains (stopped mid-re-form, the nodes of a round that
    # finished leave a node between rounds without the majority of sites it needs to end)
    wait_for(lambda: newest_round_trains(tmp_path, 3), what="the three nodes training as one job after the flapping")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)


def newest_round_trains(tmp_path, world_size):
    """Whether the newest round any worker started in is one of `world_size` nodes that trains now."""
    newest = max(record["round"] for record in starts(tmp_path))
    if newest not in rounds_of(tmp_path, world_size):
        return False
    now = time.time()
    return any(r == newest for r, _ in steps(tmp_path, now - LOSS_WINDOW / 4))


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
    time.sleep(2.0)  # cut off a while longer: a time in which only the other two may train
    healed_at = time.time()
    hosts.heal(2)
    trained = steps(tmp_path, cut_at + LOSS_WINDOW + 2.0, healed_at)
    assert {round_ for round_, _ in trained} == {two}, f"rounds that trained while cut: {trained} (the others': {two})"
    back = wait_round(tmp_path, 3, after=two, what="the three nodes meeting again after the heal")
    print(f"partition (etcd): one job of three again {time.time() - healed_at:.2f}s after the heal (round {back})")
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)

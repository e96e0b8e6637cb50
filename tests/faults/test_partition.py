"""Partitions with a site list: at most one side of a partition runs the job. Three hosts each
serve a rendezvous site (A, B, C); the host of the site holding the state is cut off from the
two others. Only the side that reaches a majority of the sites may train: the cut-off node
stops its workers and says why, the two others move the state to a site they reach and train
on, and once the link heals the three are one job again."""

from __future__ import annotations

import glob
import os
import sys
import time

import pytest

from agents import WORKERS, agent, assert_nothing_left, finish_all, node_args, wait_for, wait_round
from netns import hosts_for_a_test

TRAIN = os.path.join(WORKERS, "train_loop.py")
# a node counts as lost after 2 s without a beat (the loss window); short last calls
FAST = (
    "keep_alive_interval=250ms,keep_alive_max_attempt=8,heartbeat_timeout=1s,last_call_timeout=500ms,join_timeout=60s"
)
LOSS_WINDOW = 2.0


@pytest.fixture
def hosts():
    yield from hosts_for_a_test(3)


def steps_between(tmp_path, start, end):
    """Steps trained between two wall-clock times, by round and rank."""
    found = {}
    for path in glob.glob(str(tmp_path / "steps_*_*.txt")):
        round_, rank = os.path.basename(path)[len("steps_") : -len(".txt")].split("_")
        with open(path) as f:
            count = sum(1 for line in f if line.strip() and start < float(line.split()[0]) < end)
        if count:
            found[(int(round_), int(rank))] = count
    return found


def test_a_cut_off_site_host_stops_training_the_majority_trains_on_and_all_meet_after_the_heal(tmp_path, marker, hosts):
    endpoint = ",".join(f"{hosts.addr(i)}:29400" for i in range(3))
    agents = []
    for i in range(3):
        python = hosts.command(i, "env", f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", sys.executable)
        args = node_args("1:3", endpoint, hosts.addr(i), FAST, TRAIN, run_id="partition", max_restarts=0)
        agents.append(agent(tmp_path, marker, f"h{i}", "run", *args, python=python))
    three = wait_round(tmp_path, 3)
    wait_for(lambda: steps_between(tmp_path, 0, time.time() + 1), what="the three nodes training")
    hosts.cut(0)  # the host of site A, which holds the state, alone on one side
    cut_at = time.time()
    two = wait_round(tmp_path, 2, after=three, what="the two-site side re-forming")
    wait_for(lambda: "minority side of a partition" in agents[0].output(), timeout=30, what="the cut-off node stopping")
    time.sleep(2.0)  # both sides as they are: the majority trains, the minority waits
    healed_at = time.time()
    hosts.heal(0)
    # only one side trains: from the loss window + 2 s after the cut until the heal
    trained = steps_between(tmp_path, cut_at + LOSS_WINDOW + 2.0, healed_at)
    rounds = {round_ for round_, _ in trained}
    assert rounds == {two}, f"rounds that trained while cut: {trained} (the majority's is round {two})"
    assert len({rank for _, rank in trained}) == 2, trained
    back = wait_round(tmp_path, 3, after=two, what="the three nodes meeting again after the heal")
    print(f"partition: one job of three again {time.time() - healed_at:.2f}s after the heal (round {back})")
    assert "minority side of a partition" in agents[0].output()
    finish_all(tmp_path, agents, marker)
    assert_nothing_left(marker)

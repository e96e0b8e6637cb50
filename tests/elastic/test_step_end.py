"""Re-forming at the end of a step (rust/core/src/agent/run/step_end.rs): when a node joins, or
a node is stopped by a signal, the agents let their workers finish and save the step in
progress first, and the re-formed job restores that step rather than the one before it;
workers that do not save at a pace are not waited for. Real agents and workers training with
all_reduce and saving through elastix.checkpoint (tests/worker_programs/inprocess_loop.py)."""

from __future__ import annotations

import re
import signal
import sys

from test_elastic_reform import PROGRAM, trained

import elastix
from agents import FAST_RDZV, agent, finish_all, node_args, started, wait_for

WAITED = re.compile(r"once this node's workers saved the step after (\d+)")


def nodes(tmp_path, marker, run_id, count, *env):
    """`count` nodes of a 2:3 job on 127.0.0.x, and a maker of more (the store must outlive them)."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"

    def node(i):
        args = node_args("2:3", endpoint, f"127.0.0.{i + 1}", FAST_RDZV, PROGRAM, run_id=run_id, max_restarts=0)
        # steps of 0.2 s: the agents see a change within the same step
        python = ("env", "STEP_S=0.2", *env, sys.executable)
        return agent(tmp_path, marker, f"n{i}", "run", *args, python=python)

    return store, [node(i) for i in range(count)], node


def waited_after(agents):
    """The newest step each agent's workers had saved when it began to wait for the next."""
    return [int(found) for a in agents for found in WAITED.findall(a.output())]


def test_a_join_waits_for_the_step_in_progress_and_the_job_restores_it(tmp_path, marker):
    _store, agents, node = nodes(tmp_path, marker, "join-at-step-end", 2)
    two, _ = wait_for(lambda: started(tmp_path, 2), timeout=90, what="two nodes training")
    wait_for(lambda: trained(tmp_path, two, 2, 10), timeout=60, what="10 steps on both ranks")
    agents.append(node(2))
    _, joined = wait_for(lambda: started(tmp_path, 3, after=two), timeout=90, what="the job with the new node")
    restored = {record["step"] for record in joined}
    assert len(restored) == 1 and all(record["exact"] for record in joined), joined
    waited = waited_after(agents[:2])
    assert waited, [a.output() for a in agents[:2]]
    # the step that was in progress when the first agent saw the join is kept, not redone
    assert restored.pop() > min(waited), (joined, waited)
    finish_all(tmp_path, agents, marker)


def test_workers_that_do_not_save_at_a_pace_are_not_waited_for(tmp_path, marker):
    # only step 0 is saved: there is no step end to wait for, and the join goes on at once
    _store, agents, node = nodes(tmp_path, marker, "join-no-pace", 2, "SAVE_EVERY=1000000")
    two, _ = wait_for(lambda: started(tmp_path, 2), timeout=90, what="two nodes training")
    wait_for(lambda: trained(tmp_path, two, 2, 10), timeout=60, what="10 steps on both ranks")
    agents.append(node(2))
    _, joined = wait_for(lambda: started(tmp_path, 3, after=two), timeout=90, what="the job with the new node")
    assert {record["step"] for record in joined} == {0}, joined
    assert waited_after(agents) == []
    assert "nodes wait to join; re-forming" in agents[0].output()
    finish_all(tmp_path, agents, marker)


def test_a_stopped_node_saves_its_step_in_progress_before_it_leaves(tmp_path, marker):
    _store, agents, _ = nodes(tmp_path, marker, "stop-at-step-end", 3)
    three, _ = wait_for(lambda: started(tmp_path, 3), timeout=90, what="three nodes training")
    wait_for(lambda: trained(tmp_path, three, 3, 10), timeout=60, what="10 steps on every rank")
    leaving = agents.pop()
    leaving.proc.send_signal(signal.SIGTERM)
    assert leaving.finish() == 128 + signal.SIGTERM
    waited = waited_after([leaving])
    assert len(waited) == 1, leaving.output()
    assert f"this node's workers saved step {waited[0] + 1}" in leaving.output()
    _, after = wait_for(lambda: started(tmp_path, 2, after=three), timeout=90, what="the survivors re-forming")
    restored = {record["step"] for record in after}
    assert len(restored) == 1 and restored.pop() > waited[0], (after, waited)
    finish_all(tmp_path, agents, marker)

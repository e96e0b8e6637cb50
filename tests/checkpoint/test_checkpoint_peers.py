"""Checkpoints held by a peer: each agent copies its node's newest steps to the next node's
agent, so that when a whole host dies (every process in its namespace), the survivors restore
its part from the buddy's memory, and a node that joins takes its part from a peer's memory.
The job has no --checkpoint-dir: there is no file to read, so what is restored came from
memory. Every restored state is checked bit for bit."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

import elastix
from agents import WORKERS, agent, finish_all, node_args, started, wait_for

PROGRAM = os.path.join(WORKERS, "checkpoint_loop.py")
CONF = "join_timeout=60s"
LOG = ("--log-level", "debug")  # each copy to the buddy says how it was made


def steps_logged(tmp_path, round_):
    count = 0
    for path in glob.glob(str(tmp_path / f"steps_{round_}_*.txt")):
        with open(path) as f:
            count += sum(1 for line in f if line.strip())
    return count


def node(tmp_path, marker, hosts, i, endpoint, name=None, nnodes="2:3", flags=(), conf=CONF, env=()):
    python = hosts.command(i, "env", f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", *env, sys.executable)
    args = node_args(nnodes, endpoint, hosts.addr(i), conf, PROGRAM, run_id="peers", max_restarts=0)
    events = tmp_path / f"{name or f'h{i}'}-events.jsonl"
    return agent(tmp_path, marker, name or f"h{i}", "run", "--event-log", events, *flags, *args, python=python)


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_a_host_killed_is_restored_from_its_buddys_memory_bit_for_bit(tmp_path, marker, hosts, replicated):
    """Sharded: each rank's state its own, sent to the buddy. Replicated (plain data
    parallelism): the buddy's own rank saved the same bytes, and it copies them itself."""
    endpoint = ",".join(f"{hosts.addr(i)}:29400" for i in range(3))
    env = ("REPLICATED=1",) if replicated else ()
    agents = [node(tmp_path, marker, hosts, i, endpoint, flags=LOG, env=env) for i in range(3)]
    three, first = wait_for(lambda: started(tmp_path, 3), timeout=90, what="three nodes training")
    assert all(record["step"] is None for record in first), first  # a first start: nothing to restore
    wait_for(lambda: steps_logged(tmp_path, three) >= 3 * 40, timeout=60, what="40 steps on every rank")
    # the host of rank 1 (not host 0: its agent would take the store's first site along)
    victim = next(int(r["host"][4:]) for r in first if r["rank"] in (0, 1) and r["host"] != "host0")
    lost_rank = next(r["rank"] for r in first if r["host"] == f"host{victim}")
    assert hosts.kill(victim), f"host {victim} had no process to kill"
    killed_at = time.time()
    agents[victim].proc.wait(10)  # reaped: the next agent started here removes what it held
    two, after = wait_for(lambda: started(tmp_path, 2, after=three), timeout=90, what="the survivors re-forming")
    # every byte of every rank's state is what that rank saved at the step they agreed on
    assert all(record["exact"] for record in after), after
    assert len({record["step"] for record in after}) == 1 and after[0]["step"] is not None, after
    # no --checkpoint-dir: nothing came from a file
    assert {record["source"] for record in after} <= {"memory", "peer"}, after
    # the lost node's part came from the memory of the node that held its copy
    heir = next(record for record in after if record["source_rank"] == lost_rank)
    assert heir["source"] == "peer", after
    last = max(
        int(line.split()[1])
        for path in glob.glob(str(tmp_path / f"steps_{three}_*.txt"))
        for line in open(path)
        if line.strip() and float(line.split()[0]) < killed_at
    )
    print(
        f"host {victim} killed at step {last}; the survivors restored step {after[0]['step']} (from {heir['source']})"
    )
    survivors = [a for i, a in enumerate(agents) if i != victim]
    wait_for(lambda: steps_logged(tmp_path, two) >= 2 * 5, timeout=60, what="the survivors training again")
    # a new node on the dead host's address joins: it holds nothing, and takes its ranks'
    # state (a replica's: the world grows from 2 to 3) from a survivor's memory
    joiner = node(tmp_path, marker, hosts, victim, endpoint, name="joiner", flags=LOG, env=env)
    _, grown = wait_for(lambda: started(tmp_path, 3, after=two), timeout=90, what="the job growing back to 3")
    assert all(record["exact"] for record in grown), grown
    assert len({record["step"] for record in grown}) == 1 and grown[0]["step"] is not None, grown
    assert next(r for r in grown if r["host"] == f"host{victim}")["source"] == "peer", grown
    assert "from member" in joiner.output(), joiner.output()
    finish_all(tmp_path, [*survivors, joiner], marker)
    # how the buddies came to hold their copies: sent, or made from their own replica
    # (a replicated one is sent too where the buddy's worker had not saved the step yet)
    said = "".join(a.output() for a in [*agents, joiner])
    assert ("from its own identical save" in said) == replicated, said[-3000:]
    assert replicated or "checkpoint copied to member" in said, said[-3000:]
    # each agent removed its memory as it exited, copies from its peers still arriving or not,
    # and the joiner's removed the killed agent's
    memories = [f"/dev/shm/elastix-ckpt-peers-{a.proc.pid}" for a in [*agents, joiner]]
    left = [glob.glob(f"{memory}/**", recursive=True) for memory in memories if os.path.exists(memory)]
    assert not left, left
    # the agents said which step the round restores, and the joiner which ranks it took
    joined = [json.loads(line) for line in open(tmp_path / "joiner-events.jsonl")]
    restore = next(event for event in joined if event["event"] == "checkpoint_restore")
    assert restore["step"] == grown[0]["step"] and restore["taken"], restore
    page = tmp_path / "timeline.html"
    logs = sorted(glob.glob(str(tmp_path / "*-events.jsonl")))
    drawn = subprocess.run(
        [sys.executable, "-m", "elastix", "timeline", *logs, "-o", page], capture_output=True, text=True
    )
    assert drawn.returncode == 0, drawn.stderr
    assert f"restores step {restore['step']} from memory" in page.read_text()


def test_a_node_and_its_buddy_lost_at_once_restore_from_disk_and_say_so(tmp_path, marker, hosts):
    # the rendezvous store outside the hosts (as a standalone store would be): two of three
    # hosts die, which no majority of rendezvous sites on the hosts would survive
    store = elastix.TCPStore(hosts.gateway, 0, is_master=True, wait_for_workers=False)
    endpoint, conf = f"{hosts.gateway}:{store.port}", CONF + ",is_host=false,last_call_timeout=1s"
    flags = ("--checkpoint-dir", tmp_path / "checkpoints")
    agents = [node(tmp_path, marker, hosts, i, endpoint, nnodes="1:3", flags=flags, conf=conf) for i in range(3)]
    three, first = wait_for(lambda: started(tmp_path, 3), timeout=90, what="three nodes training")
    wait_for(lambda: steps_logged(tmp_path, three) >= 3 * 40, timeout=60, what="40 steps on every rank")
    # rank 0's state is on its own node and on its buddy's (rank 1's): both die, and the node of
    # rank 2, left alone, must restore rank 0's state, which no memory holds any more
    host = {record["rank"]: int(record["host"][4:]) for record in first}
    for rank in (0, 1):
        assert hosts.kill(host[rank]), f"host {host[rank]} had no process to kill"
    _round, alone = wait_for(lambda: started(tmp_path, 1, after=three), timeout=90, what="the survivor going on alone")
    assert alone[0]["source"] == "disk" and alone[0]["exact"] and alone[0]["step"] is not None, alone
    survivor = agents[host[2]]
    assert "no step is held in memory for every rank" in survivor.output(), survivor.output()
    wait_for(lambda: steps_logged(tmp_path, alone[0]["round"]) >= 5, timeout=60, what="the survivor training again")
    finish_all(tmp_path, [survivor], marker)

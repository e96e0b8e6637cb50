"""The first fault a newcomer tries on one machine: the README's two-node command run twice,
then the agent that hosts the rendezvous store killed. The survivor names what was lost and
what avoids it, waits with one countdown that only goes down, ends at its deadline, and a
signal ends it at once in every state it can wait in."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from agents import WORKERS, agent, assert_nothing_left, wait_for, wait_round
from conftest import closed_port, reserved_port


@pytest.fixture
def port():
    with reserved_port() as held:
        yield held


TRAIN = os.path.join(WORKERS, "train_loop.py")


def same_command(tmp_path, marker, name, port, conf, env=()):
    """The README's two-node command, as typed on each node (no --local-addr, no backend);
    each node's workers on TCP, as on two machines."""
    python = ("env", f"ELASTIX_COLLECTIVES_HOST_ID={name}", *env, sys.executable)
    args = ("--nnodes", 2, "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "first-hour")
    return agent(tmp_path, marker, name, "run", *args, "--rdzv-conf", conf, TRAIN, python=python)


def two_nodes(tmp_path, marker, port, conf, env_a=()):
    first = same_command(tmp_path, marker, "a", port, conf, env_a)
    wait_for(lambda: "this agent hosts the rendezvous store" in first.output(), timeout=30, what="a hosting the store")
    second = same_command(tmp_path, marker, "b", port, conf)
    wait_round(tmp_path, 2)
    return first, second


def after(text, line):
    return text[text.index(line) :]


def test_the_lost_store_host_is_named_with_the_remedy_and_one_countdown(tmp_path, marker, port):
    first, second = two_nodes(tmp_path, marker, port, "join_timeout=15s")
    # the survivor said where the store is: the agent started first on this machine
    assert "using the rendezvous store served there" in second.output(), second.output()
    first.kill()
    # it ends at its deadline, and says why: not a second countdown after the first
    assert second.finish(timeout=60) == 1, second.output()
    out = second.output()
    assert out.count("lost the rendezvous store") == 1, out
    lost = after(out, "lost the rendezvous store")
    assert "the agent that hosts it has ended or is cut off" in lost.splitlines()[0], lost
    assert "--rdzv-endpoint a:29400,b:29400,c:29400" in lost.splitlines()[0], lost
    assert f"served by the agent started first on this machine (pid {first.proc.pid})" in lost, lost
    countdown = [int(left) for left in re.findall(r"giving up in (\d+)s", lost)]
    assert countdown and countdown == sorted(countdown, reverse=True), countdown
    assert len(set(countdown)) == len(countdown), f"a countdown said twice: {countdown}"
    assert max(countdown) <= 15, countdown
    # one line per interval (every 10 s) from one wait, not one per task that lost the store
    warnings = [line for line in lost.splitlines() if " WARN " in line]
    assert len(warnings) <= 4, "\n".join(warnings)
    assert f"127.0.0.1:{port}" in out.strip().splitlines()[-1], out
    assert_nothing_left(marker)


def ends_on(agent_, signum, said):
    started = time.monotonic()
    agent_.proc.send_signal(signum)
    code = agent_.finish(timeout=30)
    took = time.monotonic() - started
    assert code == 128 + signum, agent_.output()
    assert f"received {signal.Signals(signum).name} {said}" in agent_.output(), agent_.output()
    # within the default --shutdown-timeout, with room for a loaded machine
    assert took < 20, f"{took:.1f}s"


def test_a_signal_ends_an_agent_waiting_for_a_store_not_there_yet(tmp_path, marker):
    with closed_port() as sock:
        port = sock.getsockname()[1]
        waiting = same_command(tmp_path, marker, "a", port, "is_host=false")
        wait_for(lambda: "cannot connect to the store" in waiting.output(), timeout=30, what="the store's warning")
        ends_on(waiting, signal.SIGINT, "while waiting for the rendezvous")
        assert "it is served by a store on 127.0.0.1 (not started yet, ended, or cut off)" in waiting.output()
    assert_nothing_left(marker)


def test_a_signal_ends_an_agent_waiting_for_the_other_nodes(tmp_path, marker, port):
    # progress lines every 200 ms: the agent says when it waits for the other node
    waiting = same_command(tmp_path, marker, "a", port, "join_timeout=60s", ("ELASTIX_RDZV_PROGRESS_INTERVAL=200ms",))
    wait_for(lambda: "waiting for 1 more node(s)" in waiting.output(), timeout=30, what="the wait for the other node")
    ends_on(waiting, signal.SIGTERM, "while waiting for the rendezvous")
    assert_nothing_left(marker)


def test_a_signal_ends_an_agent_looking_for_its_lost_store(tmp_path, marker, port):
    first, second = two_nodes(tmp_path, marker, port, "join_timeout=60s")
    first.kill()
    wait_for(lambda: "lost the rendezvous store" in second.output(), timeout=30, what="the loss said")
    ends_on(second, signal.SIGINT, "while waiting for the rendezvous")
    assert_nothing_left(marker)


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_ends_an_agent_in_the_exit_barrier(tmp_path, marker, port, signum):
    # a's workers stay on after training (LINGER): b's are done and wait for a's at the barrier
    first, second = two_nodes(tmp_path, marker, port, "join_timeout=60s", env_a=("LINGER=60",))
    (tmp_path / "stop").touch()
    wait_for(lambda: "exit barrier: this node's workers are done" in second.output(), timeout=30, what="the barrier")
    ends_on(second, signum, "in the exit barrier")
    first.kill()
    assert_nothing_left(marker)

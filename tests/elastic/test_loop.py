"""The elastic loop's side of its line to the agent (elastix/elastic/loop.py, line.py): the test
plays the agent on a socket pair. The agent may re-form twice in a row (a node lost, then its
replacement joining a few milliseconds later); a worker still between the first notice and its
place must neither join the round already over nor take its place."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import pytest

from elastix.elastic.interrupt import Reforming
from elastix.elastic.line import AgentLine, Notice
from elastix.elastic.loop import _await_place, _stop_if_over


@pytest.fixture
def agent_and_line():
    agent, worker = socket.socketpair()
    line = AgentLine(worker, notice_within=1.0)

    def say(kind, round_, **fields):
        agent.sendall(json.dumps({"kind": kind, "round": round_, **fields}).encode() + b"\n")

    yield say, line
    agent.close()


def abort(say, round_):
    say("abort", round_, why=f"round {round_} re-forms", deadline_ms=60_000)


def notice_of(line, round_) -> Notice:
    """The line's notice once it is the one of `round_` (the agent's messages arrive on a thread)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        notice = line.notice(0.1)
        if notice is not None and notice.round == round_:
            return notice
    raise AssertionError(f"no notice of round {round_}")


def test_a_place_given_before_the_agent_re_formed_again_is_not_taken(agent_and_line):
    say, line = agent_and_line
    abort(say, 1)  # round 1 ends
    say("assign", 2, env={"ELASTIX_ROUND": "2"})
    abort(say, 2)  # and round 2, before the worker took its place there
    notice = notice_of(line, 2)
    assert line.place(0.5).round == 2, "the line holds round 2's place"
    with pytest.raises(TimeoutError, match="placed this worker in no new round"):
        _await_place(line, dataclasses.replace(notice, until=time.monotonic() + 0.5))
    say("assign", 3, env={"ELASTIX_ROUND": "3"})
    assert _await_place(line, notice).round == 3


def test_joining_a_round_that_is_over_raises_reforming(agent_and_line, monkeypatch):
    say, line = agent_and_line
    monkeypatch.setenv("ELASTIX_ROUND", "2")
    _stop_if_over(line)  # no notice: the round goes on
    abort(say, 1)
    notice_of(line, 1)
    _stop_if_over(line)  # the notice of the round before: not this one's
    abort(say, 2)
    notice_of(line, 2)
    with pytest.raises(Reforming, match="round 2 is over: round 2 re-forms"):
        _stop_if_over(line)

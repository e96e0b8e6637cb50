"""The elastic loop's side of its line to the agent (elastix/elastic/loop.py, line.py): the test
plays the agent on a socket pair. The agent may re-form twice in a row (a node lost, then its
replacement joining a few milliseconds later); a worker still between the first notice and its
place must neither join the round already over nor take its place. A node that joins is
waited for at a step boundary instead: the worker stops in its save of the agreed step."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import pytest

from elastix.elastic.interrupt import Reforming
from elastix.elastic.line import AgentLine, Notice
from elastix.elastic.loop import _await_place, _drain_point, _stop_if_over


@pytest.fixture
def agent_and_line():
    agent, worker = socket.socketpair()
    line = AgentLine(worker, notice_within=1.0)

    def say(kind, round_, **fields):
        agent.sendall(json.dumps({"kind": kind, "round": round_, **fields}).encode() + b"\n")

    yield say, line
    agent.close()


@pytest.fixture
def agent_hearing_line():
    """As agent_and_line, and what the worker says on the line, a message at a time."""
    agent, worker = socket.socketpair()
    line = AgentLine(worker, notice_within=1.0)
    heard = agent.makefile("rb")

    def say(kind, round_, **fields):
        agent.sendall(json.dumps({"kind": kind, "round": round_, **fields}).encode() + b"\n")

    agent.settimeout(5)
    yield say, line, lambda: json.loads(heard.readline())
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


def drain(say, round_, step):
    say("drain", round_, step=step, why=f"a node joins: round {round_} re-forms after step {step}", deadline_ms=60_000)


def drain_told(line, step):
    """Waits until the line holds the agent's drain (the agent's messages arrive on a thread)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with line._cond:
            if line._drain is not None and line._drain.step == step:
                return
        time.sleep(0.01)
    raise AssertionError(f"no drain after step {step}")


def test_a_drain_stops_the_worker_in_its_save_of_the_agreed_step_and_says_so(agent_hearing_line):
    say, line, heard = agent_hearing_line
    after_save = _drain_point(line)
    after_save(3)
    drain(say, 2, 5)
    drain_told(line, 5)
    after_save(4)  # the steps before go on, and no abort came: nothing was interrupted
    assert line.notice(0) is None
    with pytest.raises(Reforming, match="re-forms after step 5"):
        after_save(5)
    notice = line.notice(0)
    assert notice is not None and notice.round == 2
    line.drained()
    assert heard() == {"kind": "drained", "round": 2, "step": 5}
    # the place comes in the next round, as after an abort
    say("assign", 3, env={"ELASTIX_ROUND": "3"})
    assert _await_place(line, notice).round == 3
    line.settled(0.1, 0.0, 0.05)
    assert heard()["kind"] == "reformed"
    after_save(6)  # the drain is over with its round
    assert line.notice(0) is None
    # the next round restored an older step: a drain for a step below the last saved is not
    # taken for one this worker is past
    line.settled(0.1, 0.0, 0.05)
    drain(say, 3, 4)
    drain_told(line, 4)
    assert line.notice(0) is None
    with pytest.raises(Reforming):
        after_save(4)


def test_word_about_the_round_being_joined_outlives_the_join(agent_hearing_line):
    """A host's replacement arrives as the survivors' round forms: the agent's drain (or a
    second abort) for the new round can reach a worker still joining it. Settling in must not
    forget it, or the worker trains past the step its peers stop after."""
    say, line, heard = agent_hearing_line
    after_save = _drain_point(line)
    abort(say, 4)  # a node is lost
    notice = notice_of(line, 4)
    line.drained()
    say("assign", 5, env={"ELASTIX_ROUND": "5"})
    assert _await_place(line, notice).round == 5
    drain(say, 5, 9)  # a node joins round 5 while this worker still joins it
    drain_told(line, 9)
    line.settled(0.1, 0.0, 0.05)
    assert heard()["kind"] == "reformed"
    assert line.notice(0) is None, "the notice of round 4 is over"
    after_save(8)
    with pytest.raises(Reforming, match="re-forms after step 9"):
        after_save(9)
    line.drained()
    assert heard() == {"kind": "drained", "round": 5, "step": 9}
    # an abort of the round being joined is kept too
    say("assign", 6, env={"ELASTIX_ROUND": "6"})
    assert _await_place(line, notice_of(line, 5)).round == 6
    abort(say, 6)
    notice_of(line, 6)
    line.settled(0.1, 0.0, 0.05)
    assert heard()["kind"] == "reformed"
    kept = line.notice(0)
    assert kept is not None and kept.round == 6, "the abort of round 6 explains what the worker raises next"


def test_a_worker_told_to_stop_after_a_step_it_saved_already_stops_at_once(agent_hearing_line):
    say, line, heard = agent_hearing_line
    aborted = []
    line.on_abort = aborted.append
    _drain_point(line)(7)  # its peers stop after their save of step 7: it is past it
    drain(say, 4, 7)
    notice = notice_of(line, 4)
    assert aborted == [notice.why] and "had saved it already" in notice.why
    line.drained()
    assert heard() == {"kind": "drained", "round": 4, "step": 7}


def test_a_worker_with_no_drain_says_nothing_when_it_leaves(agent_hearing_line):
    say, line, heard = agent_hearing_line
    _drain_point(line)(1)
    abort(say, 1)
    notice_of(line, 1)
    line.drained()  # it left for an abort: the agent waits for no drain
    line.broken("x")
    assert heard() == {"kind": "broken", "why": "x"}

"""The interruption of the training function at a re-form (elastix/elastic/interrupt.py): a real
signal from another thread into this one (pytest runs tests in the main thread)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from elastix.elastic.interrupt import SIGNAL, Interrupter, Reforming


@pytest.fixture
def interrupter():
    found = Interrupter()
    assert found.install() is None
    yield found
    found.uninstall()
    assert signal.getsignal(SIGNAL) == signal.SIG_DFL


def fire_soon(interrupter, why="a node was lost", times=1):
    def fire():
        for _ in range(times):
            time.sleep(0.2)
            interrupter.fire(why)

    thread = threading.Thread(target=fire)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_a_fire_interrupts_a_long_sleep_of_the_armed_thread(interrupter):
    thread = fire_soon(interrupter)
    with pytest.raises(Reforming, match="a node was lost"):
        with interrupter.armed():
            time.sleep(3600)  # the test's timeout ends it unless the fire does
    thread.join()


@pytest.mark.timeout(60)
def test_except_exception_in_a_training_loop_does_not_swallow_it(interrupter):
    caught = []
    thread = fire_soon(interrupter)
    with pytest.raises(Reforming):
        with interrupter.armed():
            for _ in range(36000):
                try:
                    time.sleep(0.1)
                except Exception as err:  # a loop's own error handling
                    caught.append(err)
    thread.join()
    assert caught == []


def test_a_fire_outside_the_armed_span_raises_nothing_then_or_later(interrupter):
    thread = fire_soon(interrupter)
    thread.join()
    time.sleep(0.1)  # a stray signal, if one came, is handled here
    with interrupter.armed():
        time.sleep(0.3)  # the earlier fire does not reach into a later span


@pytest.mark.timeout(60)
def test_one_span_is_interrupted_once(interrupter):
    raised = 0
    thread = fire_soon(interrupter, times=3)
    try:
        with interrupter.armed():
            time.sleep(3600)
    except Reforming:
        raised += 1
        time.sleep(1)  # the handling of the first: the later fires raise nothing in it
    thread.join()
    assert raised == 1


def test_a_program_s_own_sigurg_handler_is_kept():
    def mine(signum, frame):
        pass

    previous = signal.signal(SIGNAL, mine)
    try:
        interrupter = Interrupter()
        assert "SIGURG handler of its own" in interrupter.install()
        assert signal.getsignal(SIGNAL) is mine
        with interrupter.armed():
            interrupter.fire("ignored")  # not installed: nothing is sent
            time.sleep(0.1)
    finally:
        signal.signal(SIGNAL, previous)


def test_it_is_not_installed_from_another_thread():
    reasons = []
    thread = threading.Thread(target=lambda: reasons.append(Interrupter().install()))
    thread.start()
    thread.join()
    assert reasons == ["elastix.elastic.run is not called in the main thread"]
    assert signal.getsignal(SIGNAL) == signal.SIG_DFL

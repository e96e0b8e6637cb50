"""The elastic loop: :func:`run` calls the training function, and after each re-form its
agent announces, joins the next round and calls it again in the same process."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Callable, Optional, TypeVar

from .. import checkpoint as _checkpoint
from ..errors import DistError
from ..worker import progress
from .interrupt import Interrupter, Reforming
from .line import AgentLine, Notice, Place

T = TypeVar("T")

#: Variables the agent sets for a round only when they apply: gone from a place, gone here.
_ROUND_ONLY = (_checkpoint.SAVED_WORLD_VAR, _checkpoint.HELD_STEP_VAR, _checkpoint.SOURCES_VAR)
_BEAT_EVERY = 1.0  # seconds between heartbeats while a place is awaited


def run(
    train: Callable[[_checkpoint.Checkpoint], T],
    *,
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
    interrupt: bool = True,
) -> T:
    """Joins the job's default process group (``backend``, ``timeout`` as for
    ``init_process_group``), opens this rank's checkpoint and returns ``train(ckpt)``; when the
    job re-forms meanwhile, does it all again in the new round, in this process. Outside
    ``elastix run`` it does it once.

    When the job re-forms, ``train`` is interrupted where it is (:class:`Reforming` is raised
    in it: a step that computes is not finished first, its work is lost anyway); with
    ``interrupt=False`` it runs on until its next collective, which fails."""
    line = AgentLine.connect()
    interrupter = Interrupter()
    if line is not None and interrupt:
        why_not = interrupter.install()
        if why_not:
            _say(f"{why_not}: a re-form stops the training function at its next collective only")
        line.on_abort = interrupter.fire
    try:
        return _run(train, line, interrupter, backend, timeout)
    finally:
        if line is not None:
            line.on_abort = None
        interrupter.uninstall()


def _run(
    train: Callable[[_checkpoint.Checkpoint], T],
    line: Optional[AgentLine],
    interrupter: Interrupter,
    backend: Optional[str],
    timeout: Optional[timedelta],
) -> T:
    from .. import collectives

    notice: Optional[Notice] = None
    left = placed = 0.0  # when the worker left its group, and when it had its place in the next
    while True:
        ckpt: Optional[_checkpoint.Checkpoint] = None
        try:
            with interrupter.armed():
                if line is not None:
                    _stop_if_over(line)
                collectives.init_process_group(backend=backend, timeout=timeout)
                ckpt = _checkpoint.open()
                if line is not None:
                    ckpt.after_save = _drain_point(line)
                if line is not None and notice is not None:
                    line.settled(time.monotonic() - notice.at, left - notice.at, placed - notice.at)
                return train(ckpt)
        except BaseException as err:
            notice = _reform_notice(line, err)
            if notice is None:
                raise
            if ckpt is not None:
                ckpt.close()
            if collectives.is_initialized():
                collectives.destroy_process_group()
        assert line is not None  # a notice came on it
        line.drained()
        left = time.monotonic()
        _take(_await_place(line, notice))
        placed = time.monotonic()


def _reform_notice(line: Optional[AgentLine], err: BaseException) -> Optional[Notice]:
    """The agent's word that the job re-forms, if it explains ``err``: it came first (whatever
    ``err`` is, the abort explains it), or ``err`` is a collective's or store's failure and the
    word comes within the time the agent takes to count a peer lost. None: ``err`` is the
    worker's own, and it ends the worker (which its agent restarts)."""
    if line is None or not isinstance(err, (Exception, Reforming)):
        return None
    notice = line.notice(0)
    if notice is None and isinstance(err, (DistError, ConnectionError)):
        line.broken(f"{type(err).__name__}: {err}")
        _say(
            f"a collective failed ({type(err).__name__}: {err}); asking the agent whether the job re-forms "
            f"(up to {line.notice_within:.1f} s)"
        )
        notice = line.notice(line.notice_within)
    return notice


def _drain_point(line: AgentLine) -> Callable[[int], None]:
    """What runs after each checkpoint save: when the job re-forms after this step (a node
    joins), the training function stops here, its step saved."""

    def after_save(step: int) -> None:
        notice = line.at_save(step)
        if notice is not None:
            raise Reforming(notice.why)

    return after_save


def _stop_if_over(line: AgentLine) -> None:
    """Raises :class:`Reforming` if the round this worker is about to join is over already:
    the agent re-formed again while the worker had no span armed (between the notice and its
    place), so that re-form's interrupt was not raised, and joining would wait for peers that
    went on to the next round."""
    notice = line.notice(0)
    joining = int(os.environ.get("ELASTIX_ROUND", "-1"))
    if notice is not None and notice.round >= joining:
        raise Reforming(f"round {joining} is over: {notice.why}")


def _await_place(line: AgentLine, notice: Notice) -> Place:
    """The worker's place in a round after the notice's, waited for until the notice's
    deadline (a place in an earlier round, given before the agent re-formed again, is not
    taken)."""
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + notice.until - time.monotonic()))
    _say(f"the job re-forms ({notice.why}); waiting for this worker's place in round > {notice.round}, until {until}")
    while True:
        progress.heartbeat()
        place = line.place(min(_BEAT_EVERY, max(0.0, notice.until - time.monotonic())), after=notice.round)
        if place is not None:
            return place
        if time.monotonic() >= notice.until:
            raise TimeoutError(f"the agent placed this worker in no new round by {until} ({notice.why})")


def _take(place: Place) -> None:
    """Makes ``place`` this process's environment: what ``init_process_group`` and
    ``elastix.checkpoint.open`` read."""
    for name in _ROUND_ONLY:
        if name not in place.env:
            os.environ.pop(name, None)
    os.environ.update(place.env)


def _say(message: str) -> None:
    print(f"[elastix] {message}", file=sys.stderr, flush=True)

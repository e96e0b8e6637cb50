"""Hang detection, the worker's side: ``heartbeat()``, ``expect_progress(within=...)`` and
(in ``elastix.timer``) ``expires(after=...)``.

Under ``elastix run`` each worker has a slot of 64-bit words in a shared page its agent reads
(see rust/core/src/agent/hangs/heartbeats.rs); these write it in place, so a heartbeat costs a
fraction of a microsecond and no system call. Outside ``elastix run`` they do nothing.

The agent counts a worker as hung when an ``expires`` timer runs out, when inside
``expect_progress(within=W)`` its last heartbeat is older than W, or, with
``--worker-timeout T``, when its last heartbeat (once it sent one) is older than T; a worker that
never sends one is watched through its main thread and CPU use by elastix's site hook
(python/elastix/worker/site). Before killing it, the agent has it dump every thread's
stack (``faulthandler``, armed on a real-time signal by the site hook, or when this module first
finds its slot, as ``import elastix`` does), and shows them with its warning.

The slot belongs to the process that claimed it first (its pid is in the slot): a child
started with fork, spawn or forkserver inherits the variables but never writes to it.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, List, Optional, Union

# the layout of a slot: words of 8 bytes, as the agent reads them
_WORDS = 32
_LAST_BEAT, _WINDOW, _DEADLINE, _DUMP_SIGNAL, _MOVED, _OWNER, _BEATS, _STEP, _FLIGHT_COUNT = range(9)
_FLIGHT_RING, _FLIGHT_WORDS, _FLIGHTS = 9, 5, 4  # the last 4 collectives, 5 words each
_SAVED = _FLIGHT_RING + _FLIGHT_WORDS * _FLIGHTS  # the step of the last checkpoint save, plus one

_words: Optional[memoryview] = None  # this worker's page, as 64-bit words
_base = 0  # its slot's first word
_looked = False
_lock = threading.Lock()  # guards the window and timer stacks (heartbeats need no lock)
_windows: List[List[int]] = []  # open windows, innermost last; each entry is its own object
_deadlines: List[int] = []
_stacks_file = None  # kept open: faulthandler writes to its descriptor
_monotonic_ns = time.monotonic_ns  # the agent reads CLOCK_MONOTONIC too


def _slot() -> Optional[memoryview]:
    """This worker's slot (looked up once), or None outside ``elastix run``."""
    global _words, _base, _looked
    with _lock:
        if _looked:
            return _words
        _looked = True
        path, slot = os.environ.get("ELASTIX_HEARTBEAT_FILE"), os.environ.get("ELASTIX_HEARTBEAT_SLOT")
        if not path or slot is None:
            return None
        import mmap

        with open(path, "r+b") as page:
            words = memoryview(mmap.mmap(page.fileno(), 0)).cast("Q")
        base = int(slot) * _WORDS
        if base + _WORDS > len(words):
            raise RuntimeError(f"{path} has no slot {slot}: ELASTIX_HEARTBEAT_SLOT does not match the page")
        if words[base + _OWNER] not in (0, os.getpid()):
            return None  # another process's slot: this is a child it started with spawn or forkserver
        words[base + _OWNER] = os.getpid()
        _words, _base = words, base
        if not words[base + _DUMP_SIGNAL]:  # the site hook armed them already
            _arm_stack_dumps(words, base)
        # a forked child (a data loader worker) is not this worker: its beats must not count
        os.register_at_fork(after_in_child=_forget)
        return words


def _arm_stack_dumps(words: memoryview, base: int) -> None:
    global _stacks_file
    path = os.environ.get("ELASTIX_STACKS_FILE")
    if not path:
        return
    import faulthandler
    import signal

    number = signal.SIGRTMIN + 3  # a real-time signal: no program uses it for anything else
    _stacks_file = open(path, "a")  # open for as long as the process lives
    faulthandler.register(number, file=_stacks_file, all_threads=True)
    words[base + _DUMP_SIGNAL] = number


def _forget() -> None:
    global _words, _looked
    _words, _looked = None, True


def heartbeat(step: Optional[int] = None) -> None:
    """Tells the agent this worker makes progress. Cheap enough to call every step. ``step``
    (a training step, a non-negative int) is shown by ``elastix status`` with the count of
    beats."""
    words = _words if _looked else _slot()
    if words is not None:
        words[_base] = _monotonic_ns()
        words[_base + _BEATS] += 1
        if step is not None:
            if step < 0:
                raise ValueError(f"heartbeat(step={step!r}): a step is a non-negative int")
            words[_base + _STEP] = step + 1  # 0: no step given


def checkpoint_saved(step: Optional[int]) -> None:
    """Tells the agent this worker saves the checkpoint of ``step``, or restored it (None:
    restored nothing); elastix.checkpoint calls it. The agent stops the workers at such a step
    boundary when the job re-forms for a joining node."""
    words = _words if _looked else _slot()
    if words is not None:
        words[_base + _SAVED] = 0 if step is None else step + 1  # 0: none


def _nanoseconds(duration: Union[timedelta, float, int], name: str) -> int:
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if not seconds > 0:
        raise ValueError(f"{name} must be a positive duration, got {duration!r}")
    return int(seconds * 1e9)


@contextmanager
def expect_progress(within: Union[timedelta, float]) -> Iterator[None]:
    """Inside the block, this worker is hung when it sends no heartbeat for ``within`` (a
    ``timedelta`` or seconds). Entering counts as a heartbeat; blocks nest (the innermost
    window applies)."""
    window = _nanoseconds(within, "within")
    words = _slot()
    if words is None:
        yield
        return
    entry = [window]
    with _lock:
        _windows.append(entry)
        words[_base + _WINDOW] = window
    heartbeat()
    try:
        yield
    finally:
        with _lock:
            # this block's own entry: with windows of equal length, the innermost one is left
            del _windows[next(i for i, open_ in enumerate(_windows) if open_ is entry)]
            words[_base + _WINDOW] = _windows[-1][0] if _windows else 0


@contextmanager
def _expires(after: Union[timedelta, float]) -> Iterator[None]:
    """The timer behind ``elastix.timer.expires``."""
    deadline = time.monotonic_ns() + _nanoseconds(after, "after")
    words = _slot()
    if words is None:
        yield
        return
    with _lock:
        _deadlines.append(deadline)
        words[_base + _DEADLINE] = min(_deadlines)
    try:
        yield
    finally:
        with _lock:
            _deadlines.remove(deadline)
            words[_base + _DEADLINE] = min(_deadlines) if _deadlines else 0


def flight_enter(kind: int, group: int, seq: int, nbytes: int) -> Optional[int]:
    """Records, in the flight recorder of this worker's slot, that it enters collective
    number ``seq`` of ``group``; returns the entry's place for :func:`flight_exit` (None
    outside ``elastix run``). Plain words in shared memory, no lock: one thread runs a group's
    collectives."""
    words = _words if _looked else _slot()
    if words is None:
        return None
    count = words[_base + _FLIGHT_COUNT]
    at = _base + _FLIGHT_RING + (count % _FLIGHTS) * _FLIGHT_WORDS
    words[at + 4] = 0  # unfinished, before the entry says what it is
    words[at] = (kind & 0xFF) | (group << 8)
    words[at + 1] = seq
    words[at + 2] = nbytes
    words[at + 3] = _monotonic_ns()
    words[_base + _FLIGHT_COUNT] = count + 1
    return at


def flight_exit(at: int) -> None:
    """The collective recorded at ``at`` is over."""
    words = _words
    if words is not None:
        words[at + 4] = _monotonic_ns()


def arm() -> None:
    """Finds this worker's slot now (and arms stack dumps), if under ``elastix run``."""
    if os.environ.get("ELASTIX_HEARTBEAT_FILE"):
        _slot()


__all__ = ["heartbeat", "expect_progress", "arm", "flight_enter", "flight_exit"]

"""Handles of asynchronous collectives (``async_op=True``) and the per-group worker thread.

A group runs its collectives one at a time, in the order they were issued, on a worker thread
created at the first asynchronous call; a blocking call issued while asynchronous ones are
pending is queued behind them (so every rank sees the same order) and waited for.

Results travel in ``concurrent.futures.Future``s. The thread itself is not a
``ThreadPoolExecutor``: the interpreter joins those at exit, so a process that ends (say, on an
exception) with a collective still waiting for a peer would hang there until the collective's
timeout instead of exiting and letting its peers see it gone. Ours is a daemon thread, and
``ProcessGroup.close`` makes the work in progress fail promptly before it joins it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class Work:
    """torch.distributed's Work: ``wait()``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``result()``, ``get_future()``."""

    def __init__(self, future: Optional[Future[Any]] = None) -> None:
        self._future: Future[Any] = future if future is not None else Future()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the collective finished (raising its error); False on ``timeout``
        (seconds or a timedelta)."""
        if timeout is not None and hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        try:
            error = self._future.exception(timeout)
        except FutureTimeout:  # not finished (an error of the collective is returned, not raised)
            return False
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None

    def result(self) -> Any:
        self.wait()
        return self._future.result()

    def get_future(self) -> "Work":
        return self


class CompletedWork(Work):
    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._future.set_result(result)


class Executor:
    """Runs a group's collectives in issue order on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.Queue[Optional[tuple[Callable[[], Any], Future[Any]]]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._pending = 0
        self._lock = threading.Lock()
        self.inline_lock = threading.Lock()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    with self.inline_lock:
                        result = fn()
                    future.set_result(result)
                except BaseException as err:
                    future.set_exception(err)
            with self._lock:
                self._pending -= 1

    def submit(self, fn: Callable[[], Any]) -> Work:
        future: Future[Any] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"elastix-{self._name}", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put((fn, future))
        return Work(future)

    def busy(self) -> bool:
        """True while submitted work has not finished."""
        with self._lock:
            return self._pending > 0

    def drain(self) -> None:
        """Waits for the pending work (errors stay with their handles)."""
        if self.busy():
            self.submit(lambda: None).wait()

    def close(self, timeout: float = 60.0) -> None:
        """Lets the queued work run (the group was aborted first if any was pending, so it fails
        fast) and joins the thread. Work that outlives ``timeout`` (it cannot reach freed memory:
        the segments stay mapped while anything uses them) is left to end on its own."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s: a collective still runs %.0f s after its group was destroyed", self._name, timeout)
            self._thread = None


__all__ = ["Work", "CompletedWork", "Executor"]

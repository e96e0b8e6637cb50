"""Handles of asynchronous collectives (``async_op=True``) and the per-group worker thread.

A group runs its collectives one at a time, in the order they were issued, on a worker thread
created at the first asynchronous call; a blocking call issued while asynchronous ones are
pending is queued behind them (so every rank sees the same order) and waited for.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional


class Work:
    """torch.distributed's Work: ``wait()``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``result()``."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._result: Any = None

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the collective finished (raising its error); False on ``timeout``
        (seconds or a timedelta)."""
        if timeout is not None and hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> "Work":
        return self


class CompletedWork(Work):
    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._finish(result)


class Executor:
    """Runs a group's collectives in issue order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._pending = 0
        self._lock = threading.Lock()
        self.inline_lock = threading.Lock()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work = item
            try:
                with self.inline_lock:
                    result = fn()
                work._finish(result)
            except BaseException as err:
                work._finish(error=err)
            with self._lock:
                self._pending -= 1

    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"elastix-{self._name}", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put((fn, work))
        return work

    def run(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` now, or behind the pending asynchronous work."""
        if self._pending:
            return self.submit(fn).result()
        with self.inline_lock:
            return fn()

    def drain(self) -> None:
        """Waits for the pending work (errors stay with their handles)."""
        with self._lock:
            pending = self._pending
        if pending:
            self.submit(lambda: None).wait()

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None


__all__ = ["Work", "CompletedWork", "Executor"]

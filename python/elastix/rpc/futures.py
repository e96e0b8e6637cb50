"""``Future``: what ``rpc_async`` returns (torch.futures.Future's methods: ``wait``, ``then``,
``done``, ``value``, ``add_done_callback``, ``set_result``, ``set_exception``). Callbacks run
on the thread that completes the future, or at once if it is already done."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, List, Optional, TypeVar, cast

T = TypeVar("T")
S = TypeVar("S")

log = logging.getLogger(__name__)


class Future(Generic[T]):
    __slots__ = ("_callbacks", "_cond", "_done", "_error", "_value")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._done = False
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Future[T]"], None]] = []

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: Optional[float] = None) -> T:
        """The result, waiting for it (up to ``timeout`` seconds); raises the call's error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"the future was not completed within {timeout}s")
        return self.value()

    def value(self) -> T:
        """The result of a completed future (raises its error)."""
        if not self._done:
            raise RuntimeError("Future.value() on a future that is not done; wait() for it")
        if self._error is not None:
            raise self._error
        return cast(T, self._value)  # what set_result(value: T) gave

    def exception(self) -> Optional[BaseException]:
        return self._error if self._done else None

    def set_result(self, value: T) -> None:
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._complete(None, error)

    def _complete(self, value: Any, error: Optional[BaseException]) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError("this future is already completed")
            self._value, self._error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for callback in callbacks:
            self._run(callback)

    def _run(self, callback: Callable[["Future[T]"], None]) -> None:
        try:
            callback(self)
        except Exception:
            log.exception("a Future's done callback raised")

    def add_done_callback(self, callback: Callable[["Future[T]"], None]) -> None:
        with self._cond:
            if not self._done:
                self._callbacks.append(callback)
                return
        self._run(callback)

    def then(self, callback: Callable[["Future[T]"], S]) -> "Future[S]":
        """A future of ``callback(self)``'s result (or of the error it raises)."""
        chained: Future[S] = Future()

        def run(done: "Future[T]") -> None:
            try:
                result = callback(done)
            except BaseException as err:  # the chained future carries it, as torch's does
                chained.set_exception(err)
            else:
                chained.set_result(result)

        self.add_done_callback(run)
        return chained

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._error is not None else "done")
        return f"<elastix.rpc.Future {state}>"


def wait_all(futures: List[Future[Any]]) -> List[Any]:
    """The results of every future, in order (raises the first error met)."""
    return [future.wait() for future in futures]


__all__ = ["Future", "wait_all"]

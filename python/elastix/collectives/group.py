"""Process groups: the default (world) group made by ``init_process_group`` and subgroups made
by ``new_group``. Each group lives in its own namespace of the job's store
(``elastix/collectives/pg<N>/...``), so any number of groups share one store.
"""

from __future__ import annotations

import atexit
import logging
import threading
import zlib
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..store import PrefixStore
from ..store.base import to_seconds
from ..worker import progress
from .errors import GroupError, NotInitializedError
from .work import Executor

DEFAULT_TIMEOUT = timedelta(minutes=30)
STORE_PREFIX = "elastix/collectives"
BACKENDS = ("cpu", "nccl")
EXIT_JOIN_SECONDS = 5.0  # at exit, how long a group's threads get to end

log = logging.getLogger(__name__)


def normalize_backend(backend: Optional[str]) -> str:
    if backend is None:
        return "cpu"
    name = str(backend).lower()
    if name in ("cpu", "gloo", "shm", "tcp"):
        return "cpu"
    if name in ("nccl", "cuda"):
        return "nccl"
    raise ValueError(f"unknown backend {backend!r}: use 'cpu' (alias 'gloo') or 'nccl'")


class ProcessGroup:
    """A set of ranks that run collectives together. ``rank()`` is this process's rank in the
    group (-1 if it is not a member), ``size()`` the number of members; ``ranks`` lists the
    members' global ranks in group-rank order."""

    def __init__(
        self, name: str, ranks: Sequence[int], global_rank: int, backend_name: str, timeout: Optional[float], store
    ) -> None:
        self.name = name
        self.ranks: List[int] = list(ranks)
        self._rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.backend_name = backend_name
        self.timeout = timeout
        self.store = store
        # a CpuBackend or an NcclBackend (same duck-typed interface); None on non-members
        # and once destroyed, which resolve() checks before any collective runs
        self.backend: Any = None
        self.destroyed = False
        # the flight recorder's view of this group: its number, and its collectives so far
        self.number = int(name) if name.isdigit() else zlib.crc32(name.encode())
        self.collectives = 0
        # reductions' checks and descriptors by (collective, dtype, shape, op): see api._plan
        self.plans: Dict[tuple, tuple] = {}
        self.executor = Executor(f"pg{name}")
        self.send_executor = Executor(f"pg{name}-send")
        if self._rank >= 0:
            self.backend = _make_backend(backend_name, store, self._rank, self.ranks, timeout)

    def rank(self) -> int:
        return self._rank

    def _flight_enter(self, desc: Sequence[int]) -> Optional[int]:
        """Counts this group's next collective and records its start (None outside elastix run)."""
        self.collectives += 1
        return progress.flight_enter(desc[0], self.number, self.collectives, desc[4])

    def recorded(self, fn: Callable[[], Any], desc: Sequence[int]) -> Callable[[], Any]:
        """``fn`` (a collective described by ``desc``) with its start now and its end recorded in
        this worker's flight recorder (elastix.worker.progress), which the agent reads to name
        the rank that holds the others up when they hang."""
        at = self._flight_enter(desc)
        if at is None:
            return fn

        def run() -> Any:
            try:
                return fn()
            finally:
                progress.flight_exit(at)

        return run

    def run_now(self, fn: Callable[[], Any], desc: Sequence[int]) -> None:
        """Runs the collective ``fn`` (described by ``desc``) on this thread, behind any pending
        asynchronous work, with its start and end in the flight recorder (as ``recorded``,
        without a closure: this is every blocking collective's path)."""
        if self.send_executor._pending:
            self.send_executor.drain()  # a collective never shares a connection with a pending send
        if self.executor._pending:
            self.executor.submit(self.recorded(fn, desc)).result()
            return
        at = self._flight_enter(desc)
        with self.executor.inline_lock:
            try:
                fn()
            finally:
                if at is not None:
                    progress.flight_exit(at)

    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        try:
            return self.ranks.index(int(global_rank))
        except ValueError:
            raise GroupError(
                f"{what} {global_rank} is not a member of group {self.name} (ranks {self.ranks})"
            ) from None

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.name!r}, ranks={self.ranks}, rank={self._rank}, backend={self.backend_name!r})"

    def close(self, join_timeout: float = 60.0) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        backend = self.backend
        if backend is not None and (self.executor.busy() or self.send_executor.busy()):
            # what runs or waits must fail now rather than wait for its peers: abort first
            backend.abort(f"group {self.name} was destroyed")
        self.executor.close(join_timeout)
        self.send_executor.close(join_timeout)
        if backend is not None:
            backend.close()
            self.backend = None


def _make_backend(name: str, store, rank: int, ranks: List[int], timeout: Optional[float]):
    if name == "nccl":
        from .nccl_backend import NcclBackend

        return NcclBackend(store, rank, len(ranks), ranks, timeout)
    from .cpu_backend import CpuBackend

    return CpuBackend(store, rank, len(ranks), ranks, timeout)


class World:
    def __init__(
        self, store, rank: int, size: int, backend: str, timeout: Optional[float], namespace: str = ""
    ) -> None:
        # `elastix run` keeps one store for the whole job and exports the rendezvous round
        # (ELASTIX_ROUND): each round's groups get their own keys, so stale keys of an earlier
        # attempt are never read
        self.store = PrefixStore(STORE_PREFIX + (f"/{namespace}" if namespace else ""), store)
        self.raw_store = store
        self.rank = rank
        self.size = size
        self.backend = backend
        self.timeout = timeout
        self.groups: List[ProcessGroup] = []
        self.counter = 0
        self.default = self.make(list(range(size)), backend, timeout)

    def make(self, ranks: List[int], backend: str, timeout: Optional[float]) -> ProcessGroup:
        name = str(self.counter)
        self.counter += 1
        group = ProcessGroup(name, ranks, self.rank, backend, timeout, PrefixStore(f"pg{name}", self.store))
        self.groups.append(group)
        return group


_world: Optional[World] = None
_lock = threading.RLock()
_exit_hook = False


def world() -> World:
    if _world is None:
        raise NotInitializedError(
            "the default process group has not been initialized; call elastix.collectives.init_process_group() first"
        )
    return _world


def set_world(w: Optional[World]) -> None:
    global _world, _exit_hook
    _world = w
    if w is not None and not _exit_hook:
        atexit.register(_destroy_at_exit)
        _exit_hook = True


def _destroy_at_exit() -> None:
    """Destroys the groups a program left behind, so that their threads (executors, TCP
    accept and send threads, which call into the native module) have ended before the
    interpreter finalises. Work still queued fails at once (the groups are aborted)."""
    if not _lock.acquire(timeout=EXIT_JOIN_SECONDS):
        log.warning("elastix.collectives: a thread holds the groups' lock at exit; groups left as they are")
        return
    try:
        w = _world
        if w is None:
            return
        for g in reversed(w.groups):
            g.close(EXIT_JOIN_SECONDS)
        set_world(None)
    finally:
        _lock.release()


def resolve(group: Optional[ProcessGroup]) -> ProcessGroup:
    """The group a collective runs on; raises if this rank cannot use it."""
    w = world()
    g = w.default if group is None else group
    if not isinstance(g, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group(), not {type(g).__name__}")
    if g.destroyed:
        raise GroupError(f"group {g.name} was destroyed")
    if g._rank < 0:
        raise GroupError(f"rank {w.rank} is not a member of group {g.name} (ranks {g.ranks})")
    return g


def timeout_seconds(timeout) -> Optional[float]:
    return to_seconds(DEFAULT_TIMEOUT if timeout is None else timeout)


__all__ = [
    "ProcessGroup",
    "World",
    "world",
    "set_world",
    "resolve",
    "normalize_backend",
    "DEFAULT_TIMEOUT",
    "timeout_seconds",
]

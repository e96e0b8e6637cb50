"""The functions of ``elastix.rpc``, with torch.distributed.rpc's names and arguments."""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..collectives.init_method import rendezvous
from . import _current
from ._current import current_agent
from .errors import RpcError
from .futures import Future
from .options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT, RpcBackendOptions
from .rpc_agent import RpcAgent, To
from .rref import RRef, create_remote
from .serialize import OP_CALL
from .worker_info import WorkerInfo

log = logging.getLogger("elastix.rpc")
_exit_hook = False


def init_rpc(
    name: str,
    backend: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    rpc_backend_options: Optional[RpcBackendOptions] = None,
) -> None:
    """Joins this process to the RPC group as ``name``. ``rank`` and ``world_size`` default to
    RANK and WORLD_SIZE, and the store to the one ``elastix run`` (or torchrun) gives its
    workers (``init_method`` in the options: env://, tcp://, file://). Returns once every
    worker has joined. ``backend`` is accepted for torch's signature and ignored."""
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ValueError(f"an RPC worker name is a non-empty string of at most 128 characters, got {name!r}")
    options = rpc_backend_options or RpcBackendOptions()
    with _current.lock:
        if _current.agent is not None:
            raise RpcError(f"RPC is already running in this process (as {_current.agent.name!r}); shutdown() first")
        timeout = options.rpc_timeout if options.rpc_timeout > 0 else None
        store, rank, world_size = rendezvous(options.init_method, rank, world_size, timeout)
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        if options.init_method.startswith("tcp://"):
            from urllib.parse import urlparse

            host = urlparse(options.init_method).hostname or host
        _current.agent = RpcAgent(name, rank, world_size, options, store, host)
        _current.agent.start()
        global _exit_hook
        if not _exit_hook:
            atexit.register(_stop_at_exit)
            _exit_hook = True
    log.info("rpc: %s joined as rank %d of %d", name, rank, world_size)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Leaves RPC. ``graceful``: first waits until every worker has called shutdown and every
    call and RRef message anywhere is done; RRefs still held are then deleted everywhere. With
    ``graceful=False`` this worker stops at once (its pending calls fail). ``timeout`` bounds
    the graceful wait (0: no limit)."""
    with _current.lock:
        agent = _current.agent
        if agent is None or agent.stopping:
            raise RpcError("RPC is not running in this process: nothing to shut down")
        agent.stopping = True
    try:
        # the agent stays the process's agent meanwhile: the calls it still runs may make calls
        agent.shutdown(graceful, None if timeout <= 0 else float(timeout))
    finally:
        with _current.lock:
            _current.agent = None


def _stop_at_exit() -> None:
    """A program that exits without shutdown() leaves RPC at once (as shutdown(graceful=False)
    would: calls to this worker fail on the peers), so that the transport's threads have ended
    before the interpreter finalises."""
    with _current.lock:
        agent = _current.agent
        if agent is None or agent.stopping:
            return
        agent.stopping = True
    try:
        agent.shutdown(False, None)
    finally:
        with _current.lock:
            _current.agent = None


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    """This worker's WorkerInfo, or the named worker's."""
    agent = current_agent()
    return agent.worker(agent.name if worker_name is None else worker_name)


def _message(
    func: Callable[..., Any], args: Optional[Sequence[Any]], kwargs: Optional[Dict[str, Any]]
) -> Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]:
    if not callable(func):
        raise TypeError(f"an RPC runs a callable, got {func!r}")
    return (func, tuple(args or ()), dict(kwargs or {}))


def rpc_sync(
    to: To,
    func: Callable[..., Any],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Runs ``func(*args, **kwargs)`` on ``to`` and returns its result (or raises its
    exception, as the same type, with the remote traceback attached)."""
    agent = current_agent()
    return agent.call(agent.worker(to).id, OP_CALL, _message(func, args, kwargs), agent.timeout(timeout))


def rpc_async(
    to: To,
    func: Callable[..., Any],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[Any]:
    """``rpc_sync`` without waiting: a Future of the result."""
    agent = current_agent()
    return agent.call_async(agent.worker(to).id, OP_CALL, _message(func, args, kwargs), agent.timeout(timeout))


def remote(
    to: To,
    func: Callable[..., Any],
    args: Optional[Sequence[Any]] = None,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[Any]:
    """Runs ``func`` on ``to`` and returns at once an RRef to its result, which stays on
    ``to`` (the owner). ``timeout``: how long the owner may take to confirm the RRef."""
    agent = current_agent()
    return create_remote(agent, agent.worker(to).id, _message(func, args, kwargs), agent.timeout(timeout))


def _get_debug_info() -> Dict[str, Any]:
    """Counts of this worker's RRef table and transport (torch's names where it has them):
    num_owner_rrefs, num_user_rrefs, num_pending_users, num_forks, num_pending_children,
    num_pending_calls, num_pending_control."""
    return dict(current_agent().endpoint.stats())


__all__ = ["init_rpc", "shutdown", "get_worker_info", "rpc_sync", "rpc_async", "remote", "current_agent"]

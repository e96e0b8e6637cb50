"""``RRef``: a reference to a value that lives on its owner.

A Python RRef holds a handle of the Rust RRef table: the OwnerRRef itself on the owner, or
one fork (UserRRef) elsewhere. Pickling an RRef inside an RPC message makes a new fork for the
receiver (``__reduce__``), and dropping the last Python reference to an RRef lets its handle go,
which tells the owner (G1) or deletes the OwnerRRef. The protocol is in
``rust/core/src/rpc/refs``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, Tuple, TypeVar, cast

from . import serialize
from ._current import current_agent
from .errors import RpcError, RpcTimeoutError
from .futures import Future
from .options import UNSET_RPC_TIMEOUT
from .rpc_agent import RpcAgent, _Failure
from .serialize import OP_CALL, OP_REMOTE, OP_TO_HERE
from .worker_info import WorkerInfo

if TYPE_CHECKING:
    from .._core import RRefHandle

T = TypeVar("T")


class RRef(Generic[T]):
    __slots__ = ("__weakref__", "_agent", "_creation", "_deadline", "_handle")

    def __init__(self, value: T, type_hint: Optional[type] = None) -> None:
        """A new RRef owned by this worker, holding ``value``."""
        agent = current_agent()
        self._handle = agent.endpoint.new_owner(value)
        self._agent = agent
        self._creation: Optional[Future[None]] = None
        self._deadline: Optional[float] = None

    @classmethod
    def _wrap(
        cls,
        handle: RRefHandle,
        agent: RpcAgent,
        creation: Optional[Future[None]] = None,
        timeout: Optional[float] = None,
    ) -> "RRef[Any]":
        rref = cls.__new__(cls)
        rref._handle, rref._agent, rref._creation = handle, agent, creation
        rref._deadline = None if timeout is None else time.monotonic() + timeout
        return rref

    def owner(self) -> WorkerInfo:
        return self._agent.workers[self._handle.owner()]

    def owner_name(self) -> str:
        return self.owner().name

    def is_owner(self) -> bool:
        return bool(self._handle.is_owner())

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows this fork (always true on the owner)."""
        return bool(self._handle.confirmed())

    def local_value(self) -> T:
        """The value, on the owner only (waits for the function that makes it)."""
        if not self.is_owner():
            raise RuntimeError(
                f"local_value() on a UserRRef: the value lives on {self.owner()}; use to_here() to fetch a copy"
            )
        return self._owner_value(None)

    def _owner_value(self, timeout: Optional[float]) -> T:
        try:
            value = self._agent.endpoint.owner_value(self._handle.rref_id(), timeout)
        except TimeoutError as err:
            raise RpcTimeoutError(str(err)) from None
        if isinstance(value, _Failure):
            raise serialize.load_error(value.payload)
        return cast(T, value)  # what the owner holds: the RRef's value

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """A copy of the value, fetched from the owner (waits until the owner has it)."""
        limit = self._agent.timeout(timeout)
        if self.is_owner():
            return self._owner_value(limit)
        if self._deadline is not None and not self.confirmed_by_owner() and time.monotonic() > self._deadline:
            if self._creation is None or not self._creation.done():
                raise RpcTimeoutError(f"remote() on {self.owner()} was not confirmed within its timeout")
        creation_error = self._creation.exception() if self._creation is not None else None
        if creation_error is not None:
            raise creation_error
        rref, fork = self._handle.rref_id(), self._handle.fork_id()
        return cast(T, self._agent.call(self._handle.owner(), OP_TO_HERE, None, limit, rref, fork))

    def _get_future(self) -> Future[None]:
        """Completes once the owner has created the value (remote() only)."""
        if self._creation is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self._creation

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the value, on its owner."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        return _Proxy(self, "remote", timeout)

    def __reduce__(self) -> Tuple[Callable[[int, Any, Any], RRef[Any]], serialize.ForkData]:
        forks = serialize.forks_being_made()
        if forks is None:
            raise RuntimeError("an RRef can be pickled only as part of an elastix.rpc call (argument or result)")
        data = self._handle.fork_out()
        forks.append(data)
        return (_rebuild, data)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        (creator, local) = self._handle.rref_id()
        if self.is_owner():
            return f"{kind}(RRefId(created_on={creator}, local_id={local}))"
        fork_creator, fork_local = self._handle.fork_id()
        return (
            f"{kind}(RRefId(created_on={creator}, local_id={local}), "
            f"ForkId(created_on={fork_creator}, local_id={fork_local}))"
        )


def _rebuild(owner: int, rref: Any, fork: Any) -> RRef[Any]:
    origin = serialize.message_origin()
    if origin is None:
        raise RpcError("an RRef can be unpickled only from an elastix.rpc message")
    sender, agent = origin
    return RRef._wrap(agent.endpoint.fork_in(owner, tuple(rref), tuple(fork), sender), agent)


def _invoke(rref: RRef[Any], method: str, args: Any, kwargs: Any) -> Any:
    """Runs on the owner: the method of the value."""
    return getattr(rref.local_value(), method)(*args, **kwargs)


def create_remote(agent: RpcAgent, owner: int, message: Any, timeout: Optional[float]) -> RRef[Any]:
    """remote(): the caller's UserRRef (or OwnerRRef, to itself) for ``message`` run on ``owner``;
    ``timeout`` bounds how long the owner may take to confirm it."""
    rref_id, fork_id, handle = agent.endpoint.start_remote(owner)
    creation = agent.call_async(owner, OP_REMOTE, message, None, rref_id, fork_id)
    return RRef._wrap(handle, agent, creation, timeout)


class _Proxy:
    """``rref.rpc_sync()`` and friends: each method call runs on the owner, on the value."""

    __slots__ = ("_how", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], how: str, timeout: float) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            rref = self._rref
            agent = rref._agent
            owner = rref._handle.owner()
            message: Any = (_invoke, (rref, method, args, kwargs), {})
            limit = agent.timeout(self._timeout)
            if self._how == "rpc_sync":
                return agent.call(owner, OP_CALL, message, limit)
            if self._how == "rpc_async":
                return agent.call_async(owner, OP_CALL, message, limit)
            return create_remote(agent, owner, message, limit)

        return call


__all__ = ["RRef"]

"""This process's RPC agent: the endpoint (in Rust), the threads that run incoming calls
(``num_worker_threads``) and the one that completes ``rpc_async`` futures.

Workers find each other through the store: each publishes its name and address under
``rpc/<restart>/worker/<rank>``; rank 0 draws the nonce of the group's key (HMAC of the job
secret, as for the collectives), which every connection proves before any call.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .. import _core
from .._peers import group_key, local_address
from ..errors import DistNetworkError
from ..store import PrefixStore
from . import serialize
from .errors import RpcError, translate
from .futures import Future
from .options import UNSET_RPC_TIMEOUT, RpcBackendOptions
from .serialize import OP_REMOTE, OP_TO_HERE, STATUS_ERROR, STATUS_OK
from .worker_info import WorkerInfo

log = logging.getLogger("elastix.rpc")

KEY_LABEL = b"elastix rpc v1\0"
# test hook: "low,high" seconds; every reference-counting message waits a random time in it
DELAY_ENV = "ELASTIX_RPC_TEST_CONTROL_DELAY"
POLL = 0.5  # seconds a thread waits for work before checking whether RPC was shut down

To = Union[str, int, WorkerInfo]


class _Failure:
    """An OwnerRRef whose function raised: the pickled exception, raised by every to_here."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def _test_delay() -> Optional[Tuple[float, float]]:
    value = os.environ.get(DELAY_ENV)
    if not value:
        return None
    try:
        low, high = (float(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{DELAY_ENV} must be 'low,high' in seconds, got {value!r}") from None
    return low, high


class RpcAgent:
    def __init__(self, name: str, rank: int, world_size: int, options: RpcBackendOptions, store: Any, host: str):
        self.name, self.rank, self.world_size, self.options = name, rank, world_size, options
        self.stopping = False
        # calls issued and started so far (only whether it changes matters), and calls running:
        # shutdown waits for a round in which no worker starts one and none runs
        self.activity = 0
        self._running = 0
        self._running_lock = threading.Lock()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = PrefixStore(f"rpc/{restart}", store)
        wait = timedelta(seconds=options.rpc_timeout) if options.rpc_timeout > 0 else None
        key = group_key(self.store, rank, nonce_key="nonce", label=KEY_LABEL)
        self.endpoint = _core.RpcEndpoint(rank, world_size, local_address("ELASTIX_RPC_ADDR", host), key, _test_delay())
        try:
            self.workers = self._exchange(wait)
        except BaseException:
            self.endpoint.close()
            raise
        self.by_name = {worker.name: worker for worker in self.workers}
        self._futures: Dict[int, Tuple[Future[Any], int, List[serialize.ForkData], bool]] = {}
        self._futures_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self.where = f"worker '{name}' (rank {rank})"
        self._threads = [threading.Thread(target=self._complete, name="elastix-rpc-futures", daemon=True)]
        for i in range(options.num_worker_threads):
            self._threads.append(threading.Thread(target=self._serve, name=f"elastix-rpc-{i}", daemon=True))

    def start(self) -> None:
        """Starts the threads that run calls (once this agent is the process's agent: the
        functions they run may use the module's API)."""
        for thread in self._threads:
            thread.start()

    def _exchange(self, wait: Optional[timedelta]) -> List[WorkerInfo]:
        host, port = self.endpoint.address()
        me = json.dumps({"name": self.name, "addr": f"{host}:{port}"})
        self.store.set(f"worker/{self.rank}", me)
        keys = [f"worker/{rank}" for rank in range(self.world_size)]
        limit = "with no limit" if wait is None else f"for up to {wait.total_seconds():g}s"
        log.info("rpc: %s waits %s for %d workers to publish their addresses", self.name, limit, self.world_size)
        self.store.wait(keys, wait)
        entries = [json.loads(self.store.get(key)) for key in keys]
        seen: Dict[str, int] = {}
        for rank, entry in enumerate(entries):
            if entry["name"] in seen:
                raise ValueError(
                    f"RPC worker names must be unique: ranks {seen[entry['name']]} and {rank} are both "
                    f"named {entry['name']!r}"
                )
            seen[entry["name"]] = rank
        self.endpoint.set_peers([(entry["name"], entry["addr"]) for entry in entries])
        return [WorkerInfo(entry["name"], rank) for rank, entry in enumerate(entries)]

    # -- addressing -----------------------------------------------------------------------

    def worker(self, to: To) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            found = self.by_name.get(to)
            if found is None:
                raise ValueError(f"unknown RPC worker {to!r}; the workers are {sorted(self.by_name)}")
            return found
        if isinstance(to, int) and 0 <= to < self.world_size:
            return self.workers[to]
        raise ValueError(f"an RPC destination is a worker's name, rank or WorkerInfo; got {to!r}")

    def timeout(self, timeout: Optional[float]) -> Optional[float]:
        """Seconds for the transport, None for no limit (0 means no limit, as in torch)."""
        if timeout is None or timeout == UNSET_RPC_TIMEOUT:
            timeout = self.options.rpc_timeout
        if timeout < 0:
            raise ValueError(f"an RPC timeout is >= 0 seconds (0: no limit), got {timeout}")
        return None if timeout == 0 else float(timeout)

    # -- calls ----------------------------------------------------------------------------

    def undo(self, forks: Sequence[serialize.ForkData]) -> None:
        for owner, rref, fork in forks:
            self.endpoint.fork_not_delivered(owner, rref, fork)

    def decode(self, answer: Tuple[int, bytes, Sequence[Any]], callee: int) -> Any:
        status, payload, buffers = answer
        if status == STATUS_OK:
            return serialize.loads(payload, buffers, callee, self)
        if status == STATUS_ERROR:
            raise serialize.load_error(payload)
        raise RpcError(f"{self.endpoint.describe(callee)} refused the call: {bytes(payload).decode(errors='replace')}")

    def call(
        self,
        to: int,
        op: int,
        obj: Any,
        timeout: Optional[float],
        rref: Optional[Tuple[int, int]] = None,
        fork: Optional[Tuple[int, int]] = None,
    ) -> Any:
        self.activity += 1
        payload, buffers, forks = self._dumps(obj)
        try:
            answer = self.endpoint.call(to, op, payload, buffers, rref, fork, timeout)
        except (ConnectionError, RuntimeError) as err:
            self.undo(forks)
            raise translate(err) from None
        except TimeoutError as err:
            raise translate(err) from None
        return self.decode(answer, to)

    def call_async(
        self,
        to: int,
        op: int,
        obj: Any,
        timeout: Optional[float],
        rref: Optional[Tuple[int, int]] = None,
        fork: Optional[Tuple[int, int]] = None,
    ) -> Future[Any]:
        self.activity += 1
        payload, buffers, forks = self._dumps(obj)
        future: Future[Any] = Future()
        token = next(self._tokens)
        with self._futures_lock:
            self._futures[token] = (future, to, forks, op == OP_REMOTE)
        try:
            self.endpoint.call_async(to, op, payload, buffers, token, rref, fork, timeout)
        except BaseException as err:
            with self._futures_lock:
                self._futures.pop(token, None)
            self.undo(forks)
            raise translate(err) from None
        return future

    def _dumps(self, obj: Any) -> Tuple[bytes, List[memoryview], List[serialize.ForkData]]:
        try:
            return serialize.dumps(obj)
        except Exception as err:
            raise type(err)(f"cannot pickle an RPC message: {err}") from err

    def _complete(self) -> None:
        """Completes rpc_async futures as their answers arrive (their callbacks run here)."""
        while True:
            item = self.endpoint.next_completion(POLL)
            if item is None:
                if self.endpoint.is_closed():
                    return
                continue
            token, result = item
            with self._futures_lock:
                entry = self._futures.pop(token, None)
            if entry is None:
                continue
            future, callee, forks, creation = entry
            if isinstance(result, BaseException):
                if isinstance(result, ConnectionError):
                    self.undo(forks)
                future.set_exception(translate(result))
                continue
            try:
                value = None if creation else self.decode(result, callee)
            except BaseException as err:
                future.set_exception(err)
            else:
                future.set_result(value)

    # -- serving --------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            request = self.endpoint.next_request(POLL)
            if request is None:
                if self.endpoint.is_closed():
                    return
                continue
            with self._running_lock:
                self._running += 1
                self.activity += 1
            try:
                self._run(request)
            except BaseException:
                log.exception("rpc: %s failed to answer a request from rank %d", self.where, request.sender)
            finally:
                with self._running_lock:
                    self._running -= 1

    def _run(self, request: Any) -> None:
        if request.op == OP_TO_HERE:
            self.answer_value(request.responder, self.endpoint.owner_value(request.rref, 0.0))
            return
        try:
            func, args, kwargs = serialize.loads(request.payload, request.buffers, request.sender, self)
            result = func(*args, **kwargs)
        except BaseException as err:
            failure = serialize.dump_error(err, self.where)
            if request.op == OP_REMOTE:
                self.set_owner_value(request, _Failure(failure))
            else:
                request.responder.respond(STATUS_ERROR, failure, [])
            return
        if request.op == OP_REMOTE:
            self.set_owner_value(request, result)
        else:
            self.answer_value(request.responder, result)

    def set_owner_value(self, request: Any, value: Any) -> None:
        """A REMOTE's value is in: the caller's fork is confirmed (its answer goes first, so
        the caller knows its RRef is confirmed before any to_here of its own is answered),
        then the TO_HEREs that waited get the value."""
        waiting = self.endpoint.set_value(request.rref, value)
        request.responder.respond(STATUS_OK, b"", [])
        for responder in waiting:
            self.answer_value(responder, value)

    def answer_value(self, responder: Any, value: Any) -> None:
        if isinstance(value, _Failure):
            responder.respond(STATUS_ERROR, value.payload, [])
            return
        try:
            payload, buffers, _forks = serialize.dumps(value)
        except BaseException as err:
            responder.respond(STATUS_ERROR, serialize.dump_error(err, self.where), [])
            return
        responder.respond(STATUS_OK, payload, buffers)

    # -- shutdown -------------------------------------------------------------------------

    def _barrier(self, name: str, deadline: Optional[float], busy: int = 0) -> int:
        """Waits until every worker has reached barrier ``name``; returns the sum of their
        ``busy`` (each adds its own before it counts itself in)."""
        key = f"shutdown/{name}"
        self.store.add(f"{key}/busy", busy)
        if self.store.add(key, 1) == self.world_size:
            self.store.set(f"{key}/done", b"1")
        left = None if deadline is None else timedelta(seconds=max(0.001, deadline - time.monotonic()))
        self.store.wait([f"{key}/done"], left)
        return self.store.add(f"{key}/busy", 0)

    def _leave(self, deadline: Optional[float]) -> None:
        """The last step of a graceful shutdown. The store may live in rank 0's process (a
        plain launch): rank 0 leaves only once every other worker has made its last request,
        so none of theirs finds the store gone."""
        key = "shutdown/left"
        if self.rank != 0:
            try:
                if self.store.add(key, 1) == self.world_size - 1:
                    self.store.set(f"{key}/done", b"1")
            except DistNetworkError:  # the reply to the last request, lost as rank 0 left: done
                pass
            return
        if self.world_size > 1:
            left = None if deadline is None else timedelta(seconds=max(0.001, deadline - time.monotonic()))
            self.store.wait([f"{key}/done"], left)

    def _idle(self) -> bool:
        return self._running == 0 and self.endpoint.outstanding()[0] == 0

    def _quiesce(self, deadline: Optional[float]) -> None:
        """Returns once a round passes in which no worker started a call, issued or run, and
        none runs. A worker with nothing of its own waiting may still be sent a call (a
        function that another worker runs may make one, without waiting, even after a delay),
        so one barrier is not enough: rounds repeat until one sees no activity anywhere, and
        from then on no user function runs anywhere."""
        seen = -1
        for round_ in itertools.count():
            self._settle("calls waiting for answers or running", self._idle, deadline)
            busy = int(self.activity != seen)
            seen = self.activity
            if self._barrier(f"calls/{round_}", deadline, busy) == 0:
                return

    def _settle(self, what: str, done: Callable[[], bool], deadline: Optional[float]) -> None:
        """Waits (bounded by the deadline) until done() holds, saying what it waits for."""
        said = time.monotonic() + 5.0
        while not done():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"rpc.shutdown: {self.where} still has {what} at the shutdown deadline ({self.endpoint.stats()})"
                )
            if now >= said:
                log.warning("rpc.shutdown: %s waits for %s (%s)", self.where, what, self.endpoint.stats())
                said = now + 5.0
            time.sleep(0.002)

    def shutdown(self, graceful: bool, timeout: Optional[float]) -> None:
        try:
            if graceful:
                deadline = None if timeout is None else time.monotonic() + timeout
                # 1. no call is waiting for an answer or running, anywhere
                self._quiesce(deadline)
                # 2. every fork goes (its owner is told), whatever the code still holds; then
                #    every owner has heard of every deletion
                self.endpoint.release_all_users()

                def quiet() -> bool:
                    stats = self.endpoint.stats()
                    return stats["num_user_rrefs"] == 0 and stats["num_pending_control"] == 0

                self._settle("RRef messages", quiet, deadline)
                self._barrier("refs", deadline)
                # 3. what is left is held only by this worker's own code
                self.endpoint.clear_owners()
                self._leave(deadline)
        finally:
            self.endpoint.close()
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=5.0)


__all__ = ["RpcAgent", "To"]

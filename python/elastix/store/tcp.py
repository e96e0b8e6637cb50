"""``TCPStore``: torch.distributed.TCPStore's constructor and behaviour over elastix's Rust
client and server (wire-compatible: torch clients can use an elastix server and vice versa)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

from .._core import StoreCore
from .base import DEFAULT_TIMEOUT, Key, Value, encode_key, to_seconds
from .native import NativeStore


def _agent_hosts_store_on(port: int) -> bool:
    """torch's rule: a worker asked to host the store on the port where its agent already
    serves one (TORCHELASTIC_USE_AGENT_STORE) connects to it instead."""
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    return use_agent_store and os.environ.get("MASTER_PORT") == str(port)


class TCPStore(NativeStore):
    """A store served over TCP, with torch's signature and semantics.

    ``is_master=True`` starts the server in this process (port 0 picks a free port, read it
    back from ``.port``) and then connects to it. With ``world_size`` set, every store counts
    itself in, and the master waits (up to ``timeout``) until ``world_size`` have.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
        *,
        _core_store: Optional[StoreCore] = None,
    ) -> None:
        self._use_libuv = bool(use_libuv)
        if _core_store is not None:  # clone()
            super().__init__(_core_store)
            return
        if not isinstance(host_name, str):
            raise TypeError(f"host_name must be str, not {type(host_name).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise TypeError(f"port must be an int in 0..65535, got {port!r}")
        if not isinstance(is_master, bool):
            raise TypeError(f"is_master must be a bool, not {type(is_master).__name__}")
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, int):
                raise TypeError(f"world_size must be an int or None, got {world_size!r}")
            if world_size == 0:
                raise ValueError("TCPStore world size cannot be 0")
            if world_size < 0:
                world_size = None
        core = StoreCore(
            host_name,
            port,
            world_size=world_size,
            is_master=is_master,
            timeout=to_seconds(timeout),
            wait_for_workers=bool(wait_for_workers),
            multi_tenant=bool(multi_tenant),
            listen_fd=master_listen_fd,
            client_if_port_taken=is_master and _agent_hosts_store_on(port),
        )
        super().__init__(core)

    @property
    def host(self) -> str:
        return self._core.host

    @property
    def port(self) -> int:
        return self._core.port

    @property
    def libuvBackend(self) -> bool:
        return self._use_libuv

    def clone(self) -> "TCPStore":
        return TCPStore("", 0, use_libuv=self._use_libuv, _core_store=self._core.duplicate())

    def __repr__(self) -> str:
        server = f"TCPServer(port={self.port})" if self._core.is_server else "<nullptr>"
        client = f"TCPClient(addr={self._core.local_addr}, remote={self._core.remote_addr})"
        return f"TCPStore(client={client}, server={server})"

    def _check_queues(self) -> None:
        if not self._use_libuv:
            raise NotImplementedError("queues not implemented on legacy TCPStore backend")

    def queue_push(self, key: Key, value: Value) -> None:
        self._check_queues()
        super().queue_push(key, value)

    def queue_pop(self, key: Key, block: bool = True) -> bytes:
        self._check_queues()
        return super().queue_pop(key, block)

    def queue_len(self, key: Key) -> int:
        self._check_queues()
        return super().queue_len(key)

    def barrier(self, key: Key, world_size: int, timeout: Optional[timedelta] = None) -> None:
        seconds = self._core.timeout if timeout is None else to_seconds(timeout)
        self._core.barrier(encode_key(key), int(world_size), seconds)

    def ping(self) -> None:
        """Round trip to the server: raises if it is unreachable."""
        self._core.ping()

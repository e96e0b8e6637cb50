"""Where a process group's store comes from: ``env://``, ``tcp://host:port``, ``file:///path``,
or a store given by the caller.

``env://`` (the default) reads the environment ``elastix run`` and torchrun set: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT. With TORCHELASTIC_USE_AGENT_STORE=True the agent already
serves a store at MASTER_ADDR:MASTER_PORT and every worker is a client of it; otherwise rank 0
hosts one there. ``tcp://`` does the same with the address in the URL (rank and world size from
the arguments, the URL's query, or the environment). ``file://`` uses an elastix FileStore.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional, Tuple
from urllib.parse import parse_qs, urlparse

from ..store.base import Store, to_timedelta

if TYPE_CHECKING:
    from ..store import TCPStore


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _need(value: Optional[int], what: str, source: str) -> int:
    if value is None or value < 0:
        raise ValueError(
            f"{source}: {what} is not known: pass {what}= or set the environment "
            f"variable {what.upper()} (elastix run and torchrun set it)"
        )
    return value


def _agent_serves(host: str, port: int) -> bool:
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("true", "1")
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: Optional[float]) -> TCPStore:
    from ..store import TCPStore

    td = to_timedelta(timeout)
    if _agent_serves(host, port):
        return TCPStore(host, port, is_master=False, timeout=td)
    return TCPStore(
        host, port, world_size=None, is_master=(rank == 0), timeout=td, wait_for_workers=False, multi_tenant=True
    )


def rendezvous(
    init_method: str, rank: Optional[int], world_size: Optional[int], timeout: Optional[float]
) -> Tuple[Store, int, int]:
    """(store, rank, world size) for ``init_method``."""
    url = urlparse(init_method)
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if rank is None and "rank" in query:
        rank = int(query["rank"])
    if world_size is None and "world_size" in query:
        world_size = int(query["world_size"])
    if url.scheme == "env":
        rank = _need(rank if rank is not None else _env_int("RANK"), "rank", "env://")
        world_size = _need(world_size if world_size is not None else _env_int("WORLD_SIZE"), "world_size", "env://")
        host = os.environ.get("MASTER_ADDR")
        port = _env_int("MASTER_PORT")
        if not host or port is None:
            raise ValueError("env://: MASTER_ADDR and MASTER_PORT must be set (elastix run and torchrun set them)")
        return _tcp_store(host, port, rank, world_size, timeout), rank, world_size
    if url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise ValueError(f"tcp:// init needs host and port, as in tcp://10.0.0.1:29500, got {init_method!r}")
        rank = _need(rank if rank is not None else _env_int("RANK"), "rank", "tcp://")
        world_size = _need(world_size if world_size is not None else _env_int("WORLD_SIZE"), "world_size", "tcp://")
        return _tcp_store(url.hostname, url.port, rank, world_size, timeout), rank, world_size
    if url.scheme == "file":
        path = url.path or url.netloc
        if not path:
            raise ValueError(f"file:// init needs a path, as in file:///tmp/rdzv, got {init_method!r}")
        rank = _need(rank if rank is not None else _env_int("RANK"), "rank", "file://")
        world_size = _need(world_size if world_size is not None else _env_int("WORLD_SIZE"), "world_size", "file://")
        import elastix

        file_store = getattr(elastix, "FileStore", None)
        if file_store is None:
            raise NotImplementedError("file:// init needs elastix.FileStore, which this build of elastix lacks")
        store = file_store(path, world_size)
        if timeout is not None and hasattr(store, "set_timeout"):
            store.set_timeout(to_timedelta(timeout))
        return store, rank, world_size
    raise ValueError(f"unknown init_method {init_method!r}: use env://, tcp://host:port or file:///path")


__all__ = ["rendezvous"]

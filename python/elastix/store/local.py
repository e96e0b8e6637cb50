"""Stores without a server: ``HashStore`` (one process) and ``FileStore`` (processes sharing a
file, for ``file://`` initialisation)."""

from __future__ import annotations

import os

from .._core import StoreCore
from .base import DEFAULT_TIMEOUT, to_seconds
from .native import NativeStore


class HashStore(NativeStore):
    """An in-memory store shared by the threads of one process (torch's HashStore)."""

    def __init__(self) -> None:
        super().__init__(StoreCore.local(to_seconds(DEFAULT_TIMEOUT)))

    def clone(self) -> "HashStore":
        """Another handle on the same data, with this one's timeout."""
        copy = HashStore._blank()
        NativeStore.__init__(copy, self._core.duplicate())
        return copy


class FileStore(NativeStore):
    """A store shared through a file by the processes of one machine or of a shared
    filesystem (torch's FileStore), for ``file://`` initialisation.

    The file is in torch's FileStore format, so torch and elastix processes can share one
    store; ``num_keys()`` counts torch's bookkeeping counter(s) as torch does (1 on a new
    store). Every operation locks the file, so processes may use it concurrently. Each handle
    (each clone too) counts itself in when made and out when closed; with ``world_size`` >= 0,
    the last handle to close deletes the file once at least that many have closed; with the
    default -1 the file is kept. Waits poll the file (at most every 10 ms). Queues are an
    elastix extension that torch's FileStore lacks.
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        path = os.fspath(file_name)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {world_size!r}")
        core = StoreCore.file(path, None if world_size < 0 else world_size, to_seconds(DEFAULT_TIMEOUT))
        super().__init__(core)
        self._path = path
        self._world_size = world_size

    @property
    def path(self) -> str:
        return self._path

    def clone(self) -> "FileStore":
        """Another handle on the file, counted in as a new one (as torch's clone is), with the
        default timeout."""
        copy = FileStore._blank()
        world_size = None if self._world_size < 0 else self._world_size
        NativeStore.__init__(copy, StoreCore.file(self._path, world_size, to_seconds(DEFAULT_TIMEOUT)))
        copy._path = self._path
        copy._world_size = self._world_size
        return copy

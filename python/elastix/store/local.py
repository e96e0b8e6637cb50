"""Stores without a server: ``HashStore`` (one process) and ``FileStore`` (processes sharing a
file, for ``file://`` initialisation)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import List, Optional, Sequence

from .. import _core
from .base import (
    DEFAULT_TIMEOUT,
    Key,
    Store,
    Value,
    decode_key,
    encode_key,
    encode_keys,
    encode_value,
    to_seconds,
    to_timedelta,
)


class _BlockingStore(Store):
    """A store implemented by ``_core.BlockingStoreCore``; the timeout lives per handle."""

    def __init__(self, core: _core.BlockingStoreCore, timeout: Optional[float]) -> None:
        self._core = core
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return to_timedelta(self._timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = to_seconds(timeout)

    def _wait_seconds(self, timeout: Optional[timedelta]) -> Optional[float]:
        return self._timeout if timeout is None else to_seconds(timeout)

    def set(self, key: Key, value: Value) -> None:
        self._core.set(encode_key(key), encode_value(value))

    def get(self, key: Key) -> bytes:
        return self._core.get(encode_key(key), self._timeout)

    def add(self, key: Key, amount: int) -> int:
        return self._core.add(encode_key(key), int(amount))

    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes:
        return self._core.compare_set(encode_key(key), encode_value(expected_value), encode_value(desired_value))

    def check(self, keys: Sequence[Key]) -> bool:
        return self._core.check(encode_keys(keys))

    def wait(self, keys: Sequence[Key], timeout: Optional[timedelta] = None) -> None:
        self._core.wait(encode_keys(keys), self._wait_seconds(timeout))

    def delete_key(self, key: Key) -> bool:
        return self._core.delete_key(encode_key(key))

    def num_keys(self) -> int:
        return self._core.num_keys()

    def append(self, key: Key, value: Value) -> None:
        self._core.append(encode_key(key), encode_value(value))

    def multi_get(self, keys: Sequence[Key]) -> List[bytes]:
        return self._core.multi_get(encode_keys(keys), self._timeout)

    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None:
        encoded_keys, encoded_values = encode_keys(keys), [encode_value(value) for value in values]
        if len(encoded_keys) != len(encoded_values):
            from ..errors import DistStoreError

            raise DistStoreError(
                f"multi_set got {len(keys)} keys but {len(values)} values; they must be of the same length"
            )
        self._core.multi_set(encoded_keys, encoded_values)

    def queue_push(self, key: Key, value: Value) -> None:
        self._core.queue_push(encode_key(key), encode_value(value))

    def queue_pop(self, key: Key, block: bool = True) -> bytes:
        return self._core.queue_pop(encode_key(key), bool(block), self._timeout)

    def queue_len(self, key: Key) -> int:
        return self._core.queue_len(encode_key(key))

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self) -> List[str]:
        return [decode_key(key) for key in self._core.list_keys()]


class HashStore(_BlockingStore):
    """An in-memory store shared by the threads of one process (torch's HashStore)."""

    def __init__(self) -> None:
        super().__init__(_core.BlockingStoreCore.local(), to_seconds(DEFAULT_TIMEOUT))

    def clone(self) -> "HashStore":
        copy = HashStore._blank()
        _BlockingStore.__init__(copy, self._core.share(), self._timeout)
        return copy


class FileStore(_BlockingStore):
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
        core = _core.BlockingStoreCore.file(path, None if world_size < 0 else world_size)
        super().__init__(core, to_seconds(DEFAULT_TIMEOUT))
        self._path = path
        self._world_size = world_size

    @property
    def path(self) -> str:
        return self._path

    def clone(self) -> "FileStore":
        """Another handle on the file, counted in as a new one (as torch's clone is), with the
        default timeout."""
        copy = FileStore._blank()
        core = _core.BlockingStoreCore.file(self._path, None if self._world_size < 0 else self._world_size)
        _BlockingStore.__init__(copy, core, to_seconds(DEFAULT_TIMEOUT))
        copy._path = self._path
        copy._world_size = self._world_size
        return copy

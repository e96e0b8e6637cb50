"""The operations every elastix store has, over one handle of the core (``StoreCore``):
a TCPStore connection, the in-process store or the file store. Each handle keeps its timeout,
which ``get``, ``multi_get``, a blocking ``queue_pop`` and a ``wait`` without one wait for."""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence

from .._core import StoreCore
from .base import Key, Store, Value, decode_key, encode_key, encode_keys, encode_value, to_seconds, to_timedelta


class NativeStore(Store):
    """A store whose operations are elastix-core's, run with the GIL released."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    @property
    def timeout(self) -> timedelta:
        return to_timedelta(self._core.timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        self._core.set_timeout(to_seconds(timeout))

    def set(self, key: Key, value: Value) -> None:
        self._core.set(encode_key(key), encode_value(value))

    def get(self, key: Key) -> bytes:
        return self._core.get(encode_key(key))

    def add(self, key: Key, amount: int) -> int:
        return self._core.add(encode_key(key), int(amount))

    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes:
        return self._core.compare_set(encode_key(key), encode_value(expected_value), encode_value(desired_value))

    def check(self, keys: Sequence[Key]) -> bool:
        return self._core.check(encode_keys(keys))

    def wait(self, keys: Sequence[Key], timeout: Optional[timedelta] = None) -> None:
        seconds = self._core.timeout if timeout is None else to_seconds(timeout)
        self._core.wait(encode_keys(keys), seconds)

    def delete_key(self, key: Key) -> bool:
        return self._core.delete_key(encode_key(key))

    def num_keys(self) -> int:
        return self._core.num_keys()

    def append(self, key: Key, value: Value) -> None:
        self._core.append(encode_key(key), encode_value(value))

    def multi_get(self, keys: Sequence[Key]) -> List[bytes]:
        return self._core.multi_get(encode_keys(keys))

    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None:
        self._core.multi_set(encode_keys(keys), [encode_value(value) for value in values])

    def queue_push(self, key: Key, value: Value) -> None:
        self._core.queue_push(encode_key(key), encode_value(value))

    def queue_pop(self, key: Key, block: bool = True) -> bytes:
        return self._core.queue_pop(encode_key(key), bool(block))

    def queue_len(self, key: Key) -> int:
        return self._core.queue_len(encode_key(key))

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self) -> List[str]:
        return [decode_key(key) for key in self._core.list_keys()]

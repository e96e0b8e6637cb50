"""``PrefixStore``: a namespace inside another store (torch's PrefixStore)."""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence

from .base import Key, Store, Value, decode_key, encode_key, encode_value


class PrefixStore(Store):
    """Every key becomes ``prefix + "/" + key`` in the underlying store.

    As in torch: ``num_keys`` counts the whole underlying store, the timeout is the
    underlying store's, and ``barrier`` is the add/set/wait construction under the prefix.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if store is None:
            raise ValueError("store argument cannot be None")
        if not isinstance(store, Store):
            raise TypeError(f"store must be an elastix Store, not {type(store).__name__}")
        self._prefix = decode_key(encode_key(prefix))
        self._store = store

    @property
    def underlying_store(self) -> Store:
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        store = self._store
        while isinstance(store, PrefixStore):
            store = store._store
        return store

    def _key(self, key: Key) -> str:
        return f"{self._prefix}/{decode_key(encode_key(key))}"

    def _keys(self, keys: Sequence[Key]) -> List[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError("keys must be a list of keys, not a single key")
        return [self._key(key) for key in keys]

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone())

    def set(self, key: Key, value: Value) -> None:
        self._store.set(self._key(key), encode_value(value))

    def get(self, key: Key) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: Key, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes:
        return self._store.compare_set(self._key(key), encode_value(expected_value), encode_value(desired_value))

    def check(self, keys: Sequence[Key]) -> bool:
        return self._store.check(self._keys(keys))

    def wait(self, keys: Sequence[Key], timeout: Optional[timedelta] = None) -> None:
        self._store.wait(self._keys(keys), timeout)

    def delete_key(self, key: Key) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def append(self, key: Key, value: Value) -> None:
        self._store.append(self._key(key), encode_value(value))

    def multi_get(self, keys: Sequence[Key]) -> List[bytes]:
        return self._store.multi_get(self._keys(keys))

    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None:
        self._store.multi_set(self._keys(keys), [encode_value(value) for value in values])

    def queue_push(self, key: Key, value: Value) -> None:
        self._store.queue_push(self._key(key), encode_value(value))

    def queue_pop(self, key: Key, block: bool = True) -> bytes:
        return self._store.queue_pop(self._key(key), block)

    def queue_len(self, key: Key) -> int:
        return self._store.queue_len(self._key(key))

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def list_keys(self) -> List[str]:
        # torch keeps keys starting with the prefix (not prefix + "/") and strips one more char
        cut = len(self._prefix) + 1
        return [key[cut:] for key in self._store.list_keys() if key.startswith(self._prefix)]

"""The store API shared by every elastix store, with torch.distributed.Store's method names."""

from __future__ import annotations

import abc
from datetime import timedelta
from typing import Callable, Iterable, List, Optional, Sequence, Union

Key = Union[str, bytes]
Value = Union[str, bytes, bytearray, memoryview]

#: torch's default store timeout.
DEFAULT_TIMEOUT = timedelta(seconds=300)


def encode_key(key: Key) -> bytes:
    """Keys are text or bytes; text is sent as UTF-8 (undecodable bytes round-trip)."""
    if isinstance(key, str):
        return key.encode("utf-8", "surrogateescape")
    if isinstance(key, bytes):
        return key
    raise TypeError(f"a store key must be str or bytes, not {type(key).__name__}")


def decode_key(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def encode_value(value: Value) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"a store value must be str or bytes, not {type(value).__name__}")


def encode_keys(keys: Iterable[Key]) -> List[bytes]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a list of keys, not a single key")
    return [encode_key(key) for key in keys]


def to_seconds(timeout: Optional[Union[timedelta, float, int]]) -> Optional[float]:
    """A timeout as seconds for the native layer; ``None`` or negative means no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, not {type(timeout).__name__}")
    return None if seconds < 0 else seconds


def to_timedelta(seconds: Optional[float]) -> timedelta:
    return timedelta.max if seconds is None else timedelta(seconds=seconds)


class Store(abc.ABC):
    """A key-value store shared by the processes of a job (torch.distributed.Store's API).

    Keys are ``str`` or ``bytes``; values are ``str`` or bytes-like and come back as
    ``bytes``. Every blocking call releases the GIL and can be interrupted with Ctrl-C.
    """

    @abc.abstractmethod
    def set(self, key: Key, value: Value) -> None: ...

    @abc.abstractmethod
    def get(self, key: Key) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""

    @abc.abstractmethod
    def add(self, key: Key, amount: int) -> int:
        """Adds ``amount`` to the integer under ``key`` (missing counts as 0); returns the sum."""

    @abc.abstractmethod
    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes: ...

    @abc.abstractmethod
    def check(self, keys: Sequence[Key]) -> bool: ...

    @abc.abstractmethod
    def wait(self, keys: Sequence[Key], timeout: Optional[timedelta] = None) -> None:
        """Blocks until every key is set, up to ``timeout`` (default: the store timeout)."""

    @abc.abstractmethod
    def delete_key(self, key: Key) -> bool: ...

    @abc.abstractmethod
    def num_keys(self) -> int: ...

    @abc.abstractmethod
    def append(self, key: Key, value: Value) -> None: ...

    @abc.abstractmethod
    def multi_get(self, keys: Sequence[Key]) -> List[bytes]: ...

    @abc.abstractmethod
    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None: ...

    @abc.abstractmethod
    def queue_push(self, key: Key, value: Value) -> None: ...

    @abc.abstractmethod
    def queue_pop(self, key: Key, block: bool = True) -> bytes: ...

    @abc.abstractmethod
    def queue_len(self, key: Key) -> int: ...

    @abc.abstractmethod
    def list_keys(self) -> List[str]: ...

    @property
    @abc.abstractmethod
    def timeout(self) -> timedelta: ...

    @abc.abstractmethod
    def set_timeout(self, timeout: timedelta) -> None: ...

    @abc.abstractmethod
    def clone(self) -> "Store":
        """Another handle on the same store, safe to use from another thread."""

    def barrier(self, key: Key, world_size: int, timeout: Optional[timedelta] = None) -> None:
        """Blocks until ``world_size`` callers reached the barrier ``key``.

        Built from add/set/wait, as torch's base store does; like torch, a barrier key is
        single-use (its count is never reset).
        """
        prefix = decode_key(encode_key(key))
        arrived = self.add(f"{prefix}/num_members", 1)
        if arrived == world_size:
            self.set(f"{prefix}/last_member", "1")
        self.wait([f"{prefix}/last_member"], timeout)

    def has_extended_api(self) -> bool:
        return True

    def watch_key(self, key: Key, callback: Callable[..., None]) -> None:
        raise NotImplementedError("watchKey is deprecated, no implementation supports it.")

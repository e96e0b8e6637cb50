"""The store API shared by every elastix store, with torch.distributed.Store's method names."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TypeVar, Union

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


def _torch_variant(cls: type) -> Optional[type]:
    """``cls`` as a subclass of torch.distributed.Store too, when torch.distributed is loaded
    (so that torch accepts an elastix store wherever it takes its own: ``init_process_group(
    store=...)``, its ``PrefixStore``); ``None`` otherwise. torch then calls the elastix
    methods through its Store's Python trampoline."""
    torch_distributed = sys.modules.get("torch.distributed")
    base = getattr(torch_distributed, "Store", None)
    if base is None:
        return None
    variant = _TORCH_VARIANTS.get(cls)
    if variant is None:

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self)
            cls.__init__(self, *args, **kwargs)  # type: ignore[misc]

        variant = type(cls.__name__, (cls, base), {"__init__": __init__, "__module__": cls.__module__})
        _TORCH_VARIANTS[cls] = variant
    return variant


_TORCH_VARIANTS: Dict[type, type] = {}
S = TypeVar("S", bound="Store")


class Store:
    """A key-value store shared by the processes of a job (torch.distributed.Store's API).

    Keys are ``str`` or ``bytes``; values are ``str`` or bytes-like and come back as
    ``bytes``. Every blocking call releases the GIL and can be interrupted with Ctrl-C.

    As with torch's ``Store``, a subclass needs only ``set`` and ``get`` to be usable: the
    methods torch builds on others are built the same way here (``multi_get``, ``multi_set``,
    ``append`` on ``compare_set``, ``barrier``, the timeout), the queue methods and
    ``list_keys`` say they are not supported, and the rest raise ``NotImplementedError`` (a
    ``RuntimeError``, as torch's "pure virtual function" error is) naming the method.
    """

    _base_timeout: timedelta = DEFAULT_TIMEOUT  # for subclasses that keep no timeout of their own

    def __new__(cls, *args: Any, **kwargs: Any) -> "Store":
        variant = _torch_variant(cls) if cls.__module__.startswith("elastix.") else None
        if variant is None or issubclass(cls, variant):
            return super().__new__(cls)
        return sys.modules["torch.distributed"].Store.__new__(variant)  # type: ignore[no-any-return]

    @classmethod
    def _blank(cls: "type[S]") -> "S":
        """An instance that the caller sets up itself (a clone), a torch Store too when torch
        is loaded, like one made the usual way."""
        store: S = cls.__new__(cls)  # type: ignore[assignment]
        torch_base = getattr(sys.modules.get("torch.distributed"), "Store", None)
        if torch_base is not None and isinstance(store, torch_base):
            torch_base.__init__(store)
        return store

    def _missing(self, method: str) -> NotImplementedError:
        # torch's words first ("Not implemented."): code matches on them
        return NotImplementedError(f"Not implemented. ({type(self).__name__} does not implement Store.{method})")

    def set(self, key: Key, value: Value) -> None:
        raise self._missing("set")

    def get(self, key: Key) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        raise self._missing("get")

    def add(self, key: Key, amount: int) -> int:
        """Adds ``amount`` to the integer under ``key`` (missing counts as 0); returns the sum."""
        raise self._missing("add")

    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes:
        raise self._missing("compare_set")

    def check(self, keys: Sequence[Key]) -> bool:
        raise self._missing("check")

    def wait(self, keys: Sequence[Key], timeout: Optional[timedelta] = None) -> None:
        """Blocks until every key is set, up to ``timeout`` (default: the store timeout)."""
        raise self._missing("wait")

    def delete_key(self, key: Key) -> bool:
        raise self._missing("delete_key")

    def num_keys(self) -> int:
        raise self._missing("num_keys")

    def append(self, key: Key, value: Value) -> None:
        """Appends to ``key``'s value (a missing key starts empty), on ``compare_set``: the
        write lands only on the value it extends, so concurrent appends all survive."""
        addition = encode_value(value)
        wanted = addition  # a missing key is created with the addition alone
        current = self.compare_set(key, b"", wanted)
        while current != wanted:  # someone else's value: extend it, unless it changes again
            wanted = current + addition
            current = self.compare_set(key, current, wanted)

    def multi_get(self, keys: Sequence[Key]) -> List[bytes]:
        # a subclass's get and set see str keys, as torch's Store hands them on
        return [self.get(decode_key(key)) for key in encode_keys(keys)]

    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for key, value in zip(encode_keys(keys), values):
            self.set(decode_key(key), encode_value(value))

    def queue_push(self, key: Key, value: Value) -> None:
        raise NotImplementedError("queue support is not implemented.")

    def queue_pop(self, key: Key, block: bool = True) -> bytes:
        raise NotImplementedError("queue support is not implemented.")

    def queue_len(self, key: Key) -> int:
        raise NotImplementedError("queue support is not implemented.")

    def list_keys(self) -> List[str]:
        raise NotImplementedError("listKeys support is not implemented.")

    @property
    def timeout(self) -> timedelta:
        return self._base_timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._base_timeout = timeout

    def clone(self) -> "Store":
        """Another handle on the same store, safe to use from another thread."""
        raise self._missing("clone")

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
        """Whether the store implements the extended API itself (torch's base: no)."""
        return False

    def watch_key(self, key: Key, callback: Callable[..., None]) -> None:
        raise NotImplementedError("watchKey is deprecated, no implementation supports it.")

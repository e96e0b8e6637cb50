"""Element types: what the reduction kernels accept, and a stable identity for every dtype.

The kernels take bool, int8..int64, uint8..uint64, float16, float32, float64 and bfloat16.
bfloat16 is recognised as a dtype (``ml_dtypes.bfloat16``, which is how JAX and others give it
to NumPy) or, for raw 16-bit data (uint16/int16 arrays holding bfloat16 bit patterns), when the
caller says so with ``dtype="bfloat16"``. complex64/complex128 are reduced as float pairs (SUM
and AVG only). Collectives that only move data (broadcast, gathers, scatter, all_to_all,
send/recv) accept any fixed-size dtype.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

BFLOAT16 = "bfloat16"

_CODES = {
    np.dtype(np.bool_): 0,
    np.dtype(np.int8): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.uint16): 4,
    np.dtype(np.int32): 5,
    np.dtype(np.uint32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.uint64): 8,
    np.dtype(np.float16): 9,
    np.dtype(np.float32): 11,
    np.dtype(np.float64): 12,
}
_BF16_CODE = 10
_FLOAT_CODES = (9, 10, 11, 12)


@dataclass(frozen=True)
class Kind:
    """How the kernels see an array's elements: ``code`` (the Rust DType), ``view`` (the NumPy
    dtype to view the data as before handing it over), ``name`` for messages."""

    code: int
    view: np.dtype
    name: str
    is_complex: bool = False

    @property
    def is_float(self) -> bool:
        return self.code in _FLOAT_CODES


@lru_cache(maxsize=None)
def _kind(dtype: np.dtype, override: Optional[str]) -> Kind:
    if override is not None:
        if str(override).lower() != BFLOAT16:
            raise ValueError(f"dtype= only accepts 'bfloat16' (raw 16-bit data), not {override!r}")
        if dtype.itemsize != 2 or dtype.kind not in "uifV":
            raise TypeError(f"dtype='bfloat16' needs 16-bit data (e.g. uint16), not {dtype}")
        return Kind(_BF16_CODE, np.dtype(np.uint16), BFLOAT16)
    if not dtype.isnative:
        raise TypeError(f"non-native byte order ({dtype}) is not supported; use .astype(dtype.newbyteorder('='))")
    if dtype.name == BFLOAT16 and dtype.itemsize == 2:
        return Kind(_BF16_CODE, np.dtype(np.uint16), BFLOAT16)
    code = _CODES.get(dtype)
    if code is not None:
        return Kind(code, dtype, dtype.name)
    if dtype == np.complex64:
        return Kind(11, np.dtype(np.float32), dtype.name, is_complex=True)
    if dtype == np.complex128:
        return Kind(12, np.dtype(np.float64), dtype.name, is_complex=True)
    raise TypeError(
        f"cannot reduce {dtype} data; supported: bool, int8..int64, uint8..uint64, float16, "
        "bfloat16, float32, float64 (complex64/128 for SUM and AVG)"
    )


def reduce_kind(dtype, override: Optional[str] = None) -> Kind:
    """The kernel's view of ``dtype`` (TypeError when it cannot be reduced)."""
    return _kind(np.dtype(dtype), override)


def check_movable(dtype) -> np.dtype:
    """``dtype`` if collectives can move it as bytes (no Python objects inside)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"arrays of Python objects ({dtype}) cannot be communicated")
    return dtype


@lru_cache(maxsize=None)
def dtype_id(dtype: np.dtype) -> int:
    """A number that is the same in every process for the same dtype (for mismatch checks)."""
    return zlib.crc32(np.dtype(dtype).str.encode() + np.dtype(dtype).name.encode()) & 0x7FFF_FFFF


__all__ = ["BFLOAT16", "Kind", "reduce_kind", "check_movable", "dtype_id"]

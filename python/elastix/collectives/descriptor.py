"""What a rank says it is doing in a collective (compared across ranks to catch mismatches)."""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import List, Optional, Sequence

import numpy as np

from .. import _core
from .dtypes import dtype_id

# by the number descriptors and the flight recorder carry (the agent reads them too)
KINDS = list(_core.COLLECTIVE_KINDS)
KIND = {name: i for i, name in enumerate(KINDS)}
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]
MAX_DIMS = 7
WORDS = 6 + MAX_DIMS + 1

_names = {}
for _t in (
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
):
    _names[dtype_id(np.dtype(_t))] = np.dtype(_t).name


def make(kind: str, dtype: np.dtype, shape: Sequence[int], op: int = -1, root: int = -1, extra: int = 0) -> List[int]:
    """[kind, dtype, op, root, nbytes, ndim, dims..., extra] (14 words)."""
    return _make(kind, dtype, tuple(shape), op, root, extra)


@lru_cache(maxsize=4096)
def _make(kind: str, dtype: np.dtype, shape: tuple, op: int, root: int, extra: int) -> List[int]:
    dtype = np.dtype(dtype)
    did = dtype_id(dtype)
    _names.setdefault(did, dtype.name)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
    if len(shape) > MAX_DIMS:
        extra ^= zlib.crc32(repr(shape).encode())
    return [KIND[kind], did, int(op), int(root), nbytes, len(shape), *dims, int(extra)]


def describe(desc: Optional[Sequence[int]]) -> str:
    if not desc:
        return "nothing"
    kind = KINDS[desc[0]] if 0 <= desc[0] < len(KINDS) else f"collective #{desc[0]}"
    if kind == "barrier":
        return "barrier()"
    ndim = int(desc[5])
    dims = list(desc[6 : 6 + min(ndim, MAX_DIMS)])
    shape = "(" + ", ".join(map(str, dims)) + ("," if ndim == 1 else "") + (", ..." if ndim > MAX_DIMS else "") + ")"
    parts = [f"shape {shape}", _names.get(int(desc[1]), f"dtype #{desc[1]}")]
    if 0 <= desc[2] < len(OPS):
        parts.append(f"op {OPS[desc[2]]}")
    if desc[3] >= 0:
        parts.append(f"root {desc[3]}")
    return f"{kind}({', '.join(parts)})"


__all__ = ["make", "describe", "KIND", "WORDS"]

"""Arrays handed to collectives: NumPy or CuPy, normalised to C-contiguous 1-D views.

A collective works on the flat C-order elements of an array, so every rank must see the same
order: an array that is not C-contiguous is staged through a contiguous copy (written back for
outputs). Read-only outputs are refused.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from . import dtypes


def is_cupy(x) -> bool:
    return type(x) is not np.ndarray and type(x).__module__.startswith("cupy")


def check_array(x, what: str = "tensor"):
    if type(x) is np.ndarray:
        if x.dtype.hasobject:
            dtypes.check_movable(x.dtype)
        return x
    if isinstance(x, np.ndarray) or is_cupy(x):
        dtypes.check_movable(x.dtype)
        return x
    raise TypeError(f"{what} must be a numpy.ndarray or cupy.ndarray, not {type(x).__name__}")


def check_arrays(xs: Sequence, what: str) -> list:
    """``check_array`` over a sequence, naming ``what[i]`` only for one that fails."""
    out = list(xs)
    for i, x in enumerate(out):
        if type(x) is not np.ndarray or x.dtype.hasobject:
            check_array(x, f"{what}[{i}]")
    return out


class Flat:
    """A C-contiguous 1-D NumPy view of an array; ``finish()`` writes back a staged copy."""

    __slots__ = ("_writeback", "array", "flat")

    def __init__(self, array: np.ndarray, flat: np.ndarray, writeback: Optional[Callable[[], None]]):
        self.array = array
        self.flat = flat
        self._writeback = writeback

    def finish(self) -> None:
        if self._writeback is not None:
            self._writeback()


def flat_in(x: np.ndarray) -> np.ndarray:
    """A contiguous 1-D view (or copy) of an input."""
    if x.flags.c_contiguous:
        return x.reshape(-1)
    return np.ascontiguousarray(x).reshape(-1)


def flat_out(x: np.ndarray, what: str = "output") -> Flat:
    """A contiguous 1-D view of an output (a staged copy written back by ``finish``)."""
    if not x.flags.writeable:
        raise ValueError(f"{what} array is read-only")
    if x.flags.c_contiguous:
        return Flat(x, x.reshape(-1), None)
    staged = np.ascontiguousarray(x)

    def writeback() -> None:
        x[...] = staged

    return Flat(x, staged.reshape(-1), writeback)


def flat_list_out(xs: Sequence[np.ndarray], what: str) -> List[Flat]:
    return [flat_out(x, f"{what}[{i}]") for i, x in enumerate(xs)]


def split_flat(x: np.ndarray, parts: int) -> List[np.ndarray]:
    """``parts`` equal consecutive views of a flat array (its size must divide)."""
    n = x.size // parts
    return [x[i * n : (i + 1) * n] for i in range(parts)]


__all__ = ["is_cupy", "check_array", "check_arrays", "Flat", "flat_in", "flat_out", "flat_list_out", "split_flat"]

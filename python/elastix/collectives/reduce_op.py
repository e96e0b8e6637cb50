"""``ReduceOp``: the reduction operators, and which dtypes each accepts."""

from __future__ import annotations

import enum

from . import dtypes


class ReduceOp(enum.IntEnum):
    """torch.distributed.ReduceOp's members (``ReduceOp.SUM`` ...). AVG is for floating-point
    data; BAND, BOR and BXOR for integers and bool."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def as_op(op: object) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    elif isinstance(op, int) and not isinstance(op, bool):
        try:
            return ReduceOp(op)
        except ValueError:
            pass
    raise ValueError(f"unknown reduction op {op!r}; use elastix.collectives.ReduceOp")


def kernel_op(op: ReduceOp, kind: "dtypes.Kind", world_size: int) -> tuple[int, int]:
    """(kernel op code, divisor) for reducing ``kind`` data over ``world_size`` ranks."""
    if op in _BITWISE and kind.is_float:
        raise TypeError(f"ReduceOp.{op.name} needs integer or bool data, not {kind.name}")
    if kind.is_complex and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"ReduceOp.{op.name} is not defined for complex data (SUM and AVG are)")
    if op == ReduceOp.AVG:
        if not kind.is_float:
            raise TypeError(f"ReduceOp.AVG needs floating-point data, not {kind.name}; use SUM")
        return int(ReduceOp.SUM), world_size
    return int(op), 1


__all__ = ["ReduceOp", "as_op", "kernel_op"]

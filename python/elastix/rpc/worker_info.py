"""``WorkerInfo``: a worker's name and rank (its ``id``), as torch names them."""

from __future__ import annotations

from typing import NamedTuple


class WorkerInfo(NamedTuple):
    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


__all__ = ["WorkerInfo"]

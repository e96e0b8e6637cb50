"""Host memory the collectives read in place: ``shared_empty``.

A large all_reduce, reduce_scatter or all_gather on the ``cpu`` backend copies each rank's
input into the group's shared segment for its peers to read. Arrays made by ``shared_empty`` on
every rank of a host are mapped by all of them already, so those collectives read them where
they are (see shm_shared). Meant for buffers that live as long as the training does, gradient
buckets for one: each call maps a new buffer on every local rank, kept until the group is
destroyed and its arrays are gone.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

from .group import ProcessGroup, resolve


def shared_empty(
    shape: Union[int, Sequence[int]], dtype: npt.DTypeLike = np.float32, group: Optional[ProcessGroup] = None
) -> np.ndarray[Any, Any]:
    """A zeroed NumPy array that the group's other ranks on this host map too: all_reduce (in
    place), reduce_scatter (the input list, views of one such array) and all_gather (the input)
    read it where it is when every rank's is one. Every rank of the group calls it, with the
    same shape and dtype. An ordinary array where this host has no other rank of the group."""
    g = resolve(group)
    if g.backend_name != "cpu":
        raise ValueError(f"shared_empty makes host arrays for the cpu backend; group {g.name} is on {g.backend_name}")
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"shared_empty: shape must be non-negative integers, got {shape!r}")
    nbytes = math.prod(dims) * dt.itemsize
    return g.backend.shared_empty(nbytes).view(dt).reshape(dims)


__all__ = ["shared_empty"]

"""The Rust helpers (``elastix._core.collectives``): reduction kernels and shared-memory
waits."""

from __future__ import annotations

from .._core import collectives as _mod

reduce = _mod.reduce
publish = _mod.publish
load = _mod.load
Waiter = _mod.Waiter

__all__ = ["reduce", "publish", "load", "Waiter"]

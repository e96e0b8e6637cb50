"""The Rust helpers (``elastix._core.collectives``): reduction kernels, shared-memory segments
(reached by offsets, never addresses) and the waits on their counters."""

from __future__ import annotations

from .._core import collectives as _mod

reduce = _mod.reduce
copy_streaming = _mod.copy_streaming
Segment = _mod.Segment
Waiter = _mod.Waiter

__all__ = ["reduce", "copy_streaming", "Segment", "Waiter"]

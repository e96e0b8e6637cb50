"""The ``nccl`` backend: NCCL through CuPy (``cupy.cuda.nccl``), on CuPy arrays.

The NCCL unique id is made by group rank 0 and handed out through the group's store. Every
collective is enqueued on the *current* CuPy stream and returns at once (as torch's NCCL
collectives do); with ``async_op=True`` the handle's ``wait()`` makes the current stream wait for
it, and ``wait(timeout)`` polls it on the host and aborts the communicator when time runs out.
NCCL reduces int8/uint8/int32/uint32/int64/uint64/float16/bfloat16/float32/float64 (bool as
uint8 max/min); it has no bitwise ops and no 16-bit integers. Mismatched calls are not detected
by NCCL itself; set ELASTIX_NCCL_CHECK=1 to compare every call's description across ranks
first (one small extra all-gather per collective).

CuPy is an optional dependency: ``pip install 'elastix[cuda]'`` (cupy-cuda12x).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import numpy as np

from .errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError, MismatchError
from .reduce_op import ReduceOp
from .work import Work

INSTALL_HINT = (
    "the nccl backend needs CuPy built with NCCL: pip install 'elastix[cuda]' "
    "(which installs cupy-cuda12x; use cupy-cuda11x for CUDA 11)"
)

# NCCL's numbering (nccl.h): datatypes and reduction ops
_NCCL_DTYPE = {1: 0, 2: 1, 5: 2, 6: 3, 7: 4, 8: 5, 9: 6, 11: 7, 12: 8, 10: 9}  # kernel code -> ncclDataType_t
_UINT8 = 1
_NCCL_OP = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
_BOOL_OP = {ReduceOp.SUM: 2, ReduceOp.MAX: 2, ReduceOp.BOR: 2, ReduceOp.PRODUCT: 3, ReduceOp.MIN: 3, ReduceOp.BAND: 3}


def require_cupy() -> "tuple[Any, Any]":
    """(cupy, cupy.cuda.nccl), or BackendUnavailableError saying what to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as err:
        raise BackendUnavailableError(f"{INSTALL_HINT} ({err})") from err
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError(f"CuPy is installed but was built without NCCL; {INSTALL_HINT}")
    return cupy, nccl


class NcclWork(Work):
    """Completed when the CUDA event recorded after the collective has happened."""

    def __init__(self, event, backend: "NcclBackend", result=None) -> None:
        super().__init__()
        self._event = event
        self._backend = backend
        self._result = result

    def wait(self, timeout=None) -> bool:
        cupy = self._backend.cupy
        if timeout is None:
            cupy.cuda.get_current_stream().wait_event(self._event)
            return True
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        deadline = time.monotonic() + timeout
        while not self._event.done:
            if time.monotonic() > deadline:
                self._backend.abort("timed out")
                raise CollectiveTimeoutError(
                    f"NCCL collective did not finish within {timeout:.1f} s; the communicator was aborted"
                )
            time.sleep(1e-4)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.done)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self):
        self.wait()
        return self._result


def _communicator(nccl, size: int, uid: "list[int]", rank: int):
    """A communicator from the unique id's byte values, in the form this CuPy takes: bytes
    (CuPy 14 on) or a tuple of signed chars (before). A wrong form is refused before NCCL is
    called, so asking again is safe."""
    try:
        return nccl.NcclCommunicator(size, bytes(uid), rank)
    except TypeError:
        return nccl.NcclCommunicator(size, tuple(v - 256 if v > 127 else v for v in uid), rank)


class NcclBackend:
    name = "nccl"

    def __init__(self, store, rank: int, size: int, ranks, timeout: Optional[float]):
        self.cupy, self.nccl = require_cupy()
        self.rank, self.size, self.ranks, self.timeout = rank, size, list(ranks), timeout
        if rank == 0:
            # bytes in CuPy 14, a tuple of signed chars before: stored as the bytes' values
            store.set("nccl/uid", json.dumps([int(v) % 256 for v in self.nccl.get_unique_id()]))
        self.comm = _communicator(self.nccl, size, json.loads(store.get("nccl/uid")), rank)
        self.check = os.environ.get("ELASTIX_NCCL_CHECK", "") not in ("", "0")
        self.broken: Optional[str] = None

    # -- plumbing -----------------------------------------------------------------------------

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def run(self, fn, async_op: bool):
        if self.broken:
            raise CollectiveError(f"this NCCL communicator was aborted ({self.broken})")
        try:
            result = fn()
        except self.nccl.NcclError as err:
            raise CollectiveError(f"NCCL error: {err}") from err
        if not async_op:
            return result
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record()
        return NcclWork(event, self, result)

    def _device(self, x, what: str):
        if not type(x).__module__.startswith("cupy"):
            raise TypeError(
                f"the nccl backend works on cupy arrays; {what} is a {type(x).__name__} "
                "(use the cpu backend for numpy arrays)"
            )
        return x

    def _contig(self, x):
        """(contiguous array, write-back function or None)."""
        if x.flags.c_contiguous:
            return x, None
        tmp = self.cupy.ascontiguousarray(x)

        def back():
            x[...] = tmp

        return tmp, back

    def _verify(self, desc) -> None:
        if not self.check:
            return
        cp = self.cupy
        mine = cp.asarray(np.asarray(desc, dtype=np.int64))
        everyone = cp.empty(self.size * mine.size, dtype=cp.int64)
        self.comm.allGather(mine.data.ptr, everyone.data.ptr, mine.nbytes, _UINT8, self._stream())
        table = everyone.get().reshape(self.size, -1)
        for r, row in enumerate(table):
            if list(row) != list(desc):
                from .descriptor import describe

                raise MismatchError(
                    f"rank {self.ranks[self.rank]} called {describe(desc)} but rank "
                    f"{self.ranks[r]} called {describe(list(row))}"
                )

    def _red(self, op: ReduceOp, kind):
        if kind.code == 0:  # bool: logical ops as uint8 max/min
            if op not in _BOOL_OP:
                raise TypeError(f"NCCL cannot apply ReduceOp.{op.name} to bool data")
            return _UINT8, _BOOL_OP[op]
        if kind.code not in _NCCL_DTYPE:
            raise TypeError(f"NCCL cannot reduce {kind.name} data (no 16-bit integers)")
        if op not in _NCCL_OP:
            raise TypeError(f"NCCL has no ReduceOp.{op.name}")
        return _NCCL_DTYPE[kind.code], _NCCL_OP[op]

    # -- collectives --------------------------------------------------------------------------

    def all_reduce(self, x, op, kind, desc):
        self._device(x, "tensor")
        dtype, red = self._red(op, kind)
        self._verify(desc)
        buf, back = self._contig(x)
        flat = buf.reshape(-1).view(kind.view)
        self.comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, dtype, red, self._stream())
        if back:
            back()

    def reduce(self, x, root, op, kind, desc):
        self._device(x, "tensor")
        dtype, red = self._red(op, kind)
        self._verify(desc)
        buf, back = self._contig(x)
        flat = buf.reshape(-1).view(kind.view)
        if self.rank == root:
            self.comm.reduce(flat.data.ptr, flat.data.ptr, flat.size, dtype, red, root, self._stream())
            if back:
                back()
        else:
            out = self.cupy.empty_like(flat)
            self.comm.reduce(flat.data.ptr, out.data.ptr, flat.size, dtype, red, root, self._stream())

    def broadcast(self, x, root, desc):
        self._device(x, "tensor")
        self._verify(desc)
        buf, back = self._contig(x)
        self.comm.bcast(buf.data.ptr, buf.nbytes, _UINT8, root, self._stream())
        if back and self.rank != root:
            back()

    def all_gather(self, outs, x, desc):
        self._device(x, "tensor")
        self._verify(desc)
        src, _ = self._contig(x)
        flat = self.cupy.empty(self.size * src.nbytes, dtype=self.cupy.uint8)
        self.comm.allGather(src.data.ptr, flat.data.ptr, src.nbytes, _UINT8, self._stream())
        for i, o in enumerate(outs):
            o[...] = flat[i * src.nbytes : (i + 1) * src.nbytes].view(o.dtype).reshape(o.shape)

    def reduce_scatter(self, out, ins, op, kind, desc):
        self._device(out, "output")
        dtype, red = self._red(op, kind)
        self._verify(desc)
        send = self.cupy.concatenate([self.cupy.ascontiguousarray(t).reshape(-1).view(kind.view) for t in ins])
        buf, back = self._contig(out)
        flat = buf.reshape(-1).view(kind.view)
        self.comm.reduceScatter(send.data.ptr, flat.data.ptr, flat.size, dtype, red, self._stream())
        if back:
            back()

    def _p2p_group(self, sends, recvs) -> None:
        """sends/recvs: lists of (peer, contiguous array) run as one NCCL group."""
        stream = self._stream()
        self.nccl.groupStart()
        try:
            for peer, a in sends:
                self.comm.send(a.data.ptr, a.nbytes, _UINT8, peer, stream)
            for peer, a in recvs:
                self.comm.recv(a.data.ptr, a.nbytes, _UINT8, peer, stream)
        finally:
            self.nccl.groupEnd()

    def gather(self, outs, x, root, desc):
        self._device(x, "tensor")
        self._verify(desc)
        src, _ = self._contig(x)
        if self.rank == root:
            bufs = [self._contig(o) for o in outs]
            self._p2p_group([], [(r, b) for r, (b, _) in enumerate(bufs) if r != root])
            bufs[root][0][...] = src
            for _, back in bufs:
                if back:
                    back()
        else:
            self._p2p_group([(root, src)], [])

    def scatter(self, x, ins, root, desc):
        self._device(x, "tensor")
        self._verify(desc)
        buf, back = self._contig(x)
        if self.rank == root:
            srcs = [self.cupy.ascontiguousarray(t) for t in ins]
            self._p2p_group([(r, s) for r, s in enumerate(srcs) if r != root], [])
            buf[...] = srcs[root]
        else:
            self._p2p_group([], [(root, buf)])
        if back:
            back()

    def all_to_all(self, outs, ins, desc):
        self._verify(desc)
        srcs = [self.cupy.ascontiguousarray(self._device(t, "input")) for t in ins]
        bufs = [self._contig(self._device(o, "output")) for o in outs]
        self._p2p_group(
            [(r, s) for r, s in enumerate(srcs) if r != self.rank],
            [(r, b) for r, (b, _) in enumerate(bufs) if r != self.rank],
        )
        bufs[self.rank][0][...] = srcs[self.rank]
        for _, back in bufs:
            if back:
                back()

    def barrier(self, desc):
        self._verify(desc)
        token = self.cupy.zeros(1, dtype=self.cupy.int32)
        self.comm.allReduce(token.data.ptr, token.data.ptr, 1, 2, 0, self._stream())
        self.cupy.cuda.get_current_stream().synchronize()

    def send(self, x, peer, desc):
        src, _ = self._contig(self._device(x, "tensor"))
        self._p2p_group([(peer, src)], [])

    def recv(self, x, peer, desc):
        buf, back = self._contig(self._device(x, "tensor"))
        self._p2p_group([], [(peer, buf)])
        if back:
            back()

    # -- teardown -------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        self.broken = reason
        try:
            self.comm.abort()
        except Exception:
            pass

    def close(self) -> None:
        if self.broken is None:
            try:
                self.comm.destroy()
            except Exception:
                pass


__all__ = ["NcclBackend", "NcclWork", "require_cupy", "INSTALL_HINT"]

"""The nccl backend. Without CuPy the package still imports and asking for nccl says what to
install; with CuPy and a GPU (the device machine), the collectives run through NCCL (one GPU:
world size 1), and CuPy arrays also go through the cpu backend with several ranks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import collectives_harness as harness


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU = _gpu()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs CuPy and a CUDA GPU (runs on the device machine)")

NO_CUPY = "import sys; sys.modules['cupy'] = None; sys.modules['cupy.cuda'] = None\n"


def test_imports_without_cupy_and_says_what_to_install():
    code = NO_CUPY + (
        "import elastix, elastix.collectives as ec\n"
        "try:\n"
        "    ec.init_process_group('nccl', store=elastix.HashStore(), rank=0, world_size=1)\n"
        "except ec.BackendUnavailableError as err:\n"
        "    assert isinstance(err, ImportError)\n"
        "    print('REFUSED', err)\n"
        "assert not ec.is_initialized()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "pip install 'elastix[cuda]'" in out.stdout and "cupy-cuda12x" in out.stdout


def test_cupy_built_without_nccl_is_reported(monkeypatch):
    import types

    from elastix.collectives import nccl_backend

    fake_nccl = types.SimpleNamespace(available=False)
    fake_cuda = types.SimpleNamespace(nccl=fake_nccl)
    fake = types.ModuleType("cupy")
    fake.cuda = fake_cuda
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cuda)
    with pytest.raises(nccl_backend.BackendUnavailableError, match="without NCCL"):
        nccl_backend.require_cupy()


def test_the_unique_id_reaches_nccl_in_the_form_each_cupy_takes():
    """CuPy 14 takes the id as bytes, earlier CuPy as a tuple of signed chars; the store holds
    its byte values. (The real communicator is made by the GPU tests below.)"""
    import types

    from elastix.collectives.nccl_backend import _communicator

    uid = [0, 1, 127, 128, 255]

    def takes(form):
        def communicator(size, comm_id, rank):
            if not isinstance(comm_id, form):
                raise TypeError(f"Argument 'commId' has incorrect type (expected {form.__name__})")
            return (size, comm_id, rank)

        return types.SimpleNamespace(NcclCommunicator=communicator)

    assert _communicator(takes(bytes), 2, uid, 1) == (2, bytes([0, 1, 127, 128, 255]), 1)
    assert _communicator(takes(tuple), 2, uid, 0) == (2, (0, 1, 127, -128, -1), 0)


@needs_gpu
def test_nccl_world_of_one():
    import cupy

    import elastix
    import elastix.collectives as ec

    ec.init_process_group("nccl", store=elastix.HashStore(), rank=0, world_size=1)
    try:
        for dtype in (cupy.float32, cupy.float16, cupy.int64, cupy.uint8, cupy.float64):
            x = cupy.arange(1000, dtype=dtype)
            ec.all_reduce(x)
            assert cupy.array_equal(x, cupy.arange(1000, dtype=dtype))
        x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
        ec.all_reduce(x, ec.ReduceOp.AVG)
        ec.broadcast(x, 0)
        out = [cupy.empty_like(x)]
        ec.all_gather(out, x)
        assert cupy.array_equal(out[0], x)
        o = cupy.empty_like(x)
        ec.reduce_scatter(o, [x])
        assert cupy.array_equal(o, x)
        w = ec.all_reduce(x, async_op=True)
        w.wait()
        ec.barrier()
        with pytest.raises(TypeError, match="cupy"):
            ec.all_reduce(np.zeros(3))
        with pytest.raises(TypeError, match="NCCL"):
            ec.all_reduce(cupy.zeros(3, cupy.int16))
        cupy.cuda.get_current_stream().synchronize()
    finally:
        ec.destroy_process_group()


def cupy_through_cpu():
    import cupy

    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    x = cupy.full(1000, r + 1, dtype=cupy.float32)
    ec.all_reduce(x)
    y = cupy.zeros(5, dtype=cupy.int32) + r
    ec.broadcast(y, 0)
    ok = bool(cupy.all(x == sum(range(1, p + 1)))) and bool(cupy.all(y == 0))
    ec.destroy_process_group()
    return ok


@needs_gpu
def test_cupy_arrays_through_the_cpu_backend_with_several_ranks():
    assert harness.run(cupy_through_cpu, 2, timeout=120) == [True, True]

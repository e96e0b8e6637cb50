"""Reduction ops and dtypes, in this process: the Rust kernels against NumPy for every dtype
and op (and several sources, the exact aliasing the algorithms use, float16 and bfloat16),
ReduceOp parsing, and which dtypes each op accepts."""

from __future__ import annotations

import numpy as np
import pytest
from test_collectives_cpu import DTYPES, bf16_to_f32, close, data, ops_for, reference

from elastix.collectives import ReduceOp, _native, descriptor, dtypes
from elastix.collectives.reduce_op import as_op, kernel_op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 5])
def test_kernels_match_numpy(dtype, nsrc):
    for op in ops_for(dtype):
        ins = [data(dtype, k, 3001, op) for k in range(nsrc)]
        kind = dtypes.reduce_kind(ins[0].dtype, "bfloat16" if dtype == "bfloat16" else None)
        code, div = kernel_op(ReduceOp[op], kind, nsrc)
        out = np.empty_like(ins[0])
        other = np.empty_like(ins[0])
        _native.reduce(
            kind.code,
            code,
            [x.view(kind.view) for x in ins],
            [out.view(kind.view), other.view(kind.view)],
            div,
        )
        assert close(dtype, out, reference(dtype, op, ins), True), (dtype, op)
        assert np.array_equal(out.view(np.uint8), other.view(np.uint8))


def test_a_destination_may_be_a_source():
    a = np.arange(10_000, dtype=np.float32)
    b = np.ones(10_000, dtype=np.float32)
    _native.reduce(11, 0, [a, b], [a])
    assert np.array_equal(a, np.arange(10_000, dtype=np.float32) + 1)


def test_kernel_refuses_bad_buffers():
    with pytest.raises(ValueError, match="same length"):
        _native.reduce(11, 0, [np.zeros(3, np.float32), np.zeros(4, np.float32)], [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="bitwise"):
        _native.reduce(11, 4, [np.zeros(3, np.float32)], [np.zeros(3, np.float32)])
    with pytest.raises((BufferError, ValueError)):
        _native.reduce(11, 0, [np.zeros(6, np.float32)[::2]], [np.zeros(3, np.float32)])
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        _native.reduce(11, 0, [np.zeros(3, np.float32)], [ro])


def test_a_streaming_copy_writes_exactly_its_destination():
    rng = np.random.default_rng(5)
    for length in (0, 1, 15, 16, 17, 4099, 1 << 20):
        for shift in (0, 1, 8, 15):  # the destination's alignment, which streaming stores need
            src = rng.integers(0, 256, length, dtype=np.uint8)
            dst = np.full(length + 32, 0xAB, np.uint8)
            _native.copy_streaming(dst[shift : shift + length], src)
            assert np.array_equal(dst[shift : shift + length], src), (length, shift)
            assert (dst[:shift] == 0xAB).all() and (dst[shift + length :] == 0xAB).all(), (length, shift)


def test_a_streaming_copy_refuses_bad_buffers():
    with pytest.raises(ValueError, match="the destination has 3 bytes and the source 4"):
        _native.copy_streaming(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
    both = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        _native.copy_streaming(both[8:40], both[:32])
    ro = np.zeros(3, np.uint8)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        _native.copy_streaming(ro, np.zeros(3, np.uint8))


def test_float16_and_bfloat16_round_once():
    a = np.array([1.0, 2049.0, 20000.0], np.float16)
    out = np.empty_like(a)
    _native.reduce(9, 0, [a, a, a], [out])
    assert np.array_equal(out, (a.astype(np.float32) * 3).astype(np.float16))
    bits = np.array([0x3F80, 0x4000], np.uint16)  # 1.0, 2.0
    res = np.empty_like(bits)
    _native.reduce(10, 0, [bits, bits], [res], 2)  # average
    assert list(bf16_to_f32(res)) == [1.0, 2.0]


def test_bfloat16_as_a_numpy_dtype_when_available():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtypes.reduce_kind(np.dtype(ml_dtypes.bfloat16)).code == 10


def test_ops_and_their_dtypes():
    assert as_op("sum") is ReduceOp.SUM and as_op(3) is ReduceOp.MAX and as_op(ReduceOp.AVG) is ReduceOp.AVG
    f32, i8, c64 = (dtypes.reduce_kind(np.dtype(t)) for t in (np.float32, np.int8, np.complex64))
    assert kernel_op(ReduceOp.AVG, f32, 4) == (0, 4)
    assert kernel_op(ReduceOp.BXOR, i8, 4) == (6, 1)
    with pytest.raises(TypeError):
        kernel_op(ReduceOp.BAND, f32, 2)
    with pytest.raises(TypeError):
        kernel_op(ReduceOp.AVG, i8, 2)
    with pytest.raises(TypeError, match="complex"):
        kernel_op(ReduceOp.MAX, c64, 2)
    with pytest.raises(TypeError, match="cannot reduce"):
        dtypes.reduce_kind(np.dtype("U3"))
    with pytest.raises(TypeError, match="byte order"):
        dtypes.reduce_kind(np.dtype(">f4"))


def test_descriptors_describe_calls():
    d = descriptor.make("all_reduce", np.dtype(np.float32), (4, 5), 0)
    assert descriptor.describe(d) == "all_reduce(shape (4, 5), float32, op SUM)"
    assert descriptor.make("all_reduce", np.dtype(np.float32), (4, 5), 0) == d
    assert descriptor.make("all_reduce", np.dtype(np.float32), (5, 4), 0) != d
    big = descriptor.make("broadcast", np.dtype(np.int8), (1,) * 9, -1, 2)
    assert "..." in descriptor.describe(big) and "root 2" in descriptor.describe(big)


def test_outputs_stream_above_the_last_level_cache_or_the_knob(monkeypatch):
    from elastix.collectives import shm_algos

    try:
        for env, want in [(None, shm_algos.last_level_cache_bytes()), ("4096", 4096)]:
            shm_algos.stream_bytes.cache_clear()
            if env is None:
                monkeypatch.delenv("ELASTIX_SHM_STREAM_BYTES", raising=False)
            else:
                monkeypatch.setenv("ELASTIX_SHM_STREAM_BYTES", env)
            assert shm_algos.stream_bytes() == want
        assert shm_algos.last_level_cache_bytes() >= 1 << 20  # this machine's sysfs, or the 32 MiB guess
        shm_algos.stream_bytes.cache_clear()
        monkeypatch.setenv("ELASTIX_SHM_STREAM_BYTES", "lots")
        with pytest.raises(ValueError, match="ELASTIX_SHM_STREAM_BYTES must be a number of bytes, not 'lots'"):
            shm_algos.stream_bytes()
    finally:
        shm_algos.stream_bytes.cache_clear()

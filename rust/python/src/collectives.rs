//! `elastix._core.collectives`: bindings of `elastix_core::collectives` for
//! `python/elastix/collectives`: the reduction kernels (here, on buffers held through the
//! buffer protocol) and the shared-memory segments and waits (`crate::shm`). No function takes
//! an address.

use elastix_core::collectives::{self as core, DType, ReduceOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::buffer::RawBuf;
use crate::shm::{PySegment, Waiter};

/// Reductions at least this large run with the GIL released.
pub(crate) const DETACH_BYTES: usize = 64 * 1024;

/// `reduce(dtype, op, srcs, dsts, divisor=1)`: every destination gets the reduction of every
/// source (same byte length, contiguous), in source order; `divisor` > 1 averages (floats).
#[pyfunction]
#[pyo3(signature = (dtype, op, srcs, dsts, divisor = 1))]
fn reduce(
    py: Python<'_>,
    dtype: u8,
    op: u8,
    srcs: &Bound<'_, PyList>,
    dsts: &Bound<'_, PyList>,
    divisor: u32,
) -> PyResult<()> {
    let dtype = DType::from_code(dtype).ok_or_else(|| PyValueError::new_err(format!("unknown dtype code {dtype}")))?;
    let op = ReduceOp::from_code(op).ok_or_else(|| PyValueError::new_err(format!("unknown op code {op}")))?;
    let src_bufs = srcs.iter().map(|s| RawBuf::get(&s, false)).collect::<PyResult<Vec<_>>>()?;
    let dst_bufs = dsts.iter().map(|d| RawBuf::get(&d, true)).collect::<PyResult<Vec<_>>>()?;
    let Some(first) = src_bufs.first() else {
        return Err(PyValueError::new_err("reduce needs at least one source"));
    };
    let nbytes = first.len();
    if src_bufs.iter().chain(&dst_bufs).any(|b| b.len() != nbytes) {
        return Err(PyValueError::new_err("reduce: every buffer must have the same length"));
    }
    if nbytes % dtype.size() != 0 {
        return Err(PyValueError::new_err(format!("reduce: {nbytes} bytes is not a whole number of {dtype:?}")));
    }
    let srcs: Vec<usize> = src_bufs.iter().map(RawBuf::addr).collect();
    let dsts: Vec<usize> = dst_bufs.iter().map(RawBuf::addr).collect();
    let n = nbytes / dtype.size();
    let run = move || {
        let srcs: Vec<*const u8> = srcs.iter().map(|&a| a as *const u8).collect();
        let dsts: Vec<*mut u8> = dsts.iter().map(|&a| a as *mut u8).collect();
        // SAFETY: the buffers are held (and so alive, contiguous and of these lengths, the
        // destinations writable) until we return. Buffers that partly overlap only get
        // meaningless values: the kernels reach them through raw pointers, never holding
        // references into two of them at once.
        unsafe { core::reduce(dtype, op, &srcs, &dsts, n, divisor) }
    };
    let result = if nbytes >= DETACH_BYTES { py.detach(run) } else { run() };
    result.map_err(|err| PyValueError::new_err(err.to_string()))
}

/// `copy_streaming(dst, src)`: copies `src` into `dst` (contiguous, the same byte length) around
/// the caches, for a large destination that no one reads soon.
#[pyfunction]
fn copy_streaming(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let (dst, src) = (RawBuf::get(dst, true)?, RawBuf::get(src, false)?);
    if dst.len() != src.len() {
        return Err(PyValueError::new_err(format!(
            "copy_streaming: the destination has {} bytes and the source {}",
            dst.len(),
            src.len()
        )));
    }
    let (to, from, len) = (dst.addr(), src.addr(), src.len());
    if to < from + len && from < to + len {
        return Err(PyValueError::new_err("copy_streaming: the destination overlaps the source"));
    }
    let run = move || {
        // SAFETY: both buffers are held (alive, contiguous, of `len` bytes, `dst` writable)
        // until we return, and they do not overlap (checked above).
        unsafe { core::kernels::streaming::copy(from as *const u8, to as *mut u8, len) }
    };
    if len >= DETACH_BYTES {
        py.detach(run)
    } else {
        run()
    }
    Ok(())
}

/// Whether this process's memfds can be opened by its peers (`/proc/<pid>/fd/<n>`): not once
/// it is undumpable, as a process that loaded the job secret is.
#[pyfunction]
fn memfd_attachable() -> bool {
    core::mapping::memfd_attachable()
}

/// Adds the `collectives` submodule to `parent`.
pub fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let module = PyModule::new(parent.py(), "collectives")?;
    module.add_function(wrap_pyfunction!(reduce, &module)?)?;
    module.add_function(wrap_pyfunction!(copy_streaming, &module)?)?;
    module.add_function(wrap_pyfunction!(memfd_attachable, &module)?)?;
    module.add_class::<PySegment>()?;
    module.add_class::<Waiter>()?;
    parent.add_submodule(&module)
}

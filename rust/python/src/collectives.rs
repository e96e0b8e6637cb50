//! `elastix._core.collectives`: bindings of `elastix_core::collectives` for
//! `python/elastix/collectives`: the reduction kernels (here, on buffers held through the
//! buffer protocol) and the shared-memory segments and waits (`crate::shm`). No function takes
//! an address.

use elastix_core::collectives::{self as core, DType, ReduceOp};
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::{ffi, types::PyList};

use crate::shm::{PySegment, Waiter};

/// Reductions at least this large run with the GIL released.
const DETACH_BYTES: usize = 64 * 1024;

/// A buffer held through the buffer protocol (contiguous, as PyBUF_SIMPLE asks).
struct RawBuf {
    view: Box<ffi::Py_buffer>,
}

impl RawBuf {
    fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        // SAFETY: Py_buffer is a plain C struct for which all zeroes is a valid (empty) value.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags = if writable { ffi::PyBUF_WRITABLE } else { ffi::PyBUF_SIMPLE };
        // SAFETY: `obj` is a live object (we hold the GIL and a reference) and `view` a valid
        // Py_buffer to fill; on success it is released once, in `Drop`.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| PyBufferError::new_err("no buffer")));
        }
        Ok(RawBuf { view })
    }

    fn addr(&self) -> usize {
        self.view.buf as usize
    }

    fn len(&self) -> usize {
        self.view.len as usize
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: `view` was filled by a successful PyObject_GetBuffer and is released once;
        // a RawBuf is dropped where the GIL is held (never inside `detach`).
        unsafe { ffi::PyBuffer_Release(&mut *self.view) }
    }
}

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
    module.add_function(wrap_pyfunction!(memfd_attachable, &module)?)?;
    module.add_class::<PySegment>()?;
    module.add_class::<Waiter>()?;
    parent.add_submodule(&module)
}

//! Python buffers (NumPy arrays, memoryviews) held through the buffer protocol while Rust
//! reads or writes them.

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// A buffer held through the buffer protocol (contiguous, as PyBUF_SIMPLE asks).
pub(crate) struct RawBuf {
    view: Box<ffi::Py_buffer>,
}

impl RawBuf {
    pub(crate) fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
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

    pub(crate) fn addr(&self) -> usize {
        self.view.buf as usize
    }

    pub(crate) fn len(&self) -> usize {
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

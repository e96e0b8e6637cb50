//! Bytes between Python and the transport without copies: what is sent is borrowed from
//! Python's objects (bytes, pickle protocol 5's out-of-band buffers) until written, and what
//! arrives is handed to Python as a writable buffer it owns (so NumPy arrays unpickled from it
//! are writable, as pickle's own are).
//!
//! Python objects the transport lets go of are dropped on a thread of their own, with the GIL:
//! the transport's tasks never wait for the GIL. Once the interpreter is exiting they are
//! leaked instead (the exit gate).

use std::any::Any;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::{ffi, PyTypeInfo};

use crate::exit_gate;

/// Parts up to this size are copied: cheaper than keeping their object.
const COPY_BELOW: usize = 64 << 10;

type Garbage = Box<dyn Any + Send>;

fn dropper() -> &'static Mutex<Sender<Garbage>> {
    static DROPPER: OnceLock<Mutex<Sender<Garbage>>> = OnceLock::new();
    DROPPER.get_or_init(|| {
        let (tx, rx) = channel::<Garbage>();
        std::thread::Builder::new()
            .name("elastix-rpc-drop".into())
            .spawn(move || {
                while let Ok(garbage) = rx.recv() {
                    let mut garbage = Some(garbage);
                    if exit_gate::attach(|_| drop(garbage.take())).is_none() {
                        // the interpreter is exiting: dropping needs the GIL, so leak it
                        std::mem::forget(garbage);
                    }
                }
            })
            .expect("cannot start the thread that drops Python objects");
        Mutex::new(tx)
    })
}

/// Drops `garbage` on the dropper thread, with the GIL.
pub fn drop_later(garbage: Garbage) {
    let tx = dropper().lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let _ = tx.send(garbage);
}

/// A Python object kept by the transport (an OwnerRRef's value).
pub struct PyValue(Option<Py<PyAny>>);

impl PyValue {
    pub fn new(obj: Py<PyAny>) -> Self {
        PyValue(Some(obj))
    }

    pub fn get(&self, py: Python<'_>) -> Py<PyAny> {
        self.0.as_ref().expect("present until dropped").clone_ref(py)
    }
}

impl Drop for PyValue {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            drop_later(Box::new(obj));
        }
    }
}

/// A Python buffer's bytes, valid while the buffer is held.
struct Borrowed {
    ptr: NonNull<u8>,
    len: usize,
    keep: Option<Garbage>,
}

// SAFETY: `ptr` points into memory that `keep` holds alive and that nobody writes while it is
// borrowed (bytes objects are immutable; pickled buffers are not touched by the sender until
// its call is done); reading it from another thread is sound.
unsafe impl Send for Borrowed {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for Borrowed {}

impl AsRef<[u8]> for Borrowed {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` and `len` describe the live buffer held by `keep` (see above).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(keep) = self.keep.take() {
            drop_later(keep);
        }
    }
}

/// `bytes` or any C-contiguous buffer as `Bytes`, copied when small.
pub fn to_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        let data = bytes.as_bytes();
        if data.len() < COPY_BELOW {
            return Ok(Bytes::copy_from_slice(data));
        }
        let ptr = NonNull::from(data).cast::<u8>();
        let keep: Garbage = Box::new(bytes.clone().unbind());
        return Ok(Bytes::from_owner(Borrowed { ptr, len: data.len(), keep: Some(keep) }));
    }
    let buffer = PyBuffer::<u8>::get(obj)?;
    if !buffer.is_c_contiguous() {
        return Err(PyBufferError::new_err("RPC sends contiguous buffers only"));
    }
    let len = buffer.len_bytes();
    let Some(ptr) = NonNull::new(buffer.buf_ptr().cast::<u8>()) else { return Ok(Bytes::new()) };
    if len < COPY_BELOW {
        // SAFETY: the buffer is held (`buffer`) and describes `len` contiguous bytes at `ptr`.
        let copy = Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) });
        return Ok(copy);
    }
    Ok(Bytes::from_owner(Borrowed { ptr, len, keep: Some(Box::new(buffer)) }))
}

pub fn to_bytes_list(objs: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Bytes>> {
    objs.iter().map(to_bytes).collect()
}

/// Received bytes, owned by Python from now on, exposed as a writable buffer.
#[pyclass(module = "elastix._core", frozen)]
pub struct RecvBuffer {
    data: NonNull<[u8]>,
}

// SAFETY: the allocation is owned by this object alone; Python synchronises access to it
// (the GIL) as it does for any writable buffer.
unsafe impl Send for RecvBuffer {}
// SAFETY: as above.
unsafe impl Sync for RecvBuffer {}

impl RecvBuffer {
    pub fn new(bytes: Bytes) -> RecvBuffer {
        let vec: Vec<u8> = match bytes.try_into_mut() {
            Ok(unique) => unique.into(),
            Err(shared) => shared.to_vec(),
        };
        let data = NonNull::from(Box::leak(vec.into_boxed_slice()));
        RecvBuffer { data }
    }
}

impl Drop for RecvBuffer {
    fn drop(&mut self) {
        // SAFETY: `data` came from Box::leak in `new` and is freed once, here; Python holds no
        // view any more (each view holds a reference to this object).
        drop(unsafe { Box::from_raw(self.data.as_ptr()) });
    }
}

#[pymethods]
impl RecvBuffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let data = slf.get().data;
        let len = ffi::Py_ssize_t::try_from(data.len()).map_err(|_| PyBufferError::new_err("buffer too large"))?;
        // SAFETY: `view` is the Py_buffer the caller asks us to fill (the buffer protocol);
        // PyBuffer_FillInfo checks it and `flags`, and takes a new reference to `slf`, which
        // keeps the `len` bytes at `data` alive until the view is released.
        let filled =
            unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), data.as_ptr().cast::<c_void>(), len, 0, flags) };
        if filled != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

pub fn recv_list(py: Python<'_>, buffers: Vec<Bytes>) -> PyResult<Vec<Py<RecvBuffer>>> {
    let _ = RecvBuffer::type_object(py);
    buffers.into_iter().map(|bytes| Py::new(py, RecvBuffer::new(bytes))).collect()
}

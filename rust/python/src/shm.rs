//! `elastix._core.collectives.Segment` and `.Waiter`: shared memory owned by Rust
//! (`elastix_core::collectives::{segment, rank_counters}`), reached from Python by byte offsets and,
//! for NumPy, through the buffer protocol. No function here takes an address.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastix_core::collectives::{
    Backing, Descriptors, Handle, Segment as CoreSegment, SegmentError, SharedMemory, Slots, SpinPolicy, StepEnd,
    WaitError, Waiter as CoreWaiter, Words,
};
use pyo3::exceptions::{PyBufferError, PyProcessLookupError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::interrupt::PendingSignal;
use crate::slot_steps::{self, Outcome};
use crate::timeout::from_seconds;

fn to_py(err: SegmentError) -> PyErr {
    match err {
        SegmentError::ProcessGone { .. } => PyProcessLookupError::new_err(err.to_string()),
        _ => PyValueError::new_err(err.to_string()),
    }
}

/// Shared memory mapped in this process. Views (`memoryview`, `np.frombuffer`) keep the
/// mapping alive: `close()` makes every method fail and ends the waits on it, and the memory
/// is unmapped once the last view is gone too.
#[pyclass(module = "elastix._core.collectives", name = "Segment", frozen)]
pub struct PySegment {
    inner: Arc<CoreSegment>,
}

/// What a buffer export holds until it is released.
struct Export {
    _memory: Arc<SharedMemory>,
    shape: [ffi::Py_ssize_t; 1],
    strides: [ffi::Py_ssize_t; 1],
}

#[pymethods]
impl PySegment {
    /// `size` bytes (rounded up to pages) of zeroed shared memory: a memfd, or with
    /// `directory`, a file there (space reserved now; removed by `release_name()`).
    #[staticmethod]
    #[pyo3(signature = (size, directory=None))]
    fn create(py: Python<'_>, size: usize, directory: Option<PathBuf>) -> PyResult<Self> {
        let backing = directory.map_or(Backing::Memfd, Backing::File);
        let memory = py.detach(|| SharedMemory::create(size, &backing))?;
        Ok(PySegment { inner: Arc::new(CoreSegment::new(memory)) })
    }

    /// Maps the segment another process created, from its `encode()`d handle.
    #[staticmethod]
    fn attach(py: Python<'_>, handle: &str) -> PyResult<Self> {
        let handle = Handle::from_json(handle)?;
        let memory = py.detach(|| SharedMemory::attach(&handle))?;
        Ok(PySegment { inner: Arc::new(CoreSegment::new(memory)) })
    }

    /// The handle other processes attach with (JSON).
    fn encode(&self) -> String {
        self.inner.handle().to_json()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.handle().size()
    }

    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner.handle() {
            Handle::Memfd { .. } => "memfd",
            Handle::File { .. } => "file",
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Drops what lets others attach (the creator's memfd or the file's name).
    fn release_name(&self) -> PyResult<()> {
        Ok(self.inner.release_name().map_err(to_py)??)
    }

    /// Ends the waits in progress, returns once they have left, and drops this object's hold
    /// on the mapping. True if it was open.
    fn close(&self, py: Python<'_>) -> bool {
        let inner = &self.inner;
        py.detach(|| inner.close())
    }

    /// Acquire-loads the u64 at byte `offset` (8-aligned).
    fn load(&self, offset: usize) -> PyResult<u64> {
        self.inner.load(offset).map_err(to_py)
    }

    /// Release-stores `value` at byte `offset` and wakes the sleepers registered in the u32 at
    /// `waiters`, if given.
    #[pyo3(signature = (offset, waiters, value))]
    fn publish(&self, offset: usize, waiters: Option<usize>, value: u64) -> PyResult<()> {
        self.inner.publish(offset, waiters, value).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        let state = if self.inner.is_closed() { "closed" } else { "open" };
        format!("Segment({} bytes, {}, {state})", self.inner.handle().size(), self.kind())
    }

    /// A writable, contiguous byte buffer over the whole mapping.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no view to fill"));
        }
        let memory = slf.get().inner.export().map_err(|err| PyBufferError::new_err(err.to_string()))?;
        let len = ffi::Py_ssize_t::try_from(memory.len()).map_err(|_| PyBufferError::new_err("segment too large"))?;
        let buf = memory.as_ptr() as *mut c_void;
        let export = Box::into_raw(Box::new(Export { _memory: memory, shape: [len], strides: [1] }));
        // SAFETY: `view` is the non-null Py_buffer the caller asks us to fill (the buffer
        // protocol). `obj` gets a new reference, released by PyBuffer_Release. `buf` points at
        // `len` bytes kept mapped by the Arc in `export`, which lives (with the shape and stride
        // arrays the view points into) until `__releasebuffer__` frees it. "B" is a static string.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = buf;
            (*view).len = len;
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format =
                if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT { c"B".as_ptr() as *mut _ } else { ptr::null_mut() };
            (*view).ndim = 1;
            (*view).shape =
                if flags & ffi::PyBUF_ND == ffi::PyBUF_ND { (*export).shape.as_mut_ptr() } else { ptr::null_mut() };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                (*export).strides.as_mut_ptr()
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = export as *mut c_void;
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `view` is one this object filled; `internal` is its `Export`, freed once here.
        unsafe {
            let export = (*view).internal as *mut Export;
            if !export.is_null() {
                (*view).internal = ptr::null_mut();
                drop(Box::from_raw(export));
            }
        }
    }
}

/// Waits on the counters of a set of peers in a segment (offsets, checked here once); with
/// `own_flag`, also publishes this rank's counter and descriptor (`step`) and aborts.
#[pyclass(module = "elastix._core.collectives", frozen)]
pub struct Waiter {
    inner: CoreWaiter,
    pending: PendingSignal,
    // the ranks' data slots, for the collectives done in one step (the `*_small` methods)
    slots: Option<Slots>,
}

fn indexes(peers: Vec<usize>) -> Vec<u64> {
    peers.into_iter().map(|i| i as u64).collect()
}

impl Waiter {
    fn wait_inner(&self, py: Python<'_>, target: u64, timeout: Option<f64>) -> PyResult<Outcome> {
        if self.inner.ready(target).map_err(to_py)? {
            return Ok(None);
        }
        let deadline = from_seconds(timeout)?.map(|t| Instant::now() + t);
        let (inner, pending) = (&self.inner, &self.pending);
        let result = py.detach(|| inner.wait(target, deadline, &pending.interrupt())).map_err(to_py)?;
        match result {
            Ok(()) => Ok(None),
            Err(err) => self.stopped(err).map(Some),
        }
    }

    fn slots(&self) -> PyResult<&Slots> {
        self.slots.as_ref().ok_or_else(|| PyValueError::new_err("this Waiter was made without slots"))
    }

    fn step_inner(&self, py: Python<'_>, seq: u64, desc: Option<&[i64]>, timeout: Option<f64>) -> PyResult<Outcome> {
        let end = match self.inner.begin_step(seq, desc).map_err(to_py)? {
            Some(end) => end,
            None => {
                let deadline = from_seconds(timeout)?.map(|t| Instant::now() + t);
                let (inner, pending) = (&self.inner, &self.pending);
                py.detach(|| inner.finish_step(seq, desc, deadline, &pending.interrupt())).map_err(to_py)?
            }
        };
        match end {
            StepEnd::Together => Ok(None),
            StepEnd::Mismatch { peer } => Ok(Some(("mismatch", vec![peer as u64]))),
            StepEnd::Stopped(err) => self.stopped(err).map(Some),
        }
    }

    /// A wait that ended before every peer arrived, as Python's collectives take it.
    fn stopped(&self, err: WaitError) -> PyResult<(&'static str, Vec<u64>)> {
        match err {
            WaitError::Aborted { peer, code } => Ok(("aborted", vec![peer as u64, code])),
            WaitError::Dead { peer } => Ok(("dead", vec![peer as u64])),
            WaitError::Timeout { pending } => Ok(("timeout", indexes(pending))),
            WaitError::Closed { pending } => Ok(("closed", indexes(pending))),
            WaitError::Interrupted => Err(self
                .pending
                .take()
                .unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err("interrupted while waiting"))),
        }
    }
}

#[pymethods]
impl Waiter {
    /// Offsets in `segment`: `flags[i]`, `aborts[i]`, `waiters[i]` are peer i's counter, abort
    /// word (or None) and sleepers' word (or None); `pids[i]` its process (0: not checked).
    /// `slots`, `(base, bytes, ranks, me)`: where the ranks' data slots lie (see
    /// `elastix_core::collectives::slots`), for the `*_small` methods.
    #[new]
    #[pyo3(signature = (segment, flags, aborts, waiters, pids, own_flag=None, own_waiters=None, own_abort=None, spin_iters=20000, yield_us=200, check_ms=2, desc_offsets=(8, 8), slots=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        segment: &Bound<'_, PySegment>,
        flags: Vec<usize>,
        aborts: Vec<Option<usize>>,
        waiters: Vec<Option<usize>>,
        pids: Vec<i32>,
        own_flag: Option<usize>,
        own_waiters: Option<usize>,
        own_abort: Option<usize>,
        spin_iters: u32,
        yield_us: u64,
        check_ms: u64,
        desc_offsets: (usize, usize),
        slots: Option<(usize, usize, usize, usize)>,
    ) -> PyResult<Self> {
        let n = flags.len();
        if aborts.len() != n || waiters.len() != n {
            return Err(PyValueError::new_err("Waiter: one entry per peer in every list"));
        }
        let peers = (0..n).map(|i| Words { flag: flags[i], abort: aborts[i], waiters: waiters[i] }).collect();
        let own = own_flag.map(|flag| Words { flag, abort: own_abort, waiters: own_waiters });
        let policy = SpinPolicy {
            spin_iters,
            yield_for: Duration::from_micros(yield_us),
            check_every: Duration::from_millis(check_ms.max(1)),
        };
        let descriptors = Descriptors { offsets: [desc_offsets.0, desc_offsets.1] };
        let segment = segment.get().inner.clone();
        let slots = slots
            .map(|(base, bytes, ranks, me)| Slots::new(segment.clone(), base, bytes, ranks, me))
            .transpose()
            .map_err(to_py)?;
        let inner = py.detach(|| CoreWaiter::new(segment, peers, &pids, own, descriptors, policy)).map_err(to_py)?;
        Ok(Waiter { inner, pending: PendingSignal::default(), slots })
    }

    /// Waits until every peer's counter is >= `target`. None when they are; else
    /// `("timeout", [peer, ...])`, `("dead", [peer])`, `("aborted", [peer, code])` or
    /// `("closed", [peer, ...])` (the segment was closed meanwhile).
    #[pyo3(signature = (target, timeout=None))]
    fn wait(&self, py: Python<'_>, target: u64, timeout: Option<f64>) -> PyResult<Outcome> {
        self.wait_inner(py, target, timeout)
    }

    /// One lock-step: writes `desc` (if given) as this rank's step-`seq` descriptor, publishes
    /// `seq`, waits for every peer to publish `seq`, then compares their descriptors with ours:
    /// `("mismatch", [peer])` names the first that differs.
    #[pyo3(signature = (seq, desc=None, timeout=None))]
    fn step(&self, py: Python<'_>, seq: u64, desc: Option<Vec<i64>>, timeout: Option<f64>) -> PyResult<Outcome> {
        self.step_inner(py, seq, desc.as_deref(), timeout)
    }

    /// An all_reduce in one step (with `reduce_here` false on the non-roots, a reduce): copies
    /// `x` into this rank's slot of step `seq`, steps as `step` does, then reduces every
    /// rank's slot, in rank order, into `x`. Returns `step`'s outcome; `x` is reduced only when
    /// that is None.
    #[pyo3(signature = (seq, desc, timeout, x, dtype, op, divisor=1, reduce_here=true))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_small(
        &self,
        py: Python<'_>,
        seq: u64,
        desc: Option<Vec<i64>>,
        timeout: Option<f64>,
        x: &Bound<'_, PyAny>,
        dtype: u8,
        op: u8,
        divisor: u32,
        reduce_here: bool,
    ) -> PyResult<Outcome> {
        let kernel = slot_steps::kernel(dtype, op)?;
        let step = || self.step_inner(py, seq, desc.as_deref(), timeout);
        slot_steps::all_reduce(py, self.slots()?, seq, x, kernel, divisor, reduce_here, step)
    }

    /// A copy in one step: `send` (if given) into this rank's slot of step `seq`, the step,
    /// then each `recv[j]` that is not None gets the start of rank j's slot (an all_gather,
    /// a gather, a broadcast). Returns `step`'s outcome; nothing is received unless it is None.
    #[pyo3(signature = (seq, desc, timeout, send, recv))]
    fn copy_small(
        &self,
        py: Python<'_>,
        seq: u64,
        desc: Option<Vec<i64>>,
        timeout: Option<f64>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<Outcome> {
        let step = || self.step_inner(py, seq, desc.as_deref(), timeout);
        slot_steps::copy(py, self.slots()?, seq, send, recv, step)
    }

    /// A reduce_scatter in one step: `ins[j]` goes into this rank's slot at `j * region`, the
    /// step, then `out` gets every rank's operand for this rank reduced (its own from
    /// `ins[me]`). Returns `step`'s outcome; `out` is written only when that is None.
    #[pyo3(signature = (seq, desc, timeout, ins, out, region, dtype, op, divisor=1))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_small(
        &self,
        py: Python<'_>,
        seq: u64,
        desc: Option<Vec<i64>>,
        timeout: Option<f64>,
        ins: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        region: usize,
        dtype: u8,
        op: u8,
        divisor: u32,
    ) -> PyResult<Outcome> {
        let kernel = slot_steps::kernel(dtype, op)?;
        let step = || self.step_inner(py, seq, desc.as_deref(), timeout);
        slot_steps::reduce_scatter(py, self.slots()?, seq, ins, out, region, kernel, divisor, step)
    }

    /// Tells the peers this rank gave up (`code` != 0) and wakes those sleeping on its counter.
    fn abort(&self, code: u64) -> PyResult<()> {
        self.inner.abort(code).map_err(to_py)
    }
}

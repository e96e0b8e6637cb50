//! `elastix._core.collectives`: bindings of `elastix_core::collectives` for
//! `python/elastix/collectives` (the reduction kernels and the shared-memory counter waits).
//!
//! Addresses of shared memory cross as integers: the Python side owns the mappings and keeps
//! them alive while a `Waiter` that points into them exists.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use elastix_core::collectives::{self as core, DType, Liveness, Peer, ReduceOp, SpinPolicy, WaitError};
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::{ffi, types::PyList};

use crate::interrupt::PendingSignal;
use crate::timeout::from_seconds;

/// Reductions at least this large run with the GIL released.
const DETACH_BYTES: usize = 64 * 1024;

/// A buffer held through the buffer protocol (contiguous, as PyBUF_SIMPLE asks).
struct RawBuf {
    view: Box<ffi::Py_buffer>,
}

impl RawBuf {
    fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags = if writable { ffi::PyBUF_WRITABLE } else { ffi::PyBUF_SIMPLE };
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
        // Dropped where the GIL is held (never inside `detach`).
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
        // SAFETY: the buffers are held (and so alive and of these lengths) until we return.
        unsafe { core::reduce(dtype, op, &srcs, &dsts, n, divisor) }
    };
    let result = if nbytes >= DETACH_BYTES { py.detach(run) } else { run() };
    result.map_err(|err| PyValueError::new_err(err.to_string()))
}

/// Release-stores `value` at `flag` (an address of an aligned u64 in shared memory) and wakes
/// the sleepers registered at `waiters` (an aligned u32), if any.
#[pyfunction]
#[pyo3(signature = (flag, waiters, value))]
fn publish(flag: usize, waiters: Option<usize>, value: u64) {
    let (flag, waiters) = unsafe { (word(flag), waiters.map(|w| counter(w))) };
    core::publish(flag, waiters, value);
}

/// Acquire-loads the u64 at `addr`.
#[pyfunction]
fn load(addr: usize) -> u64 {
    unsafe { word(addr) }.load(Ordering::Acquire)
}

unsafe fn word<'a>(addr: usize) -> &'a AtomicU64 {
    &*(addr as *const AtomicU64)
}

unsafe fn counter<'a>(addr: usize) -> &'a AtomicU32 {
    &*(addr as *const AtomicU32)
}

#[derive(Clone, Copy)]
struct PeerAddrs {
    flag: usize,
    abort: Option<usize>,
    waiters: Option<usize>,
    liveness: Liveness,
}

/// Waits on the counters of a set of peers (see `elastix_core::collectives::wait`); with
/// `own_flag`, also publishes this rank's counter and descriptor (`step`).
#[pyclass(module = "elastix._core.collectives", frozen)]
struct Waiter {
    peers: Vec<PeerAddrs>,
    own_flag: Option<usize>,
    own_waiters: Option<usize>,
    own_abort: Option<usize>,
    desc_offsets: [usize; 2],
    policy: SpinPolicy,
    pending: PendingSignal,
}

type Outcome = Option<(&'static str, Vec<u64>)>;

impl Waiter {
    fn wait_inner(&self, py: Python<'_>, target: u64, timeout: Option<f64>) -> PyResult<Outcome> {
        let ready = self.peers.iter().all(|p| unsafe { word(p.flag) }.load(Ordering::Acquire) >= target);
        if ready {
            return Ok(None);
        }
        let deadline = from_seconds(timeout)?.map(|t| Instant::now() + t);
        let peers = self.peers.clone();
        let policy = self.policy;
        let pending = &self.pending;
        let result = py.detach(move || {
            let peers: Vec<Peer<'_>> = peers
                .iter()
                .map(|p| unsafe {
                    Peer {
                        flag: word(p.flag),
                        abort: p.abort.map(|a| word(a)),
                        waiters: p.waiters.map(|w| counter(w)),
                        liveness: p.liveness,
                    }
                })
                .collect();
            core::wait_all(&peers, target, &policy, deadline, &mut || pending.raised())
        });
        match result {
            Ok(()) => Ok(None),
            Err(WaitError::Aborted { peer, code }) => Ok(Some(("aborted", vec![peer as u64, code]))),
            Err(WaitError::Dead { peer }) => Ok(Some(("dead", vec![peer as u64]))),
            Err(WaitError::Timeout { pending }) => {
                Ok(Some(("timeout", pending.into_iter().map(|i| i as u64).collect())))
            }
            Err(WaitError::Interrupted) => Err(self.pending.take().expect("an interrupt keeps its exception")),
        }
    }
}

#[pymethods]
impl Waiter {
    /// `flags[i]`, `aborts[i]`, `waiters[i]`: addresses of peer i's counter, abort word (or
    /// None) and sleepers' word (or None); `pidfds[i]` (-1: none) and `pids[i]` (0: none) tell
    /// whether it is alive.
    #[new]
    #[pyo3(signature = (flags, aborts, waiters, pidfds, pids, own_flag=None, own_waiters=None, own_abort=None, spin_iters=20000, yield_us=200, check_ms=2, desc_offsets=(8, 8)))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        flags: Vec<usize>,
        aborts: Vec<Option<usize>>,
        waiters: Vec<Option<usize>>,
        pidfds: Vec<i32>,
        pids: Vec<i32>,
        own_flag: Option<usize>,
        own_waiters: Option<usize>,
        own_abort: Option<usize>,
        spin_iters: u32,
        yield_us: u64,
        check_ms: u64,
        desc_offsets: (usize, usize),
    ) -> PyResult<Self> {
        if desc_offsets.0 % 8 != 0 || desc_offsets.1 % 8 != 0 {
            return Err(PyValueError::new_err("Waiter: descriptor offsets must be multiples of 8"));
        }
        let n = flags.len();
        if aborts.len() != n || waiters.len() != n || pidfds.len() != n || pids.len() != n {
            return Err(PyValueError::new_err("Waiter: one entry per peer in every list"));
        }
        let all = [&flags[..], &own_flag.into_iter().collect::<Vec<_>>()[..]].concat();
        if all.iter().chain(aborts.iter().flatten()).any(|a| *a == 0 || a % 8 != 0)
            || waiters.iter().flatten().chain(own_waiters.iter()).any(|a| *a == 0 || a % 4 != 0)
        {
            return Err(PyValueError::new_err("Waiter: addresses must be non-null and aligned"));
        }
        let peers = (0..n)
            .map(|i| PeerAddrs {
                flag: flags[i],
                abort: aborts[i],
                waiters: waiters[i],
                liveness: if pidfds[i] >= 0 {
                    Liveness::Pidfd(pidfds[i])
                } else if pids[i] > 0 {
                    Liveness::Pid(pids[i])
                } else {
                    Liveness::Unknown
                },
            })
            .collect();
        let policy = SpinPolicy {
            spin_iters,
            yield_for: Duration::from_micros(yield_us),
            check_every: Duration::from_millis(check_ms.max(1)),
        };
        let desc_offsets = [desc_offsets.0, desc_offsets.1];
        Ok(Waiter { peers, own_flag, own_waiters, own_abort, desc_offsets, policy, pending: PendingSignal::default() })
    }

    /// Waits until every peer's counter is >= `target`. None when they are; else
    /// `("timeout", [peer, ...])`, `("dead", [peer])` or `("aborted", [peer, code])`.
    #[pyo3(signature = (target, timeout=None))]
    fn wait(&self, py: Python<'_>, target: u64, timeout: Option<f64>) -> PyResult<Outcome> {
        self.wait_inner(py, target, timeout)
    }

    /// One lock-step: writes `desc` (if given) at `desc_offsets[seq % 2]` bytes after this
    /// rank's counter (two copies, because a peer may start step seq + 1 while another still
    /// reads its step-seq descriptor), publishes `seq`, waits for every peer to publish `seq`,
    /// then compares their descriptors with ours: `("mismatch", [peer])` names the first that
    /// differs.
    #[pyo3(signature = (seq, desc=None, timeout=None))]
    fn step(&self, py: Python<'_>, seq: u64, desc: Option<Vec<i64>>, timeout: Option<f64>) -> PyResult<Outcome> {
        let own = self.own_flag.ok_or_else(|| PyValueError::new_err("step needs own_flag"))?;
        let offset = self.desc_offsets[(seq & 1) as usize];
        if let Some(desc) = &desc {
            for (i, v) in desc.iter().enumerate() {
                unsafe { &*((own + offset + 8 * i) as *const AtomicI64) }.store(*v, Ordering::Relaxed);
            }
        }
        core::publish(unsafe { word(own) }, self.own_waiters.map(|w| unsafe { counter(w) }), seq);
        if let Some(outcome) = self.wait_inner(py, seq, timeout)? {
            return Ok(Some(outcome));
        }
        if let Some(desc) = &desc {
            for (i, p) in self.peers.iter().enumerate() {
                let differs = desc.iter().enumerate().any(|(j, v)| {
                    unsafe { &*((p.flag + offset + 8 * j) as *const AtomicI64) }.load(Ordering::Relaxed) != *v
                });
                if differs {
                    return Ok(Some(("mismatch", vec![i as u64])));
                }
            }
        }
        Ok(None)
    }

    /// Tells the peers this rank gave up (`code` != 0) and wakes those sleeping on its counter.
    fn abort(&self, code: u64) -> PyResult<()> {
        let (Some(flag), Some(abort)) = (self.own_flag, self.own_abort) else {
            return Err(PyValueError::new_err("abort needs own_flag and own_abort"));
        };
        unsafe { word(abort) }.store(code, Ordering::SeqCst);
        core::wake(unsafe { word(flag) });
        Ok(())
    }
}

/// Adds the `collectives` submodule to `parent`.
pub fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    let module = PyModule::new(parent.py(), "collectives")?;
    module.add_function(wrap_pyfunction!(reduce, &module)?)?;
    module.add_function(wrap_pyfunction!(publish, &module)?)?;
    module.add_function(wrap_pyfunction!(load, &module)?)?;
    module.add_class::<Waiter>()?;
    parent.add_submodule(&module)
}

//! `elastix._core.rpc`: the RPC endpoint and RRef handles for `python/elastix/rpc`. Every
//! wait runs with the GIL released; pickling, and running what a request asks, stay in Python.

mod buffers;
mod handle;

use std::sync::Arc;
use std::time::Duration;

use elastix_core::rpc::endpoint::{self as core, CallError, Endpoint, Message, Peer, ValueError};
use elastix_core::rpc::ids::Gid;
use elastix_core::rpc::queue::Empty;
use elastix_core::rpc::refs::{ForkData, Handle};
use pyo3::exceptions::{PyConnectionError, PyKeyboardInterrupt, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tokio::runtime::Runtime;

use crate::exit_gate::drop_without_gil;
use crate::interrupt::PendingSignal;
use crate::runtimes;
use crate::timeout::from_seconds;
use buffers::{recv_list, to_bytes, to_bytes_list, PyValue, RecvBuffer};
use handle::RRefHandle;

/// Threads of the transport's runtime: its work is reading and writing sockets.
const RUNTIME_THREADS: usize = 1;

pub type GidTuple = (u32, u64);

pub fn gid((worker, local): GidTuple) -> Gid {
    Gid::new(worker, local)
}

pub fn tuple(id: Gid) -> GidTuple {
    (id.worker, id.local)
}

/// A failed call as the Python exception to raise: TimeoutError, ConnectionError (the callee
/// is gone) or RuntimeError; the RPC package turns them into its own classes.
fn call_error(err: CallError, pending: &PendingSignal) -> PyErr {
    match err {
        CallError::Timeout(message) => PyTimeoutError::new_err(message),
        CallError::PeerGone(message) => PyConnectionError::new_err(message),
        CallError::Shutdown(message) | CallError::Refused(message) => PyRuntimeError::new_err(message),
        CallError::Interrupted => pending.take().unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted")),
    }
}

fn value_error(err: ValueError, pending: &PendingSignal) -> PyErr {
    match err {
        ValueError::TimedOut(_) => PyTimeoutError::new_err(err.to_string()),
        ValueError::Deleted => PyRuntimeError::new_err(err.to_string()),
        ValueError::Interrupted => pending.take().unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted")),
    }
}

/// (status, payload, buffers) for Python.
type Answer = (u8, Py<PyBytes>, Vec<Py<RecvBuffer>>);

fn answer(py: Python<'_>, message: Message) -> PyResult<Answer> {
    Ok((message.status, PyBytes::new(py, &message.payload).unbind(), recv_list(py, message.buffers)?))
}

fn message(status: u8, payload: &Bound<'_, PyAny>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Message> {
    Ok(Message { status, payload: to_bytes(payload)?, buffers: to_bytes_list(buffers)? })
}

#[pyclass(module = "elastix._core", frozen)]
pub struct RpcEndpoint {
    endpoint: Arc<Endpoint>,
    runtime: std::sync::Mutex<Option<Runtime>>,
    pending: PendingSignal,
}

impl Drop for RpcEndpoint {
    fn drop(&mut self) {
        // the runtime's drop waits for its threads, which may be waiting for the GIL
        let runtime = self.runtime.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        drop_without_gil(runtime);
    }
}

#[pymethods]
impl RpcEndpoint {
    /// Listens on `host` (port chosen by the kernel) as rank `rank` of `world`; every connection proves
    /// `key`. `control_delay` (seconds, low and high) is the test hook that delays each
    /// reference-counting message by a random time.
    #[new]
    #[pyo3(signature = (rank, world, host, key, control_delay=None))]
    fn new(
        py: Python<'_>,
        rank: u32,
        world: u32,
        host: String,
        key: &crate::auth::PeerKey,
        control_delay: Option<(f64, f64)>,
    ) -> PyResult<Self> {
        let control_delay = match control_delay {
            None => None,
            Some((low, high)) => {
                let low = from_seconds(Some(low))?.unwrap_or_default();
                let high = from_seconds(Some(high))?.unwrap_or_default();
                Some((low, high.max(low)))
            }
        };
        let config = core::Config { me: rank, world, host, key: key.0.clone(), control_delay };
        let (runtime, endpoint) = py.detach(|| {
            let runtime = runtimes::own("elastix-rpc", RUNTIME_THREADS)?;
            let endpoint = runtime.block_on(Endpoint::start(config))?;
            Ok::<_, std::io::Error>((runtime, endpoint))
        })?;
        Ok(RpcEndpoint { endpoint, runtime: std::sync::Mutex::new(Some(runtime)), pending: PendingSignal::default() })
    }

    /// (host, port) it listens on.
    fn address(&self) -> (String, u16) {
        let addr = self.endpoint.local_addr();
        (addr.ip().to_string(), addr.port())
    }

    /// Every worker, by rank: (name, "host:port").
    fn set_peers(&self, peers: Vec<(String, String)>) -> PyResult<()> {
        let peers = peers.into_iter().map(|(name, addr)| Peer { name, addr }).collect();
        self.endpoint.set_peers(peers).map_err(|err| call_error(err, &self.pending))
    }

    fn describe(&self, rank: u32) -> String {
        self.endpoint.describe(rank)
    }

    /// Sends a request and waits for its answer: (status, payload, buffers).
    #[pyo3(signature = (to, op, payload, buffers, rref=None, fork=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        py: Python<'_>,
        to: u32,
        op: u8,
        payload: &Bound<'_, PyAny>,
        buffers: Vec<Bound<'_, PyAny>>,
        rref: Option<GidTuple>,
        fork: Option<GidTuple>,
        timeout: Option<f64>,
    ) -> PyResult<Answer> {
        let timeout = from_seconds(timeout)?;
        let request = request(to, op, payload, buffers, rref, fork)?;
        let endpoint = &self.endpoint;
        let pending = &self.pending;
        let result = py.detach(|| endpoint.call_sync(request, timeout, &pending.interrupt()));
        answer(py, result.map_err(|err| call_error(err, &self.pending))?)
    }

    /// Sends a request; its answer comes from `next_completion` with `token`.
    #[pyo3(signature = (to, op, payload, buffers, token, rref=None, fork=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn call_async(
        &self,
        to: u32,
        op: u8,
        payload: &Bound<'_, PyAny>,
        buffers: Vec<Bound<'_, PyAny>>,
        token: u64,
        rref: Option<GidTuple>,
        fork: Option<GidTuple>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        let request = request(to, op, payload, buffers, rref, fork)?;
        self.endpoint.call_async(request, token, timeout).map_err(|err| call_error(err, &self.pending))
    }

    /// The next answer to an `rpc_async` call, waiting up to `wait` seconds: (token, answer)
    /// or (token, exception); None if nothing came, and also once the endpoint is closed.
    fn next_completion(&self, py: Python<'_>, wait: f64) -> PyResult<Option<(u64, Py<PyAny>)>> {
        let wait = from_seconds(Some(wait))?.unwrap_or(Duration::ZERO);
        let completion = match py.detach(|| self.endpoint.next_completion(wait)) {
            Ok(completion) => completion,
            Err(Empty::TimedOut | Empty::Closed) => return Ok(None),
        };
        let result = match completion.result {
            Ok(message) => answer(py, message)?.into_pyobject(py)?.into_any().unbind(),
            Err(err) => call_error(err, &self.pending).into_value(py).into_any(),
        };
        Ok(Some((completion.token, result)))
    }

    /// The next request to run, waiting up to `wait` seconds; None if nothing came.
    fn next_request(&self, py: Python<'_>, wait: f64) -> PyResult<Option<Request>> {
        let wait = from_seconds(Some(wait))?.unwrap_or(Duration::ZERO);
        match py.detach(|| self.endpoint.next_request(wait)) {
            Ok(incoming) => Ok(Some(Request::new(py, incoming)?)),
            Err(Empty::TimedOut | Empty::Closed) => Ok(None),
        }
    }

    fn is_closed(&self) -> bool {
        self.endpoint.is_closed()
    }

    /// A new RRef owned here, holding `value`.
    fn new_owner(&self, value: Py<PyAny>) -> RRefHandle {
        let handle = self.endpoint.new_owner(Box::new(PyValue::new(value)));
        let (Handle::Owner(rref) | Handle::User(rref)) = handle;
        RRefHandle::new(&self.endpoint, handle, self.endpoint.me(), rref)
    }

    /// The caller's side of remote(): (rref id, fork id, handle).
    fn start_remote(&self, owner: u32) -> (GidTuple, GidTuple, RRefHandle) {
        let (rref, fork, handle) = self.endpoint.start_remote(owner);
        (tuple(rref), tuple(fork), RRefHandle::new(&self.endpoint, handle, owner, rref))
    }

    /// The handle for a fork that arrived from `parent`.
    fn fork_in(&self, owner: u32, rref: GidTuple, fork: GidTuple, parent: u32) -> RRefHandle {
        let data = ForkData { owner, rref: gid(rref), fork: gid(fork) };
        let handle = self.endpoint.fork_in(data, parent);
        RRefHandle::new(&self.endpoint, handle, owner, data.rref)
    }

    /// A message carrying the fork (owner, rref, fork) was never sent: undo that fork.
    fn fork_not_delivered(&self, owner: u32, rref: GidTuple, fork: GidTuple) {
        let data = ForkData { owner, rref: gid(rref), fork: gid(fork) };
        self.endpoint.fork_not_delivered(data);
    }

    /// The OwnerRRef `rref` gets its value; returns who waited for it from other workers.
    fn set_value(&self, rref: GidTuple, value: Py<PyAny>) -> Vec<Responder> {
        let responders = self.endpoint.set_value(gid(rref), Box::new(PyValue::new(value)));
        responders.into_iter().map(Responder).collect()
    }

    /// The value of the OwnerRRef `rref`, waiting up to `timeout` seconds for it.
    #[pyo3(signature = (rref, timeout=None))]
    fn owner_value(&self, py: Python<'_>, rref: GidTuple, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let timeout = from_seconds(timeout)?;
        let pending = &self.pending;
        py.detach(|| self.endpoint.wait_value(gid(rref), timeout, &pending.interrupt()))
            .map_err(|err| value_error(err, &self.pending))?;
        let value = self.endpoint.with_value(gid(rref), |value| value.downcast_ref::<PyValue>().map(|v| v.get(py)));
        value.flatten().ok_or_else(|| value_error(ValueError::Deleted, &self.pending))
    }

    /// Counts for `_get_debug_info`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let refs = self.endpoint.ref_stats();
        let (calls, control) = self.endpoint.outstanding();
        let stats = PyDict::new(py);
        stats.set_item("num_owner_rrefs", refs.owners)?;
        stats.set_item("num_forks", refs.forks_of_owners)?;
        stats.set_item("num_user_rrefs", refs.users)?;
        stats.set_item("num_pending_users", refs.pending_users)?;
        stats.set_item("num_pending_children", refs.pending_children)?;
        stats.set_item("num_pending_calls", calls)?;
        stats.set_item("num_pending_control", control)?;
        Ok(stats)
    }

    /// What the RRef table still holds, one line each (diagnostics).
    fn describe_refs(&self) -> Vec<String> {
        self.endpoint.describe_refs()
    }

    /// (calls waiting for answers, control messages waiting for acks).
    fn outstanding(&self) -> (usize, usize) {
        self.endpoint.outstanding()
    }

    fn release_all_users(&self) {
        self.endpoint.release_all_users();
    }

    fn clear_owners(&self) -> usize {
        self.endpoint.clear_owners()
    }

    /// Stops the endpoint and its threads; pending calls fail.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            self.endpoint.close();
            let runtime = self.runtime.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            if let Some(runtime) = runtime {
                runtime.shutdown_timeout(runtimes::SHUTDOWN_WAIT);
            }
        });
    }
}

fn request(
    to: u32,
    op: u8,
    payload: &Bound<'_, PyAny>,
    buffers: Vec<Bound<'_, PyAny>>,
    rref: Option<GidTuple>,
    fork: Option<GidTuple>,
) -> PyResult<core::Request> {
    let message = message(0, payload, buffers)?;
    Ok(core::Request {
        to,
        op,
        rref: rref.map(gid).unwrap_or_default(),
        fork: fork.map(gid).unwrap_or_default(),
        payload: message.payload,
        buffers: message.buffers,
    })
}

/// Where one answer goes.
#[pyclass(module = "elastix._core", frozen)]
pub struct Responder(core::Responder);

#[pymethods]
impl Responder {
    /// Sends the answer: status 0 (a result) or 1 (a pickled exception).
    fn respond(&self, status: u8, payload: &Bound<'_, PyAny>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        if status > 1 {
            return Err(PyValueError::new_err(format!("status must be 0 or 1, got {status}")));
        }
        self.0.respond(message(status, payload, buffers)?);
        Ok(())
    }
}

/// A request for this worker to run.
#[pyclass(module = "elastix._core", frozen, get_all)]
pub struct Request {
    /// The caller's rank.
    sender: u32,
    op: u8,
    rref: GidTuple,
    fork: GidTuple,
    payload: Py<PyBytes>,
    buffers: Py<PyTuple>,
    responder: Py<Responder>,
}

impl Request {
    fn new(py: Python<'_>, incoming: core::Incoming) -> PyResult<Request> {
        Ok(Request {
            sender: incoming.from,
            op: incoming.op,
            rref: tuple(incoming.rref),
            fork: tuple(incoming.fork),
            payload: PyBytes::new(py, &incoming.message.payload).unbind(),
            buffers: PyTuple::new(py, recv_list(py, incoming.message.buffers)?)?.unbind(),
            responder: Py::new(py, Responder(incoming.responder))?,
        })
    }
}

pub fn register(parent: &Bound<'_, PyModule>) -> PyResult<()> {
    parent.add_class::<RpcEndpoint>()?;
    parent.add_class::<RRefHandle>()?;
    parent.add_class::<Request>()?;
    parent.add_class::<Responder>()?;
    parent.add_class::<RecvBuffer>()?;
    Ok(())
}

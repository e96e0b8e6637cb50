//! `RendezvousCore`: a rendezvous handler. Its heartbeats and watchers must keep running
//! between Python calls, so handlers live on one shared multi-thread runtime; calls block on
//! it with the GIL released and stay interruptible by Ctrl-C.

use std::future::Future;

use elastix_core::rendezvous::{MembershipChange, Rendezvous, RendezvousError, RendezvousParams};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::{import_exception, PyErr};
use tokio::sync::Mutex;

use crate::errors::to_py as store_error_to_py;
use crate::interrupt::PendingSignal;
use crate::runtimes;
use crate::timeout::from_seconds;

import_exception!(elastix.errors, RendezvousClosedError);
import_exception!(elastix.errors, RendezvousGracefulExitError);
import_exception!(elastix.errors, RendezvousTimeoutError);
import_exception!(elastix.errors, RendezvousStateError);

pub(crate) fn to_py(err: RendezvousError, pending: &PendingSignal) -> PyErr {
    let message = err.to_string();
    match err {
        RendezvousError::Closed { .. } => RendezvousClosedError::new_err(message),
        RendezvousError::GracefulExit { .. } => RendezvousGracefulExitError::new_err(message),
        RendezvousError::Timeout(_) => RendezvousTimeoutError::new_err(message),
        RendezvousError::State(_) | RendezvousError::LeaseGone(_) => RendezvousStateError::new_err(message),
        RendezvousError::Config(_) => PyValueError::new_err(message),
        RendezvousError::Store(err) => store_error_to_py(err, pending),
    }
}

/// Runs the future `start` makes on the rendezvous runtime with the GIL released, dropping it
/// if a Python signal handler raises (Ctrl-C); that exception is then raised.
fn block_on<T: Send, F: Future<Output = Result<T, RendezvousError>>>(
    py: Python<'_>,
    pending: &PendingSignal,
    start: impl FnOnce() -> F + Send,
) -> PyResult<T> {
    let outcome = py.detach(|| runtimes::interruptible(runtimes::shared(), pending, start()));
    match outcome {
        Some(result) => result.map_err(|err| to_py(err, pending)),
        None => Err(pending.take().expect("an interrupt keeps its exception")),
    }
}

#[pyclass(module = "elastix._core", frozen)]
pub struct RendezvousCore {
    handler: Mutex<Rendezvous>,
    run_id: String,
    backend: &'static str,
    hosted_port: Option<u16>,
    pending: PendingSignal,
}

impl RendezvousCore {
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        op: impl AsyncFnOnce(&mut Rendezvous) -> Result<T, RendezvousError> + Send,
    ) -> PyResult<T> {
        block_on(py, &self.pending, || async {
            let mut handler = self.handler.lock().await;
            op(&mut handler).await
        })
    }
}

fn describe(change: &MembershipChange) -> String {
    match change {
        MembershipChange::NodesWaiting => "nodes_waiting".to_owned(),
        MembershipChange::NodeLost { rank, node } => {
            let rank = rank.map_or_else(|| "?".to_owned(), |rank| rank.to_string());
            match node {
                Some(node) => format!("node_lost:{rank}:{node}"),
                None => format!("node_lost:{rank}"),
            }
        }
        MembershipChange::RoundSuperseded { round } => format!("round_superseded:{round}"),
        MembershipChange::StoreReset => "store_reset".to_owned(),
        MembershipChange::StoreUnreachable { store, .. } => format!("store_unreachable:{store}"),
        MembershipChange::StoreMoved { to } => format!("store_moved:{to}"),
        MembershipChange::Minority { reached, .. } => format!("minority:{}", reached.join(",")),
        MembershipChange::Closed => "closed".to_owned(),
    }
}

#[pymethods]
impl RendezvousCore {
    #[new]
    /// `conf_json`: the rendezvous configuration as JSON, torch's `"k=v,k=v"` text or an object
    /// of values (see `elastix_core::rendezvous::ConfInput`).
    #[pyo3(signature = (backend, endpoint, run_id, min_nodes, max_nodes, local_addr=None, conf_json=String::from("\"\""), node_rank=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: String,
        endpoint: String,
        run_id: String,
        min_nodes: u32,
        max_nodes: u32,
        local_addr: Option<String>,
        conf_json: String,
        node_rank: Option<u32>,
    ) -> PyResult<Self> {
        let conf = serde_json::from_str(&conf_json)
            .map_err(|err| pyo3::exceptions::PyValueError::new_err(format!("rendezvous conf: {err}")))?;
        let params = RendezvousParams { backend, endpoint, run_id, min_nodes, max_nodes, local_addr, conf, node_rank };
        let pending = PendingSignal::default();
        let handler = block_on(py, &pending, || Rendezvous::create(params))?;
        Ok(RendezvousCore {
            run_id: handler.run_id().to_owned(),
            backend: handler.name(),
            hosted_port: handler.hosted_port(),
            handler: Mutex::new(handler),
            pending,
        })
    }

    #[getter]
    fn run_id(&self) -> &str {
        &self.run_id
    }

    #[getter]
    fn backend(&self) -> &str {
        self.backend
    }

    /// The rendezvous store's port when this handler serves it.
    #[getter]
    fn hosted_port(&self) -> Option<u16> {
        self.hosted_port
    }

    /// Joins the next round; returns its description as a dict.
    fn next_rendezvous<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.call(py, async |handler| handler.next_rendezvous().await)?;
        let dict = PyDict::new(py);
        dict.set_item("run_id", info.run_id)?;
        dict.set_item("round", info.round)?;
        dict.set_item("rank", info.rank)?;
        dict.set_item("world_size", info.world_size)?;
        dict.set_item("master_addr", info.master_addr)?;
        dict.set_item("master_port", info.master_port)?;
        dict.set_item("store_host", info.store_host)?;
        dict.set_item("store_port", info.store_port)?;
        dict.set_item("store_prefix", info.store_prefix)?;
        Ok(dict)
    }

    fn num_nodes_waiting(&self, py: Python<'_>) -> PyResult<u32> {
        self.call(py, async |handler| handler.num_nodes_waiting().await)
    }

    fn is_closed(&self, py: Python<'_>) -> PyResult<bool> {
        self.call(py, async |handler| handler.is_closed().await)
    }

    fn set_closed(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, async |handler| handler.set_closed().await)
    }

    fn record_restart(&self, py: Python<'_>) -> PyResult<i64> {
        self.call(py, async |handler| handler.record_restart().await)
    }

    fn restart_count(&self, py: Python<'_>) -> PyResult<i64> {
        self.call(py, async |handler| handler.restart_count().await)
    }

    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, async |handler| {
            handler.shutdown();
            Ok(())
        })
    }

    /// Blocks until the current round should end, up to `timeout` seconds (`None`: no
    /// limit); returns what happened ("nodes_waiting", "node_lost:RANK[:NODE]",
    /// "round_superseded:ROUND", "closed"), or `None` on timeout or outside a round.
    #[pyo3(signature = (timeout=None))]
    fn wait_for_change(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<String>> {
        let timeout = from_seconds(timeout)?;
        let Some(mut changes) = self.call(py, async |handler| Ok(handler.changes()))? else {
            return Ok(None);
        };
        block_on(py, &self.pending, move || async move {
            let change = async {
                loop {
                    if let Some(change) = changes.borrow_and_update().clone() {
                        return Some(describe(&change));
                    }
                    if changes.changed().await.is_err() {
                        return None; // the round ended on this side
                    }
                }
            };
            Ok(match timeout {
                Some(timeout) => tokio::time::timeout(timeout, change).await.ok().flatten(),
                None => change.await,
            })
        })
    }
}

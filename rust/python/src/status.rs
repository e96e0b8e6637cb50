//! `job_status(...)`: `elastix status`'s reading of a job, as the JSON report (`None`: the
//! store holds no such run); `job_runs(...)`: the runs a store holds; `job_dump(...)`: `elastix dump`'s stacks of a running job's
//! workers, likewise. Bounded by `timeout`; the GIL is released meanwhile.

use std::time::Duration;

use elastix_core::agent::hangs::dumps::job_dump as job_dump_of;
use elastix_core::rendezvous::status::StatusQuery;
use elastix_core::rendezvous::RendezvousError;
use elastix_core::rendezvous::{job_runs as read_runs, job_status as read_status};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::interrupt::PendingSignal;
use crate::rendezvous::to_py;
use crate::runtimes;

fn query(backend: String, endpoint: String, run_id: String, conf_json: &str, timeout: f64) -> PyResult<StatusQuery> {
    let conf =
        serde_json::from_str(conf_json).map_err(|err| PyValueError::new_err(format!("rendezvous conf: {err}")))?;
    let timeout = Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|timeout| !timeout.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("--timeout {timeout}: must be a positive number of seconds")))?;
    Ok(StatusQuery { backend, endpoint, run_id, conf, timeout })
}

/// Runs `work` on a runtime of its own with the GIL released; Ctrl-C ends it.
fn block_on<T: Send, F: std::future::Future<Output = Result<Option<T>, RendezvousError>> + Send>(
    py: Python<'_>,
    work: F,
) -> PyResult<Option<T>> {
    let pending = PendingSignal::default();
    let done =
        py.detach(|| Ok::<_, std::io::Error>(runtimes::interruptible(&runtimes::calling_thread()?, &pending, work)))?;
    match done {
        Some(result) => result.map_err(|err| to_py(err, &pending)),
        None => Err(pending.take().expect("an interrupt keeps its exception")),
    }
}

/// `conf_json`: the rendezvous configuration as `RendezvousCore` takes it.
#[pyfunction]
pub fn job_status(
    py: Python<'_>,
    backend: String,
    endpoint: String,
    run_id: String,
    conf_json: String,
    timeout: f64,
) -> PyResult<Option<String>> {
    let query = query(backend, endpoint, run_id, &conf_json, timeout)?;
    let status = block_on(py, read_status(&query))?;
    Ok(status.map(|status| serde_json::to_string(&status).expect("a status report serializes")))
}

/// The run IDs the store (or etcd cluster) at `endpoint` holds.
#[pyfunction]
pub fn job_runs(
    py: Python<'_>,
    backend: String,
    endpoint: String,
    conf_json: String,
    timeout: f64,
) -> PyResult<Vec<String>> {
    let query = query(backend, endpoint, String::new(), &conf_json, timeout)?;
    Ok(block_on(py, async { read_runs(&query).await.map(Some) })?.unwrap_or_default())
}

/// The stacks of a running job's workers (of global rank `rank`, if given), as JSON.
#[pyfunction]
#[pyo3(signature = (backend, endpoint, run_id, conf_json, rank, timeout))]
pub fn job_dump(
    py: Python<'_>,
    backend: String,
    endpoint: String,
    run_id: String,
    conf_json: String,
    rank: Option<u32>,
    timeout: f64,
) -> PyResult<Option<String>> {
    let query = query(backend, endpoint, run_id, &conf_json, timeout)?;
    Ok(block_on(py, job_dump_of(&query, rank))?.map(|dump| dump.to_string()))
}

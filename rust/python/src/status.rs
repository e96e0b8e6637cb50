//! `job_status(...)`: `elastix status`'s reading of a job, as the JSON report (`None`: the
//! store holds no such run). Bounded by `timeout`; the GIL is released meanwhile.

use std::time::Duration;

use elastix_core::rendezvous::status::{job_status as read_status, StatusQuery};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::interrupt::PendingSignal;
use crate::rendezvous::to_py;

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
    let conf =
        serde_json::from_str(&conf_json).map_err(|err| PyValueError::new_err(format!("rendezvous conf: {err}")))?;
    let timeout = Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|timeout| !timeout.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("--timeout {timeout}: must be a positive number of seconds")))?;
    let query = StatusQuery { backend, endpoint, run_id, conf, timeout };
    let status = py.detach(|| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok::<_, std::io::Error>(runtime.block_on(read_status(&query)))
    })?;
    match status {
        Ok(status) => Ok(status.map(|status| serde_json::to_string(&status).expect("a status report serializes"))),
        Err(err) => Err(to_py(err, &PendingSignal::default())),
    }
}

//! `run_agent(config_json) -> result_json`: runs an agent to the end on a runtime of its own,
//! with the GIL released. The agent handles the signals it is configured for itself.
//! `check_agent_config(config_json)`: the same checks, without running anything.
//! `failure_summary(name, failures_json)`: the agent's root-cause rule and summary.

use elastix_core::agent::failure::{self, Failure};
use elastix_core::agent::{run_agent as run, AgentConfig};

use crate::runtimes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Worker threads of the agent's runtime: its work is waiting on processes and sockets.
const AGENT_THREADS: usize = 2;

/// Raises ValueError (naming the flag) when the agent would refuse `config_json`.
#[pyfunction]
pub fn check_agent_config(config_json: &str) -> PyResult<()> {
    AgentConfig::from_json(config_json).map(drop).map_err(|err| PyValueError::new_err(err.to_string()))
}

/// Seconds in a duration's text as `--rdzv-conf` takes it (`30`, `30s`, `500ms`, `2m`);
/// ValueError otherwise.
#[pyfunction]
pub fn parse_duration(text: &str) -> PyResult<f64> {
    elastix_core::rendezvous::config::conf::parse_duration(text).map(|d| d.as_secs_f64()).map_err(PyValueError::new_err)
}

/// The root-cause summary of failures given as JSON (a list of the agent's failure objects):
/// `(text, index of the root cause)`; Python's ChildFailedError shows what the agent prints.
#[pyfunction]
pub fn failure_summary(name: &str, failures_json: &str) -> PyResult<(String, usize)> {
    let failures: Vec<Failure> =
        serde_json::from_str(failures_json).map_err(|err| PyValueError::new_err(format!("failures: {err}")))?;
    let root = failure::root_cause(&failures).ok_or_else(|| PyValueError::new_err("no failures"))?;
    Ok((failure::summary(name, &failures), root))
}

#[pyfunction]
pub fn run_agent(py: Python<'_>, config_json: &str) -> PyResult<String> {
    let config = AgentConfig::from_json(config_json).map_err(|err| PyValueError::new_err(err.to_string()))?;
    py.detach(|| {
        // Workers get a parent-death signal tied to the thread that started them, so the
        // runtime's threads must live as long as the agent: a runtime of its own per run.
        let runtime = runtimes::own("elastix-agent", AGENT_THREADS)?;
        let result = runtime.block_on(run(config));
        runtime.shutdown_timeout(runtimes::SHUTDOWN_WAIT);
        Ok(result.to_json())
    })
}

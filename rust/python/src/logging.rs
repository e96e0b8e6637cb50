//! One logging pipeline for the extension.
//!
//! * Library use (`import elastix`): no tracing subscriber is installed, so tracing turns the
//!   core's events into `log` records, and pyo3-log hands them to Python's `logging`, under
//!   the logger `elastix.<rust module path>` (e.g. `elastix.elastix_core.rendezvous.round`).
//!   pyo3-log caches loggers and their levels; `reset_log_cache()` picks up a changed
//!   logging configuration. Records pass the exit gate: once the interpreter is exiting,
//!   warnings and errors are written to stderr directly and the rest dropped.
//! * Command-line use (`elastix run`, `elastix-store`): `init_cli_logging(level)` installs the
//!   stderr subscriber of `elastix_core::logging` first, which from then on receives every
//!   event (tracing stops emitting `log` records once a subscriber exists).

use std::io::Write;
use std::sync::OnceLock;

use log::{Level, LevelFilter, Log, Metadata, Record};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3_log::{Caching, Logger, ResetHandle};

use crate::exit_gate::Pass;

static BRIDGE: OnceLock<ResetHandle> = OnceLock::new();

/// Installs the bridge to Python's `logging` (once per process; a second extension module or
/// another `log` logger keeps what it installed).
pub fn install_bridge(py: Python<'_>) -> PyResult<()> {
    if BRIDGE.get().is_some() {
        return Ok(());
    }
    let logger = Logger::new(py, Caching::LoggersAndLevels)?.set_prefix("elastix");
    let handle = logger.reset_handle();
    if log::set_boxed_logger(Box::new(GatedLogger(logger))).is_ok() {
        log::set_max_level(LevelFilter::Debug); // pyo3-log's own default; Python's levels filter further
        let _ = BRIDGE.set(handle);
    }
    Ok(())
}

/// pyo3-log behind the exit gate.
struct GatedLogger(Logger);

impl Log for GatedLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.0.enabled(metadata) // reads pyo3-log's cache only: no call into Python
    }

    fn log(&self, record: &Record<'_>) {
        match Pass::take() {
            Some(_pass) => self.0.log(record),
            None if record.level() <= Level::Warn => {
                let line = format!("elastix.{} {}: {}\n", record.target(), record.level(), record.args());
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
            None => {}
        }
    }

    fn flush(&self) {}
}

/// Forgets the cached Python loggers and levels (after `logging` was configured anew).
#[pyfunction]
pub fn reset_log_cache() {
    if let Some(handle) = BRIDGE.get() {
        handle.reset();
    }
}

/// Logs a line of the CLI's Python side through the core's stderr subscriber (one form for
/// every line).
#[pyfunction]
pub fn log_line(levelno: u32, message: &str) {
    elastix_core::logging::python_line(levelno, message);
}

/// Sends the core's events to stderr, filtered by `level` (or RUST_LOG); ValueError for a
/// level that is not one. Returns False when a subscriber was installed already.
/// `node`: the node the lines speak for (an agent's), named on each.
#[pyfunction]
#[pyo3(signature = (level, node=None))]
pub fn init_cli_logging(level: &str, node: Option<&str>) -> PyResult<bool> {
    if let Some(node) = node {
        elastix_core::logging::set_node_name(node);
    }
    elastix_core::logging::init_stderr(level).map_err(PyValueError::new_err)
}

//! `elastix._core`: Python bindings of elastix-core. This crate only converts types,
//! releases the GIL around every blocking call and maps errors to Python exceptions; the
//! Python package (`python/elastix`) builds the user-facing API on top.

mod agent;
mod auth;
mod buffer;
mod collectives;
mod errors;
mod exit_gate;
mod interrupt;
mod logging;
mod rendezvous;
mod rpc;
mod runtimes;
mod shm;
mod slot_steps;
mod status;
mod store;
mod store_cli;
mod timeout;

use pyo3::prelude::*;

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    // first, so that its atexit hook runs after every hook of the Python package
    exit_gate::register(module)?;
    // then, so that no event of the core is ever dropped
    logging::install_bridge(module.py())?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module
        .add("RENDEZVOUS_BACKENDS", pyo3::types::PyTuple::new(module.py(), elastix_core::agent::config::BACKENDS)?)?;
    module
        .add("COLLECTIVE_KINDS", pyo3::types::PyTuple::new(module.py(), elastix_core::agent::hangs::flight::KINDS)?)?;
    module.add_class::<store::StoreCore>()?;
    module.add_class::<rendezvous::RendezvousCore>()?;
    module.add_function(wrap_pyfunction!(store_cli::run_store_cli, module)?)?;
    module.add_function(wrap_pyfunction!(agent::run_agent, module)?)?;
    module.add_function(wrap_pyfunction!(agent::check_agent_config, module)?)?;
    module.add_function(wrap_pyfunction!(agent::parse_duration, module)?)?;
    module.add_function(wrap_pyfunction!(agent::failure_summary, module)?)?;
    module.add_function(wrap_pyfunction!(status::job_status, module)?)?;
    module.add_function(wrap_pyfunction!(status::job_runs, module)?)?;
    module.add_function(wrap_pyfunction!(status::job_dump, module)?)?;
    module.add_function(wrap_pyfunction!(logging::init_cli_logging, module)?)?;
    module.add_function(wrap_pyfunction!(logging::log_line, module)?)?;
    module.add_function(wrap_pyfunction!(logging::reset_log_cache, module)?)?;
    auth::register(module)?;
    collectives::register(module)?;
    rpc::register(module)?;
    Ok(())
}

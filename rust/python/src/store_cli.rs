//! The `elastix-store` console script runs the same command line as the Rust binary.

use pyo3::prelude::*;

/// Runs `elastix-store` with `argv` (program name first) until SIGTERM/SIGINT; returns the
/// exit code.
#[pyfunction]
pub fn run_store_cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| elastix_store::main_with_args(argv))
}

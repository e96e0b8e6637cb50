//! Store errors as the Python exceptions of `elastix.errors` (torch's hierarchy: DistError <
//! RuntimeError, DistStoreError and DistNetworkError < DistError, QueueEmptyError <
//! DistStoreError; elastix adds TimeoutError subclasses for every deadline).

use elastix_core::store::StoreError;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;

use crate::interrupt::PendingSignal;

pub fn to_py(err: StoreError, pending: &PendingSignal) -> PyErr {
    let message = err.to_string();
    let class = match err {
        StoreError::WaitTimeout { .. } | StoreError::BarrierTimeout { .. } | StoreError::WorkersTimeout { .. } => {
            "StoreTimeoutError"
        }
        StoreError::ConnectTimeout { .. } | StoreError::ReplyTimeout { .. } => "NetworkTimeoutError",
        StoreError::ConnectionLost { .. } | StoreError::NotAStore { .. } | StoreError::Listen(_) => "DistNetworkError",
        StoreError::Protocol { .. }
        | StoreError::InvalidArgument(_)
        | StoreError::File { .. }
        | StoreError::Runtime(_) => "DistStoreError",
        StoreError::QueueEmpty => "QueueEmptyError",
        StoreError::Auth { .. } => "AuthenticationError",
        StoreError::Interrupted => {
            return pending.take().unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted while waiting"));
        }
    };
    Python::attach(|py| store_error(py, class, &message))
}

/// `elastix.errors.raised(<class>, message)`: the class itself, or, once torch.distributed is
/// loaded, the one torch's `except` clauses catch as they catch torch's own stores' errors.
fn store_error(py: Python<'_>, class: &str, message: &str) -> PyErr {
    let made = (|| -> PyResult<Bound<'_, PyAny>> {
        let errors = py.import("elastix.errors")?;
        errors.getattr("raised")?.call1((errors.getattr(class)?, message))
    })();
    match made {
        Ok(instance) => PyErr::from_value(instance),
        Err(err) => err,
    }
}

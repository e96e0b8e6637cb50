//! Store errors as the Python exceptions of `elastix.errors` (torch's hierarchy: DistError <
//! RuntimeError, DistStoreError and DistNetworkError < DistError, QueueEmptyError <
//! DistStoreError; elastix adds TimeoutError subclasses for every deadline).

use elastix_core::store::StoreError;
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::{import_exception, PyErr};

use crate::interrupt::PendingSignal;

import_exception!(elastix.errors, DistStoreError);
import_exception!(elastix.errors, DistNetworkError);
import_exception!(elastix.errors, QueueEmptyError);
import_exception!(elastix.errors, StoreTimeoutError);
import_exception!(elastix.errors, NetworkTimeoutError);
import_exception!(elastix.errors, AuthenticationError);

pub fn to_py(err: StoreError, pending: &PendingSignal) -> PyErr {
    let message = err.to_string();
    match err {
        StoreError::WaitTimeout { .. } | StoreError::BarrierTimeout { .. } | StoreError::WorkersTimeout { .. } => {
            StoreTimeoutError::new_err(message)
        }
        StoreError::ConnectTimeout { .. } | StoreError::ReplyTimeout { .. } => NetworkTimeoutError::new_err(message),
        StoreError::ConnectionLost { .. } | StoreError::Listen(_) => DistNetworkError::new_err(message),
        StoreError::Protocol { .. } | StoreError::InvalidArgument(_) | StoreError::File { .. } => {
            DistStoreError::new_err(message)
        }
        StoreError::QueueEmpty => QueueEmptyError::new_err(message),
        StoreError::Auth { .. } => AuthenticationError::new_err(message),
        StoreError::Interrupted => {
            pending.take().unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted while waiting"))
        }
    }
}

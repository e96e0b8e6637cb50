//! Letting Ctrl-C through a blocking call that runs with the GIL released: the call asks
//! Python, now and then, whether a signal handler raised; the exception it raised is kept and
//! re-raised once the call has cleanly stopped waiting.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::{PyErr, Python};

/// How often a blocked call lets Python run its signal handlers.
pub const SIGNAL_CHECK_EVERY: Duration = Duration::from_millis(100);

#[derive(Clone, Default)]
pub struct PendingSignal(Arc<Mutex<Option<PyErr>>>);

impl PendingSignal {
    /// Runs Python's signal handlers; true if one raised (the exception is kept).
    pub fn raised(&self) -> bool {
        match Python::attach(|py| py.check_signals()) {
            Ok(()) => false,
            Err(err) => {
                *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(err);
                true
            }
        }
    }

    /// The exception a signal handler raised during the last call, if any.
    pub fn take(&self) -> Option<PyErr> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// Ends when a Python signal handler raised (checked every [`SIGNAL_CHECK_EVERY`]).
pub async fn interrupted(pending: &PendingSignal) {
    loop {
        tokio::time::sleep(SIGNAL_CHECK_EVERY).await;
        if pending.raised() {
            return;
        }
    }
}

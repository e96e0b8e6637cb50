//! Letting Ctrl-C through a blocking call that runs with the GIL released: the call asks
//! Python, now and then, whether a signal handler raised; the exception it raised is kept and
//! re-raised once the call has cleanly stopped waiting.

use std::sync::{Arc, Mutex, PoisonError};

use elastix_core::interrupt::Interrupt;
use pyo3::{PyErr, Python};

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

    /// What a blocked call asks (every [`elastix_core::interrupt::CHECK_EVERY`]): Python's
    /// signal handlers, whose exception is kept here.
    pub fn interrupt(&self) -> Interrupt {
        let pending = self.clone();
        Interrupt::new(move || pending.raised())
    }

    /// The exception a signal handler raised during the last call, if any.
    pub fn take(&self) -> Option<PyErr> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

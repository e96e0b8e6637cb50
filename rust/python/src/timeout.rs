//! Timeouts cross the boundary as float seconds: `None` or a negative number means no limit
//! (torch treats a negative timeout as infinite).

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

pub fn from_seconds(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_nan() => Err(PyValueError::new_err("timeout must be a number, got NaN")),
        Some(s) if s < 0.0 || s.is_infinite() => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|err| PyValueError::new_err(format!("invalid timeout {s}: {err}"))),
    }
}

pub fn to_seconds(timeout: Option<Duration>) -> Option<f64> {
    timeout.map(|t| t.as_secs_f64())
}

//! Calls into Python from threads that Python did not start: the store server's and the RPC
//! transport's tokio workers, the thread that drops Python objects, and the logging bridge on
//! any of them. Such a call is only sound while the interpreter lives: once `Py_Finalize` has
//! freed it, `PyGILState_Ensure` on such a thread dereferences the freed interpreter (a
//! process that finished its work then dies with SIGSEGV at exit, and its launcher reports a
//! crash).
//!
//! Every such call passes this gate. An `atexit` hook, registered when `elastix._core` is
//! imported, closes it: Python runs atexit hooks last-registered first, so the hooks of the
//! Python package (which stop its own threads) run before it, and all of them run before the
//! interpreter begins to finalise. From then on no call is let in, and the hook waits, with
//! the GIL released, for the calls already inside to leave.
//!
//! Atomics rather than a mutex: a process may fork while another thread holds the gate.
//!
//! The same threads may wait for the GIL at any time, so whatever stops them (a runtime's
//! drop waits for its threads) must run with the GIL released: [`drop_without_gil`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

static CLOSED: AtomicBool = AtomicBool::new(false);
static INSIDE: AtomicUsize = AtomicUsize::new(0);

/// How long the exit hook waits for calls already inside (a logging handler stuck on a lock
/// must not hold the process's exit for ever).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// How long a process that serves a store waits at exit for the other processes using it to
/// leave (rank 0 of a plain launch finishing first must not fail the others' last requests).
const STORE_LINGER_LIMIT: Duration = Duration::from_secs(3);

/// Held while a call into Python may run: the interpreter will not begin to finalise first.
pub struct Pass(());

impl Pass {
    /// A pass, or None once the interpreter is exiting.
    pub fn take() -> Option<Pass> {
        // SeqCst on both sides: either the closer sees this increment, or this sees CLOSED.
        INSIDE.fetch_add(1, Ordering::SeqCst);
        if CLOSED.load(Ordering::SeqCst) {
            INSIDE.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Pass(()))
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        INSIDE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `f` with the GIL, unless the interpreter is exiting (then None, and `f` is dropped
/// unrun: whatever it owns must be safe to drop without the GIL, or be leaked by the caller).
pub fn attach<R>(f: impl FnOnce(Python<'_>) -> R) -> Option<R> {
    let _pass = Pass::take()?;
    Some(Python::attach(f))
}

/// Drops `value` with the GIL released: for what owns threads that may be waiting for the GIL
/// (an in-process store server, a transport's runtime), dropped from a Python object's
/// deallocation, where the GIL is held. Holding it there would leave the drop waiting on
/// threads that wait on it, until the runtime's shutdown gives up on them.
pub fn drop_without_gil<T: Send>(value: T) {
    Python::attach(|py| py.detach(move || drop(value)));
}

/// The atexit hook: lets no further call in and waits (GIL released) for those inside, after
/// letting the other processes that use a store this one serves leave it. Returns False if
/// some calls were still inside after the limit.
#[pyfunction]
fn close_python_gate(py: Python<'_>) -> bool {
    CLOSED.store(true, Ordering::SeqCst);
    py.detach(|| {
        elastix_core::store::linger::wait_for_foreign_clients(STORE_LINGER_LIMIT);
        let deadline = Instant::now() + DRAIN_LIMIT;
        while INSIDE.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    })
}

/// Registers the hook with `atexit`; call first thing in the module's initialisation.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(close_python_gate, module)?;
    module.add_function(hook.clone())?;
    module.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

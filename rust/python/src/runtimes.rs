//! Every tokio runtime the bindings make, under one policy:
//!
//! * A call that needs no task running between Python calls runs on a current-thread runtime
//!   on the calling thread ([`calling_thread`]), with the GIL released: a status or dump
//!   query (a runtime for the query). A TCPStore connection is the same, its runtime made by
//!   the core (`elastix_core::store::BlockingTcpStore`), since its socket belongs to it.
//! * Handlers whose background tasks (heartbeats, watchers) must run between Python calls
//!   share one multi-thread runtime ([`shared`], two threads, made on first use).
//! * A long-lived engine gets a multi-thread runtime of its own ([`own`]), sized for its work
//!   and shut down within [`SHUTDOWN_WAIT`] when it ends: an agent's run (its workers'
//!   parent-death signal is tied to the threads that start them), an RPC endpoint.
//!
//! Every wait lets Ctrl-C through: it asks one [`elastix_core::interrupt::Interrupt`], made
//! by [`PendingSignal::interrupt`] (Python's signal handlers; see [`interruptible`] for a
//! future), and the exception a handler raised is raised once the wait has stopped.

use std::future::Future;
use std::io;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::runtime::{Builder, Runtime};

use crate::interrupt::PendingSignal;

/// How long an engine's runtime may take to stop its tasks when the engine ends.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

/// A current-thread runtime for calls made on the calling thread.
pub fn calling_thread() -> io::Result<Runtime> {
    Builder::new_current_thread().enable_all().build()
}

/// The runtime the rendezvous handlers share.
pub fn shared() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| own("elastix-rdzv", 2).expect("cannot start the rendezvous runtime"))
}

/// A multi-thread runtime of its own for an engine, its threads named `name`.
pub fn own(name: &str, threads: usize) -> io::Result<Runtime> {
    Builder::new_multi_thread().worker_threads(threads).thread_name(name).enable_all().build()
}

/// Runs `future` on `runtime` until it ends (`Some`) or a Python signal handler raises
/// (`None`: the exception is in `pending`). Call it with the GIL released.
pub fn interruptible<F: Future>(runtime: &Runtime, pending: &PendingSignal, future: F) -> Option<F::Output> {
    runtime.block_on(pending.interrupt().run(future))
}

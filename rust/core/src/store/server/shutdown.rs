//! The server-wide stop signal every task listens to.
//!
//! Every connection's task holds a `recv` future for its whole life, so the signal is a flag
//! and a `Notify` (a wait on it is one intrusive list node) rather than a `watch` channel,
//! whose wait is twice the size.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

#[derive(Debug, Default)]
struct Signal {
    stopped: AtomicBool,
    notify: Notify,
}

/// The server's end: stopping (or dropping it) tells every [`Shutdown`] once.
#[derive(Debug)]
pub(super) struct Stop(Arc<Signal>);

impl Stop {
    pub(super) fn new() -> (Stop, Shutdown) {
        let signal = Arc::new(Signal::default());
        (Stop(signal.clone()), Shutdown { stopped: false, signal })
    }

    pub(super) fn stop(&self) {
        self.0.stopped.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }
}

impl Drop for Stop {
    fn drop(&mut self) {
        self.stop(); // the owner is gone: that is a request to stop too
    }
}

/// Fires once when the server is asked to stop (or its owner is gone).
#[derive(Clone, Debug)]
pub(super) struct Shutdown {
    stopped: bool,
    signal: Arc<Signal>,
}

impl Shutdown {
    /// Completes when shutdown has been requested; at once on later calls.
    pub(super) async fn recv(&mut self) {
        while !self.stopped {
            // registered before the flag is read, so a stop between the two is not missed
            let notified = self.signal.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.signal.stopped.load(Ordering::Acquire) {
                self.stopped = true;
            } else {
                notified.await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_listener_sees_a_stop_whether_it_waits_already_or_comes_later() {
        let (stop, mut early) = Stop::new();
        let mut late = early.clone();
        let waiting = tokio::spawn(async move { early.recv().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        stop.stop();
        waiting.await.unwrap();
        late.recv().await; // after the stop: at once
        late.recv().await; // and again
    }

    #[tokio::test]
    async fn dropping_the_stop_stops() {
        let (stop, mut shutdown) = Stop::new();
        drop(stop);
        shutdown.recv().await;
    }
}

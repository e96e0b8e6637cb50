//! The server-wide stop signal every task listens to.

use tokio::sync::watch;

/// Fires once when the server is asked to stop (or its owner is gone).
#[derive(Clone, Debug)]
pub(super) struct Shutdown {
    stopped: bool,
    signal: watch::Receiver<bool>,
}

impl Shutdown {
    pub(super) fn new(signal: watch::Receiver<bool>) -> Self {
        Shutdown { stopped: false, signal }
    }

    /// Completes when shutdown has been requested; at once on later calls.
    pub(super) async fn recv(&mut self) {
        if !self.stopped {
            // An error means the sender is gone, which is also a request to stop.
            let _ = self.signal.wait_for(|stop| *stop).await;
            self.stopped = true;
        }
    }
}

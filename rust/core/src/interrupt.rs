//! Letting a caller stop a blocked call: every wait of the store, the shared-memory
//! collectives and RPC asks one [`Interrupt`] now and then whether to stop (Python's bindings
//! answer with its signal handlers, so Ctrl-C ends a wait), at one interval.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How often a blocked call asks whether to stop, at the latest.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);

/// The question a blocked call asks every [`CHECK_EVERY`]: should it stop now?
#[derive(Clone)]
pub struct Interrupt(Option<Arc<dyn Fn() -> bool + Send + Sync>>);

impl Interrupt {
    pub fn new(check: impl Fn() -> bool + Send + Sync + 'static) -> Interrupt {
        Interrupt(Some(Arc::new(check)))
    }

    /// A call nothing stops but its own end (or timeout).
    pub fn never() -> Interrupt {
        Interrupt(None)
    }

    /// Whether the call should stop now.
    pub fn raised(&self) -> bool {
        self.0.as_ref().is_some_and(|check| check())
    }

    /// Ends once the call should stop (never, for [`Interrupt::never`]).
    pub async fn wait(&self) {
        if self.0.is_none() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            if self.raised() {
                return;
            }
        }
    }

    /// `future`'s output, or `None` if the call had to stop first.
    pub async fn run<F: Future>(&self, future: F) -> Option<F::Output> {
        tokio::select! {
            output = future => Some(output),
            _ = self.wait() => None,
        }
    }
}

impl Default for Interrupt {
    fn default() -> Interrupt {
        Interrupt::never()
    }
}

impl fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Interrupt" } else { "Interrupt::never" })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_raised_check_stops_a_future_that_never_ends() {
        let stop = Arc::new(AtomicBool::new(false));
        let interrupt = Interrupt::new({
            let stop = stop.clone();
            move || stop.load(Ordering::SeqCst)
        });
        stop.store(true, Ordering::SeqCst);
        assert_eq!(interrupt.run(std::future::pending::<()>()).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_that_ends_gives_its_output() {
        let interrupt = Interrupt::new(|| false);
        assert_eq!(interrupt.run(async { 7 }).await, Some(7));
        assert_eq!(Interrupt::never().run(async { 8 }).await, Some(8));
        assert!(!Interrupt::never().raised());
    }
}

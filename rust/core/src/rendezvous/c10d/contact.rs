//! This node's contact with the rendezvous store while it is a member of a round, as seen by
//! its background tasks: when a request last succeeded, and since when requests fail.
//!
//! Two decisions rest on it: a node out of contact for as long as the others take to count it
//! lost stops its workers (the others re-form without it); and a silent neighbour is blamed
//! only if the store answered this node throughout the silence (a stalled or restarting store
//! silences everyone, and blaming whoever happens to be the neighbour would be wrong).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub(crate) struct Contact {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    last_ok: Instant,
    /// The first failure since the last success.
    failing_since: Option<Instant>,
    /// The last failure at all.
    last_failure: Option<Instant>,
}

impl Contact {
    pub fn new(now: Instant) -> Contact {
        Contact { state: Mutex::new(State { last_ok: now, failing_since: None, last_failure: None }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // the state is three instants, valid whatever a panicking holder left
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A request succeeded at `now`. Returns how long contact was lost, if it was.
    pub fn succeeded(&self, now: Instant) -> Option<Duration> {
        let mut state = self.state();
        let outage = state.failing_since.take().map(|_| now.saturating_duration_since(state.last_ok));
        state.last_ok = now;
        outage
    }

    /// A request failed (or the store did not answer in time) at `now`. Returns how long the
    /// store has not answered, and whether this is the first failure since a success.
    pub fn failed(&self, now: Instant) -> (Duration, bool) {
        let mut state = self.state();
        let first = state.failing_since.is_none();
        state.failing_since.get_or_insert(now);
        state.last_failure = Some(now);
        (now.saturating_duration_since(state.last_ok), first)
    }

    /// Whether a request of this node succeeded within `recent` of `now`: a store that stalls
    /// (an election, a stopped host) holds requests before any of them fails.
    pub fn answered_within(&self, now: Instant, recent: Duration) -> bool {
        now.saturating_duration_since(self.state().last_ok) <= recent
    }

    /// Whether the store answered this node without a failure since `start`.
    pub fn undisturbed_since(&self, start: Instant) -> bool {
        let state = self.state();
        state.failing_since.is_none() && state.last_failure.map_or(true, |failure| failure < start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_measured_from_the_last_success() {
        let t0 = Instant::now();
        let contact = Contact::new(t0);
        assert_eq!(contact.succeeded(t0 + Duration::from_secs(1)), None);
        assert_eq!(contact.failed(t0 + Duration::from_secs(2)), (Duration::from_secs(1), true));
        assert_eq!(contact.failed(t0 + Duration::from_secs(5)), (Duration::from_secs(4), false));
        assert_eq!(contact.succeeded(t0 + Duration::from_secs(6)), Some(Duration::from_secs(5)));
        assert_eq!(contact.succeeded(t0 + Duration::from_secs(7)), None);
    }

    #[test]
    fn a_stall_shows_as_an_old_success_before_any_failure() {
        let t0 = Instant::now();
        let contact = Contact::new(t0);
        assert!(contact.answered_within(t0 + Duration::from_secs(1), Duration::from_secs(1)));
        assert!(!contact.answered_within(t0 + Duration::from_secs(2), Duration::from_secs(1)));
        contact.succeeded(t0 + Duration::from_secs(2));
        assert!(contact.answered_within(t0 + Duration::from_secs(2), Duration::from_secs(1)));
    }

    #[test]
    fn a_window_is_undisturbed_only_without_failures_in_it() {
        let t0 = Instant::now();
        let contact = Contact::new(t0);
        assert!(contact.undisturbed_since(t0));
        contact.failed(t0 + Duration::from_secs(2));
        assert!(!contact.undisturbed_since(t0 + Duration::from_secs(1)));
        contact.succeeded(t0 + Duration::from_secs(3));
        // the failure is before a window that starts later
        assert!(contact.undisturbed_since(t0 + Duration::from_secs(3)));
        assert!(!contact.undisturbed_since(t0 + Duration::from_secs(1)));
    }
}

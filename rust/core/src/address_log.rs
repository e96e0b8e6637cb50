//! Warnings about what a peer did (a refused connection, one closed on an error), said at most
//! once a minute per address: a flood of connections must not flood the log as well, while an
//! operator still sees every address that knocked, with a running count. [`Throttled`] does
//! the same for events with no address (an accept that failed: out of descriptors).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// An address's events are said at WARN at most this often.
pub const SAY_EVERY: Duration = Duration::from_secs(60);
/// Addresses remembered; past this many the oldest are forgotten (a flood from many addresses
/// must not grow the server's memory without bound).
const REMEMBERED: usize = 4096;

#[derive(Default)]
pub struct AddressLog {
    count: AtomicU64,
    /// When each address was last said at WARN.
    said: Mutex<HashMap<IpAddr, Instant>>,
}

impl AddressLog {
    pub fn new() -> AddressLog {
        AddressLog::default()
    }

    /// Counts one event from `ip`. `Some(count so far)` when it is to be said at WARN (the
    /// first from this address in [`SAY_EVERY`]); `None`: say it at DEBUG only.
    pub fn note(&self, ip: IpAddr) -> Option<u64> {
        // a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d: one address, one entry
        let ip = ip.to_canonical();
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let mut said = self.said.lock().unwrap_or_else(PoisonError::into_inner);
        if said.get(&ip).is_some_and(|last| now.duration_since(*last) < SAY_EVERY) {
            return None;
        }
        if said.len() >= REMEMBERED {
            said.retain(|_, last| now.duration_since(*last) < SAY_EVERY);
            if said.len() >= REMEMBERED {
                said.clear(); // a flood from many addresses: say each again rather than grow
            }
        }
        said.insert(ip, now);
        Some(count)
    }

    /// Events noted so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// One kind of event said at WARN at most once per [`SAY_EVERY`], whatever else happens in
/// between (a success does not reset it): a burst of them that lasts floods no log.
#[derive(Default)]
pub struct Throttled {
    /// When it was last said, and how many happened since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttled {
    pub fn new() -> Throttled {
        Throttled::default()
    }

    /// Counts one event. `Some(how many were not said since the last time)` when it is to be
    /// said at WARN now; `None`: say it at DEBUG only.
    pub fn note(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (last, unsaid) = &mut *state;
        if last.is_some_and(|last| now.duration_since(last) < SAY_EVERY) {
            *unsaid += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(unsaid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lasting_burst_is_said_once_a_minute_with_what_went_unsaid() {
        let throttled = Throttled::new();
        assert_eq!(throttled.note(), Some(0));
        assert!((0..3000).all(|_| throttled.note().is_none()), "50 a second for a minute: one line");
        tokio::time::advance(SAY_EVERY).await;
        assert_eq!(throttled.note(), Some(3000));
        assert_eq!(throttled.note(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn says_each_address_once_a_minute_and_counts_all() {
        let log = AddressLog::new();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert_eq!(log.note(a), Some(1));
        assert!((0..1000).all(|_| log.note(a).is_none()), "one address, one line a minute");
        assert_eq!(log.note(b), Some(1002), "another address is said at once, with the count");
        assert_eq!(log.note("::ffff:10.0.0.1".parse().unwrap()), None, "the same address, mapped");
        tokio::time::advance(SAY_EVERY).await;
        assert_eq!(log.note(a), Some(1004));
        assert_eq!(log.count(), 1004);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_from_many_addresses_does_not_grow_memory() {
        let log = AddressLog::new();
        for i in 0..3 * REMEMBERED as u32 {
            log.note(IpAddr::from(i.to_be_bytes()));
        }
        assert!(log.said.lock().unwrap().len() <= REMEMBERED);
    }
}

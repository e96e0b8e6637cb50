//! Who is blocked in WAIT or BARRIER, on which keys, and how to wake them.
//!
//! The rules are torch's: a waiter counts the keys that were missing when it registered (a key
//! named twice counts twice); every write to one of them decrements the count, and at zero the
//! waiter gets its STOP_WAITING. A queue push satisfies only the first waiter it completes.
//! Nothing here has a timer: clients enforce their own timeouts with CANCEL_WAIT.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// Identifies one waiting party: a client connection, or an in-process watcher.
pub type WaiterId = u64;

/// How a waiter is told it may stop waiting: a count of its completed waits, and a wake-up
/// for the task that answers them. Every connection has one, so it is small: 48 bytes of
/// heap (a tokio channel, which this was, takes 544, a fifth of an idle client's cost).
#[derive(Clone, Debug, Default)]
pub struct Waker(Arc<Signal>);

#[derive(Debug, Default)]
struct Signal {
    completed: AtomicUsize,
    notify: Notify,
}

impl Waker {
    /// One more of the party's waits completed.
    pub fn wake(&self) {
        self.0.completed.fetch_add(1, Ordering::AcqRel);
        self.0.notify.notify_one(); // kept as a permit when nobody awaits `woken` now
    }

    /// How many waits completed since the last `take` (and forgets them).
    pub fn take(&self) -> usize {
        self.0.completed.swap(0, Ordering::AcqRel)
    }

    /// Completes after a `wake` (possibly one whose count was taken already: then `take`
    /// says 0). Smaller than `woken`, for a future every connection holds.
    pub fn notified(&self) -> Notified<'_> {
        self.0.notify.notified()
    }

    /// Completes with `take`'s count once it is not zero. Cancel safe: a count is taken only
    /// by a call that returns it.
    pub async fn woken(&self) -> usize {
        loop {
            let completed = self.take();
            if completed > 0 {
                return completed;
            }
            self.0.notify.notified().await;
        }
    }
}

#[derive(Debug, Default)]
pub struct Waiters {
    by_key: HashMap<Bytes, VecDeque<WaiterId>>,
    pending: HashMap<WaiterId, Pending>,
    /// The parties whose waits completed since the last [`Waiters::take_completed`], for a
    /// server that finds the connection to answer by its id (io_uring's loop) rather than by
    /// a wake-up; `None` where nobody asks.
    completed: Option<Vec<WaiterId>>,
}

#[derive(Debug)]
struct Pending {
    outstanding: usize,
    keys: Vec<Bytes>,
    waker: Waker,
}

/// A party may have one wait in flight; torch clients never send a second WAIT before the
/// first is answered or cancelled.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("a wait is already pending on this connection")]
pub struct AlreadyWaiting;

impl Waiters {
    /// Waiters that also list the ids of completed waits (see [`Waiters::take_completed`]).
    pub fn listing_completed() -> Waiters {
        Waiters { completed: Some(Vec::new()), ..Waiters::default() }
    }

    /// Moves the ids of the waits completed since the last call into `into` (nothing unless
    /// made [`Waiters::listing_completed`]).
    pub fn take_completed(&mut self, into: &mut Vec<WaiterId>) {
        if let Some(completed) = self.completed.as_mut() {
            into.append(completed);
        }
    }

    /// Registers `id` as waiting until each key in `missing` has been written (duplicates
    /// count once per occurrence). `missing` must not be empty.
    pub fn register(&mut self, id: WaiterId, missing: &[&[u8]], waker: Waker) -> Result<(), AlreadyWaiting> {
        debug_assert!(!missing.is_empty());
        if self.pending.contains_key(&id) {
            return Err(AlreadyWaiting);
        }
        let mut keys = Vec::with_capacity(missing.len());
        for key in missing {
            let key = match self.by_key.get_key_value(*key) {
                Some((stored, _)) => stored.clone(),
                None => Bytes::copy_from_slice(key),
            };
            self.by_key.entry(key.clone()).or_default().push_back(id);
            keys.push(key);
        }
        self.pending.insert(id, Pending { outstanding: missing.len(), keys, waker });
        Ok(())
    }

    pub fn is_waiting(&self, id: WaiterId) -> bool {
        self.pending.contains_key(&id)
    }

    /// Number of parties currently waiting.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// `key` was written: every waiter on it counts one key less.
    pub fn key_written(&mut self, key: &[u8]) {
        let Some(ids) = self.by_key.remove(key) else { return };
        for id in ids {
            self.count_down(id);
        }
    }

    /// An item was pushed to the queue `key`: waiters on it count down in arrival order until
    /// one of them completes; that one is woken and the rest keep waiting.
    pub fn item_pushed(&mut self, key: &[u8]) {
        let Some(ids) = self.by_key.get_mut(key) else { return };
        let mut woken = false;
        while let Some(id) = ids.pop_front() {
            if let Some(pending) = self.pending.get_mut(&id) {
                pending.outstanding -= 1;
                if pending.outstanding == 0 {
                    complete(&mut self.pending, &mut self.completed, id);
                    woken = true;
                }
            }
            if woken {
                break;
            }
        }
        if self.by_key.get(key).is_some_and(VecDeque::is_empty) {
            self.by_key.remove(key);
        }
    }

    /// Drops the wait of `id`, if any (CANCEL_WAIT, or the connection closed). Returns whether
    /// a wait was pending.
    pub fn cancel(&mut self, id: WaiterId) -> bool {
        let Some(pending) = self.pending.remove(&id) else { return false };
        for key in pending.keys {
            if let Some(ids) = self.by_key.get_mut(&key) {
                ids.retain(|other| *other != id);
                if ids.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
        true
    }

    fn count_down(&mut self, id: WaiterId) {
        let Some(pending) = self.pending.get_mut(&id) else { return };
        pending.outstanding -= 1;
        if pending.outstanding == 0 {
            complete(&mut self.pending, &mut self.completed, id);
        }
    }

    /// Number of (key, waiter) registrations still held, for leak checks in tests.
    #[cfg(test)]
    fn registrations(&self) -> usize {
        self.by_key.values().map(VecDeque::len).sum()
    }
}

/// The wait of `id` is over: it is woken, and listed where completions are.
fn complete(pending: &mut HashMap<WaiterId, Pending>, completed: &mut Option<Vec<WaiterId>>, id: WaiterId) {
    let pending = pending.remove(&id).expect("present");
    pending.waker.wake();
    if let Some(completed) = completed.as_mut() {
        completed.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter() -> (Waker, Waker) {
        let waker = Waker::default();
        (waker.clone(), waker)
    }

    fn woken(rx: &mut Waker) -> bool {
        rx.take() > 0
    }

    #[tokio::test]
    async fn woken_counts_every_wake_since_the_last_take_and_a_stale_permit_is_no_wake() {
        let waker = Waker::default();
        waker.wake();
        waker.wake();
        assert_eq!(waker.woken().await, 2);
        assert_eq!(waker.take(), 0);
        let other = waker.clone();
        let later = tokio::spawn(async move { other.woken().await });
        tokio::task::yield_now().await; // it consumed the stale permit and waits again
        assert!(!later.is_finished());
        waker.wake();
        assert_eq!(later.await.unwrap(), 1);
    }

    #[test]
    fn a_waiter_wakes_once_every_missing_key_is_written() {
        let mut waiters = Waiters::default();
        let (tx, mut rx) = waiter();
        waiters.register(1, &[b"a", b"b"], tx).unwrap();
        waiters.key_written(b"a");
        assert!(!woken(&mut rx));
        waiters.key_written(b"a"); // the same key again does not count twice
        assert!(!woken(&mut rx));
        waiters.key_written(b"b");
        assert!(woken(&mut rx));
        assert!(waiters.is_empty());
        assert_eq!(waiters.registrations(), 0);
    }

    #[test]
    fn a_duplicated_key_is_satisfied_by_one_write() {
        let mut waiters = Waiters::default();
        let (tx, mut rx) = waiter();
        waiters.register(1, &[b"k", b"k"], tx).unwrap();
        waiters.key_written(b"k");
        assert!(woken(&mut rx));
    }

    #[test]
    fn a_second_wait_on_the_same_connection_is_refused() {
        let mut waiters = Waiters::default();
        waiters.register(1, &[b"a"], waiter().0).unwrap();
        assert_eq!(waiters.register(1, &[b"b"], waiter().0), Err(AlreadyWaiting));
    }

    #[test]
    fn cancel_leaves_nothing_behind() {
        let mut waiters = Waiters::default();
        let (tx, mut rx) = waiter();
        waiters.register(1, &[b"a", b"b", b"a"], tx).unwrap();
        waiters.register(2, &[b"a"], waiter().0).unwrap();
        assert!(waiters.cancel(1));
        assert!(!waiters.cancel(1));
        assert_eq!(waiters.registrations(), 1);
        waiters.key_written(b"a");
        waiters.key_written(b"b");
        assert!(!woken(&mut rx));
        assert!(waiters.is_empty());
        assert_eq!(waiters.registrations(), 0);
    }

    #[test]
    fn a_push_wakes_one_waiter_in_arrival_order() {
        let mut waiters = Waiters::default();
        let (tx1, mut rx1) = waiter();
        let (tx2, mut rx2) = waiter();
        waiters.register(1, &[b"q"], tx1).unwrap();
        waiters.register(2, &[b"q"], tx2).unwrap();
        waiters.item_pushed(b"q");
        assert!(woken(&mut rx1));
        assert!(!woken(&mut rx2));
        waiters.item_pushed(b"q");
        assert!(woken(&mut rx2));
        assert_eq!(waiters.registrations(), 0);
    }

    #[test]
    fn completed_waits_are_listed_once_where_asked_and_a_cancelled_one_never() {
        let mut waiters = Waiters::listing_completed();
        waiters.register(1, &[b"a"], waiter().0).unwrap();
        waiters.register(2, &[b"a", b"b"], waiter().0).unwrap();
        waiters.register(3, &[b"q"], waiter().0).unwrap();
        waiters.register(4, &[b"a"], waiter().0).unwrap();
        waiters.cancel(4);
        waiters.key_written(b"a");
        waiters.item_pushed(b"q");
        let mut completed = Vec::new();
        waiters.take_completed(&mut completed);
        assert_eq!(completed, [1, 3]);
        waiters.key_written(b"b");
        waiters.take_completed(&mut completed);
        assert_eq!(completed, [1, 3, 2]);
        waiters.take_completed(&mut completed);
        assert_eq!(completed.len(), 3, "each once");
        let mut unlisted = Waiters::default();
        unlisted.register(1, &[b"a"], waiter().0).unwrap();
        unlisted.key_written(b"a");
        unlisted.take_completed(&mut completed);
        assert_eq!(completed.len(), 3);
    }

    #[test]
    fn a_push_counts_down_waiters_it_does_not_complete() {
        let mut waiters = Waiters::default();
        let (tx1, mut rx1) = waiter();
        let (tx2, mut rx2) = waiter();
        waiters.register(1, &[b"q", b"other"], tx1).unwrap();
        waiters.register(2, &[b"q"], tx2).unwrap();
        waiters.item_pushed(b"q");
        assert!(!woken(&mut rx1));
        assert!(woken(&mut rx2));
        waiters.key_written(b"other");
        assert!(woken(&mut rx1));
    }
}

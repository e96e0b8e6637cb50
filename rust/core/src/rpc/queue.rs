//! A queue that plain threads (Python's RPC threads, with the GIL released) wait on, and
//! that the transport's tasks fill without ever waiting.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::interrupt::{Interrupt, CHECK_EVERY};

pub struct BlockingQueue<T> {
    state: Mutex<(VecDeque<T>, bool)>,
    ready: Condvar,
}

impl<T> Default for BlockingQueue<T> {
    fn default() -> Self {
        BlockingQueue { state: Mutex::new((VecDeque::new(), false)), ready: Condvar::new() }
    }
}

/// Why `pop` returned nothing.
#[derive(Debug, PartialEq, Eq)]
pub enum Empty {
    TimedOut,
    Closed,
}

impl<T> BlockingQueue<T> {
    /// Adds `item`; false (and `item` dropped) once the queue is closed.
    pub fn push(&self, item: T) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.1 {
            return false;
        }
        state.0.push_back(item);
        drop(state);
        self.ready.notify_one();
        true
    }

    /// The next item, waiting up to `wait`. What is queued is still handed out after `close`.
    pub fn pop(&self, wait: Duration) -> Result<T, Empty> {
        if let Some(item) = spin(|| self.state.lock().unwrap_or_else(PoisonError::into_inner).0.pop_front()) {
            return Ok(item);
        }
        let deadline = Instant::now() + wait;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(item) = state.0.pop_front() {
                return Ok(item);
            }
            if state.1 {
                return Err(Empty::Closed);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Empty::TimedOut);
            }
            state = self.ready.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// No more items are taken; every waiter wakes.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        self.ready.notify_all();
    }
}

/// How long a waiter polls before it sleeps: an answer that comes within this time is taken
/// without the cost of waking a sleeping thread, which dominates a round trip on loopback.
const SPIN: Duration = Duration::from_micros(50);

/// Polls `ready` for up to [`SPIN`], yielding the CPU between polls.
pub fn spin<T>(mut ready: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(item) = ready() {
            return Some(item);
        }
        if start.elapsed() >= SPIN {
            return None;
        }
        std::thread::yield_now();
    }
}

/// How [`wait_on`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited<T> {
    Got(T),
    /// The sender was dropped.
    Gone,
    TimedOut,
    Interrupted,
}

/// Waits for the message on `rx`, up to `timeout` (None: no limit), polling briefly first
/// ([`spin`]) and asking `interrupt` every [`CHECK_EVERY`] whether to give up (Ctrl-C).
pub fn wait_on<T>(rx: &Receiver<T>, timeout: Option<Duration>, interrupt: &Interrupt) -> Waited<T> {
    if let Some(item) = spin(|| rx.try_recv().ok()) {
        return Waited::Got(item);
    }
    let deadline = timeout.map(|timeout| Instant::now() + timeout);
    loop {
        let left = deadline.map_or(CHECK_EVERY, |d| d.saturating_duration_since(Instant::now()));
        match rx.recv_timeout(left.min(CHECK_EVERY)) {
            Ok(item) => return Waited::Got(item),
            Err(RecvTimeoutError::Disconnected) => return Waited::Gone,
            Err(RecvTimeoutError::Timeout) => {}
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Waited::TimedOut;
        }
        if interrupt.raised() {
            return Waited::Interrupted;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_channel_wait_ends_with_the_message_its_loss_the_deadline_or_an_interrupt() {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        tx.send(7).unwrap();
        assert_eq!(wait_on(&rx, None, &Interrupt::never()), Waited::Got(7));
        assert_eq!(wait_on(&rx, Some(Duration::from_millis(1)), &Interrupt::never()), Waited::TimedOut);
        assert_eq!(wait_on(&rx, None, &Interrupt::new(|| true)), Waited::Interrupted);
        drop(tx);
        assert_eq!(wait_on(&rx, None, &Interrupt::never()), Waited::Gone);
    }

    #[test]
    fn waiters_get_items_then_learn_it_is_closed() {
        let queue = Arc::new(BlockingQueue::default());
        let waiter = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.pop(Duration::from_secs(10)))
        };
        assert!(queue.push(1));
        assert_eq!(waiter.join().unwrap(), Ok(1));
        assert_eq!(queue.pop(Duration::from_millis(1)), Err(Empty::TimedOut));
        queue.push(2);
        queue.close();
        assert!(!queue.push(3));
        assert_eq!(queue.pop(Duration::from_secs(10)), Ok(2));
        assert_eq!(queue.pop(Duration::from_secs(10)), Err(Empty::Closed));
    }
}

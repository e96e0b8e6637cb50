//! A queue that plain threads (Python's RPC threads, with the GIL released) wait on, and
//! that the transport's tasks fill without ever waiting.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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

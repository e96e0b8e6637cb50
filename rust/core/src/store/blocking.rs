//! Stores used from plain threads, without a network: the in-process [`LocalStore`] (torch's
//! `HashStore`) and the file-backed store (torch's `FileStore`). They implement a few
//! non-blocking primitives; the waiting operations (with timeouts and an interrupt check) are
//! written once here on top of them.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::error::{Result, StoreError};
use crate::interrupt::{Interrupt, CHECK_EVERY};

/// Keys and values are opaque bytes, as the user gave them (the file store adds torch's key
/// prefix in its file only). Every method may be called from several threads at once.
pub trait BlockingStore: Send + Sync {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()>;
    /// The value, or `None` if the key is missing; never waits.
    fn get_now(&self, key: &[u8]) -> Result<Option<Bytes>>;
    fn add(&self, key: &[u8], delta: i64) -> Result<i64>;
    /// torch's COMPARE_SET rules (see [`super::data::KvState::compare_set`]).
    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes>;
    /// Whether every key exists (or names a non-empty queue).
    fn check(&self, keys: &[&[u8]]) -> Result<bool>;
    fn delete_key(&self, key: &[u8]) -> Result<bool>;
    fn num_keys(&self) -> Result<i64>;
    fn append(&self, key: &[u8], value: &[u8]) -> Result<()>;
    fn multi_set(&self, pairs: &[(&[u8], &[u8])]) -> Result<()>;
    fn list_keys(&self) -> Result<Vec<Bytes>>;
    fn queue_push(&self, key: &[u8], value: &[u8]) -> Result<()>;
    /// The oldest item, or `None` if the queue is empty; never waits.
    fn queue_pop_now(&self, key: &[u8]) -> Result<Option<Bytes>>;
    fn queue_len(&self, key: &[u8]) -> Result<i64>;

    /// Blocks for at most `slice`, returning early once the store may have changed in a way
    /// that matters to `keys`. Spurious returns are fine: callers re-check.
    fn wait_for_change(&self, keys: &[&[u8]], slice: Duration) -> Result<()>;

    /// Blocks until every key exists, up to `timeout` (`None`: no limit). `interrupt` is
    /// asked at least every [`CHECK_EVERY`]; returning true ends the wait with
    /// [`StoreError::Interrupted`].
    fn wait(&self, keys: &[&[u8]], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.check(keys)? {
                return Ok(());
            }
            let slice = match timeout {
                None => CHECK_EVERY,
                Some(timeout) => match timeout.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left.min(CHECK_EVERY),
                    _ => {
                        return Err(StoreError::WaitTimeout {
                            timeout,
                            keys: keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect(),
                        })
                    }
                },
            };
            self.wait_for_change(keys, slice)?;
            if interrupt.raised() {
                return Err(StoreError::Interrupted);
            }
        }
    }

    /// Waits for `key`, then reads it.
    fn get(&self, key: &[u8], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Bytes> {
        loop {
            self.wait(&[key], timeout, interrupt)?;
            // deleted again between the wait and the read: wait again
            if let Some(value) = self.get_now(key)? {
                return Ok(value);
            }
        }
    }

    /// Waits for every key, then reads them all.
    fn multi_get(&self, keys: &[&[u8]], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Vec<Bytes>> {
        self.wait(keys, timeout, interrupt)?;
        keys.iter().map(|key| Ok(self.get_now(key)?.unwrap_or_default())).collect()
    }

    /// Pops the oldest item; a blocking pop waits for one first.
    fn queue_pop(&self, key: &[u8], block: bool, timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Bytes> {
        let start = Instant::now();
        loop {
            if let Some(item) = self.queue_pop_now(key)? {
                return Ok(item);
            }
            if !block {
                return Err(StoreError::QueueEmpty);
            }
            // another consumer may take the item we were woken for: wait again, same deadline
            let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
            self.wait(&[key], left, interrupt).map_err(|err| match err {
                StoreError::WaitTimeout { keys, .. } => {
                    StoreError::WaitTimeout { timeout: timeout.unwrap_or_default(), keys }
                }
                other => other,
            })?;
        }
    }
}

//! An in-process store (torch's `HashStore`): the same data rules as the server, shared by the
//! threads of one process, with waits woken by a condition variable.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;

use super::blocking::BlockingStore;
use super::data::KvState;
use super::error::{Result, StoreError};

#[derive(Default)]
pub struct LocalStore {
    state: Mutex<KvState>,
    changed: Condvar,
}

impl LocalStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, KvState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a write and wakes every waiter to re-check.
    fn write<T>(&self, write: impl FnOnce(&mut KvState) -> T) -> T {
        let result = write(&mut self.state());
        self.changed.notify_all();
        result
    }
}

impl BlockingStore for LocalStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|state| state.set(key, value));
        Ok(())
    }

    fn get_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        Ok(self.state().get(key).cloned())
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.write(|state| state.add(key, delta)).map_err(|err| {
            StoreError::InvalidArgument(format!("cannot add to key {:?}: {err}", String::from_utf8_lossy(key)))
        })
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        Ok(self.write(|state| state.compare_set(key, expected, desired)).value)
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        let state = self.state();
        Ok(keys.iter().all(|key| state.is_ready(key)))
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        Ok(self.state().delete(key))
    }

    fn num_keys(&self) -> Result<i64> {
        Ok(self.state().num_keys() as i64)
    }

    fn append(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|state| state.append(key, value));
        Ok(())
    }

    fn multi_set(&self, pairs: &[(&[u8], &[u8])]) -> Result<()> {
        self.write(|state| pairs.iter().for_each(|(key, value)| state.set(key, value)));
        Ok(())
    }

    fn list_keys(&self) -> Result<Vec<Bytes>> {
        Ok(self.state().keys().cloned().collect())
    }

    fn queue_push(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|state| state.queue_push(key, value));
        Ok(())
    }

    fn queue_pop_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        Ok(self.state().queue_pop(key).1)
    }

    fn queue_len(&self, key: &[u8]) -> Result<i64> {
        Ok(self.state().queue_len(key) as i64)
    }

    fn wait_for_change(&self, keys: &[&[u8]], slice: Duration) -> Result<()> {
        let state = self.state();
        if keys.iter().all(|key| state.is_ready(key)) {
            return Ok(());
        }
        drop(self.changed.wait_timeout(state, slice).unwrap_or_else(PoisonError::into_inner));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::interrupt::Interrupt;

    #[test]
    fn operations_follow_the_shared_rules() {
        let store = LocalStore::new();
        store.set(b"k", b"v").unwrap();
        assert_eq!(store.get(b"k", None, &Interrupt::never()).unwrap(), "v");
        assert_eq!(store.add(b"n", 2).unwrap(), 2);
        assert_eq!(store.compare_set(b"k", b"v", b"w").unwrap(), "w");
        assert_eq!(store.num_keys().unwrap(), 2);
        assert!(store.delete_key(b"n").unwrap());
        assert!(!store.check(&[b"n"]).unwrap());
        store.set(b"t", b"text").unwrap();
        assert!(matches!(store.add(b"t", 1), Err(StoreError::InvalidArgument(_))));
    }

    #[test]
    fn a_waiter_is_woken_by_another_thread() {
        let store = Arc::new(LocalStore::new());
        let setter = store.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            setter.set(b"late", b"here").unwrap();
        });
        assert_eq!(store.get(b"late", Some(Duration::from_secs(30)), &Interrupt::never()).unwrap(), "here");
        thread.join().unwrap();
    }

    #[test]
    fn timeouts_and_interrupts_end_waits() {
        let store = LocalStore::new();
        let err = store.wait(&[b"nokey"], Some(Duration::from_millis(50)), &Interrupt::never()).unwrap_err();
        assert_eq!(err.to_string(), "wait timeout after 50ms, keys: nokey");
        let asked = std::sync::atomic::AtomicU32::new(0);
        let second_ask = Interrupt::new(move || asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1);
        let err = store.wait(&[b"nokey"], None, &second_ask).unwrap_err();
        assert!(matches!(err, StoreError::Interrupted));
        let err = store.queue_pop(b"q", false, None, &Interrupt::never()).unwrap_err();
        assert!(matches!(err, StoreError::QueueEmpty));
    }

    #[test]
    fn a_blocking_pop_gets_an_item_pushed_later() {
        let store = Arc::new(LocalStore::new());
        let pusher = store.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            pusher.queue_push(b"q", b"item").unwrap();
        });
        assert_eq!(store.queue_pop(b"q", true, Some(Duration::from_secs(30)), &Interrupt::never()).unwrap(), "item");
        thread.join().unwrap();
    }
}

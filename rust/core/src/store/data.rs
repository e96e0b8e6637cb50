//! The data of a store and the meaning of each operation on it, with no I/O and no waiting.
//! The network server, the in-process store and the file store all keep their data here, so
//! they agree on every rule (how ADD parses, what COMPARE_SET returns, what counts as a key).

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::counter::{format_counter, parse_counter, CounterError, COUNTER_BYTES};

/// Keys and values are opaque bytes. Queues live in their own namespace: a queue named `k`
/// and a key `k` are different things, and `num_keys`/`list_keys` see only keys.
#[derive(Debug, Default)]
pub struct KvState {
    kv: HashMap<Bytes, Bytes>,
    queues: HashMap<Bytes, VecDeque<Bytes>>,
}

/// What COMPARE_SET answers, and whether it changed anything.
#[derive(Debug, PartialEq, Eq)]
pub struct CompareSetOutcome {
    pub value: Bytes,
    pub stored: bool,
}

impl KvState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, key: &[u8]) -> Option<&Bytes> {
        self.kv.get(key)
    }

    pub fn set(&mut self, key: &[u8], value: &[u8]) {
        match self.kv.get_mut(key) {
            Some(slot) => overwrite(slot, value),
            None => {
                self.kv.insert(Bytes::copy_from_slice(key), Bytes::copy_from_slice(value));
            }
        }
    }

    /// torch's rules: a missing key with an empty `expected` is created; a missing key with a
    /// non-empty `expected` stays missing and the answer is `expected`; a present key equal to
    /// `expected` takes `desired`; otherwise the current value is returned unchanged.
    pub fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> CompareSetOutcome {
        match self.kv.get_mut(key) {
            None if expected.is_empty() => {
                let value = Bytes::copy_from_slice(desired);
                self.kv.insert(Bytes::copy_from_slice(key), value.clone());
                CompareSetOutcome { value, stored: true }
            }
            None => CompareSetOutcome { value: Bytes::copy_from_slice(expected), stored: false },
            Some(current) if current.as_ref() == expected => {
                *current = Bytes::copy_from_slice(desired);
                CompareSetOutcome { value: current.clone(), stored: true }
            }
            Some(current) => CompareSetOutcome { value: current.clone(), stored: false },
        }
    }

    /// Adds `delta` to the counter under `key` (a missing key counts as 0), wrapping on
    /// overflow as torch does, and returns the new value.
    pub fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, CounterError> {
        let current = match self.kv.get(key) {
            Some(value) => parse_counter(value)?,
            None => 0,
        };
        let total = current.wrapping_add(delta);
        let mut text = [0; COUNTER_BYTES];
        self.set(key, format_counter(total, &mut text));
        Ok(total)
    }

    pub fn append(&mut self, key: &[u8], suffix: &[u8]) {
        match self.kv.get_mut(key) {
            Some(current) => {
                let mut joined = Vec::with_capacity(current.len() + suffix.len());
                joined.extend_from_slice(current);
                joined.extend_from_slice(suffix);
                *current = Bytes::from(joined);
            }
            None => self.set(key, suffix),
        }
    }

    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.kv.remove(key).is_some()
    }

    /// Whether a WAIT or CHECK on `key` is satisfied: the key exists, or (as torch's libuv
    /// server counts it) a queue of that name holds an item.
    pub fn is_ready(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queue_len(key) > 0
    }

    pub fn num_keys(&self) -> usize {
        self.kv.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = &Bytes> {
        self.kv.keys()
    }

    pub fn queue_push(&mut self, key: &[u8], value: &[u8]) {
        let value = Bytes::copy_from_slice(value);
        match self.queues.get_mut(key) {
            Some(queue) => queue.push_back(value),
            None => {
                self.queues.insert(Bytes::copy_from_slice(key), VecDeque::from([value]));
            }
        }
    }

    /// Pops the oldest item; returns the queue's length before the pop with it. An emptied
    /// queue is forgotten, which no client can tell from an empty one.
    pub fn queue_pop(&mut self, key: &[u8]) -> (usize, Option<Bytes>) {
        let Some(queue) = self.queues.get_mut(key) else {
            return (0, None);
        };
        let before = queue.len();
        let item = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(key);
        }
        (before, item)
    }

    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }
}

/// Puts `value` in `slot`, in the memory the slot holds when nothing else shares it and the
/// value is no longer: a key written again and again (a counter, a heartbeat, a status) costs
/// no allocation.
fn overwrite(slot: &mut Bytes, value: &[u8]) {
    match std::mem::take(slot).try_into_mut() {
        Ok(mut held) if held.capacity() >= value.len() => {
            held.clear();
            held.extend_from_slice(value);
            *slot = held.freeze();
        }
        _ => *slot = Bytes::copy_from_slice(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_set_follows_torch_rules() {
        let mut state = KvState::new();
        // missing key, non-empty expected: answers `expected`, stores nothing
        let outcome = state.compare_set(b"k", b"x", b"y");
        assert_eq!(outcome, CompareSetOutcome { value: Bytes::from_static(b"x"), stored: false });
        assert!(state.get(b"k").is_none());
        // missing key, empty expected: creates it
        assert_eq!(state.compare_set(b"k", b"", b"v1").value, "v1");
        // wrong expected: current value, unchanged
        assert_eq!(
            state.compare_set(b"k", b"wrong", b"v2"),
            CompareSetOutcome { value: Bytes::from_static(b"v1"), stored: false }
        );
        // right expected: swapped
        assert_eq!(state.compare_set(b"k", b"v1", b"v2").value, "v2");
        assert_eq!(state.get(b"k").unwrap(), "v2");
    }

    #[test]
    fn add_counts_from_zero_and_wraps() {
        let mut state = KvState::new();
        assert_eq!(state.add(b"c", 5), Ok(5));
        assert_eq!(state.add(b"c", -2), Ok(3));
        assert_eq!(state.get(b"c").unwrap(), "3");
        state.set(b"m", b"9223372036854775807");
        assert_eq!(state.add(b"m", 1), Ok(i64::MIN));
        state.set(b"t", b"abc");
        assert!(state.add(b"t", 1).is_err());
        assert_eq!(state.get(b"t").unwrap(), "abc", "a failed ADD changes nothing");
    }

    #[test]
    fn a_value_written_again_is_right_whether_its_memory_is_reused_or_shared() {
        let mut state = KvState::new();
        state.set(b"k", b"first");
        let shared = state.get(b"k").unwrap().clone(); // as a local store's get hands it out
        state.set(b"k", b"other"); // same length, but shared: not written over
        assert_eq!(shared, "first");
        assert_eq!(state.get(b"k").unwrap(), "other");
        drop(shared);
        state.set(b"k", b"abc"); // shorter, in place
        assert_eq!(state.get(b"k").unwrap(), "abc");
        state.set(b"k", b"longer than before"); // longer: new memory
        assert_eq!(state.get(b"k").unwrap(), "longer than before");
        state.set(b"k", b"");
        assert_eq!(state.get(b"k").unwrap(), "");
    }

    #[test]
    fn append_creates_or_extends() {
        let mut state = KvState::new();
        state.append(b"a", b"po");
        state.append(b"a", b"tato");
        assert_eq!(state.get(b"a").unwrap(), "potato");
    }

    #[test]
    fn queues_are_fifo_and_separate_from_keys() {
        let mut state = KvState::new();
        assert_eq!(state.queue_pop(b"q"), (0, None));
        state.queue_push(b"q", b"1");
        state.queue_push(b"q", b"2");
        assert_eq!(state.num_keys(), 0);
        assert!(state.is_ready(b"q"));
        assert_eq!(state.queue_pop(b"q"), (2, Some(Bytes::from_static(b"1"))));
        assert_eq!(state.queue_pop(b"q"), (1, Some(Bytes::from_static(b"2"))));
        assert!(!state.is_ready(b"q"));
        assert_eq!(state.queue_len(b"q"), 0);
    }
}

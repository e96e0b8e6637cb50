//! What a handle knows of the store: the file's entries replayed in order. Pure, no I/O.

use std::collections::HashMap;

use bytes::Bytes;

use super::format::{check_start, decode, Change, NotAStore};
use crate::store::counter::{parse_counter, CounterError};
use crate::store::data::KvState;

/// Which file (device, inode) a replica's entries came from.
pub(super) type FileId = (u64, u64);

/// The data of the first `applied` bytes of one file.
#[derive(Debug, Default)]
pub(super) struct Replica {
    /// The users' keys, and elastix's queues.
    pub state: KvState,
    /// Keys outside the users' namespace (torch's counters); torch counts them as keys.
    others: HashMap<Bytes, Bytes>,
    /// Bytes of the file replayed: every whole entry; never a part of one.
    pub applied: u64,
    /// The file replayed, once one was.
    pub file: Option<FileId>,
}

impl Replica {
    pub fn apply(&mut self, change: Change<'_>) {
        match change {
            Change::Set { key, value } => self.state.set(key, value),
            Change::Delete { key } => {
                self.state.delete(key);
            }
            Change::SetOther { key, value } => {
                self.others.insert(Bytes::copy_from_slice(key), Bytes::copy_from_slice(value));
            }
            Change::DeleteOther { key } => {
                self.others.remove(key);
            }
            Change::QueuePush { queue, item } => self.state.queue_push(queue, item),
            Change::QueuePop { queue } => {
                self.state.queue_pop(queue);
            }
        }
    }

    /// Replays `unread`, the file's bytes from `applied` on, entry by entry; stops before an
    /// entry that runs past the end (a torn tail), leaving it out of `applied`.
    pub fn replay(&mut self, unread: &[u8]) -> Result<(), NotAStore> {
        if self.applied == 0 {
            check_start(unread)?;
        }
        let mut rest = unread;
        while let Some((entry, used)) = decode(rest) {
            self.apply(Change::of(entry));
            self.applied += used as u64;
            rest = &rest[used..];
        }
        Ok(())
    }

    /// The number of keys as torch counts them: the users' and torch's own counters.
    pub fn num_keys(&self) -> usize {
        self.state.num_keys() + self.others.len()
    }

    /// The value of a key outside the users' namespace.
    pub fn other(&self, key: &[u8]) -> Option<&Bytes> {
        self.others.get(key)
    }

    /// Forgets everything, so that the next operation replays the file from its start.
    pub fn reset(&mut self) {
        *self = Replica::default();
    }
}

/// A counter's value as ADD reads it in this format: a missing or empty value is 0, anything
/// else parses as C's `strtoll` does.
pub(super) fn counter(value: Option<&Bytes>) -> Result<i64, CounterError> {
    match value {
        Some(value) if !value.is_empty() => parse_counter(value),
        _ => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::file::format::{CLEANUP, REFCOUNT};

    /// What torch 2.15.0's FileStore wrote for: open (world_size -1), set k=v, add n 7,
    /// compare_set k v->x, compare_set new ""->y, delete_key k, delete_key absent, append a "po"
    /// then "tato", multi_set m1=1 m2=2, set t=text, then the handle's close.
    const TORCH_FILE: &[u8] = b"\t\x00\x00\x00refcount/\x01\x00\x00\x001\
        \x02\x00\x00\x00/k\x01\x00\x00\x00v\x02\x00\x00\x00/n\x01\x00\x00\x007\
        \x02\x00\x00\x00/k\x01\x00\x00\x00x\x04\x00\x00\x00/new\x01\x00\x00\x00y\
        \x03\x00\x00\x00-/k\x00\x00\x00\x00\x08\x00\x00\x00-/absent\x00\x00\x00\x00\
        \x02\x00\x00\x00/a\x02\x00\x00\x00po\x02\x00\x00\x00/a\x06\x00\x00\x00potato\
        \x03\x00\x00\x00/m1\x01\x00\x00\x001\x03\x00\x00\x00/m2\x01\x00\x00\x002\
        \x02\x00\x00\x00/t\x04\x00\x00\x00text\
        \x08\x00\x00\x00cleanup/\x01\x00\x00\x001\t\x00\x00\x00refcount/\x01\x00\x00\x000";

    fn replayed(bytes: &[u8]) -> Replica {
        let mut replica = Replica::default();
        replica.replay(bytes).unwrap();
        replica
    }

    fn user_keys(replica: &Replica) -> Vec<&[u8]> {
        let mut keys: Vec<&[u8]> = replica.state.keys().map(|key| &key[..]).collect();
        keys.sort();
        keys
    }

    #[test]
    fn a_file_written_by_torch_replays_to_torchs_data_and_key_count() {
        let replica = replayed(TORCH_FILE);
        assert_eq!(replica.applied, TORCH_FILE.len() as u64);
        assert_eq!(user_keys(&replica), [&b"a"[..], b"m1", b"m2", b"n", b"new", b"t"]);
        assert_eq!(replica.state.get(b"a").unwrap(), "potato");
        assert_eq!(replica.state.get(b"n").unwrap(), "7");
        assert!(replica.state.get(b"k").is_none(), "deleted");
        assert_eq!(replica.other(REFCOUNT).unwrap(), "0");
        assert_eq!(replica.other(CLEANUP).unwrap(), "1");
        // torch's num_keys() on this file: its 6 keys and its 2 counters
        assert_eq!(replica.num_keys(), 8);
    }

    #[test]
    fn replay_is_the_same_in_any_number_of_steps() {
        let whole = replayed(TORCH_FILE);
        for cut in 0..TORCH_FILE.len() {
            let mut replica = Replica::default();
            replica.replay(&TORCH_FILE[..cut]).unwrap();
            assert!(replica.applied <= cut as u64);
            let applied = replica.applied as usize;
            replica.replay(&TORCH_FILE[applied..]).unwrap();
            assert_eq!(replica.applied, whole.applied);
            assert_eq!((user_keys(&replica), replica.num_keys()), (user_keys(&whole), whole.num_keys()));
        }
    }

    #[test]
    fn a_torn_tail_is_left_unapplied() {
        let mut bytes = TORCH_FILE[..18 + 11].to_vec(); // the refcount entry and `/k = v`
        let whole = bytes.len() as u64;
        // a set of "/abc" promising 10 value bytes, with 4 of them
        bytes.extend_from_slice(b"\x04\x00\x00\x00/abc\x0a\x00\x00\x00half");
        let replica = replayed(&bytes);
        assert_eq!(replica.applied, whole);
        assert_eq!(user_keys(&replica), [b"k"]);
        assert_eq!(replica.num_keys(), 2);
    }

    #[test]
    fn queues_are_invisible_to_key_counts_and_survive_replay() {
        let mut bytes = Vec::new();
        let changes = [
            Change::SetOther { key: REFCOUNT, value: b"1" },
            Change::QueuePush { queue: b"q", item: b"1" },
            Change::QueuePush { queue: b"q", item: b"2" },
            Change::QueuePop { queue: b"q" },
            Change::Set { key: b"q", value: b"a key, not the queue" },
        ];
        changes.iter().for_each(|change| change.encode(&mut bytes).unwrap());
        let mut replica = replayed(&bytes);
        assert_eq!(replica.state.queue_len(b"q"), 1);
        assert_eq!(replica.state.queue_pop(b"q").1.unwrap(), "2");
        assert_eq!(replica.num_keys(), 2);
    }

    #[test]
    fn a_foreign_start_is_refused_before_anything_is_applied() {
        let mut replica = Replica::default();
        assert!(replica.replay(b"just some text, not a store").is_err());
        assert_eq!((replica.applied, replica.num_keys()), (0, 0));
        // the start is checked once: later entries may be anything
        let mut replica = replayed(&TORCH_FILE[..18]);
        replica.replay(b"\x01\x00\x00\x00x\x00\x00\x00\x00").unwrap();
        assert_eq!(replica.other(b"x").unwrap(), "");
    }

    #[test]
    fn counters_read_empty_as_zero_and_text_as_strtoll_does() {
        assert_eq!(counter(None), Ok(0));
        assert_eq!(counter(Some(&Bytes::new())), Ok(0));
        assert_eq!(counter(Some(&Bytes::from_static(b" 12abc"))), Ok(12));
        assert!(counter(Some(&Bytes::from_static(b"text"))).is_err());
        assert!(counter(Some(&Bytes::from_static(b"99999999999999999999"))).is_err());
    }
}

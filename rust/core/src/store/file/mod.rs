//! A store shared through one file, in the format of torch's `FileStore`, so that torch and
//! elastix processes can share one store: `file:///path` initialisation, by the processes of
//! one machine or of a filesystem they all mount.
//!
//! # File format (torch's)
//!
//! The file has no header. It is a sequence of entries, each a key and a value, each of those
//! a length (a `u32`, little-endian: torch writes its host's byte order, and every platform it
//! runs on is little-endian) and then that many bytes:
//!
//! ```text
//! key length: u32 LE | key | value length: u32 LE | value
//! ```
//!
//! Entries are only ever appended; read in order, a later entry for a key replaces an earlier
//! one. A key's first byte says what the entry does:
//!
//! * `/` + k: the user's key k takes the value. SET writes it; ADD, COMPARE_SET and APPEND write
//!   the value they produce (a counter as decimal text; a missing or empty value counts as 0),
//!   and a COMPARE_SET that changes nothing writes nothing. MULTI_SET writes one per pair.
//! * `-` + x: the key x is removed (whatever the value, empty when written): DELETE of k is
//!   `-/k`.
//! * anything else is one of torch's own counters, kept as ADD keeps a counter: `refcount/`, the
//!   handles open (each opener adds 1, each closer -1), and `cleanup/`, the handles closed so
//!   far. torch counts them as keys, so `num_keys` is 1 on a new store, as it is here.
//!
//! Queues are elastix's own (torch's `FileStore` raises `NotImplementedError` for them): a push
//! is an entry `-elastix/queue-push/` + name with the item as value, a pop one
//! `-elastix/queue-pop/` + name. torch's reader takes them for the removal of keys that never
//! exist: they change nothing that torch sees. Also unlike torch: DELETE of a missing key
//! answers false and writes nothing (torch writes the removal and answers true), and
//! `list_keys` gives the users' keys only (torch's lists its counters too, less their first
//! byte).
//!
//! # Concurrency
//!
//! Every operation opens the path and takes an `flock` on the whole file ([`lock`]), shared to
//! read and exclusive to write, as torch's handles do; then it replays the entries appended
//! since this handle last looked ([`replica`]) and appends its own in one write. An entry cut
//! short (its writer died mid-write) at the end of the file is skipped by readers and cut off
//! by the next writer, before its own write; torch's reader would wait forever at such an entry,
//! and a torch writer appends after it, which no reader can make sense of. A file whose start
//! is no store entry is refused and left alone. Nothing can wake a waiter in another process,
//! so waits poll the file.
//!
//! # Cleanup
//!
//! When a handle closes it adds 1 to `cleanup/` and -1 to `refcount/`; if that leaves no handle
//! open and a `world_size` was given, and at least that many handles have closed, it deletes the
//! file. A handle whose file is deleted under it (by hand, or by a closer counting another
//! `world_size`) reads an empty store and makes the file anew with its next write, as torch's
//! handles do, and replays the new file from its start.

mod format;
mod lock;
mod replica;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use self::format::{Change, CLEANUP, REFCOUNT};
use self::lock::{Access, Locked};
use self::replica::Replica;
use super::blocking::BlockingStore;
use super::counter::{format_counter, COUNTER_BYTES};
use super::error::{Result, StoreError};

/// Waits poll the file, first after this long, then at doubling intervals up to [`LAST_POLL`]
/// (torch's poll every 10 ms).
const FIRST_POLL: Duration = Duration::from_millis(1);
const LAST_POLL: Duration = Duration::from_millis(10);

/// A handle on a store file; torch's `FileStore(path, world_size)`.
pub struct FileStore {
    path: PathBuf,
    world_size: Option<u32>,
    /// Held for a whole operation, taken before the file's lock.
    replica: Mutex<Replica>,
    /// The process that counted this handle in (`None` until then): only it counts it out, not
    /// a child forked from it.
    opened_by: Option<u32>,
}

/// One writing operation in progress: the file locked and replayed. Entries queued in `out` are
/// written by [`Txn::commit`].
struct Txn<'a> {
    replica: MutexGuard<'a, Replica>,
    file: Locked<'a>,
    out: Vec<u8>,
}

/// A counter that ADD changes.
#[derive(Clone, Copy)]
enum Counter<'k> {
    /// A user's key.
    User(&'k [u8]),
    /// One of torch's counters, [`REFCOUNT`] or [`CLEANUP`].
    Torch(&'static [u8]),
}

impl FileStore {
    /// Opens the store in the file at `path`, creating the file if it is missing (its directory
    /// must exist), and counts this handle in. `world_size`: once that many handles have closed
    /// and none is open, the last one deletes the file; `None` keeps the file.
    pub fn open(path: impl AsRef<Path>, world_size: Option<u32>) -> Result<FileStore> {
        let mut store =
            FileStore { path: path.as_ref().to_path_buf(), world_size, replica: Mutex::default(), opened_by: None };
        store.write(|txn| txn.add(Counter::Torch(REFCOUNT), 1))?;
        store.opened_by = Some(std::process::id());
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counts this handle out, and deletes the file if the job is over.
    fn close(&self) -> Result<()> {
        let replica = self.replica();
        // no file: nothing to count in (torch's closer does nothing either)
        let Some(file) = Locked::existing(&self.path, Access::Exclusive)? else {
            return Ok(());
        };
        let mut txn = self.start(replica, file)?;
        let closed = txn.add(Counter::Torch(CLEANUP), 1)?;
        let open = txn.add(Counter::Torch(REFCOUNT), -1)?;
        txn.commit()?;
        if open == 0 && self.world_size.is_some_and(|size| closed >= i64::from(size)) {
            // still locked: an opener waiting for the lock finds the path gone and opens anew
            txn.file.remove()?;
        }
        Ok(())
    }

    fn replica(&self) -> MutexGuard<'_, Replica> {
        self.replica.lock().unwrap_or_else(|poisoned| {
            // a panic mid-operation may have left the replica half-changed: rebuild it
            let mut replica = poisoned.into_inner();
            replica.reset();
            self.replica.clear_poison();
            replica
        })
    }

    /// Brings `replica` up to date with the locked `file`.
    fn catch_up(&self, replica: &mut Replica, file: &Locked<'_>) -> Result<()> {
        if replica.file != Some(file.id) {
            if replica.file.is_some() {
                tracing::warn!(
                    path = %self.path.display(),
                    "the store's file was deleted or replaced under an open handle; reading the new one"
                );
            }
            replica.reset();
            replica.file = Some(file.id);
        }
        if file.len < replica.applied {
            let reason = format!(
                "the file shrank from {} to {} bytes: something other than a store changed it",
                replica.applied, file.len
            );
            return Err(file_error(&self.path, reason));
        }
        let unread = file.read_from(replica.applied)?;
        replica.replay(&unread).map_err(|err| file_error(&self.path, err.to_string()))
    }

    /// Runs a reading operation on the replica, brought up to date under a shared lock.
    fn read<T>(&self, op: impl FnOnce(&Replica) -> T) -> Result<T> {
        let mut replica = self.replica();
        match Locked::existing(&self.path, Access::Shared)? {
            Some(file) => self.catch_up(&mut replica, &file)?,
            // deleted under this handle: an empty store until a writer makes the file anew
            None => replica.reset(),
        }
        Ok(op(&replica))
    }

    /// Runs an operation that may queue entries, under an exclusive lock, then writes them.
    fn write<T>(&self, op: impl FnOnce(&mut Txn<'_>) -> Result<T>) -> Result<T> {
        let replica = self.replica();
        let mut txn = self.start(replica, Locked::create(&self.path)?)?;
        let result = op(&mut txn)?;
        txn.commit()?;
        Ok(result)
    }

    fn start<'a>(&'a self, mut replica: MutexGuard<'a, Replica>, file: Locked<'a>) -> Result<Txn<'a>> {
        self.catch_up(&mut replica, &file)?;
        Ok(Txn { replica, file, out: Vec::new() })
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if self.opened_by == Some(std::process::id()) {
            if let Err(err) = self.close() {
                tracing::warn!("closing the file store: {err}");
            }
        }
    }
}

pub(super) fn file_error(path: &Path, reason: impl Into<String>) -> StoreError {
    StoreError::File { path: path.to_path_buf(), reason: reason.into() }
}

fn lossy(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

impl Txn<'_> {
    /// Queues the entry of a change and applies it to the replica.
    fn push(&mut self, change: Change<'_>) -> Result<()> {
        change.encode(&mut self.out).map_err(|err| StoreError::InvalidArgument(err.to_string()))?;
        self.replica.apply(change);
        Ok(())
    }

    /// Queues the entry of a change already applied to the replica.
    fn log(&mut self, change: Change<'_>) -> Result<()> {
        change.encode(&mut self.out).map_err(|err| {
            // the replica is ahead of what will be written: rebuild it next time
            self.replica.reset();
            StoreError::InvalidArgument(err.to_string())
        })
    }

    /// ADD: queues the new value of the counter, and returns it.
    fn add(&mut self, counter: Counter<'_>, delta: i64) -> Result<i64> {
        let current = match counter {
            Counter::User(key) => self.replica.state.get(key),
            Counter::Torch(key) => self.replica.other(key),
        };
        let total = replica::counter(current)
            .map_err(|err| match counter {
                Counter::User(key) => StoreError::InvalidArgument(format!("cannot add to key {:?}: {err}", lossy(key))),
                Counter::Torch(key) => {
                    file_error(self.file.path(), format!("torch's counter {:?} is corrupt: {err}", lossy(key)))
                }
            })?
            .wrapping_add(delta);
        let mut text = [0; COUNTER_BYTES];
        let value = format_counter(total, &mut text);
        self.push(match counter {
            Counter::User(key) => Change::Set { key, value },
            Counter::Torch(key) => Change::SetOther { key, value },
        })?;
        Ok(total)
    }

    /// Appends the queued entries in one write, first cutting off a torn entry at the end.
    fn commit(&mut self) -> Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let entries = std::mem::take(&mut self.out);
        let at = self.replica.applied;
        match self.file.write_at(at, &entries) {
            Ok(()) => {
                self.replica.applied = at + entries.len() as u64;
                Ok(())
            }
            Err(err) => {
                // the replica holds changes the file may not: rebuild it from the file next time
                self.replica.reset();
                Err(err)
            }
        }
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if !self.out.is_empty() {
            // changes applied but never written: the replica is ahead of the file
            self.replica.reset();
        }
    }
}

impl BlockingStore for FileStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| txn.push(Change::Set { key, value }))
    }

    fn get_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.read(|replica| replica.state.get(key).cloned())
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.write(|txn| txn.add(Counter::User(key), delta))
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        self.write(|txn| {
            let outcome = txn.replica.state.compare_set(key, expected, desired);
            if outcome.stored {
                txn.log(Change::Set { key, value: &outcome.value })?;
            }
            Ok(outcome.value)
        })
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.read(|replica| keys.iter().all(|key| replica.state.is_ready(key)))
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.write(|txn| {
            let existed = txn.replica.state.get(key).is_some();
            if existed {
                txn.push(Change::Delete { key })?;
            }
            Ok(existed)
        })
    }

    fn num_keys(&self) -> Result<i64> {
        self.read(|replica| replica.num_keys() as i64)
    }

    fn append(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| {
            let current = txn.replica.state.get(key).map_or(&[][..], |current| &current[..]);
            let joined = [current, value].concat();
            txn.push(Change::Set { key, value: &joined })
        })
    }

    fn multi_set(&self, pairs: &[(&[u8], &[u8])]) -> Result<()> {
        self.write(|txn| pairs.iter().try_for_each(|&(key, value)| txn.push(Change::Set { key, value })))
    }

    fn list_keys(&self) -> Result<Vec<Bytes>> {
        self.read(|replica| replica.state.keys().cloned().collect())
    }

    fn queue_push(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| txn.push(Change::QueuePush { queue: key, item: value }))
    }

    fn queue_pop_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.write(|txn| {
            let item = txn.replica.state.queue_pop(key).1;
            if item.is_some() {
                txn.log(Change::QueuePop { queue: key })?;
            }
            Ok(item)
        })
    }

    fn queue_len(&self, key: &[u8]) -> Result<i64> {
        self.read(|replica| replica.state.queue_len(key) as i64)
    }

    /// Polls: returns once the keys are ready, the file has changed, or `slice` has passed.
    fn wait_for_change(&self, keys: &[&[u8]], slice: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = FIRST_POLL;
        let mut seen = None;
        loop {
            let (ready, now) = self.read(|replica| {
                (keys.iter().all(|key| replica.state.is_ready(key)), (replica.file, replica.applied))
            })?;
            if ready || seen.is_some_and(|seen| seen != now) {
                return Ok(());
            }
            seen = Some(now);
            let left = slice.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(LAST_POLL);
        }
    }
}

#[cfg(test)]
mod tests;

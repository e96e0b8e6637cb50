//! A store shared through one file (torch's `FileStore`), for `file:///path` initialisation:
//! processes on one machine, or on a filesystem they all mount, open the same path.
//!
//! # File format (version 1)
//!
//! The file is an append-only log. Its first opener writes a 12-byte header: the magic
//! `b"ELXFSTOR"`, then the format version as a u32 LE. Records follow, each
//!
//! ```text
//! kind: u8 | key length: u64 LE | key | value length: u64 LE | value
//! ```
//!
//! with the kinds 1 set, 2 append, 3 delete, 4 queue push, 5 queue pop (the key names the
//! queue; delete and pop have an empty value), 6 join and 7 leave (a handle was opened or
//! dropped; empty key and value). ADD and COMPARE_SET are logged as the `set` of their result.
//! Replaying the records in order through [`KvState`] gives the store's data.
//!
//! # Concurrency
//!
//! Every operation holds an exclusive `flock` on the file while it replays the records appended
//! since this handle last looked into its cached [`KvState`], runs, and appends its own records
//! in one write. A record cut short (its writer died mid-write) is skipped by readers and cut
//! off by the next writer; the whole records before it stay, so a `multi_set` killed mid-write
//! may have stored only its first pairs. Nothing can wake a waiter in another process, so waits
//! poll.
//!
//! # Cleanup
//!
//! When a dropped handle was the last one open, it deletes the file if a `world_size` was given
//! and at least that many handles have left in total; otherwise the file stays.

use std::fmt::Display;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::blocking::BlockingStore;
use super::error::{Result, StoreError};
use super::state::KvState;

const MAGIC: &[u8; 8] = b"ELXFSTOR";
const VERSION: u32 = 1;
const HEADER_LEN: u64 = 12;

/// Waits poll the file, first after this long, then at doubling intervals up to [`LAST_POLL`].
const FIRST_POLL: Duration = Duration::from_millis(1);
const LAST_POLL: Duration = Duration::from_millis(10);

/// A record's first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Set = 1,
    Append = 2,
    Delete = 3,
    QueuePush = 4,
    QueuePop = 5,
    Join = 6,
    Leave = 7,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Set,
            2 => Kind::Append,
            3 => Kind::Delete,
            4 => Kind::QueuePush,
            5 => Kind::QueuePop,
            6 => Kind::Join,
            7 => Kind::Leave,
            _ => return None,
        })
    }
}

struct Record<'a> {
    kind: Kind,
    key: &'a [u8],
    value: &'a [u8],
}

fn header() -> Vec<u8> {
    [&MAGIC[..], &VERSION.to_le_bytes()].concat()
}

fn encode(out: &mut Vec<u8>, kind: Kind, key: &[u8], value: &[u8]) {
    out.reserve(17 + key.len() + value.len());
    out.push(kind as u8);
    out.extend_from_slice(&(key.len() as u64).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
}

/// Why the bytes at some offset are not a record.
enum Undecodable {
    /// The record goes on past the end of the file: its writer died mid-write.
    Incomplete,
    UnknownKind(u8),
}

/// Decodes the record at the start of `bytes`; returns it with its length.
fn decode(bytes: &[u8]) -> Result<(Record<'_>, usize), Undecodable> {
    let (&byte, rest) = bytes.split_first().ok_or(Undecodable::Incomplete)?;
    let kind = Kind::from_byte(byte).ok_or(Undecodable::UnknownKind(byte))?;
    let (key, rest) = split_sized(rest)?;
    let (value, rest) = split_sized(rest)?;
    Ok((Record { kind, key, value }, bytes.len() - rest.len()))
}

/// Splits a u64 LE length and that many bytes off the front of `bytes`.
fn split_sized(bytes: &[u8]) -> Result<(&[u8], &[u8]), Undecodable> {
    let (len, rest) = bytes.split_at_checked(8).ok_or(Undecodable::Incomplete)?;
    let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    usize::try_from(len).ok().and_then(|len| rest.split_at_checked(len)).ok_or(Undecodable::Incomplete)
}

/// What this handle knows of the file: the data and bookkeeping of its first `applied` bytes.
#[derive(Default)]
struct Replica {
    state: KvState,
    /// Bytes of the file replayed into `state`, header included; 0 until the header is read.
    applied: u64,
    joined: u64,
    left: u64,
}

impl Replica {
    fn apply(&mut self, record: Record<'_>) {
        let Record { kind, key, value } = record;
        match kind {
            Kind::Set => self.state.set(key, value),
            Kind::Append => self.state.append(key, value),
            Kind::Delete => {
                self.state.delete(key);
            }
            Kind::QueuePush => self.state.queue_push(key, value),
            Kind::QueuePop => {
                self.state.queue_pop(key);
            }
            Kind::Join => self.joined += 1,
            Kind::Leave => self.left += 1,
        }
    }

    /// Handles open now, as far as the log tells (a process killed without leaving counts on).
    fn users(&self) -> u64 {
        self.joined.saturating_sub(self.left)
    }

    /// Forgets everything, so that the next operation replays the whole file.
    fn reset(&mut self) {
        *self = Replica::default();
    }
}

/// A handle on a store file. Each handle has its own open file, so handles in one process
/// exclude each other through the file lock exactly as handles in different processes do.
pub struct FileStore {
    path: PathBuf,
    world_size: Option<u32>,
    file: File,
    /// Held for a whole operation: threads sharing one open file would all "own" its flock.
    replica: Mutex<Replica>,
    /// The process that logged this handle's join (`None` until then): only it logs the
    /// leave, and a child forked from it shares its open file, so must lock through its own.
    joined_by: Option<u32>,
}

/// One operation in progress: the file locked and replayed into the replica. Records queued in
/// `out` are written by [`Txn::commit`].
struct Txn<'a> {
    // Declared first so it drops first: the file is unlocked before the mutex is released, or
    // another thread of this handle could lock (a no-op on the same open file) just before
    // this unlock and run unprotected.
    _lock: Flock<File>,
    replica: MutexGuard<'a, Replica>,
    store: &'a FileStore,
    out: Vec<u8>,
    /// The file's length, torn tail included.
    len: u64,
}

impl FileStore {
    /// Opens the store in the file at `path`, creating the file if it is missing (its directory
    /// must exist). `world_size`: how many handles, in all, use the store; once that many have
    /// been dropped and none is open, the last one deletes the file. `None` keeps the file.
    pub fn open(path: impl AsRef<Path>, world_size: Option<u32>) -> Result<FileStore> {
        let path = path.as_ref();
        loop {
            let file = open_file(path)?;
            let mut store =
                FileStore { path: path.to_path_buf(), world_size, file, replica: Mutex::default(), joined_by: None };
            // false: the last user of a finished store deleted the file between our open and
            // our lock; start over on a new file
            if store.join()? {
                store.joined_by = Some(std::process::id());
                return Ok(store);
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Logs this handle's arrival; false if the file was deleted before we locked it.
    fn join(&self) -> Result<bool> {
        let mut txn = self.begin()?;
        if !self.names_our_file()? {
            return Ok(false);
        }
        txn.push(Kind::Join, b"", b"");
        txn.commit()?;
        Ok(true)
    }

    /// Logs this handle's departure, and deletes the file if the job is over.
    fn leave(&self) -> Result<()> {
        let mut txn = self.begin()?;
        txn.push(Kind::Leave, b"", b"");
        txn.commit()?;
        let finished = self.world_size.is_some_and(|size| txn.replica.left >= u64::from(size));
        if finished && txn.replica.users() == 0 && self.names_our_file()? {
            // still locked: an opener waiting for the lock will see the file gone and start over
            std::fs::remove_file(&self.path).map_err(|err| self.error("cannot delete the finished store", err))?;
        }
        Ok(())
    }

    fn error(&self, what: &str, err: impl Display) -> StoreError {
        file_error(&self.path, format!("{what}: {err}"))
    }

    /// Locks the file and brings the replica up to date with it.
    fn begin(&self) -> Result<Txn<'_>> {
        let replica = self.replica();
        let lock = self.lock_file()?;
        let mut txn = Txn { _lock: lock, replica, store: self, out: Vec::new(), len: 0 };
        txn.catch_up()?;
        Ok(txn)
    }

    fn replica(&self) -> MutexGuard<'_, Replica> {
        self.replica.lock().unwrap_or_else(|poisoned| {
            // a panic mid-operation may have left the cache half-changed: rebuild it
            let mut replica = poisoned.into_inner();
            replica.reset();
            self.replica.clear_poison();
            replica
        })
    }

    fn lock_file(&self) -> Result<Flock<File>> {
        let mut fd = if self.joined_by.is_some_and(|pid| pid != std::process::id()) {
            self.open_for_lock_in_child()?
        } else {
            // a duplicate descriptor shares the open file, hence its lock, and unlocks on drop
            self.file.try_clone().map_err(|err| self.error("cannot duplicate its descriptor", err))?
        };
        loop {
            match Flock::lock(fd, FlockArg::LockExclusive) {
                Ok(lock) => return Ok(lock),
                Err((back, Errno::EINTR)) => fd = back,
                Err((_, errno)) => return Err(self.error("cannot lock the file", errno)),
            }
        }
    }

    /// A forked child shares its parent's open file, and flock cannot tell the two apart: the
    /// child locks a file of its own on the path (its reads and writes, at explicit offsets,
    /// can keep using the shared one).
    fn open_for_lock_in_child(&self) -> Result<File> {
        let file = File::open(&self.path).map_err(|err| self.error("cannot reopen the file", err))?;
        let stat = |file: &File| file.metadata().map_err(|err| self.error("cannot stat the file", err));
        if !same_file(&stat(&file)?, &stat(&self.file)?) {
            return Err(file_error(&self.path, "the store's file was deleted or replaced"));
        }
        Ok(file)
    }

    /// Whether the path still names the file this handle has open.
    fn names_our_file(&self) -> Result<bool> {
        let ours = self.file.metadata().map_err(|err| self.error("cannot stat the file", err))?;
        Ok(match std::fs::metadata(&self.path) {
            Ok(named) => same_file(&named, &ours),
            Err(err) if err.kind() == io::ErrorKind::NotFound => false,
            Err(err) => return Err(self.error("cannot stat the path", err)),
        })
    }

    fn read_bytes(&self, buf: &mut [u8], at: u64) -> Result<()> {
        self.file.read_exact_at(buf, at).map_err(|err| self.error("cannot read the file", err))
    }

    /// Runs an operation that may queue records, then writes them.
    fn write<T>(&self, op: impl FnOnce(&mut Txn<'_>) -> Result<T>) -> Result<T> {
        let mut txn = self.begin()?;
        let result = op(&mut txn)?;
        txn.commit()?;
        Ok(result)
    }

    fn read<T>(&self, op: impl FnOnce(&Replica) -> T) -> Result<T> {
        Ok(op(&self.begin()?.replica))
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if self.joined_by == Some(std::process::id()) {
            if let Err(err) = self.leave() {
                tracing::warn!("leaving the store: {err}");
            }
        }
    }
}

fn same_file(a: &Metadata, b: &Metadata) -> bool {
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

fn file_error(path: &Path, reason: impl Into<String>) -> StoreError {
    StoreError::File { path: path.to_path_buf(), reason: reason.into() }
}

fn open_file(path: &Path) -> Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(|err| {
        let parent = path.parent().filter(|dir| !dir.as_os_str().is_empty());
        let reason = match parent {
            Some(dir) if err.kind() == io::ErrorKind::NotFound && !dir.is_dir() => {
                format!("cannot create the file: directory {} does not exist", dir.display())
            }
            _ => format!("cannot open or create the file: {err}"),
        };
        file_error(path, reason)
    })
}

impl Txn<'_> {
    /// Replays the records appended since this handle last looked, up to a torn tail if any.
    fn catch_up(&mut self) -> Result<()> {
        let store = self.store;
        self.len = store.file.metadata().map_err(|err| store.error("cannot stat the file", err))?.len();
        if self.replica.applied == 0 && !self.read_header()? {
            return Ok(());
        }
        let applied = self.replica.applied;
        if self.len < applied {
            let len = self.len;
            let reason = format!("the file shrank from {applied} to {len} bytes: something else changed it");
            return Err(file_error(&store.path, reason));
        }
        let unread = usize::try_from(self.len - applied).map_err(|err| store.error("too large", err))?;
        let mut bytes = vec![0; unread];
        store.read_bytes(&mut bytes, applied)?;
        let mut rest = &bytes[..];
        loop {
            match decode(rest) {
                Ok((record, used)) => {
                    self.replica.apply(record);
                    self.replica.applied += used as u64;
                    rest = &rest[used..];
                }
                // a torn tail (or nothing): ignored until a writer cuts it off
                Err(Undecodable::Incomplete) => return Ok(()),
                Err(Undecodable::UnknownKind(kind)) => {
                    let at = self.replica.applied;
                    let reason = format!("unknown record kind {kind} at byte {at}: the file is corrupt");
                    return Err(file_error(&store.path, reason));
                }
            }
        }
    }

    /// Checks the header and marks it applied; false if it is not all there yet (a new file, or
    /// its creator died mid-write), in which case the next write starts the file over.
    fn read_header(&mut self) -> Result<bool> {
        let store = self.store;
        let mut found = [0; HEADER_LEN as usize];
        let present = &mut found[..self.len.min(HEADER_LEN) as usize];
        store.read_bytes(present, 0)?;
        let magic_len = present.len().min(MAGIC.len());
        if present[..magic_len] != MAGIC[..magic_len] {
            let reason = "not an elastix file store (its first bytes are not the ELXFSTOR magic)";
            return Err(file_error(&store.path, reason));
        }
        if present.len() < HEADER_LEN as usize {
            return Ok(false);
        }
        let version = u32::from_le_bytes(found[MAGIC.len()..].try_into().expect("4 bytes"));
        if version != VERSION {
            let reason = format!("the file is in store format version {version}; this build reads version {VERSION}");
            return Err(file_error(&store.path, reason));
        }
        self.replica.applied = HEADER_LEN;
        Ok(true)
    }

    /// Applies a change to the replica and queues its record.
    fn push(&mut self, kind: Kind, key: &[u8], value: &[u8]) {
        self.replica.apply(Record { kind, key, value });
        self.log(kind, key, value);
    }

    /// Queues the record of a change already made to the replica.
    fn log(&mut self, kind: Kind, key: &[u8], value: &[u8]) {
        encode(&mut self.out, kind, key, value);
    }

    /// Appends the queued records in one write, first cutting off a torn tail.
    fn commit(&mut self) -> Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let records = std::mem::take(&mut self.out);
        let written = self.append(records);
        if written.is_err() {
            // the replica holds changes the file may not: rebuild it from the file next time
            self.replica.reset();
        }
        written
    }

    fn append(&mut self, records: Vec<u8>) -> Result<()> {
        let store = self.store;
        let at = self.replica.applied;
        let bytes = if at == 0 { [header(), records].concat() } else { records };
        if self.len > at {
            store.file.set_len(at).map_err(|err| store.error("cannot cut off a torn record", err))?;
        }
        store.file.write_all_at(&bytes, at).map_err(|err| store.error("cannot write the file", err))?;
        self.replica.applied = at + bytes.len() as u64;
        self.len = self.replica.applied;
        Ok(())
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if !self.out.is_empty() {
            // changes made but never written: the replica is ahead of the file
            self.replica.reset();
        }
    }
}

fn lossy(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

impl BlockingStore for FileStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| {
            txn.push(Kind::Set, key, value);
            Ok(())
        })
    }

    fn get_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.read(|replica| replica.state.get(key).cloned())
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.write(|txn| {
            let total = txn
                .replica
                .state
                .add(key, delta)
                .map_err(|err| StoreError::InvalidArgument(format!("cannot add to key {:?}: {err}", lossy(key))))?;
            let stored = txn.replica.state.get(key).cloned().unwrap_or_default();
            txn.log(Kind::Set, key, &stored);
            Ok(total)
        })
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        self.write(|txn| {
            let outcome = txn.replica.state.compare_set(key, expected, desired);
            if outcome.stored {
                txn.log(Kind::Set, key, &outcome.value);
            }
            Ok(outcome.value)
        })
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.read(|replica| keys.iter().all(|key| replica.state.is_ready(key)))
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.write(|txn| {
            let existed = txn.replica.state.delete(key);
            if existed {
                txn.log(Kind::Delete, key, b"");
            }
            Ok(existed)
        })
    }

    fn num_keys(&self) -> Result<i64> {
        self.read(|replica| replica.state.num_keys() as i64)
    }

    fn append(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| {
            txn.push(Kind::Append, key, value);
            Ok(())
        })
    }

    fn multi_set(&self, pairs: &[(&[u8], &[u8])]) -> Result<()> {
        self.write(|txn| {
            pairs.iter().for_each(|(key, value)| txn.push(Kind::Set, key, value));
            Ok(())
        })
    }

    fn list_keys(&self) -> Result<Vec<Bytes>> {
        self.read(|replica| replica.state.keys().cloned().collect())
    }

    fn queue_push(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(|txn| {
            txn.push(Kind::QueuePush, key, value);
            Ok(())
        })
    }

    fn queue_pop_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.write(|txn| {
            let item = txn.replica.state.queue_pop(key).1;
            if item.is_some() {
                txn.log(Kind::QueuePop, key, b"");
            }
            Ok(item)
        })
    }

    fn queue_len(&self, key: &[u8]) -> Result<i64> {
        self.read(|replica| replica.state.queue_len(key) as i64)
    }

    /// Polls: returns once the keys are ready, the store has changed, or `slice` has passed.
    fn wait_for_change(&self, keys: &[&[u8]], slice: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = FIRST_POLL;
        let mut seen = None;
        loop {
            let (ready, applied) =
                self.read(|replica| (keys.iter().all(|key| replica.state.is_ready(key)), replica.applied))?;
            if ready || seen.is_some_and(|seen| seen != applied) {
                return Ok(());
            }
            seen = Some(applied);
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
mod tests {
    use std::collections::BTreeSet;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    fn never() -> impl FnMut() -> bool {
        || false
    }

    /// A path in the temp directory, unique per process and test, removed when dropped (declare
    /// it before the stores on it, so that it drops after them).
    struct TempPath(PathBuf);

    impl TempPath {
        fn new(name: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let name = format!("elastix-filestore-{}-{n}-{name}", std::process::id());
            TempPath(std::env::temp_dir().join(name))
        }

        fn open(&self, world_size: Option<u32>) -> FileStore {
            FileStore::open(&self.0, world_size).unwrap()
        }

        fn len(&self) -> u64 {
            std::fs::metadata(&self.0).unwrap().len()
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn record(kind: Kind, key: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(&mut out, kind, key, value);
        out
    }

    #[test]
    fn operations_follow_the_shared_rules() {
        let path = TempPath::new("rules");
        let store = path.open(None);
        store.set(b"k", b"v").unwrap();
        assert_eq!(store.get(b"k", None, &mut never()).unwrap(), "v");
        assert_eq!(store.add(b"n", 2).unwrap(), 2);
        assert_eq!(store.compare_set(b"k", b"v", b"w").unwrap(), "w");
        assert_eq!(store.compare_set(b"k", b"v", b"x").unwrap(), "w");
        assert_eq!(store.compare_set(b"missing", b"e", b"x").unwrap(), "e");
        assert_eq!(store.num_keys().unwrap(), 2);
        assert!(store.delete_key(b"n").unwrap());
        assert!(!store.delete_key(b"n").unwrap());
        assert!(!store.check(&[b"n"]).unwrap());
        store.set(b"t", b"text").unwrap();
        assert!(matches!(store.add(b"t", 1), Err(StoreError::InvalidArgument(_))));
        store.append(b"t", b"!").unwrap();
        assert_eq!(store.get_now(b"t").unwrap().unwrap(), "text!");
        store.queue_push(b"q", b"1").unwrap();
        assert_eq!((store.num_keys().unwrap(), store.queue_len(b"q").unwrap()), (2, 1));
        assert!(store.check(&[b"q"]).unwrap(), "a non-empty queue counts as ready");
        assert_eq!(store.queue_pop_now(b"q").unwrap().unwrap(), "1");
        assert_eq!(store.queue_pop_now(b"q").unwrap(), None);
    }

    #[test]
    fn the_file_holds_the_documented_format() {
        let path = TempPath::new("format");
        let store = path.open(None);
        store.set(b"k", b"v").unwrap();
        assert_eq!(store.add(b"n", 7).unwrap(), 7);
        assert_eq!(store.compare_set(b"k", b"nope", b"x").unwrap(), "v");
        store.delete_key(b"k").unwrap();
        let expected = [
            b"ELXFSTOR\x01\x00\x00\x00".to_vec(),
            record(Kind::Join, b"", b""),
            [&[1u8][..], &1u64.to_le_bytes(), b"k", &1u64.to_le_bytes(), b"v"].concat(),
            record(Kind::Set, b"n", b"7"),
            record(Kind::Delete, b"k", b""),
        ]
        .concat();
        assert_eq!(std::fs::read(&path.0).unwrap(), expected, "a failed COMPARE_SET logs nothing");
    }

    #[test]
    fn two_handles_see_each_others_writes() {
        let path = TempPath::new("handles");
        let (a, b) = (path.open(None), path.open(None));
        a.set(b"k", b"v").unwrap();
        assert_eq!(b.get_now(b"k").unwrap().unwrap(), "v");
        b.append(b"k", b"w").unwrap();
        assert_eq!(a.get_now(b"k").unwrap().unwrap(), "vw");
        assert_eq!(a.add(b"n", 5).unwrap(), 5);
        assert_eq!(b.add(b"n", 1).unwrap(), 6);
        assert_eq!(a.compare_set(b"n", b"6", b"seven").unwrap(), "seven");
        assert_eq!(b.get_now(b"n").unwrap().unwrap(), "seven");
        a.queue_push(b"q", b"1").unwrap();
        a.queue_push(b"q", b"2").unwrap();
        assert_eq!(b.queue_pop_now(b"q").unwrap().unwrap(), "1");
        assert_eq!(a.queue_len(b"q").unwrap(), 1);
        b.multi_set(&[(b"x", b"1"), (b"y", b"2")]).unwrap();
        let keys: BTreeSet<Bytes> = a.list_keys().unwrap().into_iter().collect();
        assert_eq!(keys, [&b"k"[..], b"n", b"x", b"y"].into_iter().map(Bytes::from_static).collect());
        assert!(a.delete_key(b"x").unwrap());
        assert!(!b.check(&[b"x"]).unwrap());
        assert_eq!(b.num_keys().unwrap(), 3);
        // a handle opened later replays everything
        let c = path.open(None);
        assert_eq!(c.get_now(b"k").unwrap().unwrap(), "vw");
        assert_eq!(c.queue_pop_now(b"q").unwrap().unwrap(), "2");
        assert_eq!(a.queue_len(b"q").unwrap(), 0);
    }

    #[test]
    fn bookkeeping_is_not_visible_as_keys() {
        let path = TempPath::new("bookkeeping");
        let (a, _b) = (path.open(None), path.open(None));
        assert_eq!(a.num_keys().unwrap(), 0);
        assert!(a.list_keys().unwrap().is_empty());
        assert!(!a.check(&[b""]).unwrap());
        assert_eq!(a.replica().users(), 2);
    }

    #[test]
    fn a_waiter_is_woken_by_a_set_from_another_handle() {
        let path = TempPath::new("wake");
        let waiter = path.open(None);
        let setter = path.open(None);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            setter.set(b"late", b"here").unwrap();
        });
        assert_eq!(waiter.get(b"late", Some(Duration::from_secs(30)), &mut never()).unwrap(), "here");
        thread.join().unwrap();
    }

    #[test]
    fn a_blocking_pop_gets_an_item_pushed_by_another_handle() {
        let path = TempPath::new("pop");
        let popper = path.open(None);
        let pusher = path.open(None);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            pusher.queue_push(b"q", b"item").unwrap();
        });
        let item = popper.queue_pop(b"q", true, Some(Duration::from_secs(30)), &mut never()).unwrap();
        assert_eq!(item, "item");
        thread.join().unwrap();
    }

    #[test]
    fn concurrent_adds_from_four_handles_sum_exactly() {
        // each handle has its own open file, as separate processes would: only flock keeps
        // their read-modify-write cycles apart
        let path = TempPath::new("adds");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = path.open(None);
                std::thread::spawn(move || (0..200).map(|_| store.add(b"n", 1).unwrap()).collect::<Vec<_>>())
            })
            .collect();
        let totals: BTreeSet<i64> = threads.into_iter().flat_map(|thread| thread.join().unwrap()).collect();
        assert_eq!(totals, (1..=800).collect(), "every add saw a distinct total");
        assert_eq!(path.open(None).get_now(b"n").unwrap().unwrap(), "800");
    }

    #[test]
    fn threads_sharing_handles_add_exactly() {
        let path = TempPath::new("shared");
        let handles = [Arc::new(path.open(None)), Arc::new(path.open(None))];
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let store = handles[i % 2].clone();
                std::thread::spawn(move || (0..100).for_each(|_| assert!(store.add(b"n", 1).unwrap() > 0)))
            })
            .collect();
        threads.into_iter().for_each(|thread| thread.join().unwrap());
        assert_eq!(handles[0].get_now(b"n").unwrap().unwrap(), "800");
    }

    #[test]
    fn a_forked_child_and_its_parent_exclude_each_other_on_one_handle() {
        use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
        use nix::unistd::{fork, ForkResult};

        let path = TempPath::new("fork");
        let store = path.open(Some(1));
        // SAFETY: the child touches only `store` (no other thread uses it) and leaves through
        // `exit`, running no destructors and no test-harness code.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                let added = std::panic::catch_unwind(|| (0..300).all(|_| store.add(b"n", 1).is_ok()));
                std::process::exit(if matches!(added, Ok(true)) { 0 } else { 1 });
            }
            ForkResult::Parent { child } => {
                (0..300).for_each(|_| assert!(store.add(b"n", 1).unwrap() > 0));
                // bounded: a child stuck on a lock inherited from another test thread must
                // fail this test, not hang the suite
                let deadline = Instant::now() + Duration::from_secs(30);
                let status = loop {
                    match waitpid(child, Some(WaitPidFlag::WNOHANG)).unwrap() {
                        WaitStatus::StillAlive if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        WaitStatus::StillAlive => {
                            let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                            panic!("the forked child did not finish within 30 s");
                        }
                        status => break status,
                    }
                };
                assert_eq!(status, WaitStatus::Exited(child, 0));
            }
        }
        assert_eq!(store.get_now(b"n").unwrap().unwrap(), "600");
        assert_eq!(store.replica().users(), 1, "the child neither joined nor left");
    }

    #[test]
    fn concurrent_pops_take_each_item_once() {
        let path = TempPath::new("pops");
        let pusher = path.open(None);
        (0..200).for_each(|i| pusher.queue_push(b"q", i.to_string().as_bytes()).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = path.open(None);
                std::thread::spawn(move || {
                    std::iter::from_fn(|| store.queue_pop_now(b"q").unwrap()).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut items: Vec<Bytes> = threads.into_iter().flat_map(|thread| thread.join().unwrap()).collect();
        assert_eq!(items.len(), 200);
        items.sort();
        items.dedup();
        assert_eq!(items.len(), 200);
    }

    #[test]
    fn a_torn_tail_is_ignored_by_readers_and_cut_off_by_the_next_writer() {
        let path = TempPath::new("torn");
        let store = path.open(None);
        store.set(b"kept", b"v").unwrap();
        let good_len = path.len();
        // a writer killed mid-append: a set of "abc" promising 10 value bytes, with 4 of them
        let torn = [&[Kind::Set as u8][..], &3u64.to_le_bytes(), b"abc", &10u64.to_le_bytes(), b"half"];
        let torn = torn.concat();
        OpenOptions::new().append(true).open(&path.0).unwrap().write_all(&torn).unwrap();

        assert_eq!(store.get_now(b"kept").unwrap().unwrap(), "v");
        assert!(!store.check(&[b"abc"]).unwrap());
        assert_eq!(store.num_keys().unwrap(), 1);
        assert_eq!(path.len(), good_len + torn.len() as u64, "readers leave the tail alone");

        store.set(b"after", b"x").unwrap();
        assert_eq!(path.len(), good_len + record(Kind::Set, b"after", b"x").len() as u64);
        let other = path.open(None);
        let keys: BTreeSet<Bytes> = other.list_keys().unwrap().into_iter().collect();
        assert_eq!(keys, [Bytes::from_static(b"after"), Bytes::from_static(b"kept")].into());
    }

    #[test]
    fn a_torn_header_is_started_over() {
        let path = TempPath::new("torn-header");
        std::fs::write(&path.0, b"ELXF").unwrap();
        let store = path.open(None);
        store.set(b"k", b"v").unwrap();
        assert_eq!(path.open(None).get_now(b"k").unwrap().unwrap(), "v");
        assert!(std::fs::read(&path.0).unwrap().starts_with(b"ELXFSTOR\x01\x00\x00\x00"));
    }

    #[test]
    fn a_file_that_is_not_a_store_is_refused_and_left_alone() {
        let path = TempPath::new("foreign");
        std::fs::write(&path.0, b"just some text, not a store").unwrap();
        let err = FileStore::open(&path.0, None).err().unwrap();
        let message = err.to_string();
        assert!(matches!(err, StoreError::File { .. }), "{err}");
        assert!(message.contains("not an elastix file store") && message.contains(&*path.0.to_string_lossy()));
        assert_eq!(std::fs::read(&path.0).unwrap(), b"just some text, not a store");

        std::fs::write(&path.0, b"ELXFSTOR\x63\x00\x00\x00").unwrap();
        let message = FileStore::open(&path.0, None).err().unwrap().to_string();
        assert!(message.contains("version 99"), "{message}");
        assert_eq!(path.len(), HEADER_LEN);
    }

    #[test]
    fn a_corrupt_record_is_reported() {
        let path = TempPath::new("corrupt");
        drop(path.open(None));
        // a whole record of a kind this version does not know
        let unknown = [&[0xee][..], &0u64.to_le_bytes(), &0u64.to_le_bytes()].concat();
        OpenOptions::new().append(true).open(&path.0).unwrap().write_all(&unknown).unwrap();
        let message = FileStore::open(&path.0, None).err().unwrap().to_string();
        assert!(message.contains("corrupt"), "{message}");
    }

    #[test]
    fn a_missing_directory_is_named_in_the_error() {
        let dir = std::env::temp_dir().join(format!("elastix-no-such-dir-{}", std::process::id()));
        let err = FileStore::open(dir.join("store"), None).err().unwrap();
        let message = err.to_string();
        assert!(matches!(err, StoreError::File { .. }));
        assert!(message.contains(&format!("directory {} does not exist", dir.display())), "{message}");
    }

    #[test]
    fn the_file_is_deleted_once_world_size_users_have_left() {
        let path = TempPath::new("cleanup");
        let (a, b) = (path.open(Some(2)), path.open(Some(2)));
        a.set(b"k", b"v").unwrap();
        drop(a);
        assert!(path.0.exists(), "one user is still there");
        drop(b);
        assert!(!path.0.exists());

        // a late opener starts a new, empty store
        let c = path.open(Some(2));
        assert_eq!(c.num_keys().unwrap(), 0);
        drop(c);
        assert!(path.0.exists(), "only one of two users has left");
        drop(path.open(Some(2)));
        assert!(!path.0.exists(), "two users have left in all, one after the other");
    }

    #[test]
    fn the_file_is_kept_without_a_world_size() {
        let path = TempPath::new("kept");
        let stores: Vec<_> = (0..3).map(|_| path.open(None)).collect();
        stores[0].set(b"k", b"v").unwrap();
        drop(stores);
        assert!(path.0.exists());
        assert_eq!(path.open(None).get_now(b"k").unwrap().unwrap(), "v");
    }

    #[test]
    fn timeouts_and_interrupts_end_waits() {
        let path = TempPath::new("timeouts");
        let store = path.open(None);
        let start = Instant::now();
        let err = store.wait(&[b"nokey"], Some(Duration::from_millis(50)), &mut never()).unwrap_err();
        assert_eq!(err.to_string(), "wait timeout after 50ms, keys: nokey");
        assert!(start.elapsed() >= Duration::from_millis(50));
        let mut asked = 0;
        let err = store
            .wait(&[b"nokey"], None, &mut || {
                asked += 1;
                asked == 2
            })
            .unwrap_err();
        assert!(matches!(err, StoreError::Interrupted));
        let err = store.queue_pop(b"q", false, None, &mut never()).unwrap_err();
        assert!(matches!(err, StoreError::QueueEmpty));
        let err = store.queue_pop(b"q", true, Some(Duration::from_millis(20)), &mut never()).unwrap_err();
        assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
    }

    #[test]
    fn a_wait_polls_without_spinning() {
        let path = TempPath::new("poll");
        let store = path.open(None);
        let before = path.len();
        let start = Instant::now();
        store.wait_for_change(&[b"nokey"], Duration::from_millis(100)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(100));
        assert_eq!(path.len(), before, "polling writes nothing");
    }
}

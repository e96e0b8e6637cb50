//! Persisting what the workers saved in memory: the newest whole step of each local rank is
//! copied to the checkpoint directory (data first, then the manifest with its checksum, each
//! through a temporary name), and only the newest `keep` steps are kept. Plain blocking file
//! I/O: the agent runs a pass on a blocking thread, never on its control loop; the data is
//! written back as it goes ([`super::writeback`]), not in one burst at the end.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::layout::{rank_dir, rank_of, read_slot, step_dir, step_of, DiskManifest, SlotManifest, SLOTS};
use super::quiet::Quiet;
use super::writeback;

/// Bytes copied per read.
const CHUNK: usize = 4 << 20;

/// A rank's newest step on disk: which, when it got there (ms since the epoch) and how long
/// writing it took (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnDisk {
    pub step: u64,
    pub at_ms: u64,
    pub took_ms: u64,
}

/// Each rank's newest step on disk, kept up to date by the persister.
pub type Record = Arc<Mutex<HashMap<u32, OnDisk>>>;

/// One rank's step, written to disk.
#[derive(Clone, Debug, PartialEq)]
pub struct Persisted {
    pub rank: u32,
    pub step: u64,
    pub bytes: u64,
    pub took: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("cannot write rank {rank}'s step {step} to {}: {source}", path.display())]
    Write { rank: u32, step: u64, path: PathBuf, source: io::Error },
    /// The worker saved into the slot while it was copied: the next pass takes the newer step.
    #[error("rank {rank}'s step {step} changed while it was copied")]
    Changed { rank: u32, step: u64 },
}

pub struct Persister {
    memory: PathBuf,
    run_dir: PathBuf,
    keep: usize,
    /// The newest step persisted per rank, and when (ms since the epoch): what a pass skips,
    /// and what `elastix status` shows.
    record: Record,
    quiet: Arc<Quiet>,
}

impl Persister {
    /// Persists what is saved under `memory` into `run_dir`, keeping the newest `keep` steps,
    /// waiting between chunks while `quiet` holds it back.
    pub fn new(memory: PathBuf, run_dir: PathBuf, keep: usize, quiet: Arc<Quiet>) -> Persister {
        Persister { memory, run_dir, keep: keep.max(1), record: Arc::default(), quiet }
    }

    /// Each rank's newest step persisted, and when (ms since the epoch), kept up to date.
    pub fn record(&self) -> Record {
        self.record.clone()
    }

    /// One pass: every rank whose newest whole step is not on disk yet gets it there.
    pub fn pass(&mut self) -> Vec<Result<Persisted, PersistError>> {
        let mut outcomes = Vec::new();
        for (rank, manifest, data) in newest_slots(&self.memory) {
            if self.persisted(rank).is_some_and(|done| done >= manifest.step) {
                continue;
            }
            let outcome = self.persist(rank, &manifest, &data);
            if let Ok(done) = &outcome {
                let disk =
                    OnDisk { step: done.step, at_ms: (now() * 1000.0) as u64, took_ms: done.took.as_millis() as u64 };
                self.record.lock().unwrap_or_else(PoisonError::into_inner).insert(rank, disk);
            }
            outcomes.push(outcome);
        }
        if outcomes.iter().any(Result::is_ok) {
            self.prune();
        }
        outcomes
    }

    fn persisted(&self, rank: u32) -> Option<u64> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner).get(&rank).map(|disk| disk.step)
    }

    fn persist(&self, rank: u32, manifest: &SlotManifest, data: &Path) -> Result<Persisted, PersistError> {
        let started = Instant::now();
        let dir = step_dir(&self.run_dir, manifest.step);
        let target = dir.join(format!("rank-{rank}.data"));
        let failed = |source: io::Error, path: &Path| PersistError::Write {
            rank,
            step: manifest.step,
            path: path.to_owned(),
            source,
        };
        fs::create_dir_all(&dir).map_err(|err| failed(err, &dir))?;
        let crc32 = copy_with_checksum(data, &target, manifest.size, &self.quiet).map_err(|err| {
            let _ = fs::remove_file(target.with_extension("data.tmp")); // a full disk keeps no half file
            failed(err, &target)
        })?;
        // the slot was saved into meanwhile: what was copied may be torn
        if slot_generation(&self.memory, rank, manifest) != Some(manifest.generation) {
            let _ = fs::remove_file(&target);
            return Err(PersistError::Changed { rank, step: manifest.step });
        }
        let disk = DiskManifest { slot: manifest.clone(), crc32, persisted: now() };
        let json = dir.join(format!("rank-{rank}.json"));
        let bytes = serde_json::to_vec(&disk).expect("a manifest serializes");
        write_atomically(&json, &bytes).map_err(|err| failed(err, &json))?;
        Ok(Persisted { rank, step: manifest.step, bytes: manifest.size, took: started.elapsed() })
    }

    /// Removes this agent's ranks' files of all but their newest `keep` steps, and step
    /// directories left empty. Other ranks' files are left alone: on a directory the nodes
    /// share, each agent keeps the steps of its own ranks.
    fn prune(&self) {
        let Ok(entries) = fs::read_dir(&self.run_dir) else { return };
        let mut steps: Vec<(u64, PathBuf)> =
            entries.flatten().filter_map(|entry| Some((step_of(entry.file_name().to_str()?)?, entry.path()))).collect();
        steps.sort_unstable_by_key(|(step, _)| std::cmp::Reverse(*step));
        let ranks: Vec<u32> = self.record.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
        for rank in ranks {
            let held = steps.iter().filter(|(_, dir)| dir.join(format!("rank-{rank}.json")).exists());
            for (step, dir) in held.skip(self.keep) {
                for file in [format!("rank-{rank}.json"), format!("rank-{rank}.data")] {
                    if let Err(err) = fs::remove_file(dir.join(&file)) {
                        tracing::warn!("cannot remove rank {rank}'s old checkpoint of step {step} ({file}): {err}");
                    }
                }
                let _ = fs::remove_dir(dir); // once no rank's files are left in it
            }
        }
    }
}

/// Each rank's newest whole slot under `memory`: its rank, manifest and data file.
pub fn newest_slots(memory: &Path) -> Vec<(u32, SlotManifest, PathBuf)> {
    let Ok(entries) = fs::read_dir(memory) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(rank) = entry.file_name().to_str().and_then(rank_of) else { continue };
        let newest = (0..SLOTS)
            .filter_map(|slot| read_slot(&entry.path(), rank, slot))
            .max_by_key(|(manifest, _)| manifest.step);
        if let Some((manifest, data)) = newest {
            found.push((rank, manifest, data));
        }
    }
    found.sort_unstable_by_key(|(rank, _, _)| *rank);
    found
}

/// The generation of the slot that held `manifest`'s step, if it still holds it.
pub(super) fn slot_generation(memory: &Path, rank: u32, manifest: &SlotManifest) -> Option<u64> {
    (0..SLOTS).find_map(|slot| {
        let (now, _) = read_slot(&rank_dir(memory, rank), rank, slot)?;
        (now.step == manifest.step).then_some(now.generation)
    })
}

/// Copies the first `size` bytes of `from` to `to` (through a temporary name, synced) and
/// returns their CRC-32, waiting before each chunk while `quiet` holds it back.
fn copy_with_checksum(from: &Path, to: &Path, size: u64, quiet: &Quiet) -> io::Result<u32> {
    let mut source = File::open(from)?.take(size);
    let temporary = to.with_extension("data.tmp");
    let mut target = File::create(&temporary)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; CHUNK];
    let mut copied = 0u64;
    // where each written chunk began: the one two behind is waited for (see `writeback`)
    let mut behind = std::collections::VecDeque::with_capacity(3);
    loop {
        quiet.wait_blocking();
        let n = read_chunk(&mut source, &mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        target.write_all(&buffer[..n])?;
        // the writeback is help for the kernel, not the check: a file system that refuses it
        // is written as before, and the fsync below is what must succeed
        let _ = writeback::start(&target, copied, n as u64);
        behind.push_back((copied, n as u64));
        if behind.len() > 2 {
            let (offset, len) = behind.pop_front().expect("three chunks");
            let _ = writeback::finish(&target, offset, len);
        }
        copied += n as u64;
    }
    if copied != size {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("{copied} of {size} bytes in memory")));
    }
    let _ = writeback::finish(&target, 0, copied);
    target.sync_all()?;
    fs::rename(&temporary, to)?;
    Ok(hasher.finalize())
}

/// Reads up to a whole `buffer` (a short read only at the end), so that chunks are written,
/// and written back, whole.
fn read_chunk(source: &mut impl Read, buffer: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match source.read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(filled)
}

/// Writes `bytes` to `path` through a temporary name, synced, so a reader sees all or nothing.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let temporary = path.with_extension("json.tmp");
    let mut file = File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    fs::rename(&temporary, path)?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::checkpoints::layout::fixtures::{manifest, write_slot};
    use crate::agent::checkpoints::layout::slot_paths;

    fn unhushed(memory: &Path) -> Arc<Quiet> {
        Arc::new(Quiet::new(memory.to_owned()))
    }

    /// A directory of the test's own, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("elastix-ckpt-test-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn save(memory: &Path, rank: u32, slot: u32, step: u64, data: &[u8]) {
        write_slot(memory, slot, &manifest(rank, step, data.len() as u64), data);
    }

    #[test]
    fn the_newest_whole_step_of_each_rank_reaches_disk_with_its_checksum() {
        let root = Scratch::new("newest");
        let (memory, run_dir) = (root.path().join("memory"), root.path().join("run"));
        save(&memory, 0, 0, 3, b"three");
        save(&memory, 0, 1, 4, b"four");
        save(&memory, 1, 0, 4, b"FOUR");
        // a slot being written has no manifest: it does not count
        fs::write(slot_paths(&rank_dir(&memory, 1), 1).0, b"half").unwrap();
        let mut persister = Persister::new(memory.clone(), run_dir.clone(), 2, unhushed(&memory));
        let done: Vec<_> = persister.pass().into_iter().map(Result::unwrap).map(|p| (p.rank, p.step)).collect();
        assert_eq!(done, [(0, 4), (1, 4)]);
        let dir = step_dir(&run_dir, 4);
        assert_eq!(fs::read(dir.join("rank-0.data")).unwrap(), b"four");
        let manifest: DiskManifest = serde_json::from_slice(&fs::read(dir.join("rank-1.json")).unwrap()).unwrap();
        assert_eq!(manifest.crc32, crc32fast::hash(b"FOUR"));
        assert_eq!(manifest.slot.step, 4);
        // nothing new: nothing written again
        assert!(persister.pass().is_empty());
    }

    #[test]
    fn only_the_newest_steps_are_kept() {
        let root = Scratch::new("keep");
        let (memory, run_dir) = (root.path().join("memory"), root.path().join("run"));
        let mut persister = Persister::new(memory.clone(), run_dir.clone(), 2, unhushed(&memory));
        for step in 1..=4 {
            save(&memory, 0, (step % 2) as u32, step, format!("step {step}").as_bytes());
            assert!(persister.pass().into_iter().all(|outcome| outcome.is_ok()));
        }
        let mut left: Vec<_> = fs::read_dir(&run_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["step-000000000003", "step-000000000004"]);
    }

    #[test]
    fn a_shared_directory_keeps_the_steps_of_the_ranks_of_other_nodes() {
        let root = Scratch::new("shared");
        let (mine, theirs, run_dir) = (root.path().join("mine"), root.path().join("theirs"), root.path().join("run"));
        let mut persisters = [
            Persister::new(mine.clone(), run_dir.clone(), 1, unhushed(&mine)),
            Persister::new(theirs.clone(), run_dir.clone(), 1, unhushed(&theirs)),
        ];
        // the other node's rank 1 persisted step 1 and then died; this node's rank 0 goes on
        save(&theirs, 1, 0, 1, b"theirs");
        assert!(persisters[1].pass().into_iter().all(|outcome| outcome.is_ok()));
        for step in 1..=3 {
            save(&mine, 0, (step % 2) as u32, step, b"mine");
            assert!(persisters[0].pass().into_iter().all(|outcome| outcome.is_ok()));
        }
        assert!(step_dir(&run_dir, 1).join("rank-1.json").exists(), "the other node's only step is kept");
        assert!(!step_dir(&run_dir, 1).join("rank-0.json").exists());
        assert!(!step_dir(&run_dir, 2).exists(), "a step directory left empty is removed");
        assert!(step_dir(&run_dir, 3).join("rank-0.json").exists());
    }

    #[test]
    fn an_unwritable_directory_is_an_error_and_the_memory_copy_stays() {
        let root = Scratch::new("unwritable");
        let memory = root.path().join("memory");
        save(&memory, 0, 0, 1, b"one");
        let blocker = root.path().join("not-a-dir");
        fs::write(&blocker, b"a file").unwrap();
        let mut persister = Persister::new(memory.clone(), blocker.join("run"), 2, unhushed(&memory));
        let outcome = persister.pass().pop().unwrap();
        assert!(matches!(outcome, Err(PersistError::Write { rank: 0, step: 1, .. })), "{outcome:?}");
        assert_eq!(newest_slots(&memory).len(), 1, "the memory copy is kept");
    }
}

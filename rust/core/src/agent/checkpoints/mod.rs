//! Checkpoints held by the agent: the workers save into shared memory that the agent owns
//! (`elastix.checkpoint`), so a save blocks training for the copy only, and what was saved
//! outlives the worker that saved it: a worker restarted on this node restores from it. The
//! agent persists the newest whole step of each local rank to `--checkpoint-dir` in the
//! background ([`persist`]), once more when the run ends (a failure, a stop signal), and
//! removes the memory when it exits.
//!
//! A copy of each node's checkpoints is held by a peer's agent too ([`copies`]), so that the
//! part of a lost node is restored from memory as well.
//!
//! * [`layout`]: the files, in memory and on disk, and their manifests.
//! * [`persist`]: copying the newest steps to disk, keeping the newest few ([`writeback`]:
//!   without a burst of dirty pages).
//! * [`copies`]: the copies held by peers, and taking them back.
//! * [`quiet`]: persisting and copies held back while a round restores.

pub mod copies;
pub mod layout;
pub mod persist;
pub mod quiet;
mod writeback;

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;

use self::copies::{Copies, Restore, Round};
use self::persist::{PersistError, Persister};
use self::quiet::Quiet;
use crate::agent::progress::HeldView;
use crate::rendezvous::records::HeldCheckpoint;

/// The variable that tells a worker where its agent keeps checkpoints in memory.
pub const MEMORY_VAR: &str = "ELASTIX_CHECKPOINT_MEMORY";
/// The variable that tells a worker where the job's checkpoints are persisted.
pub const DIR_VAR: &str = "ELASTIX_CHECKPOINT_DIR";
/// The variable that tells a worker the world size the newest step was saved in: rank `r`
/// restores the state of rank `r % that` ([`copies::plan::source`]) unless
/// [`copies::plan::SOURCES_VAR`] names another.
pub const SAVED_WORLD_VAR: &str = "ELASTIX_CHECKPOINT_SAVED_WORLD";
/// The variable that tells a worker the newest step every rank's state is held for in the
/// members' memory: a restore that finds none refuses to start afresh.
pub const HELD_STEP_VAR: &str = "ELASTIX_CHECKPOINT_HELD_STEP";

impl Restore {
    /// What the workers are told of it.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        let world = self.saved_world.map(|world| (SAVED_WORLD_VAR.to_owned(), world.to_string()));
        let step = self.step.map(|step| (HELD_STEP_VAR.to_owned(), step.to_string()));
        let sources = (!self.sources.is_empty())
            .then(|| (copies::plan::SOURCES_VAR.to_owned(), copies::plan::sources_value(&self.sources)));
        world.into_iter().chain(step).chain(sources).collect()
    }
}
/// The start of each agent's checkpoint memory's name: `<prefix><run id>-<agent pid>`.
const MEMORY_PREFIX: &str = "elastix-ckpt-";
/// How often the agent looks for a newer step to persist.
const PERSIST_EVERY: Duration = Duration::from_millis(500);
/// After a pass that wrote, the agent rests this many times as long as the pass took: writing
/// (a checksummed copy and an fsync per rank) takes at most a fifth of the time, so a large
/// state saved every step is persisted every few steps rather than slowing every step (memory
/// and the peer's copy hold the newest step; the disk is for losing both, and for a stop,
/// which persists the newest at once).
const PERSIST_REST: u32 = 4;

/// This agent's checkpoint memory, and the task that persists it.
pub struct Checkpoints {
    memory: PathBuf,
    /// The memory's lock, held while this agent lives ([`crate::agent::shm::hold`]).
    _held: nix::fcntl::Flock<fs::File>,
    persister: Option<Arc<Mutex<Persister>>>,
    /// Each rank's newest step persisted, and when.
    persisted: persist::Record,
    task: Option<JoinHandle<()>>,
    /// The copies held for and by peers (`None`: no copy server could be started).
    copies: Option<Arc<Copies>>,
    /// Holds back persisting and copies while a round restores.
    quiet: Arc<Quiet>,
}

impl Checkpoints {
    /// Makes this agent's memory directory (under /dev/shm, for the job `run_id`, readable by
    /// this user only) and, with `dir`, starts persisting into `dir/<run_id>` keeping `keep`
    /// steps; serves copies to the round's members on `host`, and sends its own to its buddy
    /// at most `copy_rate` bytes a second (0: unlimited). Must run inside a tokio runtime.
    pub fn start(
        run_id: &str,
        dir: Option<&Path>,
        keep: usize,
        host: &str,
        copy_rate: u64,
    ) -> std::io::Result<Checkpoints> {
        let shm = crate::agent::shm::dir();
        // what agents killed outright (SIGKILL, their host lost) held would stay until reboot
        for (dir, bytes) in crate::agent::shm::remove_orphan_dirs(&shm, MEMORY_PREFIX) {
            tracing::info!("removed the checkpoint memory of an agent that died: {} ({bytes} bytes)", dir.display());
        }
        let memory = shm.join(format!("{MEMORY_PREFIX}{}-{}", sanitized(run_id), std::process::id()));
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&memory)?;
        let held = crate::agent::shm::hold(&memory)?;
        let quiet = Arc::new(Quiet::new(memory.clone()));
        let persister = dir.map(|dir| Persister::new(memory.clone(), dir.join(run_id), keep, quiet.clone()));
        let persisted = persister.as_ref().map_or_else(Arc::default, Persister::record);
        let persister = persister.map(|persister| Arc::new(Mutex::new(persister)));
        let task = persister.clone().map(|persister| tokio::spawn(persist_now_and_then(persister)));
        let copies = match Copies::start(memory.clone(), host, copy_rate, quiet.clone()) {
            Ok(copies) => Some(Arc::new(copies)),
            Err(err) => {
                tracing::warn!("cannot serve checkpoint copies ({err}): no peer holds this node's checkpoints");
                None
            }
        };
        Ok(Checkpoints { memory, _held: held, persister, persisted, task, copies, quiet })
    }

    /// A round starts: persisting and copies to the buddy wait until the workers train again
    /// ([`quiet`]), leaving the machine to the round's restore.
    pub fn hush(&self) {
        self.quiet.hush();
    }

    /// A new round: the members learn what each holds, this node takes the copies its workers
    /// will restore from, and starts sending to its new buddy.
    pub async fn enter_round(&self, round: Round<'_>) -> crate::agent::error::Result<Restore> {
        match &self.copies {
            Some(copies) => copies.enter_round(round).await,
            None => Ok(Restore::default()),
        }
    }

    /// What `elastix status` shows of each global rank's checkpoints: its newest step in
    /// memory (size, when saved) and the newest that reached the disk. Reads the slots'
    /// manifests (small files in shared memory) when called.
    pub fn view(&self) -> HeldView {
        let (memory, persisted, copies) = (self.memory.clone(), self.persisted.clone(), self.copies.clone());
        Arc::new(move || {
            let persisted = persisted.lock().unwrap_or_else(PoisonError::into_inner).clone();
            persist::newest_slots(&memory)
                .into_iter()
                .map(|(rank, manifest, _)| {
                    let disk = persisted.get(&rank).copied();
                    let copy = copies.as_ref().and_then(|copies| copies.sent(rank));
                    let held = HeldCheckpoint {
                        step: manifest.step,
                        bytes: manifest.size,
                        saved_ms: (manifest.saved * 1000.0) as u64,
                        persisted_step: disk.map(|disk| disk.step),
                        persisted_ms: disk.map(|disk| disk.at_ms),
                        save_ms: manifest.took.map(|took| (took * 1000.0).round() as u64),
                        persist_ms: disk.map(|disk| disk.took_ms),
                        copied_step: copy.map(|(step, _)| step),
                        restored: layout::read_restored(&layout::rank_dir(&memory, rank)),
                    };
                    (rank, held)
                })
                .collect::<HashMap<_, _>>()
        })
    }

    /// What the workers are told: where the memory is, and where the job persists.
    pub fn worker_env(&self, run_id: &str, dir: Option<&Path>) -> Vec<(String, String)> {
        let mut env = vec![(MEMORY_VAR.to_owned(), self.memory.to_string_lossy().into_owned())];
        if let Some(dir) = dir {
            env.push((DIR_VAR.to_owned(), dir.join(run_id).to_string_lossy().into_owned()));
        }
        env
    }

    /// Persists what is in memory now, up to `within` (the run is ending: a failure, a stop
    /// signal, success), then stops persisting. Copies to and from peers stop first: no round
    /// will restore from this agent, and the disk gets the machine.
    pub async fn flush(&mut self, within: Duration) {
        if let Some(copies) = &self.copies {
            copies.stop();
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.quiet.lift();
        let Some(persister) = self.persister.take() else { return };
        tracing::debug!("persisting the checkpoints in memory, for at most {within:?}");
        let pass = tokio::task::spawn_blocking(move || lock(&persister).pass());
        match tokio::time::timeout(within, pass).await {
            Ok(Ok(outcomes)) => report(outcomes, &mut HashSet::new()),
            Ok(Err(err)) => tracing::warn!("persisting the checkpoints failed: {err}"),
            Err(_) => tracing::warn!("the checkpoints in memory were not all persisted within {within:?}"),
        }
    }
}

impl Drop for Checkpoints {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        if let Some(copies) = &self.copies {
            copies.stop(); // a put still arriving would write into the memory as it goes
        }
        if let Err(err) = remove_memory(&self.memory) {
            tracing::warn!("cannot remove the checkpoint memory {}: {err}", self.memory.display());
        }
    }
}

/// Removes the memory directory. A file operation of a copy stopped a moment ago can still
/// finish on a blocking thread (stopping a task does not stop those) and create a file while
/// the directory is emptied: then the removal fails, and is tried again a few times.
fn remove_memory(memory: &Path) -> std::io::Result<()> {
    const ATTEMPTS: u32 = 5;
    const PAUSE: Duration = Duration::from_millis(20);
    for attempt in 1..=ATTEMPTS {
        match fs::remove_dir_all(memory) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(_) if attempt < ATTEMPTS => std::thread::sleep(PAUSE),
            done => return done,
        }
    }
    Ok(())
}

/// Persists every [`PERSIST_EVERY`], on a blocking thread, resting after each pass that wrote
/// ([`PERSIST_REST`]).
async fn persist_now_and_then(persister: Arc<Mutex<Persister>>) {
    let mut every = tokio::time::interval(PERSIST_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = HashSet::new();
    loop {
        every.tick().await;
        let persister = persister.clone();
        let started = tokio::time::Instant::now();
        match tokio::task::spawn_blocking(move || lock(&persister).pass()).await {
            Ok(outcomes) => {
                let wrote = outcomes.iter().any(Result::is_ok);
                report(outcomes, &mut failing);
                if wrote {
                    let rest = started.elapsed() * PERSIST_REST;
                    tracing::debug!("persisting rests {rest:?} (the pass took a fifth of that)");
                    tokio::time::sleep(rest).await;
                }
            }
            Err(err) => tracing::warn!("persisting the checkpoints failed: {err}"),
        }
    }
}

fn lock(persister: &Mutex<Persister>) -> std::sync::MutexGuard<'_, Persister> {
    persister.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Logs each rank's step persisted (DEBUG) or why not: a write that fails is a WARN once
/// (the memory copy is kept and training goes on), again at DEBUG while it keeps failing, and
/// its recovery an INFO; `failing` holds the ranks whose writes fail. A step saved while it
/// was copied is no fault.
fn report(outcomes: Vec<Result<persist::Persisted, PersistError>>, failing: &mut HashSet<u32>) {
    for outcome in outcomes {
        match outcome {
            Ok(done) => {
                if failing.remove(&done.rank) {
                    tracing::info!("rank {}'s checkpoints reach the disk again (step {})", done.rank, done.step);
                }
                tracing::debug!(
                    rank = done.rank,
                    step = done.step,
                    "checkpoint persisted: {} bytes in {:.0?}",
                    done.bytes,
                    done.took
                )
            }
            Err(changed @ PersistError::Changed { .. }) => {
                tracing::debug!("{changed}; the next pass takes the newer step")
            }
            Err(err @ PersistError::Write { rank, .. }) => {
                if failing.insert(rank) {
                    tracing::warn!("{err}; the copy in memory is kept and training goes on");
                } else {
                    tracing::debug!("{err} (still)");
                }
            }
        }
    }
}

/// `run_id` as a file name.
fn sanitized(run_id: &str) -> String {
    run_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

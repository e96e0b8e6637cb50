//! Nothing a worker started outlives the agent, even when the agent is SIGKILLed.
//!
//! What protects what (each facility used where the system has it; none is needed to run):
//! * Every child of the agent (worker or standby) runs in its own process group with a
//!   parent-death signal ([`crate::agent::workers::process`]): it dies with the agent, and a clean stop kills
//!   its whole group.
//! * The cleanup [`watchdog`], a process started before the first worker that outlives the
//!   agent: it is told each child's process group while the group can still be alive, and
//!   kills the groups still listed once the agent is gone. This covers a worker's children
//!   that stay in its group (DataLoader workers, `subprocess.Popen`).
//! * A cgroup v2 per job where one can be created ([`cgroup`]): every worker and all it
//!   starts, including processes that moved to a process group or session of their own
//!   (`os.setsid()`, daemons), is in its worker group's leaf. A clean stop kills the leaf; the
//!   watchdog kills the whole job cgroup and removes its directories when the agent is gone.
//!
//! Not used: `PR_SET_CHILD_SUBREAPER`. A subreaper inherits every orphaned descendant, and
//! must reap each of them; tokio reaps only the children it started, by pid, and the only
//! way to reap unknown pids, `waitpid(-1)`, would steal the exit statuses of tokio's children
//! (the workers) and of any child the host Python program starts. Orphans reparented to the
//! agent could not be told apart from those safely, and where the cgroup exists it already
//! finds them, living or not, without a second reaper.

mod cgroup;
mod watchdog;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use nix::errno::Errno;
use nix::sys::signal::killpg;
use nix::unistd::Pid;

pub use cgroup::Cgroup;
use cgroup::{JobCgroup, Leaf};
use watchdog::{Op, Watchdog, GROUP_CAPACITY};

/// The process-wide protection, started with the first child and kept for the process's life
/// (the watchdog's end-of-file is the agent process's end).
struct Reaper {
    watchdog: Option<Watchdog>,
    cgroup: Option<JobCgroup>,
    /// Cleared when a child could not join the cgroup: later children do not try.
    cgroup_works: AtomicBool,
    /// Process groups the watchdog holds.
    watched: AtomicUsize,
    warned_full: AtomicBool,
    warned_lost: AtomicBool,
}

static REAPER: OnceLock<Reaper> = OnceLock::new();

fn reaper() -> &'static Reaper {
    REAPER.get_or_init(Reaper::start)
}

impl Reaper {
    fn start() -> Reaper {
        let cgroup = JobCgroup::create();
        // the private copy of a secret from ELASTIX_AUTH_TOKEN (made before the first worker
        // starts): the watchdog removes it if the agent is killed
        let secret_dir = crate::auth::secret::private_copy_dir()
            .and_then(|dir| std::ffi::CString::new(dir.into_os_string().into_encoded_bytes()).ok());
        let job = cgroup.as_ref().ok().map(|job| (job.dir_c(), job.lock_fd()));
        let watchdog = Watchdog::start(job, secret_dir.as_deref());
        let (watchdog, cgroup) = match (watchdog, cgroup) {
            (Ok(watchdog), Ok(cgroup)) => {
                tracing::debug!(
                    "orphan protection: cgroup {} holds the workers and all they start; the cleanup watchdog \
                     (pid {}) kills it and the workers' process groups if the agent dies",
                    cgroup.dir().display(),
                    watchdog.pid()
                );
                (Some(watchdog), Some(cgroup))
            }
            (Ok(watchdog), Err(why)) => {
                tracing::info!(
                    "no cgroup for this job ({why}): the cleanup watchdog (pid {}) kills the workers' process \
                     groups if the agent dies, but a process a worker moved to a session or process group of \
                     its own (setsid) is not tracked",
                    watchdog.pid()
                );
                (Some(watchdog), None)
            }
            (Err(err), cgroup) => {
                // without a watchdog, nothing would remove the job cgroup: do without it
                if let Ok(cgroup) = cgroup {
                    cgroup.remove();
                }
                tracing::warn!(
                    "cannot start the cleanup watchdog ({err}): workers still die with the agent, but what they \
                     started may outlive an agent that is killed"
                );
                (None, None)
            }
        };
        Reaper {
            watchdog,
            cgroup,
            cgroup_works: AtomicBool::new(true),
            watched: AtomicUsize::new(0),
            warned_full: AtomicBool::new(false),
            warned_lost: AtomicBool::new(false),
        }
    }

    fn send(&self, op: Op, id: i32) {
        let Some(watchdog) = &self.watchdog else { return };
        if let Err(err) = watchdog.send(op, id) {
            if !self.warned_lost.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "cannot reach the cleanup watchdog (pid {}): {err}; what the workers start may outlive an \
                     agent that is killed",
                    watchdog.pid()
                );
            }
        }
    }

    fn job_cgroup(&self) -> Option<&JobCgroup> {
        self.cgroup.as_ref().filter(|_| self.cgroup_works.load(Ordering::Relaxed))
    }
}

/// Starts the protection if it is not running yet: before the first child, so that it is
/// covered from its start.
pub fn ensure_started() {
    reaper();
}

/// The cgroup standbys wait in (the job's), if there is one.
pub fn standby_cgroup() -> Option<Cgroup> {
    reaper().job_cgroup().map(|job| job.cgroup().clone())
}

/// A cgroup for one worker group, if the job has one: killed and removed when dropped.
pub fn group_cgroup() -> Option<GroupCgroup> {
    let reaper = reaper();
    let job = reaper.job_cgroup()?;
    let announce = |id: u32| reaper.send(Op::WatchLeaf, id as i32);
    match job.create_leaf(announce) {
        Ok(leaf) => Some(GroupCgroup { leaf: Some(leaf) }),
        Err(err) => {
            tracing::warn!("cannot create a cgroup for the workers in {}: {err}", job.dir().display());
            None
        }
    }
}

/// Checks, after a spawn, that the child joined `cgroup`; if not, says why that matters once
/// and stops using cgroups.
pub fn check_joined(cgroup: &Cgroup, pid: u32) {
    if cgroup.holds(pid) != Some(false) {
        return; // in it, or already gone
    }
    let reaper = reaper();
    if reaper.cgroup_works.swap(false, Ordering::Relaxed) {
        tracing::info!(
            "process {pid} could not join cgroup {} (writing to its cgroup.procs failed); using process groups \
             only: a process a worker moves to a session of its own (setsid) is not tracked",
            cgroup.path()
        );
    }
}

/// A worker group's cgroup leaf.
pub struct GroupCgroup {
    leaf: Option<Leaf>,
}

impl GroupCgroup {
    pub fn cgroup(&self) -> Option<&Cgroup> {
        self.leaf.as_ref().map(Leaf::cgroup)
    }

    /// SIGKILL to every process in it.
    pub fn kill(&self) {
        if let Some(leaf) = &self.leaf {
            leaf.kill();
        }
    }
}

impl Drop for GroupCgroup {
    fn drop(&mut self) {
        if let Some(leaf) = self.leaf.take() {
            leaf.remove(|id| reaper().send(Op::UnwatchLeaf, id as i32));
        }
    }
}

/// The watchdog's hold on a child's process group: from the child's start until the group
/// is known to be empty (its id may then be reused), or until this is dropped. Shared between
/// the task that reaps the child and the code that may still signal its group.
#[derive(Clone, Debug)]
pub struct Watch(Arc<Watched>);

#[derive(Debug)]
struct Watched {
    pgid: i32,
    released: AtomicBool,
}

/// Has the watchdog watch the process group `pgid` (a child started with `process_group(0)`).
pub fn watch(pgid: u32) -> Watch {
    let reaper = reaper();
    let pgid = pgid as i32;
    if reaper.watched.fetch_add(1, Ordering::Relaxed) >= GROUP_CAPACITY
        && !reaper.warned_full.swap(true, Ordering::Relaxed)
    {
        tracing::warn!("more than {GROUP_CAPACITY} process groups at once: the cleanup watchdog ignores the others");
    }
    reaper.send(Op::WatchGroup, pgid);
    Watch(Arc::new(Watched { pgid, released: AtomicBool::new(false) }))
}

impl Watch {
    /// Call once the group's leader was reaped: if nothing is left in its group, the id is
    /// free for reuse, so the watchdog forgets it.
    pub fn release_if_empty(&self) {
        if killpg(Pid::from_raw(self.0.pgid), None) == Err(Errno::ESRCH) {
            self.0.release();
        }
    }

    /// Whether the group was found empty: its id may belong to someone else now.
    pub fn is_released(&self) -> bool {
        self.0.released.load(Ordering::Relaxed)
    }
}

impl Watched {
    fn release(&self) {
        if !self.released.swap(true, Ordering::Relaxed) {
            let reaper = reaper();
            reaper.watched.fetch_sub(1, Ordering::Relaxed);
            reaper.send(Op::UnwatchGroup, self.pgid);
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.release();
    }
}

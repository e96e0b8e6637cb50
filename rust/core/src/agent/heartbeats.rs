//! Hang detection: one shared page per attempt, where each worker's `elastix.heartbeat()`,
//! `elastix.expect_progress(...)` and `elastix.timer.expires(...)` write plain 64-bit words
//! (no system call, no store round trip), and the check that reads them.
//!
//! A worker's slot is [`SLOT_WORDS`] words: the time of its last heartbeat, the progress
//! window it is in (`expect_progress`), the deadline of its earliest timer, the signal on
//! which it dumps its threads' stacks (0 until armed), when its main thread last moved and
//! the pid of the process that owns the slot, then its collective flight recorder: how many
//! collectives it entered, and the last [`FLIGHTS`] of them ([`Flight`], written by
//! elastix.collectives as each starts and ends); the rest is spare. Times are
//! `CLOCK_MONOTONIC` nanoseconds, the clock Python's `time.monotonic_ns()` reads; 0 means none.
//!
//! Every Python worker fills the last two with no change to its code: elastix's site hook
//! (python/elastix/worker/site) claims the slot for the worker's own pid (children
//! started with spawn or forkserver, which inherit the variables, leave it alone) and a
//! thread of it writes when the main thread's current frame and line last changed.
//!
//! A worker is hung when its timer expired, when it is in a progress window and its last
//! heartbeat is older than that, or, with `--worker-timeout T`: when its last heartbeat (once
//! it sent one) is older than T, or, for a worker that never sent one, when its main thread
//! has not moved and it used no CPU ([`super::cpu`]) for T. Explicit heartbeats and windows
//! take precedence over the automatic progress.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use nix::time::{clock_gettime, ClockId};

/// Words in one worker's slot (256 bytes: whole cache lines, so workers never share one).
pub const SLOT_WORDS: usize = 32;
const LAST_BEAT: usize = 0;
const WINDOW: usize = 1;
const DEADLINE: usize = 2;
const DUMP_SIGNAL: usize = 3;
const MOVED: usize = 4;
const OWNER: usize = 5;
/// Heartbeats sent, and the last step one named plus one (0: none named).
const BEATS: usize = 6;
const STEP: usize = 7;
/// The number of collectives entered so far; the entries follow, a ring of [`FLIGHTS`].
const FLIGHT_COUNT: usize = 8;
const FLIGHT_RING: usize = 9;
/// Words per flight entry: kind | group << 8, sequence number, bytes, entered, finished.
const FLIGHT_WORDS: usize = 5;
/// Collectives each slot remembers.
pub const FLIGHTS: usize = 4;

/// One collective as its rank recorded it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Flight {
    /// The operation (elastix.collectives.descriptor.KINDS).
    pub kind: u8,
    pub group: u64,
    /// Its number among the group's collectives on this rank (the first is 1).
    pub seq: u64,
    pub bytes: u64,
    pub entered: u64,
    /// 0 while it runs.
    pub finished: u64,
}
/// The variables a worker finds its slot with.
pub const FILE_VAR: &str = "ELASTIX_HEARTBEAT_FILE";
pub const SLOT_VAR: &str = "ELASTIX_HEARTBEAT_SLOT";
/// Where a worker's stack dumps go (see [`super::stacks`]).
pub const STACKS_VAR: &str = "ELASTIX_STACKS_FILE";
/// How often (milliseconds) the site hook looks at the main thread; set with `--worker-timeout`.
pub const PROGRESS_VAR: &str = "ELASTIX_PROGRESS_INTERVAL_MS";

/// How often the site hook should look for a worker timeout: often enough to see a move
/// within a small part of it, rarely enough to cost nothing.
pub fn progress_interval(worker_timeout: Duration) -> Duration {
    (worker_timeout / 10).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// The wall-clock time of a moment on the workers' clock (`None` for 0: never).
pub fn wall_time(ns: u64) -> Option<std::time::SystemTime> {
    (ns != 0).then(|| std::time::SystemTime::now() - Duration::from_nanos(now_ns().saturating_sub(ns)))
}

/// Moment `ns` of the workers' clock on this process's monotonic clock (`None` for 0: never).
pub fn instant(ns: u64) -> Option<std::time::Instant> {
    let now = std::time::Instant::now();
    (ns != 0).then(|| now.checked_sub(Duration::from_nanos(now_ns().saturating_sub(ns))).unwrap_or(now))
}

/// Now on the workers' clock.
pub fn now_ns() -> u64 {
    clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

/// What one worker's slot says at a moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub last_beat: u64,
    pub window: u64,
    pub deadline: u64,
    pub dump_signal: u64,
    /// When the main thread's frame or line last changed (0: nobody watches it).
    pub moved: u64,
    /// The pid of the process that claimed the slot (0: none yet).
    pub owner: u64,
    /// Heartbeats sent so far.
    pub beats: u64,
    /// The training step the last heartbeat named, if any did.
    pub step: Option<u64>,
}

impl Heartbeats {
    /// The last collectives worker `slot` recorded, oldest first.
    pub fn flights(&self, slot: usize) -> Vec<Flight> {
        let count = self.word(slot, FLIGHT_COUNT) as usize;
        (count.saturating_sub(FLIGHTS)..count)
            .map(|n| {
                let at = FLIGHT_RING + (n % FLIGHTS) * FLIGHT_WORDS;
                let head = self.word(slot, at);
                Flight {
                    kind: (head & 0xff) as u8,
                    group: head >> 8,
                    seq: self.word(slot, at + 1),
                    bytes: self.word(slot, at + 2),
                    entered: self.word(slot, at + 3),
                    finished: self.word(slot, at + 4),
                }
            })
            .collect()
    }
}

/// Why a worker counts as hung.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lapse {
    TimerExpired {
        late: Duration,
    },
    NoProgress {
        window: Duration,
        since: Duration,
    },
    NoHeartbeat {
        timeout: Duration,
        since: Duration,
    },
    /// No heartbeat ever, and neither a move of the main thread nor CPU use for the timeout.
    Stalled {
        timeout: Duration,
        since: Duration,
    },
    /// Hung workers wait in a collective for this one, which never entered it (it may look
    /// busy or may not have lapsed yet: it is the cause all the same).
    HoldsOthersUp,
}

impl std::fmt::Display for Lapse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = |d: &Duration| format!("{:.2}s", d.as_secs_f64());
        match self {
            Lapse::TimerExpired { late } => write!(f, "its timer expired {} ago", secs(late)),
            Lapse::NoProgress { window, since } => {
                write!(f, "no progress for {} in a window of {}", secs(since), secs(window))
            }
            Lapse::NoHeartbeat { timeout, since } => {
                write!(f, "no heartbeat for {} (--worker-timeout {})", secs(since), secs(timeout))
            }
            Lapse::Stalled { timeout, since } => write!(
                f,
                "its main thread has not moved and it used no CPU for {} (--worker-timeout {})",
                secs(since),
                secs(timeout)
            ),
            Lapse::HoldsOthersUp => write!(f, "hung ranks wait for it in a collective"),
        }
    }
}

impl Slot {
    /// Whether this slot, read at `now`, makes its worker hung; `busy_at`: the last moment
    /// its process was seen using CPU (0: never).
    pub fn lapse(&self, now: u64, worker_timeout: Option<Duration>, busy_at: u64) -> Option<Lapse> {
        let since_beat = Duration::from_nanos(now.saturating_sub(self.last_beat));
        if self.deadline != 0 && now > self.deadline {
            return Some(Lapse::TimerExpired { late: Duration::from_nanos(now - self.deadline) });
        }
        let window = Duration::from_nanos(self.window);
        if self.window != 0 && self.last_beat != 0 && since_beat > window {
            return Some(Lapse::NoProgress { window, since: since_beat });
        }
        let timeout = worker_timeout?;
        if self.last_beat != 0 {
            return (since_beat > timeout).then_some(Lapse::NoHeartbeat { timeout, since: since_beat });
        }
        if self.window != 0 || self.moved == 0 {
            return None; // in a window that has not seen a beat yet, or nobody watches it
        }
        let since = Duration::from_nanos(now.saturating_sub(self.moved.max(busy_at)));
        (since > timeout).then_some(Lapse::Stalled { timeout, since })
    }
}

/// One attempt's shared page, removed from the filesystem when dropped (workers keep their
/// mappings).
pub struct Heartbeats {
    map: MmapRaw,
    slots: usize,
    path: PathBuf,
}

impl Heartbeats {
    /// A fresh page for one attempt's `slots` workers. The first one of a process also
    /// removes the pages of agents that died without removing theirs (SIGKILL).
    pub fn for_attempt(slots: usize) -> io::Result<Heartbeats> {
        static ATTEMPTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = ATTEMPTS.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            remove_orphans(&page_dir());
        }
        Heartbeats::create(slots, &format!("{PAGE_PREFIX}{}-{n}", std::process::id()))
    }

    /// A zeroed page for `slots` workers, in `/dev/shm` where there is one.
    pub fn create(slots: usize, name: &str) -> io::Result<Heartbeats> {
        let path = page_dir().join(name);
        let file = File::options().read(true).write(true).create_new(true).open(&path)?;
        let made = (|| {
            file.set_len((slots.max(1) * SLOT_WORDS * 8) as u64)?;
            MmapOptions::new().map_raw(&file)
        })();
        match made {
            Ok(map) => Ok(Heartbeats { map, slots, path }),
            Err(err) => {
                let _ = std::fs::remove_file(&path);
                Err(err)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn word(&self, slot: usize, index: usize) -> u64 {
        assert!(slot < self.slots && index < SLOT_WORDS);
        let offset = (slot * SLOT_WORDS + index) * 8;
        // SAFETY: the mapping is page-aligned and `slots * SLOT_WORDS` words long (checked
        // above), so the pointer is in bounds and 8-byte aligned, and it lives as long as
        // `self`. Workers write these words concurrently, so they are only ever read
        // atomically, never through a plain reference.
        let word = unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast::<u64>()) };
        word.load(Ordering::Relaxed)
    }

    pub fn slot(&self, slot: usize) -> Slot {
        Slot {
            last_beat: self.word(slot, LAST_BEAT),
            window: self.word(slot, WINDOW),
            deadline: self.word(slot, DEADLINE),
            dump_signal: self.word(slot, DUMP_SIGNAL),
            moved: self.word(slot, MOVED),
            owner: self.word(slot, OWNER),
            beats: self.word(slot, BEATS),
            step: self.word(slot, STEP).checked_sub(1),
        }
    }
}

/// Pages are named `<PAGE_PREFIX><agent pid>-<attempt>`.
const PAGE_PREFIX: &str = "elastix-heartbeats-";

fn page_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Removes the pages in `dir` whose agent is no longer running.
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(PAGE_PREFIX)).and_then(|rest| rest.split('-').next());
        let Some(pid) = pid.and_then(|pid| pid.parse::<i32>().ok()) else { continue };
        // ESRCH: no such process (EPERM means one runs, under another user)
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) == Err(nix::errno::Errno::ESRCH) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn lapses() {
        let now = 100 * S;
        let five = Some(Duration::from_secs(5));
        let quiet = Slot::default();
        assert_eq!(quiet.lapse(now, Some(Duration::from_secs(1)), 0), None, "nothing watched: never hung");
        let beat = Slot { last_beat: 90 * S, ..Slot::default() };
        assert_eq!(beat.lapse(now, None, 0), None, "no --worker-timeout");
        assert_eq!(
            beat.lapse(now, five, 0),
            Some(Lapse::NoHeartbeat { timeout: Duration::from_secs(5), since: Duration::from_secs(10) })
        );
        assert_eq!(beat.lapse(now, Some(Duration::from_secs(20)), 0), None);
        let window = Slot { last_beat: 90 * S, window: 5 * S, ..Slot::default() };
        assert!(matches!(window.lapse(now, None, 0), Some(Lapse::NoProgress { .. })));
        let timer = Slot { last_beat: 99 * S, deadline: 98 * S, ..Slot::default() };
        assert_eq!(timer.lapse(now, None, 0), Some(Lapse::TimerExpired { late: Duration::from_secs(2) }));
        assert_eq!(Slot { deadline: 101 * S, ..Slot::default() }.lapse(now, None, 0), None);
        // automatic progress: the main thread, else the CPU, must have moved within the timeout
        let still = Slot { moved: 90 * S, ..Slot::default() };
        assert_eq!(
            still.lapse(now, five, 0),
            Some(Lapse::Stalled { timeout: Duration::from_secs(5), since: Duration::from_secs(10) })
        );
        assert_eq!(still.lapse(now, five, 97 * S), None, "busy in a C call");
        assert_eq!(Slot { moved: 97 * S, ..Slot::default() }.lapse(now, five, 0), None);
        assert_eq!(still.lapse(now, None, 0), None, "no --worker-timeout");
        // explicit heartbeats take precedence: a recent beat keeps a still main thread alive
        assert_eq!(Slot { moved: 90 * S, last_beat: 98 * S, ..Slot::default() }.lapse(now, five, 0), None);
    }

    #[test]
    fn pages_of_dead_agents_are_removed_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("elastix-hb-orphans-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // a pid past the kernel's limit never runs
        let dead = dir.join(format!("{PAGE_PREFIX}{}-0", i32::MAX));
        let live = dir.join(format!("{PAGE_PREFIX}{}-0", std::process::id()));
        let other = dir.join("unrelated-file");
        for path in [&dead, &live, &other] {
            std::fs::write(path, b"").unwrap();
        }
        remove_orphans(&dir);
        assert!(!dead.exists() && live.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_page_reads_what_a_worker_wrote_and_is_removed_when_dropped() {
        let page = Heartbeats::create(2, &format!("elastix-test-hb-{}", std::process::id())).unwrap();
        let path = page.path().to_owned();
        let map = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        // a worker writes its slot's words in place
        let mut words = [0u64; 2 * SLOT_WORDS];
        words[0] = 7;
        words[SLOT_WORDS..SLOT_WORDS + 5].copy_from_slice(&[11, 12, 13, 14, 15]);
        words[SLOT_WORDS + BEATS..SLOT_WORDS + STEP + 1].copy_from_slice(&[9, 42]);
        // slot 1 entered 5 collectives: the ring holds the last 4, the fifth in its first place
        words[SLOT_WORDS + FLIGHT_COUNT] = 5;
        for n in 1..5u64 {
            let at = SLOT_WORDS + FLIGHT_RING + (n as usize % FLIGHTS) * FLIGHT_WORDS;
            words[at..at + FLIGHT_WORDS].copy_from_slice(&[1 | (3 << 8), n + 1, 64, 100 + n, 200 + n]);
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        std::os::unix::fs::FileExt::write_all_at(&map, &bytes, 0).unwrap();
        assert_eq!(page.slot(0).last_beat, 7);
        assert_eq!(
            page.slot(1),
            Slot {
                last_beat: 11,
                window: 12,
                deadline: 13,
                dump_signal: 14,
                moved: 15,
                owner: 0,
                beats: 9,
                step: Some(41)
            }
        );
        assert_eq!((page.slot(0).beats, page.slot(0).step), (0, None), "no step named");
        let flights = page.flights(1);
        assert_eq!(flights.iter().map(|f| f.seq).collect::<Vec<_>>(), [2, 3, 4, 5]);
        assert_eq!(flights[3], Flight { kind: 1, group: 3, seq: 5, bytes: 64, entered: 104, finished: 204 });
        assert!(page.flights(0).is_empty());
        drop(page);
        assert!(!path.exists());
    }
}

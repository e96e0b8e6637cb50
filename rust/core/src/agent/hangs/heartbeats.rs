//! Hang detection: one shared page per attempt, where each worker's `elastix.heartbeat()`,
//! `elastix.expect_progress(...)` and `elastix.timer.expires(...)` write plain 64-bit words
//! (no system call, no store round trip), and the check that reads them.
//!
//! A worker's slot is [`SLOT_WORDS`] words: the time of its last heartbeat, the progress
//! window it is in (`expect_progress`), the deadline of its earliest timer, the signal on
//! which it dumps its threads' stacks (0 until armed), a spare word, and the pid of the
//! process that owns the slot, then its collective flight recorder: how many collectives it
//! entered, and the last [`FLIGHTS`] of them ([`Flight`], written by elastix.collectives as
//! each starts and ends), then the step of its last checkpoint save (written by
//! elastix.checkpoint: where a re-form for a joining node can stop it); the rest is spare. Times are `CLOCK_MONOTONIC` nanoseconds, the
//! clock Python's `time.monotonic_ns()` reads; 0 means none.
//!
//! Every Python worker claims its slot with no change to its code: elastix's site hook
//! (python/elastix/worker/site) writes the worker's own pid as the owner (children started
//! with spawn or forkserver, which inherit the variables, leave it alone) and arms the stack
//! dumps. The agent then watches the owner through the kernel ([`crate::agent::hangs::activity`]).
//!
//! A worker is hung when its timer expired, when it is in a progress window and its last
//! heartbeat is older than that, or, with `--worker-timeout T`: when its last heartbeat (once
//! it sent one) is older than T, or, for a worker that never sent one, when its main thread
//! has not run at all and its processes used no CPU for T. Explicit heartbeats and windows
//! take precedence over the automatic watch.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use nix::time::{clock_gettime, ClockId};

use crate::agent::hangs::activity::Activity;

/// Words in one worker's slot (256 bytes: whole cache lines, so workers never share one).
pub const SLOT_WORDS: usize = 32;
const LAST_BEAT: usize = 0;
const WINDOW: usize = 1;
const DEADLINE: usize = 2;
const DUMP_SIGNAL: usize = 3;
// word 4 is spare (an older site hook wrote its frame sampler's moves there)
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
/// The step of the worker's last `elastix.checkpoint` save, plus one (0: none yet).
const SAVED: usize = FLIGHT_RING + FLIGHTS * FLIGHT_WORDS;

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
/// Where a worker's stack dumps go (see [`crate::agent::hangs::stacks`]).
pub const STACKS_VAR: &str = "ELASTIX_STACKS_FILE";
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
    /// The pid of the process that claimed the slot (0: none yet).
    pub owner: u64,
    /// Heartbeats sent so far.
    pub beats: u64,
    /// The training step the last heartbeat named, if any did.
    pub step: Option<u64>,
    /// When it entered the elastix collective it is inside, if it is inside one (0: none).
    pub collective_since: u64,
    /// The step of its last checkpoint save, if it saved one.
    pub saved: Option<u64>,
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
    /// No heartbeat ever, and neither a run of the main thread nor CPU use for the timeout.
    Blocked {
        timeout: Duration,
        since: Duration,
    },
    /// No heartbeat ever, and inside one elastix collective without CPU use for the timeout
    /// (the collectives wake now and then to look for an abort: that is no progress).
    InCollective {
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
            Lapse::Blocked { timeout, since } => write!(
                f,
                "its main thread has not run and its processes used no CPU for {} (--worker-timeout {})",
                secs(since),
                secs(timeout)
            ),
            Lapse::InCollective { timeout, since } => write!(
                f,
                "it has waited in a collective and its processes used no CPU for {} (--worker-timeout {})",
                secs(since),
                secs(timeout)
            ),
            Lapse::HoldsOthersUp => write!(f, "hung ranks wait for it in a collective"),
        }
    }
}

impl Slot {
    /// Whether this slot, read at `now`, makes its worker hung; `watched`: what the kernel
    /// showed of its owner ([`Activity`]; `None`: nobody claimed the slot, so nothing is known).
    pub fn lapse(&self, now: u64, worker_timeout: Option<Duration>, watched: Option<&Activity>) -> Option<Lapse> {
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
        let Some(watched) = watched.filter(|watched| self.window == 0 && watched.main_ran_at() != 0) else {
            return None; // in a window that has not seen a beat yet, or nobody watches it
        };
        if self.collective_since != 0 {
            let since = Duration::from_nanos(now.saturating_sub(self.collective_since.max(watched.busy_at())));
            return (since > timeout).then_some(Lapse::InCollective { timeout, since });
        }
        let since = Duration::from_nanos(now.saturating_sub(watched.main_ran_at().max(watched.busy_at())));
        (since > timeout).then_some(Lapse::Blocked { timeout, since })
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
            crate::agent::shm::remove_orphans(&crate::agent::shm::dir(), PAGE_PREFIX);
        }
        Heartbeats::create(slots, &format!("{PAGE_PREFIX}{}-{n}", std::process::id()))
    }

    /// A zeroed page for `slots` workers, in `/dev/shm` where there is one.
    pub fn create(slots: usize, name: &str) -> io::Result<Heartbeats> {
        let path = crate::agent::shm::dir().join(name);
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

    /// Zeroes worker `slot`'s words, for a new process in that place (a worker restarted
    /// alone while its group stays): it claims the slot as the first did.
    pub fn clear(&self, slot: usize) {
        assert!(slot < self.slots);
        for index in 0..SLOT_WORDS {
            let offset = (slot * SLOT_WORDS + index) * 8;
            // SAFETY: as in `word`: in bounds, 8-byte aligned, alive as long as `self`, and only
            // ever accessed atomically.
            let word = unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast::<u64>()) };
            word.store(0, Ordering::Relaxed);
        }
    }

    pub fn slot(&self, slot: usize) -> Slot {
        Slot {
            last_beat: self.word(slot, LAST_BEAT),
            window: self.word(slot, WINDOW),
            deadline: self.word(slot, DEADLINE),
            dump_signal: self.word(slot, DUMP_SIGNAL),
            owner: self.word(slot, OWNER),
            beats: self.word(slot, BEATS),
            step: self.word(slot, STEP).checked_sub(1),
            collective_since: self.flights(slot).last().filter(|flight| flight.finished == 0).map_or(0, |f| f.entered),
            saved: self.word(slot, SAVED).checked_sub(1),
        }
    }
}

/// Pages are named `<PAGE_PREFIX><agent pid>-<attempt>`.
const PAGE_PREFIX: &str = "elastix-heartbeats-";

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
        assert_eq!(quiet.lapse(now, Some(Duration::from_secs(1)), None), None, "nothing watched: never hung");
        let beat = Slot { last_beat: 90 * S, ..Slot::default() };
        assert_eq!(beat.lapse(now, None, None), None, "no --worker-timeout");
        assert_eq!(
            beat.lapse(now, five, None),
            Some(Lapse::NoHeartbeat { timeout: Duration::from_secs(5), since: Duration::from_secs(10) })
        );
        assert_eq!(beat.lapse(now, Some(Duration::from_secs(20)), None), None);
        let window = Slot { last_beat: 90 * S, window: 5 * S, ..Slot::default() };
        assert!(matches!(window.lapse(now, None, None), Some(Lapse::NoProgress { .. })));
        let timer = Slot { last_beat: 99 * S, deadline: 98 * S, ..Slot::default() };
        assert_eq!(timer.lapse(now, None, None), Some(Lapse::TimerExpired { late: Duration::from_secs(2) }));
        assert_eq!(Slot { deadline: 101 * S, ..Slot::default() }.lapse(now, None, None), None);
        // automatic watch: the main thread must have run, else the processes used CPU, within the timeout
        let owned = Slot { owner: 42, ..Slot::default() };
        let blocked = Activity::seen(90 * S, 0);
        assert_eq!(
            owned.lapse(now, five, Some(&blocked)),
            Some(Lapse::Blocked { timeout: Duration::from_secs(5), since: Duration::from_secs(10) })
        );
        assert_eq!(owned.lapse(now, five, Some(&Activity::seen(90 * S, 97 * S))), None, "busy in a C call");
        assert_eq!(owned.lapse(now, five, Some(&Activity::seen(97 * S, 0))), None, "it ran");
        assert_eq!(owned.lapse(now, None, Some(&blocked)), None, "no --worker-timeout");
        assert_eq!(owned.lapse(now, five, Some(&Activity::default())), None, "not watched yet");
        // explicit heartbeats and windows take precedence: a recent beat keeps a blocked main thread alive
        let beating = Slot { last_beat: 98 * S, ..owned };
        assert_eq!(beating.lapse(now, five, Some(&blocked)), None);
        let in_window = Slot { window: 60 * S, ..owned };
        assert_eq!(in_window.lapse(now, five, Some(&blocked)), None, "a window without a beat yet");
        // inside a collective, the main thread's wakes (an abort check) are no progress
        let waiting = Slot { collective_since: 92 * S, ..owned };
        let woken = Activity::seen(99 * S, 0);
        assert_eq!(
            waiting.lapse(now, five, Some(&woken)),
            Some(Lapse::InCollective { timeout: Duration::from_secs(5), since: Duration::from_secs(8) })
        );
        assert_eq!(waiting.lapse(now, five, Some(&Activity::seen(99 * S, 98 * S))), None, "moving bytes");
        assert_eq!(Slot { collective_since: 97 * S, ..owned }.lapse(now, five, Some(&woken)), None);
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
        words[SLOT_WORDS + SAVED] = 18; // its last checkpoint save was of step 17
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
                owner: 0,
                beats: 9,
                step: Some(41),
                collective_since: 0,
                saved: Some(17),
            }
        );
        assert_eq!((page.slot(0).beats, page.slot(0).step), (0, None), "no step named");
        assert_eq!(page.slot(0).saved, None, "no checkpoint saved");
        let flights = page.flights(1);
        assert_eq!(flights.iter().map(|f| f.seq).collect::<Vec<_>>(), [2, 3, 4, 5]);
        assert_eq!(flights[3], Flight { kind: 1, group: 3, seq: 5, bytes: 64, entered: 104, finished: 204 });
        assert!(page.flights(0).is_empty());
        // a worker restarted alone finds its slot as the first one did, the others' untouched
        page.clear(1);
        assert_eq!(page.slot(1), Slot::default());
        assert!(page.flights(1).is_empty());
        assert_eq!(page.slot(0).last_beat, 7);
        drop(page);
        assert!(!path.exists());
    }
}

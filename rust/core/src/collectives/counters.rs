//! Waiting on sequence counters in shared memory.
//!
//! Each rank owns counters that only it writes (single writer) and that only grow. A writer
//! [`publish`]es a new value with a release store; a reader waits until every peer's counter
//! reached a target with acquire loads, so what the writer wrote before publishing (data in
//! its slot) is visible once the wait returns.
//!
//! A wait spins for a little while (the common case: the peer is about to arrive), then yields
//! the processor (more ranks than cores), then sleeps on a futex on the counter, registered in
//! the writer's `waiters` word so that the writer knows to wake it. While sleeping it wakes
//! every `check_every` to see whether the peers it waits for are still alive (pidfd or pid), set
//! their abort word, whether the deadline passed, and whether Ctrl-C was pressed.

use std::hint::spin_loop;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::libc;

/// How long to spin and to yield before sleeping, and how often to check on the peers.
#[derive(Clone, Copy, Debug)]
pub struct SpinPolicy {
    pub spin_iters: u32,
    pub yield_for: Duration,
    pub check_every: Duration,
}

impl Default for SpinPolicy {
    fn default() -> Self {
        SpinPolicy { spin_iters: 20_000, yield_for: Duration::from_micros(200), check_every: Duration::from_millis(2) }
    }
}

/// How to tell whether a peer process is still running.
#[derive(Clone, Copy, Debug)]
pub enum Liveness {
    /// Not checked (a thread in this process, or an unknown process).
    Unknown,
    /// A pidfd (Linux >= 5.3): it becomes readable when the process ends, zombie or not.
    Pidfd(RawFd),
    /// A pid in this pid namespace: dead when it is gone or a zombie.
    Pid(i32),
}

impl Liveness {
    pub fn is_dead(&self) -> bool {
        match *self {
            Liveness::Unknown => false,
            Liveness::Pidfd(fd) => {
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd and a zero timeout; a stale fd only gives POLLNVAL.
                let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
                ready > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
            }
            Liveness::Pid(pid) => pid_is_dead(pid),
        }
    }
}

fn pid_is_dead(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    // A zombie still answers kill(pid, 0): look at its state in /proc.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next()) == Some("Z"),
        Err(_) => false,
    }
}

/// A peer's counter, with what tells that it gave up (`abort`, non-zero when it did) and the
/// word where sleepers register (`waiters`, so the writer wakes them).
pub struct Peer<'a> {
    pub flag: &'a AtomicU64,
    pub abort: Option<&'a AtomicU64>,
    pub waiters: Option<&'a AtomicU32>,
    pub liveness: Liveness,
}

/// Why a wait ended without every peer reaching the target. Peers are indexes into the slice
/// given to [`wait_all`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitError {
    Aborted {
        peer: usize,
        code: u64,
    },
    Dead {
        peer: usize,
    },
    Timeout {
        pending: Vec<usize>,
    },
    Interrupted,
    /// The segment was closed while waiting (see [`super::rank_counters::Waiter::wait`]).
    Closed {
        pending: Vec<usize>,
    },
}

/// Stores `value` in `flag` and wakes whoever sleeps on it.
pub fn publish(flag: &AtomicU64, waiters: Option<&AtomicU32>, value: u64) {
    flag.store(value, Ordering::SeqCst);
    if let Some(waiters) = waiters {
        if waiters.load(Ordering::SeqCst) != 0 {
            futex_wake(flag);
        }
    }
}

/// Wakes every sleeper on `flag` (after an abort word was set, say).
pub fn wake(flag: &AtomicU64) {
    futex_wake(flag);
}

/// Waits until every peer's counter is >= `target`.
pub fn wait_all(
    peers: &[Peer<'_>],
    target: u64,
    policy: &SpinPolicy,
    deadline: Option<Instant>,
    interrupted: &mut dyn FnMut() -> bool,
) -> Result<(), WaitError> {
    let pending_from = |from: usize| (from..peers.len()).find(|&i| peers[i].flag.load(Ordering::Acquire) < target);
    let aborted = |i: usize| -> Result<(), WaitError> {
        match peers[i].abort.map(|a| a.load(Ordering::Acquire)) {
            Some(code) if code != 0 => Err(WaitError::Aborted { peer: i, code }),
            _ => Ok(()),
        }
    };
    let mut idx = match pending_from(0) {
        None => return Ok(()),
        Some(i) => i,
    };
    for _ in 0..policy.spin_iters {
        spin_loop();
        idx = match pending_from(idx) {
            None => return Ok(()),
            Some(i) => i,
        };
    }
    aborted(idx)?;
    let start = Instant::now();
    let mut last_check = start;
    loop {
        let now = Instant::now();
        let sleeping = now.duration_since(start) >= policy.yield_for;
        if sleeping || now.duration_since(last_check) >= policy.check_every {
            last_check = now;
            let pending: Vec<usize> =
                (idx..peers.len()).filter(|&i| peers[i].flag.load(Ordering::Acquire) < target).collect();
            for &i in &pending {
                aborted(i)?;
                if peers[i].liveness.is_dead() {
                    // it may have published just before it ended
                    if peers[i].flag.load(Ordering::Acquire) < target {
                        return Err(WaitError::Dead { peer: i });
                    }
                }
            }
            if deadline.is_some_and(|d| now >= d) {
                if pending.is_empty() {
                    return Ok(());
                }
                return Err(WaitError::Timeout { pending });
            }
            if interrupted() {
                return Err(WaitError::Interrupted);
            }
        }
        if sleeping {
            let mut slice = policy.check_every;
            if let Some(d) = deadline {
                slice = slice.min(d.saturating_duration_since(now)).max(Duration::from_micros(50));
            }
            sleep_on(&peers[idx], target, slice);
        } else {
            // SAFETY: sched_yield takes no arguments and cannot fail.
            unsafe { libc::sched_yield() };
        }
        idx = match pending_from(idx) {
            None => return Ok(()),
            Some(i) => i,
        };
        aborted(idx)?;
    }
}

/// Sleeps until `peer`'s counter changes, it is woken, or `slice` passes.
fn sleep_on(peer: &Peer<'_>, target: u64, slice: Duration) {
    let Some(waiters) = peer.waiters else {
        std::thread::sleep(slice.min(Duration::from_micros(200)));
        return;
    };
    waiters.fetch_add(1, Ordering::SeqCst);
    let seen = peer.flag.load(Ordering::SeqCst);
    if seen < target && peer.abort.map_or(0, |a| a.load(Ordering::SeqCst)) == 0 {
        futex_wait(peer.flag, seen as u32, slice);
    }
    waiters.fetch_sub(1, Ordering::SeqCst);
}

/// The 32 bits of a counter that a futex watches: the low half, which changes with every
/// increment.
fn low_half(word: &AtomicU64) -> *const u32 {
    let base = word as *const AtomicU64 as *const u32;
    if cfg!(target_endian = "little") {
        base
    } else {
        // SAFETY: the second u32 of the u64 is inside the same word.
        unsafe { base.add(1) }
    }
}

fn futex_wait(word: &AtomicU64, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // Shared (not PRIVATE): the word lives in memory mapped by several processes.
    // SAFETY: the futex word is an aligned u32 inside `word`, which outlives the call; the
    // timespec lives on this stack frame; the kernel only reads them.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            low_half(word),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

fn futex_wake(word: &AtomicU64) {
    // SAFETY: the futex word is an aligned u32 inside `word`; FUTEX_WAKE only reads its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            low_half(word),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct Block {
        flags: Vec<AtomicU64>,
        aborts: Vec<AtomicU64>,
        waiters: Vec<AtomicU32>,
    }

    fn block(n: usize) -> Arc<Block> {
        Arc::new(Block {
            flags: (0..n).map(|_| AtomicU64::new(0)).collect(),
            aborts: (0..n).map(|_| AtomicU64::new(0)).collect(),
            waiters: (0..n).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    fn peers<'a>(b: &'a Block, live: &[Liveness]) -> Vec<Peer<'a>> {
        (0..b.flags.len())
            .map(|i| Peer {
                flag: &b.flags[i],
                abort: Some(&b.aborts[i]),
                waiters: Some(&b.waiters[i]),
                liveness: live.get(i).copied().unwrap_or(Liveness::Unknown),
            })
            .collect()
    }

    fn quick() -> SpinPolicy {
        SpinPolicy { spin_iters: 10, yield_for: Duration::from_micros(10), check_every: Duration::from_millis(1) }
    }

    fn later(d: u64) -> Option<Instant> {
        Some(Instant::now() + Duration::from_millis(d))
    }

    #[test]
    fn ready_peers_return_at_once() {
        let b = block(3);
        for f in &b.flags {
            f.store(5, Ordering::SeqCst);
        }
        assert_eq!(wait_all(&peers(&b, &[]), 5, &quick(), later(10), &mut || false), Ok(()));
    }

    #[test]
    fn a_publish_wakes_a_sleeping_waiter() {
        let b = block(2);
        let writer = {
            let b = b.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                publish(&b.flags[0], Some(&b.waiters[0]), 1);
                std::thread::sleep(Duration::from_millis(30));
                publish(&b.flags[1], Some(&b.waiters[1]), 1);
            })
        };
        // Sleeping slices of 60 s: a waiter the futex does not wake sees the second publish
        // only when its slice ends, so returning well before that shows it was woken.
        let policy = SpinPolicy { check_every: Duration::from_secs(60), ..quick() };
        let start = Instant::now();
        assert_eq!(wait_all(&peers(&b, &[]), 1, &policy, later(120_000), &mut || false), Ok(()));
        assert!(start.elapsed() < Duration::from_secs(30), "woken by the futex, not by the end of a slice");
        writer.join().unwrap();
    }

    #[test]
    fn timeout_names_the_pending_peers() {
        let b = block(3);
        b.flags[1].store(2, Ordering::SeqCst);
        let err = wait_all(&peers(&b, &[]), 2, &quick(), later(20), &mut || false).unwrap_err();
        assert_eq!(err, WaitError::Timeout { pending: vec![0, 2] });
    }

    #[test]
    fn an_abort_word_ends_the_wait() {
        let b = block(2);
        let other = {
            let b = b.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                b.aborts[1].store(7, Ordering::SeqCst);
                wake(&b.flags[1]);
            })
        };
        b.flags[0].store(1, Ordering::SeqCst);
        let err = wait_all(&peers(&b, &[]), 1, &quick(), later(5_000), &mut || false).unwrap_err();
        assert_eq!(err, WaitError::Aborted { peer: 1, code: 7 });
        other.join().unwrap();
    }

    #[test]
    fn interrupt_ends_the_wait() {
        let b = block(1);
        let mut calls = 0;
        let err = wait_all(&peers(&b, &[]), 1, &quick(), later(5_000), &mut || {
            calls += 1;
            calls > 2
        })
        .unwrap_err();
        assert_eq!(err, WaitError::Interrupted);
    }

    #[test]
    fn dead_processes_are_noticed_reaped_or_zombie() {
        // reaped: the pid is gone
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        assert!(Liveness::Pid(pid).is_dead());
        // zombie: exited, not reaped yet; and its pidfd is readable
        let mut child = std::process::Command::new("sleep").arg("0.05").spawn().unwrap();
        let pid = child.id() as i32;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
        assert!(!Liveness::Pid(pid).is_dead());
        if pidfd >= 0 {
            assert!(!Liveness::Pidfd(pidfd).is_dead());
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(Liveness::Pid(pid).is_dead(), "a zombie counts as dead");
        let b = block(1);
        let live = if pidfd >= 0 { Liveness::Pidfd(pidfd) } else { Liveness::Pid(pid) };
        let err = wait_all(&peers(&b, &[live]), 1, &quick(), later(5_000), &mut || false).unwrap_err();
        assert_eq!(err, WaitError::Dead { peer: 0 });
        child.wait().unwrap();
        if pidfd >= 0 {
            // SAFETY: this test opened `pidfd` and closes it once.
            unsafe { libc::close(pidfd) };
        }
        assert!(!Liveness::Pid(std::process::id() as i32).is_dead());
    }
}

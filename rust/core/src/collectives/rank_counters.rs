//! One rank's view of the counters in a [`Segment`]: its own words (counter, sleepers, abort)
//! and its peers', all as byte offsets checked when the waiter is made, plus what tells
//! whether each peer's process still runs (a pidfd the waiter owns, or its pid).
//!
//! A wait holds the segment's read lock; it also ends when the segment is closed, so closing
//! never has to wait longer than one check interval for it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use nix::libc;

use super::counters::{self, Liveness, Peer, SpinPolicy, WaitError};
use super::mapping::SharedMemory;
use super::segment::{Segment, SegmentError};
use crate::interrupt::Interrupt;

/// The byte offsets of one rank's words: its counter (u64), its abort word (u64) and the word
/// where sleepers on its counter register (u32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Words {
    pub flag: usize,
    pub abort: Option<usize>,
    pub waiters: Option<usize>,
}

impl Words {
    fn check(&self, memory: &SharedMemory) -> Result<(), SegmentError> {
        memory.check(self.flag, 8, 8)?;
        if let Some(abort) = self.abort {
            memory.check(abort, 8, 8)?;
        }
        if let Some(waiters) = self.waiters {
            memory.check(waiters, 4, 4)?;
        }
        Ok(())
    }

    fn peer<'m>(&self, memory: &'m SharedMemory, liveness: Liveness) -> Result<Peer<'m>, SegmentError> {
        Ok(Peer {
            flag: memory.u64_at(self.flag)?,
            abort: self.abort.map(|a| memory.u64_at(a)).transpose()?,
            waiters: self.waiters.map(|w| memory.u32_at(w)).transpose()?,
            liveness,
        })
    }
}

/// Where a rank keeps the descriptor of its current collective: two copies (by step parity),
/// each `offsets[parity]` bytes after its counter.
#[derive(Clone, Copy, Debug)]
pub struct Descriptors {
    pub offsets: [usize; 2],
}

/// How a lock-step ([`Waiter::begin_step`]) ended for this rank.
#[derive(Debug, PartialEq, Eq)]
pub enum StepEnd {
    /// Every peer published the step, with the same descriptor.
    Together,
    /// Every peer published the step; `peer`'s descriptor differs (the first that does).
    Mismatch { peer: usize },
    /// The wait ended first: a peer aborted or died, the deadline passed, the segment closed,
    /// or a signal handler raised.
    Stopped(WaitError),
}

pub struct Waiter {
    segment: Arc<Segment>,
    peers: Vec<Words>,
    liveness: Vec<Liveness>,
    // the pidfds in `liveness`, closed when the waiter goes (after every wait has ended)
    _pidfds: Vec<OwnedFd>,
    own: Option<Words>,
    descriptors: Descriptors,
    policy: SpinPolicy,
}

/// A pidfd for `pid` (None where the kernel has none); an error if the process is gone.
fn open_pidfd(pid: i32) -> Result<Option<OwnedFd>, SegmentError> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return match io::Error::last_os_error().raw_os_error() {
            Some(libc::ESRCH) => Err(SegmentError::ProcessGone { pid }),
            _ => Ok(None), // an old kernel, or not allowed: the pid is checked instead
        };
    }
    let fd = i32::try_from(fd).map_err(|_| SegmentError::Invalid("pidfd out of range"))?;
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

impl Waiter {
    /// `peers[i]` are peer i's words and `pids[i]` its process (0: not checked); `own`, this
    /// rank's words, is needed to publish and abort.
    pub fn new(
        segment: Arc<Segment>,
        peers: Vec<Words>,
        pids: &[i32],
        own: Option<Words>,
        descriptors: Descriptors,
        policy: SpinPolicy,
    ) -> Result<Waiter, SegmentError> {
        if pids.len() != peers.len() {
            return Err(SegmentError::Invalid("one pid per peer"));
        }
        if descriptors.offsets.iter().any(|o| o % 8 != 0) {
            return Err(SegmentError::Invalid("descriptor offsets must be multiples of 8"));
        }
        segment.with(|memory| peers.iter().chain(own.iter()).try_for_each(|w| w.check(memory)))??;
        let mut pidfds = Vec::new();
        let mut liveness = Vec::with_capacity(pids.len());
        for &pid in pids {
            if pid <= 0 {
                liveness.push(Liveness::Unknown);
            } else if let Some(fd) = open_pidfd(pid)? {
                liveness.push(Liveness::Pidfd(fd.as_raw_fd()));
                pidfds.push(fd);
            } else {
                liveness.push(Liveness::Pid(pid));
            }
        }
        Ok(Waiter { segment, peers, liveness, _pidfds: pidfds, own, descriptors, policy })
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    fn own(&self, what: &'static str) -> Result<Words, SegmentError> {
        self.own.ok_or(SegmentError::Invalid(what))
    }

    /// True if every peer's counter is >= `target` now.
    pub fn ready(&self, target: u64) -> Result<bool, SegmentError> {
        self.segment.with(|memory| {
            for words in &self.peers {
                if memory.u64_at(words.flag)?.load(Ordering::Acquire) < target {
                    return Ok(false);
                }
            }
            Ok(true)
        })?
    }

    /// Waits until every peer's counter is >= `target` (see [`counters::wait_all`]); a close of the
    /// segment meanwhile ends it with [`WaitError::Closed`]. The outer error: the segment was
    /// already closed.
    pub fn wait(
        &self,
        target: u64,
        deadline: Option<Instant>,
        interrupt: &Interrupt,
    ) -> Result<Result<(), WaitError>, SegmentError> {
        self.segment.with(|memory| {
            let peers = self
                .peers
                .iter()
                .zip(&self.liveness)
                .map(|(words, liveness)| words.peer(memory, *liveness))
                .collect::<Result<Vec<_>, _>>()?;
            let closing = || self.segment.is_closed();
            let result =
                counters::wait_all(&peers, target, &self.policy, deadline, &mut || closing() || interrupt.raised());
            if result == Err(WaitError::Interrupted) && closing() {
                let pending = (0..peers.len()).filter(|&i| peers[i].flag.load(Ordering::Acquire) < target).collect();
                return Ok(Err(WaitError::Closed { pending }));
            }
            Ok(result)
        })?
    }

    /// Writes `desc` (if any) as this rank's step-`seq` descriptor, then publishes `seq`.
    pub fn publish(&self, seq: u64, desc: Option<&[i64]>) -> Result<(), SegmentError> {
        let own = self.own("publishing needs this rank's own words")?;
        let at = own.flag + self.descriptors.offsets[(seq & 1) as usize];
        self.segment.with(|memory| {
            for (i, value) in desc.unwrap_or_default().iter().enumerate() {
                memory.i64_at(at + 8 * i)?.store(*value, Ordering::Relaxed);
            }
            let waiters = own.waiters.map(|w| memory.u32_at(w)).transpose()?;
            counters::publish(memory.u64_at(own.flag)?, waiters, seq);
            Ok(())
        })?
    }

    /// The first peer whose step-`seq` descriptor differs from `desc` (read after a wait for
    /// `seq`, so their writes are visible).
    pub fn mismatch(&self, seq: u64, desc: &[i64]) -> Result<Option<usize>, SegmentError> {
        let offset = self.descriptors.offsets[(seq & 1) as usize];
        self.segment.with(|memory| {
            for (i, words) in self.peers.iter().enumerate() {
                for (j, value) in desc.iter().enumerate() {
                    if memory.i64_at(words.flag + offset + 8 * j)?.load(Ordering::Relaxed) != *value {
                        return Ok(Some(i));
                    }
                }
            }
            Ok(None)
        })?
    }

    /// One lock-step, up to the wait: writes `desc` (if any) as this rank's step-`seq`
    /// descriptor and publishes `seq`; if every peer is there already, the step's end
    /// (`Some`); else the caller waits with [`Self::finish_step`] (where a binding first lets
    /// go of what it holds, such as Python's GIL).
    pub fn begin_step(&self, seq: u64, desc: Option<&[i64]>) -> Result<Option<StepEnd>, SegmentError> {
        self.publish(seq, desc)?;
        if !self.ready(seq)? {
            return Ok(None);
        }
        self.compare(seq, desc).map(Some)
    }

    /// The rest of a lock-step [`Self::begin_step`] began: waits for every peer to publish
    /// `seq`, then compares their descriptors with `desc`.
    pub fn finish_step(
        &self,
        seq: u64,
        desc: Option<&[i64]>,
        deadline: Option<Instant>,
        interrupt: &Interrupt,
    ) -> Result<StepEnd, SegmentError> {
        match self.wait(seq, deadline, interrupt)? {
            Ok(()) => self.compare(seq, desc),
            Err(err) => Ok(StepEnd::Stopped(err)),
        }
    }

    fn compare(&self, seq: u64, desc: Option<&[i64]>) -> Result<StepEnd, SegmentError> {
        let mismatch = match desc {
            Some(desc) => self.mismatch(seq, desc)?,
            None => None,
        };
        Ok(mismatch.map_or(StepEnd::Together, |peer| StepEnd::Mismatch { peer }))
    }

    /// Tells the peers this rank gave up (`code` != 0) and wakes those sleeping on its counter.
    pub fn abort(&self, code: u64) -> Result<(), SegmentError> {
        let own = self.own("aborting needs this rank's own words")?;
        let abort = own.abort.ok_or(SegmentError::Invalid("aborting needs this rank's abort word"))?;
        self.segment.abort(own.flag, abort, code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::mapping::{Backing, SharedMemory};
    use std::time::Duration;

    fn segment() -> Arc<Segment> {
        Arc::new(Segment::new(SharedMemory::create(4096, &Backing::Memfd).unwrap()))
    }

    fn words(base: usize) -> Words {
        Words { flag: base, abort: Some(base + 8), waiters: Some(base + 16) }
    }

    fn quick() -> SpinPolicy {
        SpinPolicy { spin_iters: 10, yield_for: Duration::from_micros(10), check_every: Duration::from_millis(1) }
    }

    fn pair(seg: &Arc<Segment>, me: usize, other: usize) -> Waiter {
        let descriptors = Descriptors { offsets: [64, 192] };
        Waiter::new(seg.clone(), vec![words(other)], &[0], Some(words(me)), descriptors, quick()).unwrap()
    }

    #[test]
    fn bad_offsets_are_refused_when_the_waiter_is_made() {
        let seg = segment();
        let d = Descriptors { offsets: [64, 192] };
        let bad = [
            Words { flag: 4096, abort: None, waiters: None },
            Words { flag: 4, abort: None, waiters: None },
            Words { flag: 0, abort: Some(4092), waiters: None },
            Words { flag: 0, abort: None, waiters: Some(4094) },
        ];
        for words in bad {
            let err = Waiter::new(seg.clone(), vec![words], &[0], None, d, quick()).err().unwrap();
            assert!(matches!(err, SegmentError::Offset(_)), "{words:?}: {err:?}");
        }
        let odd = Descriptors { offsets: [60, 192] };
        assert!(Waiter::new(seg.clone(), vec![], &[], None, odd, quick()).is_err());
        assert!(Waiter::new(seg, vec![words(0)], &[], None, d, quick()).is_err());
    }

    #[test]
    fn a_descriptor_past_the_end_is_an_error_not_a_write() {
        let seg = segment();
        let w = pair(&seg, 4096 - 256, 0);
        let long = vec![1i64; 64];
        assert!(matches!(w.publish(1, Some(&long)), Err(SegmentError::Offset(_))));
    }

    #[test]
    fn two_ranks_step_and_compare_descriptors() {
        let seg = segment();
        let (a, b) = (pair(&seg, 0, 512), pair(&seg, 512, 0));
        a.publish(1, Some(&[1, 2, 3])).unwrap();
        assert_eq!(a.ready(1), Ok(false));
        b.publish(1, Some(&[1, 2, 4])).unwrap();
        assert_eq!(a.wait(1, None, &Interrupt::never()), Ok(Ok(())));
        assert_eq!(a.mismatch(1, &[1, 2, 3]), Ok(Some(0)));
        assert_eq!(b.mismatch(1, &[1, 2, 3]), Ok(None));
        b.abort(2).unwrap();
        let late = Some(Instant::now() + Duration::from_secs(5));
        assert_eq!(a.wait(2, late, &Interrupt::never()), Ok(Err(WaitError::Aborted { peer: 0, code: 2 })));
    }

    #[test]
    fn a_lock_step_ends_together_apart_or_stopped() {
        let seg = segment();
        let (a, b) = (pair(&seg, 0, 512), pair(&seg, 512, 0));
        // the first to arrive must wait; the second finds the first there
        assert_eq!(a.begin_step(1, Some(&[7, 8])), Ok(None));
        assert_eq!(b.begin_step(1, Some(&[7, 8])), Ok(Some(StepEnd::Together)));
        assert_eq!(a.finish_step(1, Some(&[7, 8]), None, &Interrupt::never()), Ok(StepEnd::Together));
        // different descriptors name the peer; no descriptor compares nothing
        assert_eq!(a.begin_step(2, Some(&[1])), Ok(None));
        assert_eq!(b.begin_step(2, Some(&[2])), Ok(Some(StepEnd::Mismatch { peer: 0 })));
        assert_eq!(a.finish_step(2, None, None, &Interrupt::never()), Ok(StepEnd::Together));
        // a wait that ends first says why
        assert_eq!(a.begin_step(3, None), Ok(None));
        let soon = Some(Instant::now() + Duration::from_millis(20));
        assert_eq!(
            a.finish_step(3, None, soon, &Interrupt::never()),
            Ok(StepEnd::Stopped(WaitError::Timeout { pending: vec![0] }))
        );
    }

    #[test]
    fn close_ends_a_wait_in_progress_and_returns_after_it() {
        let seg = segment();
        let w = Arc::new(pair(&seg, 0, 512));
        let waiting = {
            let w = w.clone();
            std::thread::spawn(move || w.wait(1, None, &Interrupt::never()))
        };
        // it registers as a sleeper on the peer's counter once it stopped spinning
        let started = Instant::now();
        while seg.with(|m| m.u32_at(512 + 16).unwrap().load(Ordering::SeqCst)) == Ok(0) {
            assert!(started.elapsed() < Duration::from_secs(10), "the wait never slept");
            std::thread::yield_now();
        }
        assert!(seg.close());
        assert_eq!(waiting.join().unwrap(), Ok(Err(WaitError::Closed { pending: vec![0] })));
        assert_eq!(w.wait(1, None, &Interrupt::never()), Err(SegmentError::Closed));
        assert_eq!(w.publish(1, None), Err(SegmentError::Closed));
    }

    #[test]
    fn a_gone_process_is_an_error() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        let err = Waiter::new(segment(), vec![words(0)], &[pid], None, Descriptors { offsets: [64, 192] }, quick());
        assert_eq!(err.err(), Some(SegmentError::ProcessGone { pid }));
    }
}

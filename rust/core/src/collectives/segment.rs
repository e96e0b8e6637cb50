//! A [`SharedMemory`] that can be closed while other threads use it.
//!
//! Every access runs under a read lock taken with `try_read`, so an access never blocks: the
//! only writer is [`Segment::close`], and a reader that finds it closing (or closed) gets
//! [`SegmentError::Closed`]. `close` first raises the `closed` flag, which waits in progress
//! check every few milliseconds ([`super::rank_counters`]), then takes the write lock, so it returns
//! only once every access has left, and drops the mapping. Views exported to Python hold an
//! `Arc` of the mapping ([`Segment::export`]): the memory is unmapped when the last of them
//! goes, never under them.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, TryLockError};

use super::counters;
use super::mapping::{Handle, OffsetError, SharedMemory};

/// Why a segment refused an access.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    #[error("segment is closed")]
    Closed,
    #[error(transparent)]
    Offset(#[from] OffsetError),
    #[error("process {pid} is already gone")]
    ProcessGone { pid: i32 },
    #[error("{0}")]
    Invalid(&'static str),
}

pub struct Segment {
    memory: RwLock<Option<Arc<SharedMemory>>>,
    closed: AtomicBool,
    handle: Handle,
}

impl Segment {
    pub fn new(memory: SharedMemory) -> Segment {
        let handle = memory.handle().clone();
        Segment { memory: RwLock::new(Some(Arc::new(memory))), closed: AtomicBool::new(false), handle }
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Runs `f` on the mapping unless the segment is closed or closing (never blocks).
    pub fn with<R>(&self, f: impl FnOnce(&SharedMemory) -> R) -> Result<R, SegmentError> {
        if self.is_closed() {
            return Err(SegmentError::Closed);
        }
        let guard = match self.memory.try_read() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return Err(SegmentError::Closed), // `close` holds or awaits it
        };
        match guard.as_deref() {
            Some(memory) => Ok(f(memory)),
            None => Err(SegmentError::Closed),
        }
    }

    /// A reference that keeps the mapping alive (for views handed to Python).
    pub fn export(&self) -> Result<Arc<SharedMemory>, SegmentError> {
        if self.is_closed() {
            return Err(SegmentError::Closed);
        }
        match self.memory.try_read() {
            Ok(guard) => guard.clone().ok_or(SegmentError::Closed),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner().clone().ok_or(SegmentError::Closed),
            Err(TryLockError::WouldBlock) => Err(SegmentError::Closed),
        }
    }

    /// Makes every later access fail, waits until the ones in progress (waits included, which
    /// notice within their check interval) have left, and drops this segment's reference to the
    /// mapping. True if it was open. Blocks: call it without holding locks readers need.
    pub fn close(&self) -> bool {
        self.closed.store(true, Ordering::Release);
        let memory = self.memory.write().unwrap_or_else(PoisonError::into_inner).take();
        memory.is_some()
    }

    /// Drops the creator's name of the segment (see [`SharedMemory::release_name`]).
    pub fn release_name(&self) -> Result<io::Result<()>, SegmentError> {
        self.with(|memory| memory.release_name())
    }

    /// Acquire-loads the u64 at `offset`.
    pub fn load(&self, offset: usize) -> Result<u64, SegmentError> {
        self.with(|memory| Ok(memory.u64_at(offset)?.load(Ordering::Acquire)))?
    }

    /// Stores `value` at `offset` and wakes the sleepers registered at `waiters`.
    pub fn publish(&self, offset: usize, waiters: Option<usize>, value: u64) -> Result<(), SegmentError> {
        self.with(|memory| {
            let flag = memory.u64_at(offset)?;
            let waiters: Option<&AtomicU32> = waiters.map(|w| memory.u32_at(w)).transpose()?;
            counters::publish(flag, waiters, value);
            Ok(())
        })?
    }

    /// Stores `code` at `abort` and wakes whoever sleeps on the counter at `flag`.
    pub fn abort(&self, flag: usize, abort: usize, code: u64) -> Result<(), SegmentError> {
        self.with(|memory| {
            let flag: &AtomicU64 = memory.u64_at(flag)?;
            memory.u64_at(abort)?.store(code, Ordering::SeqCst);
            counters::wake(flag);
            Ok(())
        })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::mapping::Backing;

    fn segment() -> Segment {
        Segment::new(SharedMemory::create(4096, &Backing::Memfd).unwrap())
    }

    #[test]
    fn offsets_are_checked() {
        let seg = segment();
        seg.publish(16, Some(24), 5).unwrap();
        assert_eq!(seg.load(16), Ok(5));
        assert_eq!(
            seg.load(4096),
            Err(SegmentError::Offset(OffsetError::OutOfBounds { offset: 4096, size: 8, len: 4096 }))
        );
        assert_eq!(seg.load(8 + 4), Err(SegmentError::Offset(OffsetError::Misaligned { offset: 12, align: 8 })));
        assert!(matches!(seg.publish(16, Some(4094), 1), Err(SegmentError::Offset(_))));
        assert!(matches!(seg.abort(16, 4095, 1), Err(SegmentError::Offset(_))));
    }

    #[test]
    fn a_closed_segment_refuses_everything_and_closing_twice_is_harmless() {
        let seg = segment();
        assert!(seg.close());
        assert!(!seg.close());
        assert_eq!(seg.load(0), Err(SegmentError::Closed));
        assert_eq!(seg.publish(0, None, 1), Err(SegmentError::Closed));
        assert!(seg.export().is_err());
        assert!(seg.release_name().is_err());
    }

    #[test]
    fn an_export_keeps_the_memory_mapped_after_close() {
        let seg = segment();
        seg.publish(0, None, 9).unwrap();
        let view = seg.export().unwrap();
        seg.close();
        assert_eq!(view.u64_at(0).unwrap().load(Ordering::SeqCst), 9);
    }
}

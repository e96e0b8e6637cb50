//! The ranks' data slots in a [`Segment`]: two buffers per rank, used by step parity, which a
//! collective fills before a lock-step and its peers read after it. Rank `j`'s buffer for step
//! `seq` lies at `base + (2j + seq % 2) * bytes`; the layout is checked once, when made.
//!
//! A small all_reduce is one step: each rank stages its data in its slot, steps, and reduces
//! every rank's slot (in rank order, so every rank gets the same bits) into its own buffer.
//! Double buffering makes that safe: a rank writes its slot for step `seq + 2` only after its
//! peers published `seq + 1`, which they do after they read its slot of step `seq`.

use std::ptr;
use std::sync::Arc;

use smallvec::SmallVec;

use super::dtype::{DType, ReduceOp};
use super::kernels::{self, KernelError};
use super::segment::{Segment, SegmentError};

/// Slots of a reduction that does not run (a kernel error) or a segment that closed.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error(transparent)]
    Segment(#[from] SegmentError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

pub struct Slots {
    segment: Arc<Segment>,
    base: usize,
    bytes: usize,
    ranks: usize,
    me: usize,
}

impl Slots {
    /// `ranks` ranks' slots of `bytes` bytes each from byte `base` (64-aligned); `me` is this
    /// rank's index.
    pub fn new(
        segment: Arc<Segment>,
        base: usize,
        bytes: usize,
        ranks: usize,
        me: usize,
    ) -> Result<Slots, SegmentError> {
        if me >= ranks {
            return Err(SegmentError::Invalid("this rank's index is not below the number of ranks"));
        }
        let total = ranks
            .checked_mul(2)
            .and_then(|n| n.checked_mul(bytes))
            .ok_or(SegmentError::Invalid("slots larger than the address space"))?;
        segment.with(|memory| memory.check(base, total, 64))??;
        Ok(Slots { segment, base, bytes, ranks, me })
    }

    /// This rank's index.
    pub fn me(&self) -> usize {
        self.me
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Where `len` bytes from `offset` of rank `rank`'s slot of step `seq` start in the
    /// segment, if they fit the slot.
    fn at(&self, rank: usize, seq: u64, offset: usize, len: usize) -> Result<usize, SegmentError> {
        if rank >= self.ranks {
            return Err(SegmentError::Invalid("no such rank"));
        }
        if offset.checked_add(len).map_or(true, |end| end > self.bytes) {
            return Err(SegmentError::Invalid("data larger than a slot"));
        }
        Ok(self.base + (2 * rank + (seq & 1) as usize) * self.bytes + offset)
    }

    /// Copies `len` bytes from `data` into this rank's slot for step `seq` (to be published
    /// next), from byte `offset` of the slot.
    ///
    /// # Safety
    /// `data` must be valid for reads of `len` bytes, outside this segment's slots.
    pub unsafe fn stage(&self, seq: u64, offset: usize, data: *const u8, len: usize) -> Result<(), SegmentError> {
        let at = self.at(self.me, seq, offset, len)?;
        self.segment.with(|memory| {
            // SAFETY: inside the mapping (checked in `new` and `at`), which `with` keeps mapped,
            // and `data` is readable (the caller's promise). Only this rank writes its own
            // slot, and its peers read this buffer only after the step it is staged for is
            // published (module docs).
            unsafe { ptr::copy_nonoverlapping(data, memory.as_ptr().add(at), len) }
        })
    }

    /// Copies `len` bytes from byte `offset` of rank `rank`'s slot of step `seq` into `into`
    /// (after the step: the rank staged them before it published it).
    ///
    /// # Safety
    /// `into` must be valid for writes of `len` bytes, outside this segment's slots.
    pub unsafe fn fetch(
        &self,
        seq: u64,
        rank: usize,
        offset: usize,
        into: *mut u8,
        len: usize,
    ) -> Result<(), SegmentError> {
        let at = self.at(rank, seq, offset, len)?;
        self.segment.with(|memory| {
            // SAFETY: inside the mapping (checked), read only while the step lasts; `into` is
            // writable (the caller's promise).
            unsafe { ptr::copy_nonoverlapping(memory.as_ptr().add(at), into, len) }
        })
    }

    /// Reduces `len` bytes from byte `offset` of every rank's slot of step `seq` (rank order)
    /// into `into`, as `dtype` elements; `divisor` > 1 averages. With `own`, this rank's
    /// operand is read there instead of from its slot (it never staged it).
    ///
    /// # Safety
    /// `into` must be valid for writes of `len` bytes, and `own` (if any) for reads of `len`
    /// bytes, both outside this segment's slots.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_into(
        &self,
        seq: u64,
        offset: usize,
        dtype: DType,
        op: ReduceOp,
        into: *mut u8,
        len: usize,
        divisor: u32,
        own: Option<*const u8>,
    ) -> Result<(), SlotError> {
        if len % dtype.size() != 0 {
            return Err(SegmentError::Invalid("data is not a whole number of elements").into());
        }
        let count = len / dtype.size();
        let ats = (0..self.ranks).map(|j| self.at(j, seq, offset, len)).collect::<Result<SmallVec<[usize; 8]>, _>>()?;
        self.segment
            .with(|memory| {
                let srcs: SmallVec<[*const u8; 8]> = ats
                    .iter()
                    .enumerate()
                    .map(|(j, &at)| match own {
                        Some(own) if j == self.me => own,
                        // SAFETY: inside the mapping (checked in `at`), which `with` keeps mapped.
                        _ => unsafe { memory.as_ptr().add(at) as *const u8 },
                    })
                    .collect();
                // SAFETY: every slot source holds `len` bytes of the mapping, read only (each
                // rank's slot of a published step stays as it is until the next step); `into` and
                // `own` are valid outside the slots (the caller's promise).
                unsafe { kernels::reduce(dtype, op, &srcs, &[into], count, divisor) }
            })?
            .map_err(SlotError::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::mapping::{Backing, SharedMemory};

    fn segment(size: usize) -> Arc<Segment> {
        Arc::new(Segment::new(SharedMemory::create(size, &Backing::Memfd).unwrap()))
    }

    fn f32s(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn stage(slots: &Slots, seq: u64, data: &[u8]) -> Result<(), SegmentError> {
        // SAFETY: a slice of this test's own, outside the segment.
        unsafe { slots.stage(seq, 0, data.as_ptr(), data.len()) }
    }

    fn reduce(slots: &Slots, seq: u64, into: &mut [u8], divisor: u32) -> Result<(), SlotError> {
        // SAFETY: a slice of this test's own, outside the segment.
        unsafe { slots.reduce_into(seq, 0, DType::F32, ReduceOp::Sum, into.as_mut_ptr(), into.len(), divisor, None) }
    }

    #[test]
    fn every_rank_reduces_every_slot_of_its_step() {
        let seg = segment(8192);
        let ranks: Vec<Slots> = (0..3).map(|me| Slots::new(seg.clone(), 64, 256, 3, me).unwrap()).collect();
        for (j, slots) in ranks.iter().enumerate() {
            stage(slots, 1, &f32s(&[j as f32, 10.0])).unwrap();
            stage(slots, 2, &f32s(&[100.0, 100.0])).unwrap(); // the other buffer: not read at step 1
        }
        let mut out = f32s(&[0.0, 0.0]);
        reduce(&ranks[1], 1, &mut out, 1).unwrap();
        assert_eq!(out, f32s(&[3.0, 30.0]));
        reduce(&ranks[0], 2, &mut out, 3).unwrap(); // the average
        assert_eq!(out, f32s(&[100.0, 100.0]));
    }

    #[test]
    fn a_layout_outside_the_segment_or_data_larger_than_a_slot_is_refused() {
        let seg = segment(4096);
        assert!(Slots::new(seg.clone(), 64, 1024, 2, 2).is_err()); // no rank 2 of 2
        assert!(Slots::new(seg.clone(), 64, 1024, 2, 0).is_err()); // 4 KiB from 64: past the end
        assert!(Slots::new(seg.clone(), 8, 16, 2, 0).is_err()); // not 64-aligned
        assert!(Slots::new(seg.clone(), 0, usize::MAX / 2, 2, 0).is_err()); // overflows
        let slots = Slots::new(seg.clone(), 64, 512, 2, 0).unwrap();
        assert!(stage(&slots, 1, &[0u8; 513]).is_err());
        assert!(reduce(&slots, 1, &mut [0u8; 6], 1).is_err()); // 1.5 floats
        seg.close();
        assert!(matches!(stage(&slots, 1, &[0u8; 4]), Err(SegmentError::Closed)));
    }

    #[test]
    fn parts_of_slots_are_staged_fetched_and_reduced_with_this_ranks_own_operand() {
        let seg = segment(8192);
        let ranks: Vec<Slots> = (0..2).map(|me| Slots::new(seg.clone(), 64, 256, 2, me).unwrap()).collect();
        let mine = f32s(&[5.0]);
        let theirs = f32s(&[7.0]);
        // SAFETY: slices of this test's own, outside the segment.
        unsafe {
            ranks[1].stage(1, 16, theirs.as_ptr(), 4).unwrap(); // rank 1's operand for rank 0, at 16
            let mut got = [0u8; 4];
            ranks[0].fetch(1, 1, 16, got.as_mut_ptr(), 4).unwrap();
            assert_eq!(got.to_vec(), theirs);
            let mut sum = [0u8; 4];
            ranks[0]
                .reduce_into(1, 16, DType::F32, ReduceOp::Sum, sum.as_mut_ptr(), 4, 1, Some(mine.as_ptr()))
                .unwrap();
            assert_eq!(sum.to_vec(), f32s(&[12.0]));
            assert!(ranks[0].fetch(1, 2, 0, got.as_mut_ptr(), 4).is_err()); // no rank 2
            assert!(ranks[0].fetch(1, 1, 254, got.as_mut_ptr(), 4).is_err()); // past the slot
        }
    }
}

//! The buffers every connection's receives draw from (io_uring's ring-mapped provided
//! buffers): the kernel picks a free one when bytes arrive and names it in the completion;
//! the loop reads it and puts it back on the ring it shares with the kernel, with no system
//! call and no submission. Memory for receiving is the pool's, however many clients are
//! connected, instead of a buffer per connection.

use std::alloc::Layout;
use std::io;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::BufRingEntry;

use super::ring::Ring;

/// The group the pool's buffers are provided in (the server has one pool).
pub(super) const GROUP: u16 = 0;

pub(super) struct Pool {
    /// `count` buffers of `size` bytes, one after the other. Raw: the kernel writes into
    /// buffers while the loop reads others, so no Rust reference spans the whole.
    memory: *mut u8,
    /// The ring of free buffers the kernel takes from: `count` entries, page aligned.
    entries: *mut BufRingEntry,
    size: usize,
    count: u16,
    /// Buffers put on the ring so far (wrapping); published to the kernel as the ring's tail.
    tail: u16,
}

// SAFETY: the pool is two plain allocations owned by one loop, moved with it to its thread.
unsafe impl Send for Pool {}

impl Pool {
    /// `count` (a power of two, at most 2^15) buffers of `size` bytes, registered with `ring`
    /// and all of them offered to the kernel. The pool must outlive the ring.
    pub fn new(ring: &Ring, count: u16, size: usize) -> io::Result<Pool> {
        assert!(count.is_power_of_two() && count <= 1 << 15, "a buffer ring holds a power of two, at most 2^15");
        let memory = Box::into_raw(vec![0u8; usize::from(count) * size].into_boxed_slice()).cast::<u8>();
        // SAFETY: the layout is non-zero (count > 0) and page aligned, as the kernel requires.
        let entries = unsafe { std::alloc::alloc_zeroed(Pool::ring_layout(count)) }.cast::<BufRingEntry>();
        if entries.is_null() {
            std::alloc::handle_alloc_error(Pool::ring_layout(count));
        }
        let mut pool = Pool { memory, entries, size, count, tail: 0 };
        // SAFETY: `entries` holds `count` zeroed entries and stays allocated until the pool is
        // dropped, after the ring (the loop's field order) that reads it.
        unsafe { ring.register_buffers(entries as u64, count, GROUP)? };
        for id in 0..count {
            pool.put(id);
        }
        pool.publish();
        Ok(pool)
    }

    fn ring_layout(count: u16) -> Layout {
        Layout::from_size_align(usize::from(count) * std::mem::size_of::<BufRingEntry>(), 4096)
            .expect("a valid layout: a small size, a power-of-two alignment")
    }

    /// Gives buffer `id` back to the kernel (seen once [`Pool::publish`]ed).
    pub fn give_back(&mut self, id: u16) {
        self.put(id);
        self.publish();
    }

    fn put(&mut self, id: u16) {
        let slot = usize::from(self.tail & (self.count - 1));
        // SAFETY: `slot` is below `count`; the kernel reads only the entries before the
        // published tail, and this one is past it until `publish`.
        let entry = unsafe { &mut *self.entries.add(slot) };
        // SAFETY: `id` is below `count`, so the offset stays inside the allocation.
        entry.set_addr(unsafe { self.memory.add(usize::from(id) * self.size) } as u64);
        entry.set_len(u32::try_from(self.size).expect("buffers are far smaller than 4 GiB"));
        entry.set_bid(id);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Lets the kernel see every buffer put back so far.
    fn publish(&self) {
        // SAFETY: the tail is the first entry's last 16 bits, which the kernel reads as an
        // atomic; the release orders the entries written before it.
        let tail = unsafe { &*BufRingEntry::tail(self.entries).cast::<AtomicU16>() };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes of buffer `id`, which a completion just handed back.
    ///
    /// # Safety
    ///
    /// The kernel must have completed a receive into buffer `id`, and the buffer must not be
    /// given back while the returned slice lives.
    pub unsafe fn received(&self, id: u16, len: usize) -> &[u8] {
        assert!(id < self.count && len <= self.size, "buffer {id} of {len} bytes is outside the pool");
        // SAFETY: in bounds (checked above); the caller guarantees the kernel is done with it.
        unsafe { std::slice::from_raw_parts(self.memory.add(usize::from(id) * self.size), len) }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let whole = std::ptr::slice_from_raw_parts_mut(self.memory, usize::from(self.count) * self.size);
        // SAFETY: both came from the allocations in `new`, of exactly these sizes; the loop
        // drops its ring (ending every receive into them) before its pool.
        unsafe {
            drop(Box::from_raw(whole));
            std::alloc::dealloc(self.entries.cast(), Pool::ring_layout(self.count));
        }
    }
}

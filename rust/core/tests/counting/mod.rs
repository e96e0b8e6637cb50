//! A global allocator for tests that count allocations: those of the calling thread while
//! [`on_this_thread`] runs its work, or those of the whole process while [`in_process`] does.
//! A test file installs it with `#[global_allocator] static GLOBAL: Counting = Counting;`.
#![allow(dead_code)] // each test file uses what it needs

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static IN_PROCESS: AtomicBool = AtomicBool::new(false);

thread_local! {
    // const-initialised, no destructor: reading it never allocates
    static ON_THIS_THREAD: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if IN_PROCESS.load(Ordering::Relaxed) || ON_THIS_THREAD.with(Cell::get) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed on unchanged to the system allocator, which upholds
// GlobalAlloc's contract; counting touches only atomics and a const thread-local.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires of it
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from System through this allocator, with this layout
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as for dealloc, and `new_size` as the caller gave it
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The allocations (and reallocations) `work` makes on this thread.
pub fn on_this_thread(work: impl FnOnce()) -> usize {
    counted(work, |on| ON_THIS_THREAD.with(|flag| flag.set(on)))
}

/// The allocations (and reallocations) made anywhere in the process while `work` runs.
pub fn in_process(work: impl FnOnce()) -> usize {
    counted(work, |on| IN_PROCESS.store(on, Ordering::Relaxed))
}

fn counted(work: impl FnOnce(), switch: impl Fn(bool)) -> usize {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    switch(true);
    work();
    switch(false);
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

//! A counting global allocator, for tests that prove a path allocates nothing: each test binary
//! that wants it installs [`Counting`] with `#[global_allocator]` and compares [`this_thread`]
//! (what the calling thread allocated) or [`everywhere`] (every thread) before and after.
//!
//! The only `unsafe` in the test crates lives here: `GlobalAlloc` is an unsafe trait, and every
//! call is forwarded unchanged to the system allocator.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts every allocation (alloc, alloc_zeroed, realloc) of the process and of each thread.
pub struct Counting;

static ALL: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static MINE: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    ALL.fetch_add(1, Ordering::Relaxed);
    // `try_with`: a thread being torn down may still allocate.
    let _ = MINE.try_with(|c| c.set(c.get() + 1));
}

/// Allocations the calling thread made so far (while [`Counting`] is the global allocator).
pub fn this_thread() -> u64 {
    MINE.with(Cell::get)
}

/// Allocations every thread made so far.
pub fn everywhere() -> u64 {
    ALL.load(Ordering::Relaxed)
}

// SAFETY: every method forwards its arguments unchanged to the system allocator, which upholds
// GlobalAlloc's contract; counting touches only atomics and a const-initialised thread local
// (no allocation, so no recursion).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

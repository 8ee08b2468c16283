//! Locks on ranges of blocks, so that writers wait only for writers of the same blocks.
//!
//! A write of part of a block reads the block, patches it and writes it whole: no other write
//! may land on that block in between, or the read-modify-write would bring back what it read.
//! One lock for the whole cache made every writer wait for every such write, including its
//! reads from a slow backing store (one 512-byte write stalled all writers). Here a partial
//! write holds its blocks exclusively, a whole-block write holds its blocks shared, and writes
//! of other blocks never wait.
//!
//! Ranges are exact (no striping), so two writes conflict only when their blocks overlap. The
//! set of held ranges is small (one per write in flight) and kept in a vector reused between
//! requests; a release wakes waiters only when there are some.
//!
//! Lock order: a write takes `Engine::writes_gate` (shared) first, then its range here; nothing
//! that holds a range takes the gate, and a thread never holds two ranges.

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
pub(crate) struct RangeLock {
    state: Mutex<Held>,
    released: Condvar,
}

#[derive(Default)]
struct Held {
    ranges: Vec<Range>,
    next_id: u64,
    /// Threads waiting in [`RangeLock::lock`].
    waiting: usize,
}

struct Range {
    id: u64,
    first: u64,
    end: u64,
    exclusive: bool,
}

impl Held {
    fn conflicts(&self, first: u64, end: u64, exclusive: bool) -> bool {
        self.ranges
            .iter()
            .any(|r| r.first < end && first < r.end && (exclusive || r.exclusive))
    }
}

/// Blocks held until dropped.
pub(crate) struct RangeGuard<'a> {
    lock: &'a RangeLock,
    id: u64,
}

impl RangeLock {
    /// Holds blocks `first..first + count`: `exclusive` against every other holder of any of
    /// them, otherwise only against exclusive holders. Waits until that is possible.
    pub(crate) fn lock(&self, first: u64, count: u64, exclusive: bool) -> RangeGuard<'_> {
        let end = first.saturating_add(count.max(1));
        let mut held = self.state.lock();
        while held.conflicts(first, end, exclusive) {
            held.waiting += 1;
            self.released.wait(&mut held);
            held.waiting -= 1;
        }
        let id = held.next_id;
        held.next_id += 1;
        held.ranges.push(Range {
            id,
            first,
            end,
            exclusive,
        });
        RangeGuard { lock: self, id }
    }

    /// Ranges held now (for tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.state.lock().ranges.len()
    }
}

impl RangeGuard<'_> {
    /// From exclusive to shared: other whole-block writers of these blocks may proceed.
    pub(crate) fn downgrade(&mut self) {
        let mut held = self.lock.state.lock();
        if let Some(r) = held.ranges.iter_mut().find(|r| r.id == self.id) {
            r.exclusive = false;
        }
        if held.waiting > 0 {
            self.lock.released.notify_all();
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.lock.state.lock();
        if let Some(i) = held.ranges.iter().position(|r| r.id == self.id) {
            held.ranges.swap_remove(i);
        }
        if held.waiting > 0 {
            self.lock.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Whether `lock(first, count, exclusive)` gets through within a short while, with the
    /// guards in `held` kept.
    fn gets_through(lock: &Arc<RangeLock>, first: u64, count: u64, exclusive: bool) -> bool {
        let done = Arc::new(AtomicBool::new(false));
        let (l, d) = (lock.clone(), done.clone());
        let t = std::thread::spawn(move || {
            let _g = l.lock(first, count, exclusive);
            d.store(true, Ordering::SeqCst);
        });
        for _ in 0..50 {
            if done.load(Ordering::SeqCst) {
                t.join().unwrap();
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // Leave it waiting; the caller drops what blocks it.
        std::mem::forget(t);
        false
    }

    /// Waits (a little) until `held` ranges are held, and asserts it.
    fn settles_at(lock: &RangeLock, held: usize) {
        for _ in 0..100 {
            if lock.held() == held {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(lock.held(), held);
    }

    #[test]
    fn only_overlapping_ranges_conflict() {
        let lock = Arc::new(RangeLock::default());
        let g = lock.lock(10, 5, true); // 10..15
        assert!(gets_through(&lock, 0, 10, true), "the range before");
        assert!(gets_through(&lock, 15, 3, true), "the range after");
        assert!(
            !gets_through(&lock, 14, 1, false),
            "a shared overlap of an exclusive one"
        );
        drop(g);
        // The waiter left behind got through once the exclusive holder was gone.
        settles_at(&lock, 0);
    }

    #[test]
    fn shared_holders_exclude_only_exclusive_ones() {
        let lock = Arc::new(RangeLock::default());
        let a = lock.lock(0, 8, false);
        assert!(gets_through(&lock, 4, 8, false), "two shared holders");
        assert!(
            !gets_through(&lock, 7, 1, true),
            "an exclusive overlap of a shared one"
        );
        drop(a);
        settles_at(&lock, 0);
    }

    #[test]
    fn downgrading_lets_shared_holders_in() {
        let lock = Arc::new(RangeLock::default());
        let mut g = lock.lock(0, 4, true);
        assert!(!gets_through(&lock, 2, 1, false));
        g.downgrade();
        settles_at(&lock, 1); // the waiting shared holder got in and left
        assert!(!gets_through(&lock, 3, 1, true), "still held, shared");
        drop(g);
    }

    /// Many threads hammering overlapping ranges: each block has either one exclusive holder or
    /// any number of shared ones, never both.
    #[test]
    fn exclusive_holders_are_alone() {
        use std::sync::atomic::AtomicI32;
        let lock = Arc::new(RangeLock::default());
        let blocks: Arc<Vec<AtomicI32>> = Arc::new((0..20).map(|_| AtomicI32::new(0)).collect());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (lock, blocks) = (lock.clone(), blocks.clone());
                std::thread::spawn(move || {
                    for i in 0..3000u64 {
                        let exclusive = (i + t) % 3 == 0;
                        let first = (i * 7 + t) % 16;
                        let _g = lock.lock(first, 4, exclusive);
                        let held = first as usize..first as usize + 4;
                        for b in &blocks[held.clone()] {
                            if exclusive {
                                assert_eq!(
                                    b.compare_exchange(0, -1, Ordering::SeqCst, Ordering::SeqCst),
                                    Ok(0)
                                );
                            } else {
                                assert!(b.fetch_add(1, Ordering::SeqCst) >= 0);
                            }
                        }
                        std::thread::yield_now();
                        for b in &blocks[held] {
                            if exclusive {
                                b.store(0, Ordering::SeqCst);
                            } else {
                                b.fetch_sub(1, Ordering::SeqCst);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(lock.held(), 0);
    }
}

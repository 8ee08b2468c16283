//! Locks on ranges of blocks, so that writers wait only for writers of the same blocks.
//!
//! A write of part of a block reads the block, patches it and writes it whole: no other write
//! may land on that block in between, or the read-modify-write would bring back what it read.
//! One lock for the whole cache made every writer wait for every such write, including its
//! reads from a slow backing store (one 512-byte write stalled all writers). Here a partial
//! write holds its blocks exclusively, a whole-block write holds its blocks shared, and writes
//! of other blocks never wait.
//!
//! The backing store's lock has a third kind of holder, a read ([`Hold::Reading`]): reads share
//! blocks with each other but not with writes. Neither a file's page cache nor a block device
//! promises that a read overlapping a write sees the block whole, old or new; one that does not
//! hands the client a block torn between two writes.
//!
//! Ranges are exact (no striping), so two holders conflict only when their blocks overlap. The
//! set of held ranges is small (one per request in flight) and kept in a vector reused between
//! requests; a release wakes waiters only when there are some.
//!
//! Lock order: a write takes `Engine::writes_gate` (shared) first, then its range here; nothing
//! that holds a range takes the gate, and a thread that holds a range never waits for another
//! of the same lock: a batch of writes (`cache::write_batch`) holds several, each taken with
//! [`RangeLock::try_lock`], and leaves a write whose range is not free at once.

use parking_lot::{Condvar, Mutex};

/// How a range is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Alone on its blocks.
    Exclusive,
    /// Alongside other `Shared` holders of its blocks.
    Shared,
    /// Alongside other `Reading` holders of its blocks: a read that must not overlap a write.
    Reading,
}

impl Hold {
    fn shares_with(self, other: Hold) -> bool {
        self == other && self != Hold::Exclusive
    }
}

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
    hold: Hold,
}

impl Held {
    fn conflicts(&self, first: u64, end: u64, hold: Hold) -> bool {
        self.ranges
            .iter()
            .any(|r| r.first < end && first < r.end && !hold.shares_with(r.hold))
    }

    fn add<'a>(&mut self, lock: &'a RangeLock, first: u64, end: u64, hold: Hold) -> RangeGuard<'a> {
        let id = self.next_id;
        self.next_id += 1;
        self.ranges.push(Range {
            id,
            first,
            end,
            hold,
        });
        RangeGuard { lock, id }
    }
}

/// Blocks held until dropped.
pub(crate) struct RangeGuard<'a> {
    lock: &'a RangeLock,
    id: u64,
}

impl RangeLock {
    /// Holds blocks `first..first + count` as `hold` says, waiting until no holder of any of
    /// them conflicts.
    pub(crate) fn lock(&self, first: u64, count: u64, hold: Hold) -> RangeGuard<'_> {
        let end = first.saturating_add(count.max(1));
        let mut held = self.state.lock();
        while held.conflicts(first, end, hold) {
            held.waiting += 1;
            self.released.wait(&mut held);
            held.waiting -= 1;
        }
        held.add(self, first, end, hold)
    }

    /// [`RangeLock::lock`] if no holder conflicts now; `None` (without waiting) otherwise.
    pub(crate) fn try_lock(&self, first: u64, count: u64, hold: Hold) -> Option<RangeGuard<'_>> {
        let end = first.saturating_add(count.max(1));
        let mut held = self.state.lock();
        (!held.conflicts(first, end, hold)).then(|| held.add(self, first, end, hold))
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
            r.hold = Hold::Shared;
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

    use Hold::{Exclusive, Reading, Shared};

    /// Whether `lock(first, count, hold)` gets through within a short while, with the guards
    /// held by the caller kept.
    fn gets_through(lock: &Arc<RangeLock>, first: u64, count: u64, hold: Hold) -> bool {
        let done = Arc::new(AtomicBool::new(false));
        let (l, d) = (lock.clone(), done.clone());
        let t = std::thread::spawn(move || {
            let _g = l.lock(first, count, hold);
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
        let g = lock.lock(10, 5, Exclusive); // 10..15
        assert!(gets_through(&lock, 0, 10, Exclusive), "the range before");
        assert!(gets_through(&lock, 15, 3, Exclusive), "the range after");
        assert!(
            !gets_through(&lock, 14, 1, Shared),
            "a shared overlap of an exclusive one"
        );
        drop(g);
        // The waiter left behind got through once the exclusive holder was gone.
        settles_at(&lock, 0);
    }

    #[test]
    fn shared_holders_exclude_only_exclusive_ones() {
        let lock = Arc::new(RangeLock::default());
        let a = lock.lock(0, 8, Shared);
        assert!(gets_through(&lock, 4, 8, Shared), "two shared holders");
        assert!(
            !gets_through(&lock, 7, 1, Exclusive),
            "an exclusive overlap of a shared one"
        );
        drop(a);
        settles_at(&lock, 0);
    }

    #[test]
    fn downgrading_lets_shared_holders_in() {
        let lock = Arc::new(RangeLock::default());
        let mut g = lock.lock(0, 4, Exclusive);
        assert!(!gets_through(&lock, 2, 1, Shared));
        g.downgrade();
        settles_at(&lock, 1); // the waiting shared holder got in and left
        assert!(!gets_through(&lock, 3, 1, Exclusive), "still held, shared");
        drop(g);
    }

    #[test]
    fn readers_share_with_readers_only() {
        let lock = Arc::new(RangeLock::default());
        let r = lock.lock(0, 8, Reading);
        assert!(gets_through(&lock, 4, 8, Reading), "two readers");
        assert!(
            !gets_through(&lock, 7, 1, Shared),
            "a writer of a block being read"
        );
        assert!(!gets_through(&lock, 0, 1, Exclusive));
        drop(r);
        settles_at(&lock, 0);
        let w = lock.lock(0, 8, Shared);
        assert!(
            !gets_through(&lock, 3, 2, Reading),
            "a reader of a block being written"
        );
        drop(w);
        settles_at(&lock, 0);
    }

    #[test]
    fn try_lock_never_waits() {
        let lock = RangeLock::default();
        let w = lock.lock(10, 5, Shared);
        assert!(lock.try_lock(12, 1, Reading).is_none());
        assert!(lock.try_lock(14, 4, Exclusive).is_none());
        let other = lock.try_lock(15, 1, Reading).expect("the block after");
        let shared = lock.try_lock(10, 1, Shared).expect("another writer");
        assert_eq!(lock.held(), 3);
        drop((w, shared, other));
        assert_eq!(lock.held(), 0);
        assert!(lock.try_lock(12, 1, Reading).is_some());
        assert_eq!(lock.held(), 0, "a guard from try_lock releases on drop");
    }

    /// Many threads hammering overlapping ranges: each block has one exclusive holder, or any
    /// number of shared ones, or any number of readers, never two kinds at once.
    #[test]
    fn holders_of_different_kinds_are_never_together() {
        use std::sync::atomic::AtomicI64;
        // Per block: -1 for an exclusive holder, else shared holders plus readers << 20.
        const READER: i64 = 1 << 20;
        let lock = Arc::new(RangeLock::default());
        let blocks: Arc<Vec<AtomicI64>> = Arc::new((0..20).map(|_| AtomicI64::new(0)).collect());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (lock, blocks) = (lock.clone(), blocks.clone());
                std::thread::spawn(move || {
                    for i in 0..3000u64 {
                        let hold = [Exclusive, Shared, Reading][((i + t) % 3) as usize];
                        let first = (i * 7 + t) % 16;
                        let _g = if i % 2 == 0 {
                            lock.lock(first, 4, hold)
                        } else {
                            match lock.try_lock(first, 4, hold) {
                                Some(g) => g,
                                None => continue,
                            }
                        };
                        let held = first as usize..first as usize + 4;
                        let unit = if hold == Reading { READER } else { 1 };
                        for b in &blocks[held.clone()] {
                            if hold == Exclusive {
                                assert_eq!(
                                    b.compare_exchange(0, -1, Ordering::SeqCst, Ordering::SeqCst),
                                    Ok(0)
                                );
                            } else {
                                let before = b.fetch_add(unit, Ordering::SeqCst);
                                assert!(before >= 0, "{hold:?} with an exclusive holder");
                                let others = if hold == Reading {
                                    before % READER
                                } else {
                                    before / READER
                                };
                                assert_eq!(others, 0, "{hold:?} with holders of the other kind");
                            }
                        }
                        std::thread::yield_now();
                        for b in &blocks[held] {
                            if hold == Exclusive {
                                b.store(0, Ordering::SeqCst);
                            } else {
                                b.fetch_sub(unit, Ordering::SeqCst);
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

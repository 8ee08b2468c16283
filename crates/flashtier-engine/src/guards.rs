//! Keeping read-miss promotions from caching stale data.
//!
//! A read miss reads the backing store, then asks the log to cache what it read (a PROMOTE
//! record). Meanwhile a write may have changed those blocks: in the cache (write-back) or in the
//! backing store (write-around, write-through, trim, zeroing). PROMOTE only maps blocks that are
//! unmapped when it is applied, which handles writes that land in the cache, but not writes that
//! went around the cache, nor writes that were cached, cleaned and evicted in the meantime.
//!
//! So every write bumps a stamp for the blocks it touches (striped by LBA), and writes that go to
//! the backing store also mark their blocks busy until the backing store has them. A promotion
//! records the clock before it reads the backing store and is dropped, before it reaches the log,
//! if any of its blocks was stamped after that or is busy now. False conflicts (another block in
//! the same stripe) only cost a promotion, never correctness.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const STRIPES: usize = 4096;

pub struct Guards {
    clock: AtomicU64,
    stamps: Box<[AtomicU64]>,
    busy: Box<[AtomicU32]>,
}

fn stripe(lba: u64) -> usize {
    (lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % STRIPES
}

/// The stripes a range of blocks touches (all of them for a large range).
fn stripes(first: u64, count: u64) -> impl Iterator<Item = usize> {
    let all = count >= STRIPES as u64;
    let n = if all { STRIPES as u64 } else { count };
    (0..n).map(move |i| if all { i as usize } else { stripe(first + i) })
}

impl Default for Guards {
    fn default() -> Self {
        Guards {
            clock: AtomicU64::new(1),
            stamps: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            busy: (0..STRIPES).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

/// Blocks marked busy for a write that goes to the backing store; unmarked (and stamped) on drop.
pub struct BusyRange<'a> {
    guards: &'a Guards,
    first: u64,
    count: u64,
}

impl Drop for BusyRange<'_> {
    fn drop(&mut self) {
        // Stamp before clearing busy, so no window shows the blocks as neither.
        self.guards.stamp(self.first, self.count);
        for s in stripes(self.first, self.count) {
            self.guards.busy[s].fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Guards {
    /// The clock a promotion records before it reads the backing store.
    pub fn now(&self) -> u64 {
        self.clock.load(Ordering::SeqCst)
    }

    /// Records that blocks are being written.
    pub fn stamp(&self, first: u64, count: u64) {
        let t = self.clock.fetch_add(1, Ordering::SeqCst) + 1;
        for s in stripes(first, count) {
            self.stamps[s].fetch_max(t, Ordering::SeqCst);
        }
    }

    /// Marks blocks busy for a write to the backing store, until the returned guard drops.
    pub fn busy(&self, first: u64, count: u64) -> BusyRange<'_> {
        for s in stripes(first, count) {
            self.busy[s].fetch_add(1, Ordering::SeqCst);
        }
        self.stamp(first, count);
        BusyRange {
            guards: self,
            first,
            count,
        }
    }

    /// True if a promotion of these blocks that read the backing store after `since` is still
    /// safe: nothing wrote them since, and no backing-store write of them is in flight.
    pub fn promotion_safe(&self, first: u64, count: u64, since: u64) -> bool {
        stripes(first, count).all(|s| {
            self.busy[s].load(Ordering::SeqCst) == 0
                && self.stamps[s].load(Ordering::SeqCst) <= since
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_after_the_read_started_spoil_the_promotion() {
        let g = Guards::default();
        let since = g.now();
        assert!(g.promotion_safe(10, 4, since));
        g.stamp(12, 1);
        assert!(!g.promotion_safe(10, 4, since));
        // A promotion that started after the write is fine.
        assert!(g.promotion_safe(10, 4, g.now()));
    }

    #[test]
    fn backing_writes_in_flight_spoil_the_promotion_until_they_finish() {
        let g = Guards::default();
        let busy = g.busy(100, 8);
        let since = g.now();
        assert!(!g.promotion_safe(104, 1, since), "busy");
        drop(busy);
        assert!(!g.promotion_safe(104, 1, since), "stamped when it finished");
        assert!(g.promotion_safe(104, 1, g.now()));
        assert!(g.promotion_safe(5000, 1, since));
    }

    #[test]
    fn huge_ranges_cover_every_stripe() {
        let g = Guards::default();
        let since = g.now();
        g.stamp(0, 1 << 30);
        assert!(!g.promotion_safe(123_456_789, 1, since));
    }
}

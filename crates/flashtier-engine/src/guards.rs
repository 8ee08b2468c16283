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
//! records the clock before the read looks its blocks up in the index and is dropped, before it
//! reaches the log, if any of its blocks was stamped after that or is busy now. A write to the
//! cache is stamped when its WRITE record is applied to the index (by the log writer, which also
//! checks promotions, in log order), so a write the lookup did not see is always stamped after
//! the promotion's clock. Both orders matter (found by a test racing a reader against writers in
//! a cache too small for them): with the clock taken after the lookup, or the stamp before the
//! record was applied, a miss could look up a block just before a write mapped it, read the older
//! backing copy, pass the check, and wait in the queue (promotions wait for reclaim like any client
//! record) while reclaim wrote the new data back and evicted it; the promotion then mapped the old
//! data as clean. False conflicts (another block in the same stripe) only cost a promotion, never
//! correctness.
//!
//! A promotion must also not cache what the backing store holds only in its volatile cache: a
//! write that went around the cache and was not yet flushed there. Once the promotion is durable
//! in the log, a power loss would leave the cache serving the new content as clean while the
//! backing store went back to the old, which an eviction would later bring back. So a backing
//! write without FUA leaves its blocks' stripes *unflushed* (the clock when it finished), and a
//! promotion is dropped if any of its stripes was left unflushed after the last backing flush
//! began.
//!
//! Write-through writes of the same blocks take turns ([`Guards::write_through_lock`]): two of
//! them could otherwise reach the backing store in the opposite order from the log, and the
//! newer cached copy would then be marked clean over an older backing block.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const STRIPES: usize = 4096;

/// Stripes of the write-through turn locks (fewer: a large write takes each of its stripes).
const TURN_STRIPES: usize = 256;

pub struct Guards {
    clock: AtomicU64,
    stamps: Box<[AtomicU64]>,
    busy: Box<[AtomicU32]>,
    /// Per stripe: the clock when a backing write without FUA last finished there.
    unflushed: Box<[AtomicU64]>,
    /// The clock when the last successful backing flush began: it covers every backing write
    /// that finished before that.
    flushed_upto: AtomicU64,
    turns: Box<[parking_lot::Mutex<()>]>,
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
            unflushed: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            flushed_upto: AtomicU64::new(0),
            turns: (0..TURN_STRIPES)
                .map(|_| parking_lot::Mutex::new(()))
                .collect(),
        }
    }
}

/// Blocks marked busy for a write that goes to the backing store; unmarked (and stamped) on drop.
pub struct BusyRange<'a> {
    guards: &'a Guards,
    first: u64,
    count: u64,
    unflushed: bool,
}

impl BusyRange<'_> {
    /// The backing store took the write into its volatile cache (no FUA): promotions of these
    /// blocks are unsafe until the next backing flush.
    pub fn written_unflushed(&mut self) {
        self.unflushed = true;
    }
}

impl Drop for BusyRange<'_> {
    fn drop(&mut self) {
        // Stamp before clearing busy, so no window shows the blocks as neither.
        let t = self.guards.stamp(self.first, self.count);
        if self.unflushed {
            for s in stripes(self.first, self.count) {
                self.guards.unflushed[s].fetch_max(t, Ordering::SeqCst);
            }
        }
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

    /// Records that blocks are being written; returns the stamp.
    pub fn stamp(&self, first: u64, count: u64) -> u64 {
        let t = self.clock.fetch_add(1, Ordering::SeqCst) + 1;
        for s in stripes(first, count) {
            self.stamps[s].fetch_max(t, Ordering::SeqCst);
        }
        t
    }

    /// Call right before flushing the backing store; pass the result to [`Guards::flushed`]
    /// once the flush succeeded.
    pub fn flush_begins(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn flushed(&self, began: u64) {
        self.flushed_upto.fetch_max(began, Ordering::SeqCst);
    }

    /// Exclusive turn for a write-through write of `[first, first + count)`.
    pub fn write_through_lock(
        &self,
        first: u64,
        count: u64,
    ) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        let mut idx: Vec<usize> = if count >= TURN_STRIPES as u64 {
            (0..TURN_STRIPES).collect()
        } else {
            (first..first + count)
                .map(|b| (b % TURN_STRIPES as u64) as usize)
                .collect()
        };
        // One global order, so two writers never wait for each other's stripes.
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| self.turns[i].lock()).collect()
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
            unflushed: false,
        }
    }

    /// True if a promotion of these blocks that read the backing store after `since` is still
    /// safe: nothing wrote them since, and no backing-store write of them is in flight.
    /// The backing store must also hold them durably.
    pub fn promotion_safe(&self, first: u64, count: u64, since: u64) -> bool {
        let flushed = self.flushed_upto.load(Ordering::SeqCst);
        stripes(first, count).all(|s| {
            self.busy[s].load(Ordering::SeqCst) == 0
                && self.stamps[s].load(Ordering::SeqCst) <= since
                && self.unflushed[s].load(Ordering::SeqCst) < flushed.max(1)
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
    fn unflushed_backing_writes_spoil_promotions_until_a_flush_that_began_after_them() {
        let g = Guards::default();
        let mut busy = g.busy(7, 1);
        busy.written_unflushed();
        drop(busy);
        assert!(
            !g.promotion_safe(7, 1, g.now()),
            "volatile on the backing store"
        );
        let early = g.flush_begins();
        g.flushed(early);
        assert!(g.promotion_safe(7, 1, g.now()), "the flush covers it");
        let racing_flush = g.flush_begins();
        let mut busy = g.busy(7, 1);
        busy.written_unflushed();
        drop(busy);
        g.flushed(racing_flush);
        assert!(
            !g.promotion_safe(7, 1, g.now()),
            "a flush that began before it does not"
        );
        drop(g.busy(9, 1));
        assert!(
            g.promotion_safe(9, 1, g.now()),
            "FUA writes leave nothing unflushed"
        );
    }

    #[test]
    fn write_through_turns_exclude_overlapping_ranges_only() {
        let g = Guards::default();
        let held = g.write_through_lock(10, 4);
        assert!(g.turns[12].try_lock().is_none());
        assert!(g.turns[20].try_lock().is_some());
        drop(held);
        assert!(g.turns[12].try_lock().is_some());
        assert_eq!(g.write_through_lock(0, 1 << 20).len(), TURN_STRIPES);
    }

    #[test]
    fn huge_ranges_cover_every_stripe() {
        let g = Guards::default();
        let since = g.now();
        g.stamp(0, 1 << 30);
        assert!(!g.promotion_safe(123_456_789, 1, since));
    }
}

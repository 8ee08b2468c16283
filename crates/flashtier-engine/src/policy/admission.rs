//! n-hit admission: a block read from the backing store is promoted only on its nth miss within
//! a window, so blocks read once (a scan, a backup, a cold table) never displace the working set.
//!
//! [`MissTable`] counts recent misses per block in a fixed amount of RAM: a set-associative hash
//! table of [`WAYS`]-entry buckets, each entry `(block, misses, second of the first miss)`, 16
//! bytes. Entries whose window has passed count as free. A miss of a block not in the table
//! takes a free entry of its bucket, or else the entry whose first miss is oldest (the one
//! closest to expiring anyway; counted in [`MissTable::evictions`]). A block admitted leaves the
//! table, so a block evicted from the cache later needs n new misses to come back. Buckets are
//! spread over [`SHARDS`] mutexes, so concurrent readers rarely meet.
//!
//! Eviction only ever loses counts, so a full table admits less, never more: under a miss rate
//! the table cannot hold for a whole window, a block's misses must come closer together than
//! the window to count.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// Entries per bucket.
pub const WAYS: usize = 8;
/// Mutexes the buckets are spread over.
pub const SHARDS: usize = 64;
/// Fewest entries a table has (256 KiB).
pub const MIN_ENTRIES: usize = 16 << 10;
/// Most entries a table has (16 MiB): beyond about a million distinct blocks missed per window,
/// a block missed twice is no stronger a signal than the cache's own LRU.
pub const MAX_ENTRIES: usize = 1 << 20;

/// The table size for a cache of `slots` blocks: one entry per 2 cache blocks (8 bytes per cache
/// block, next to the index's 13), within [`MIN_ENTRIES`]..=[`MAX_ENTRIES`]. A block's second
/// miss counts only while its first is still in the table, so the table is what `promotion =
/// auto` waits on once the cache is full: under MariaDB with a cache half the data, one entry per
/// 16 blocks kept 73–74% of reads hitting 80 s after the warm-up where promoting every miss kept
/// 78.5%, and one per 2 blocks 77.5% (bench/results/promotion_auto/).
pub fn entries_for_cache(slots: u64) -> usize {
    ((slots / 2) as usize).clamp(MIN_ENTRIES, MAX_ENTRIES)
}

/// Whether an eviction noted as `last` (its second + 1; 0: none) fell within the `window`
/// seconds up to `now`.
pub fn evicted_within(last: u32, now: u32, window: u32) -> bool {
    last != 0 && now.saturating_add(1).saturating_sub(last) < window
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// Block + 1; 0 marks a free entry.
    key: u64,
    /// The second of the first miss counted.
    since: u32,
    misses: u32,
}

type Bucket = [Entry; WAYS];

/// Recent misses per block; see the module docs.
pub struct MissTable {
    shards: Box<[Mutex<Box<[Bucket]>>]>,
    /// log2 of the bucket count.
    bits: u32,
    evictions: AtomicU64,
}

impl MissTable {
    /// A table of at least `entries` entries (rounded up to a power of two, at least
    /// `WAYS * SHARDS`). Allocates all of it now.
    pub fn with_capacity(entries: usize) -> MissTable {
        let buckets = entries.div_ceil(WAYS).next_power_of_two().max(SHARDS);
        let per_shard = buckets / SHARDS;
        MissTable {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(vec![Bucket::default(); per_shard].into_boxed_slice()))
                .collect(),
            bits: buckets.trailing_zeros(),
            evictions: AtomicU64::new(0),
        }
    }

    /// Entries the table holds at most.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        (1usize << self.bits) * WAYS
    }

    /// Counted misses lost to make room for others.
    #[cfg(test)]
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Records a miss of `block` at second `now`; returns whether the block is admitted: this is
    /// its `nhit`th miss within `window` seconds of the first one counted (a miss `window` or more
    /// seconds after that starts the count again).
    pub fn record_miss(&self, block: u64, now: u32, nhit: u32, window: u32) -> bool {
        if nhit <= 1 {
            return true;
        }
        let key = block.wrapping_add(1);
        let h = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - self.bits)) as usize;
        let mut shard = self.shards[h % SHARDS].lock();
        let bucket = &mut shard[h / SHARDS];
        let live = |e: &Entry| e.key != 0 && now.saturating_sub(e.since) < window;
        if let Some(e) = bucket.iter_mut().find(|e| e.key == key) {
            if live(e) {
                e.misses += 1;
            } else {
                *e = Entry {
                    key,
                    since: now,
                    misses: 1,
                };
            }
            if e.misses >= nhit {
                *e = Entry::default();
                return true;
            }
            return false;
        }
        let way = match bucket.iter().position(|e| !live(e)) {
            Some(free) => free,
            None => {
                self.evictions.fetch_add(1, Ordering::Relaxed);
                (0..WAYS).min_by_key(|&i| bucket[i].since).unwrap_or(0)
            }
        };
        bucket[way] = Entry {
            key,
            since: now,
            misses: 1,
        };
        false
    }

    /// Blocks with misses counted and not yet expired at `now` (tests, diagnostics).
    #[cfg(test)]
    pub fn live_entries(&self, now: u32, window: u32) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .iter()
                    .flatten()
                    .filter(|e| e.key != 0 && now.saturating_sub(e.since) < window)
                    .count()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn an_eviction_counts_for_the_window_after_its_second() {
        assert!(!evicted_within(0, 0, 300), "none yet");
        assert!(!evicted_within(0, 1000, 300), "none yet");
        // Evicted at second 5 (noted as 6).
        assert!(evicted_within(6, 5, 300));
        assert!(evicted_within(6, 304, 300));
        assert!(!evicted_within(6, 305, 300));
        assert!(evicted_within(6, 5, 1));
        assert!(!evicted_within(6, 6, 1));
        assert!(evicted_within(u32::MAX, u32::MAX, 1), "no overflow");
    }

    #[test]
    fn the_nth_miss_within_the_window_admits() {
        let t = MissTable::with_capacity(1024);
        assert!(!t.record_miss(7, 100, 3, 10));
        assert!(!t.record_miss(7, 105, 3, 10));
        assert!(
            t.record_miss(7, 109, 3, 10),
            "third miss, 9 s after the first"
        );
        // Admitted blocks leave the table: the count starts again.
        assert!(!t.record_miss(7, 109, 3, 10));
        assert!(!t.record_miss(7, 110, 3, 10));
        // The window is counted from the first miss: at 119 the count restarts.
        assert!(!t.record_miss(7, 119, 3, 10));
        assert!(!t.record_miss(7, 120, 3, 10));
        assert!(t.record_miss(7, 121, 3, 10));
        assert!(t.record_miss(8, 0, 1, 10), "nhit 1 admits every miss");
        assert_eq!(t.live_entries(121, 10), 0);
    }

    /// Blocks that share a bucket, found by trying.
    fn same_bucket(t: &MissTable, n: usize) -> Vec<u64> {
        let bucket = |b: u64| (b + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - t.bits);
        let home = bucket(0);
        (0..).filter(|&b| bucket(b) == home).take(n).collect()
    }

    #[test]
    fn a_full_bucket_reuses_expired_entries_then_evicts_the_oldest() {
        let t = MissTable::with_capacity(0);
        assert_eq!(t.capacity(), WAYS * SHARDS);
        let blocks = same_bucket(&t, WAYS + 2);
        // Fill the bucket; block i first missed at second i.
        for (i, &b) in blocks[..WAYS].iter().enumerate() {
            assert!(!t.record_miss(b, i as u32, 2, 100));
        }
        // At second 100 block 0's window has passed: its entry is free, nothing is evicted.
        assert!(!t.record_miss(blocks[WAYS], 100, 2, 100));
        assert_eq!(t.evictions(), 0);
        assert!(
            !t.record_miss(blocks[0], 100, 2, 100),
            "block 0 counts from 1 again"
        );
        assert_eq!(
            t.evictions(),
            1,
            "and it took the place of the oldest: block 1"
        );
        assert!(
            !t.record_miss(blocks[1], 100, 2, 100),
            "block 1 was evicted"
        );
        // The others kept their counts.
        for &b in &blocks[3..WAYS] {
            assert!(t.record_miss(b, 100, 2, 100), "block {b}");
        }
    }

    #[test]
    fn memory_stays_bounded_under_a_flood_of_distinct_misses() {
        let t = MissTable::with_capacity(MIN_ENTRIES);
        for b in 0..(MIN_ENTRIES as u64 * 8) {
            assert!(!t.record_miss(b * 7919, (b / 1000) as u32, 2, 1_000_000));
        }
        assert!(t.live_entries(0, u32::MAX) <= t.capacity());
        assert_eq!(
            t.evictions(),
            MIN_ENTRIES as u64 * 8 - t.capacity() as u64,
            "every miss beyond the capacity evicted one"
        );
        // The most recent misses survived (the oldest were evicted first).
        let last = MIN_ENTRIES as u64 * 8 - 1;
        assert!(t.record_miss(last * 7919, (last / 1000) as u32, 2, 1_000_000));
        assert_eq!(entries_for_cache(1 << 40), MAX_ENTRIES);
        assert_eq!(entries_for_cache(1000), MIN_ENTRIES);
        assert_eq!(entries_for_cache(1 << 20), 512 << 10);
    }

    /// The unbounded model: block → (misses, second of the first).
    fn model_miss(m: &mut HashMap<u64, (u32, u32)>, b: u64, now: u32, n: u32, w: u32) -> bool {
        if n <= 1 {
            return true;
        }
        let e = m.entry(b).or_insert((0, now));
        if e.0 == 0 || now.saturating_sub(e.1) >= w {
            *e = (0, now);
        }
        e.0 += 1;
        if e.0 >= n {
            m.remove(&b);
            return true;
        }
        false
    }

    proptest! {
        #[test]
        fn matches_an_unbounded_model_while_nothing_is_evicted(
            ops in proptest::collection::vec((0..200u64, 0..3u32, 1..5u32, 1..6u32), 1..800)
        ) {
            let t = MissTable::with_capacity(4096);
            let mut m = HashMap::new();
            let mut now = 0u32;
            for (b, dt, nhit, window) in ops {
                now += dt;
                let got = t.record_miss(b, now, nhit, window);
                let want = model_miss(&mut m, b, now, nhit, window);
                prop_assert_eq!(got, want, "block {} at {}s, nhit {}, window {}", b, now, nhit, window);
            }
            prop_assert_eq!(t.evictions(), 0, "the model assumes room for every block");
        }
    }
}

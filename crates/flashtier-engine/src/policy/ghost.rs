//! The ghost list: which recently evicted blocks were read again.
//!
//! A read miss on a block reclaim evicted a little while ago is a miss a bigger cache would
//! have turned into a hit; counted, it answers the operator's "would more cache help?" where the
//! misses alone cannot (a miss on a block never seen before is cured by no cache size). The
//! ghost remembers the last `capacity` blocks evicted, the cache's own size, so its hits are
//! roughly the extra hits of a cache twice as large under the same policy (S3-FIFO's ghost queue
//! and ARC's B1/B2 lists are the same idea, used there to steer admission).
//!
//! **Bounded by sampling.** Remembering a 1 TiB cache's worth of evictions exactly would take
//! gigabytes, so the ghost keeps only the blocks whose hash falls in a fixed 1-in-2^k sample
//! (SHARDS spatial sampling, as `flashtier advise` does): at most [`MAX_SAMPLED`] blocks, and each
//! sampled hit counts as 2^k. The sample is of blocks, not of events, so a sampled block is
//! followed through every eviction and re-read; the estimate's error is that of the sample
//! (about 1/sqrt(sampled hits)). Caches of up to `MAX_SAMPLED` blocks (256 MiB of 4 KiB blocks)
//! are followed exactly.
//!
//! **Cost.** Blocks outside the sample cost one multiplication; the lock is taken only for
//! sampled blocks, on a read miss (which waits for the backing store anyway) or by reclaim while
//! it evicts. The memory is allocated on the first eviction, so a cache that never evicts pays
//! nothing. Lock order: the ghost's mutex is a leaf (reclaim takes it under the state lock).

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

/// Most blocks the ghost remembers; beyond, it samples.
pub const MAX_SAMPLED: u64 = 1 << 16;

/// Fibonacci hashing's multiplier (2^64 / φ): its high bits spread any run of block numbers.
const SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;

/// Recently evicted blocks, sampled; see the module doc.
pub(crate) struct Ghost {
    /// Blocks are sampled when the top `sample_bits` bits of their hash are zero.
    sample_bits: u32,
    /// Sampled blocks remembered.
    capacity: usize,
    list: Mutex<Option<GhostList>>,
}

/// Evictions in order: a block evicted again moves to the back (its older entry is skipped when
/// it reaches the front, by its stamp).
struct GhostList {
    order: VecDeque<(u64, u64)>,
    stamps: HashMap<u64, u64>,
    next_stamp: u64,
}

impl Ghost {
    /// A ghost remembering `cache_blocks` evictions, the size of a cache of that many blocks.
    pub(crate) fn new(cache_blocks: u64) -> Ghost {
        let mut sample_bits = 0;
        while cache_blocks >> sample_bits > MAX_SAMPLED {
            sample_bits += 1;
        }
        Ghost {
            sample_bits,
            capacity: (cache_blocks >> sample_bits).max(1) as usize,
            list: Mutex::new(None),
        }
    }

    fn sampled(&self, lba: u64) -> bool {
        self.sample_bits == 0 || lba.wrapping_mul(SPREAD) >> (64 - self.sample_bits) == 0
    }

    /// What one sampled hit stands for.
    pub(crate) fn weight(&self) -> u64 {
        1 << self.sample_bits
    }

    /// Remembers that `lbas` were evicted, in this order (one lock for a victim's worth).
    pub(crate) fn evicted(&self, lbas: &[u64]) {
        let mut sampled = lbas
            .iter()
            .copied()
            .filter(|&lba| self.sampled(lba))
            .peekable();
        if sampled.peek().is_none() {
            return;
        }
        let mut guard = self.list.lock();
        let capacity = self.capacity;
        let list = guard.get_or_insert_with(|| GhostList {
            order: VecDeque::with_capacity(2 * capacity),
            stamps: HashMap::with_capacity(capacity + 1),
            next_stamp: 0,
        });
        for lba in sampled {
            let stamp = list.next_stamp;
            list.next_stamp += 1;
            list.stamps.insert(lba, stamp);
            list.order.push_back((lba, stamp));
            // Stale entries (blocks evicted again, or read again) count against twice the
            // capacity, so the queue stays bounded whatever the pattern.
            while list.stamps.len() > capacity || list.order.len() > 2 * capacity {
                let Some((old, old_stamp)) = list.order.pop_front() else {
                    break;
                };
                if list.stamps.get(&old) == Some(&old_stamp) {
                    list.stamps.remove(&old);
                }
            }
        }
    }

    /// A read missed `lba`: how many ghost hits that stands for (0, or [`Ghost::weight`] if the
    /// block was evicted recently). The block is forgotten, so a second miss before its next
    /// eviction does not count again.
    pub(crate) fn read_missed(&self, lba: u64) -> u64 {
        if !self.sampled(lba) {
            return 0;
        }
        let remembered = self
            .list
            .lock()
            .as_mut()
            .is_some_and(|list| list.stamps.remove(&lba).is_some());
        if remembered {
            self.weight()
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_read_again_within_capacity_evictions_is_a_ghost_hit_once() {
        let g = Ghost::new(100);
        assert_eq!(g.weight(), 1);
        assert_eq!(g.read_missed(7), 0, "nothing evicted yet");
        g.evicted(&[7]);
        for lba in 1000..1099 {
            g.evicted(&[lba]);
        }
        assert_eq!(
            g.read_missed(7),
            1,
            "99 evictions later it is still remembered"
        );
        assert_eq!(g.read_missed(7), 0, "counted once");
        g.evicted(&[8]);
        for lba in 2000..2100 {
            g.evicted(&[lba]);
        }
        assert_eq!(g.read_missed(8), 0, "100 evictions later it is forgotten");
    }

    #[test]
    fn a_block_evicted_again_is_remembered_from_its_last_eviction() {
        let g = Ghost::new(10);
        g.evicted(&[1]);
        for lba in 100..105 {
            g.evicted(&[lba]);
        }
        g.evicted(&[1]);
        for lba in 200..208 {
            g.evicted(&[lba]);
        }
        // 14 evictions since its first, 8 since its second: remembered.
        assert_eq!(g.read_missed(1), 1);
    }

    #[test]
    fn the_same_blocks_evicted_over_and_over_keep_the_queue_bounded() {
        let g = Ghost::new(8);
        for round in 0..10_000u64 {
            g.evicted(&[round % 3]);
        }
        let guard = g.list.lock();
        let list = guard.as_ref().unwrap();
        assert!(list.order.len() <= 16, "{}", list.order.len());
        assert_eq!(list.stamps.len(), 3);
    }

    #[test]
    fn a_large_cache_samples_and_weighs_its_hits() {
        let blocks = 1u64 << 26; // 256 GiB of 4 KiB blocks
        let g = Ghost::new(blocks);
        assert_eq!(g.weight(), 1 << 10);
        assert_eq!(
            g.capacity as u64 * g.weight(),
            blocks,
            "remembers a cache's worth"
        );
        // Evict 200k blocks, then read back the last 100k: about 100k ghost hits estimated.
        let lbas: Vec<u64> = (0..200_000u64).map(|i| i * 7919).collect();
        for victim in lbas.chunks(1024) {
            g.evicted(victim);
        }
        let estimate: u64 = lbas[100_000..].iter().map(|&l| g.read_missed(l)).sum();
        let sampled = g.list.lock().as_ref().unwrap().stamps.len() as u64 + estimate / g.weight();
        assert!(sampled <= MAX_SAMPLED, "{sampled}");
        assert!(
            (80_000..=120_000).contains(&estimate),
            "estimated {estimate} ghost hits for 100,000"
        );
    }

    #[test]
    fn a_cache_that_never_evicts_allocates_nothing() {
        let g = Ghost::new(1 << 20);
        assert_eq!(g.read_missed(5), 0);
        assert!(g.list.lock().is_none());
    }
}

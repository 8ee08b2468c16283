//! The floor under every curve: the fewest read misses any cache of a given size could have on
//! the stream, if it knew the future (Belady's MIN, 1966). No policy gets there; a target below
//! it cannot be met by any cache, and the distance between a policy and it is what a better
//! policy could still win.
//!
//! The cache may hold any blocks it likes, up to its size, and may decline to keep a block it
//! has just read or been written (bypass). A read of a block it does not hold is a miss; a write
//! gives it the block's new contents for nothing; a trim removes the block. The rule: after each
//! access, while the cache is over its size, drop the block whose next *read* comes last. A block
//! that is written or trimmed before it is read again is worth nothing until then (the write
//! brings it back for free), so it goes first. Exchanging one choice of the rule for another
//! choice never saves a miss (the test holds the rule against an exhaustive search over every
//! set the cache could hold at every step).
//!
//! Two passes: one backwards to find each access's next read, one forwards with a max-heap of
//! next reads (stale entries skipped when popped).

use std::collections::{BinaryHeap, HashMap};

use super::Access;

/// A block never read again before it is written, trimmed or the stream ends. Above every index
/// into a stream; a held block's key adds the index of the access that brought it (see
/// `read_misses`).
const NEVER: u64 = 1 << 63;
/// A block the simulated cache does not hold.
const NOT_HELD: u64 = u64::MAX;

/// For each access of a stream, its block numbered densely (so the simulation keeps a vector,
/// not a hash map) and when that block is next read with nothing written or trimmed in between
/// (an index into the stream, or [`NEVER`]). Computed once, simulated at many sizes.
pub struct NextReads<'a> {
    stream: &'a [Access],
    ids: Vec<u32>,
    next: Vec<u64>,
    blocks: usize,
}

impl<'a> NextReads<'a> {
    pub fn of(stream: &'a [Access]) -> NextReads<'a> {
        let mut dense: HashMap<u64, u32> = HashMap::new();
        let ids: Vec<u32> = stream
            .iter()
            .map(|&(Access::Read(b) | Access::Write(b) | Access::Trim(b))| {
                let n = dense.len() as u32;
                *dense.entry(b).or_insert(n)
            })
            .collect();
        let mut next = vec![NEVER; stream.len()];
        // Each block's next access after the one being looked at: a read's index, or NEVER for a
        // write, a trim or none.
        let mut ahead = vec![NEVER; dense.len()];
        for (i, &a) in stream.iter().enumerate().rev() {
            let id = ids[i] as usize;
            next[i] = ahead[id];
            ahead[id] = match a {
                Access::Read(_) => i as u64,
                Access::Write(_) | Access::Trim(_) => NEVER,
            };
        }
        NextReads {
            stream,
            ids,
            next,
            blocks: dense.len(),
        }
    }

    /// The read misses of the best possible cache of `capacity` blocks on the stream.
    pub fn read_misses(&self, capacity: usize) -> u64 {
        // Per block: its key while held (its next read; for a block worth nothing, NEVER plus the
        // index of the access that brought it, so every key is pushed once), else NOT_HELD. The
        // heap holds (key, block); an entry whose key is not the block's any more is stale.
        let mut held = vec![NOT_HELD; self.blocks];
        let mut count = 0usize;
        let mut heap: BinaryHeap<(u64, u32)> = BinaryHeap::new();
        let mut misses = 0u64;
        for (i, ((&a, &id), &next)) in self
            .stream
            .iter()
            .zip(&self.ids)
            .zip(&self.next)
            .enumerate()
        {
            let key = if next == NEVER {
                NEVER + i as u64
            } else {
                next
            };
            let slot = &mut held[id as usize];
            match a {
                Access::Read(_) => misses += (*slot == NOT_HELD) as u64,
                Access::Write(_) => {}
                Access::Trim(_) => {
                    count -= (*slot != NOT_HELD) as usize;
                    *slot = NOT_HELD;
                    continue;
                }
            }
            count += (*slot == NOT_HELD) as usize;
            *slot = key;
            heap.push((key, id));
            while count > capacity {
                let (when, b) = heap.pop().expect("every held block is in the heap");
                if held[b as usize] == when {
                    held[b as usize] = NOT_HELD;
                    count -= 1;
                }
            }
            // Stale entries would otherwise pile up to one per access. Keys are unique, so this
            // leaves one entry per held block, and its cost is paid for by the pushes since the
            // last time.
            if heap.len() > 4 * count + 1024 {
                heap.retain(|&(when, b)| held[b as usize] == when);
            }
        }
        misses
    }
}

#[cfg(test)]
mod tests {
    use super::super::policies::{Fifo, S3Fifo};
    use super::super::simulate;
    use super::super::stack::LruStack;
    use super::*;
    use proptest::prelude::*;

    /// The fewest read misses over every choice of what to hold at every step: the sets a cache
    /// of `capacity` could hold, as bitmasks over blocks 0..8.
    fn exhaustive(stream: &[Access], capacity: u32) -> u64 {
        const WORST: u64 = u64::MAX;
        let mut best = vec![WORST; 256];
        best[0] = 0;
        for &a in stream {
            let mut next = vec![WORST; 256];
            for (set, &misses) in best.iter().enumerate() {
                if misses == WORST {
                    continue;
                }
                let (reachable, cost) = match a {
                    Access::Read(b) => (set | 1 << b, u64::from(set & 1 << b == 0)),
                    Access::Write(b) => (set | 1 << b, 0),
                    Access::Trim(b) => (set & !(1 << b), 0),
                };
                // Any subset of what it could hold after the access, within its size.
                let mut sub = reachable;
                loop {
                    if (sub as u32).count_ones() <= capacity {
                        let m = &mut next[sub];
                        *m = (*m).min(misses + cost);
                    }
                    if sub == 0 {
                        break;
                    }
                    sub = (sub - 1) & reachable;
                }
            }
            best = next;
        }
        best.into_iter().min().unwrap()
    }

    fn access() -> impl Strategy<Value = Access> {
        access_of(8)
    }

    fn access_of(blocks: u64) -> impl Strategy<Value = Access> {
        (0u64..blocks, 0u8..10).prop_map(|(b, k)| match k {
            0..=5 => Access::Read(b),
            6..=8 => Access::Write(b),
            _ => Access::Trim(b),
        })
    }

    #[test]
    fn a_block_written_before_its_next_read_is_dropped_first() {
        use Access::{Read, Write};
        // Cache of 1: after reading 1 and 2, keep 2 over 1. 1 is used sooner, but by a write,
        // which brings it back for nothing (a Belady that counted writes as uses would keep 1).
        let s = [Read(1), Read(2), Write(1), Read(2)];
        let n = NextReads::of(&s);
        assert_eq!(n.read_misses(1), 2, "only the two cold reads miss");
        // Farthest next read goes: 3 is read last, so it is dropped for 4 and missed again.
        let s = [Read(1), Read(2), Read(3), Read(1), Read(2), Read(3)];
        assert_eq!(NextReads::of(&s).read_misses(2), 4);
        assert_eq!(NextReads::of(&s).read_misses(3), 3);
        assert_eq!(NextReads::of(&s).read_misses(0), 6);
    }

    /// The rule written plainly: a list of what is held, scanned for the block read last.
    fn plain(stream: &[Access], capacity: usize) -> u64 {
        let next_read = |from: usize, block: u64| {
            for (j, &a) in stream.iter().enumerate().skip(from + 1) {
                match a {
                    Access::Read(b) if b == block => return j as u64,
                    Access::Write(b) | Access::Trim(b) if b == block => return NEVER,
                    _ => {}
                }
            }
            NEVER
        };
        let mut held: Vec<u64> = Vec::new();
        let mut misses = 0;
        for (i, &a) in stream.iter().enumerate() {
            match a {
                Access::Read(b) | Access::Write(b) => {
                    misses += u64::from(matches!(a, Access::Read(_)) && !held.contains(&b));
                    if !held.contains(&b) {
                        held.push(b);
                    }
                }
                Access::Trim(b) => held.retain(|&h| h != b),
            }
            while held.len() > capacity {
                let last = (0..held.len())
                    .max_by_key(|&k| next_read(i, held[k]))
                    .unwrap();
                held.swap_remove(last);
            }
        }
        misses
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Long streams, many blocks: the heap (stale entries, pruning) keeps to the plain rule.
        #[test]
        fn the_heap_keeps_to_the_plain_rule(
            capacity in 1usize..200,
            stream in prop::collection::vec(access_of(600), 3000..6000),
        ) {
            let n = NextReads::of(&stream);
            prop_assert_eq!(n.read_misses(capacity), plain(&stream, capacity));
        }
    }

    proptest! {
        /// The rule is optimal: it misses exactly as often as the best of every possible choice.
        #[test]
        fn belady_matches_an_exhaustive_search(
            capacity in 0u32..5,
            stream in prop::collection::vec(access(), 0..24),
        ) {
            let n = NextReads::of(&stream);
            prop_assert_eq!(n.read_misses(capacity as usize), exhaustive(&stream, capacity));
        }

        /// And so no policy misses less, at any size.
        #[test]
        fn no_policy_misses_less(
            capacity in 1usize..40,
            stream in prop::collection::vec((0u64..100, 0u8..10), 0..2000),
        ) {
            let stream: Vec<Access> = stream
                .into_iter()
                .map(|(b, k)| if k < 7 { Access::Read(b) } else { Access::Write(b) })
                .collect();
            let opt = NextReads::of(&stream).read_misses(capacity);
            let mut lru = LruStack::with_capacity(stream.len());
            for &a in &stream {
                match a {
                    Access::Read(b) => lru.access(b, true),
                    Access::Write(b) => lru.access(b, false),
                    Access::Trim(b) => lru.forget(b),
                }
            }
            let lru = lru.curve();
            prop_assert!(opt <= lru.reads - lru.hits(capacity as u64));
            prop_assert!(opt <= simulate(&stream, Fifo::new(capacity)));
            prop_assert!(opt <= simulate(&stream, S3Fifo::new(capacity)));
        }
    }
}

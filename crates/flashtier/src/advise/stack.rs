//! Exact LRU miss-ratio curves in one pass: Mattson's stack algorithm. An access's *stack
//! distance* is the number of distinct other blocks accessed since the block's previous access;
//! an LRU cache of `s` blocks hits exactly the accesses whose distance is below `s`. So one
//! histogram of read distances gives the hits of every cache size at once.
//!
//! The distance is counted with a Fenwick tree over access times holding a 1 at the time of each
//! block's most recent access: the distinct blocks accessed since time `t` are the ones in
//! `(t, now)`. A trim forgets the block (its next access is a miss, as in a cache that dropped
//! it) without disturbing the others' distances, which is what removing it from the LRU stack
//! does.

use std::collections::HashMap;

/// Prefix sums over access times (1-based inside).
struct Fenwick(Vec<u32>);

impl Fenwick {
    fn new(n: usize) -> Fenwick {
        Fenwick(vec![0; n + 1])
    }

    fn add(&mut self, at: usize, delta: i32) {
        let mut i = at + 1;
        while i < self.0.len() {
            self.0[i] = self.0[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of `[0, end)`.
    fn prefix(&self, end: usize) -> u64 {
        let mut i = end;
        let mut sum = 0u64;
        while i > 0 {
            sum += self.0[i] as u64;
            i -= i & i.wrapping_neg();
        }
        sum
    }
}

/// The LRU stack of a stream of block accesses, and its read hits by stack distance.
pub struct LruStack {
    last: HashMap<u64, usize>,
    tree: Fenwick,
    now: usize,
    /// `hits[d]`: reads whose block was last accessed `d` distinct blocks ago.
    hits: Vec<u64>,
    reads: u64,
}

impl LruStack {
    /// A stack for at most `accesses` accesses (reads and writes; trims take none).
    pub fn with_capacity(accesses: usize) -> LruStack {
        LruStack {
            last: HashMap::new(),
            tree: Fenwick::new(accesses),
            now: 0,
            hits: Vec::new(),
            reads: 0,
        }
    }

    /// An access of `block`; reads are the ones counted (a write brings the block to the top
    /// too: write-back and write-through caches keep what is written).
    pub fn access(&mut self, block: u64, read: bool) {
        let now = self.now;
        if let Some(then) = self.last.insert(block, now) {
            if read {
                let distance = (self.tree.prefix(now) - self.tree.prefix(then + 1)) as usize;
                if self.hits.len() <= distance {
                    self.hits.resize(distance + 1, 0);
                }
                self.hits[distance] += 1;
            }
            self.tree.add(then, -1);
        }
        self.reads += read as u64;
        self.tree.add(now, 1);
        self.now += 1;
    }

    /// The block was trimmed: a cache drops it.
    pub fn forget(&mut self, block: u64) {
        if let Some(then) = self.last.remove(&block) {
            self.tree.add(then, -1);
        }
    }

    /// Distinct blocks in the stack.
    pub fn blocks(&self) -> usize {
        self.last.len()
    }

    pub fn curve(&self) -> LruCurve {
        let mut cumulative = Vec::with_capacity(self.hits.len() + 1);
        let mut sum = 0;
        cumulative.push(0);
        for &h in &self.hits {
            sum += h;
            cumulative.push(sum);
        }
        LruCurve {
            cumulative,
            reads: self.reads,
        }
    }
}

/// Read hits of an LRU cache of every size.
#[derive(Debug, Clone)]
pub struct LruCurve {
    /// `cumulative[s]`: read hits of a cache of `s` blocks (constant past the end).
    cumulative: Vec<u64>,
    pub reads: u64,
}

impl LruCurve {
    pub fn hits(&self, blocks: u64) -> u64 {
        let i = (blocks as usize).min(self.cumulative.len() - 1);
        self.cumulative[i]
    }

    /// Read hits of a cache large enough for every block: all reads but the first of each block.
    pub fn max_hits(&self) -> u64 {
        *self.cumulative.last().expect("never empty")
    }

    /// The smallest cache with at least `want` read hits (the largest useful one if none has).
    pub fn size_for_hits(&self, want: u64) -> u64 {
        (self.cumulative.partition_point(|&h| h < want) as u64)
            .min(self.cumulative.len() as u64 - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A list kept in recency order: the reference the stack algorithm must agree with.
    fn naive_lru_hits(accesses: &[(u64, bool)], size: usize) -> u64 {
        let mut stack: Vec<u64> = Vec::new();
        let mut hits = 0;
        for &(b, read) in accesses {
            if let Some(at) = stack.iter().position(|&x| x == b) {
                stack.remove(at);
                hits += read as u64;
            } else if stack.len() == size {
                stack.pop();
            }
            if size > 0 {
                stack.insert(0, b);
            }
        }
        hits
    }

    proptest! {
        #[test]
        fn the_curve_is_an_lru_cache_of_every_size(
            accesses in prop::collection::vec((0u64..40, any::<bool>()), 0..400),
        ) {
            let mut s = LruStack::with_capacity(accesses.len());
            for &(b, read) in &accesses {
                s.access(b, read);
            }
            let curve = s.curve();
            prop_assert_eq!(curve.reads, accesses.iter().filter(|a| a.1).count() as u64);
            for size in 0..45 {
                prop_assert_eq!(curve.hits(size as u64), naive_lru_hits(&accesses, size), "size {}", size);
            }
        }
    }

    #[test]
    fn a_trimmed_block_misses_and_leaves_the_others_alone() {
        let mut s = LruStack::with_capacity(8);
        for b in [1, 2, 3] {
            s.access(b, false);
        }
        s.forget(2);
        s.access(2, true); // a cold miss again
        s.access(1, true); // 3 and 2 since: distance 2
        let c = s.curve();
        assert_eq!((c.hits(2), c.hits(3), c.max_hits(), c.reads), (0, 1, 1, 2));
        assert_eq!((c.size_for_hits(1), c.size_for_hits(2)), (3, 3));
        assert_eq!(s.blocks(), 3);
    }
}

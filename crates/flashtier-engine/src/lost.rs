//! Lost blocks: addresses whose newest data the cache held and can no longer produce.
//!
//! A block is lost when its only up-to-date copy failed its checksum: a dirty block damaged on
//! the cache device, or a record that recovery had to skip in the middle of the log. Serving the
//! backing store's older copy instead would be serving wrong data, so reads of a lost block fail
//! with EIO until something replaces it: a client write (WRITE, or an INVALIDATE before data
//! written around the cache) or an explicit acknowledgement of the loss (`forget-lost`, which is
//! an INVALIDATE too). The set is part of the state the log rebuilds: LOST records add to it,
//! checkpoints carry it, and replay applies both like any other record.
//!
//! Ranges are kept merged and disjoint, so the set stays small even when a large record is lost.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent ranges `first → count` of lost blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LostSet {
    ranges: BTreeMap<u64, u64>,
    blocks: u64,
}

impl LostSet {
    pub fn from_ranges(ranges: &[(u64, u64)]) -> LostSet {
        let mut set = LostSet::default();
        for &(first, n) in ranges {
            set.insert(first, n);
        }
        set
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Lost blocks in all.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Number of ranges (what a checkpoint must find room for).
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    /// The ranges `(first, count)` in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&f, &n)| (f, n))
    }

    /// Whether any block of `[first, first + n)` is lost.
    pub fn overlaps(&self, first: u64, n: u64) -> bool {
        if self.ranges.is_empty() || n == 0 {
            return false;
        }
        let end = first.saturating_add(n);
        // The last range starting before `end` is the only one that can reach into the span.
        self.ranges
            .range(..end)
            .next_back()
            .is_some_and(|(&f, &k)| f + k > first)
    }

    /// Marks `[first, first + n)` lost.
    pub fn insert(&mut self, first: u64, n: u64) {
        if n == 0 {
            return;
        }
        let mut start = first;
        let mut end = first.saturating_add(n);
        self.remove(first, n);
        // Merge with neighbours that touch the new range.
        if let Some((&f, &k)) = self.ranges.range(..start).next_back() {
            if f + k == start {
                self.ranges.remove(&f);
                self.blocks -= k;
                start = f;
            }
        }
        if let Some(&k) = self.ranges.get(&end) {
            self.ranges.remove(&end);
            self.blocks -= k;
            end += k;
        }
        self.ranges.insert(start, end - start);
        self.blocks += end - start;
    }

    /// Clears `[first, first + n)`; returns how many blocks were lost there.
    pub fn remove(&mut self, first: u64, n: u64) -> u64 {
        if !self.overlaps(first, n) {
            return 0;
        }
        let end = first.saturating_add(n);
        let mut cleared = 0;
        // Ranges that overlap: the one starting before `first` (if it reaches in) and those
        // starting inside the span.
        let starts: Vec<u64> = self
            .ranges
            .range(..end)
            .rev()
            .take_while(|(&f, &k)| f + k > first)
            .map(|(&f, _)| f)
            .collect();
        for f in starts {
            let k = self.ranges.remove(&f).expect("listed above");
            let r_end = f + k;
            if f < first {
                self.ranges.insert(f, first - f);
            }
            if r_end > end {
                self.ranges.insert(end, r_end - end);
            }
            cleared += r_end.min(end) - f.max(first);
        }
        self.blocks -= cleared;
        cleared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn ranges_merge_split_and_count() {
        let mut s = LostSet::default();
        s.insert(10, 5);
        s.insert(15, 5);
        assert_eq!(
            s.ranges().collect::<Vec<_>>(),
            vec![(10, 10)],
            "adjacent merge"
        );
        assert_eq!(s.blocks(), 10);
        assert!(s.overlaps(19, 1) && s.overlaps(0, 11) && !s.overlaps(20, 100));
        assert!(!s.overlaps(0, 10));
        assert_eq!(s.remove(12, 3), 3);
        assert_eq!(s.ranges().collect::<Vec<_>>(), vec![(10, 2), (15, 5)]);
        s.insert(11, 6);
        assert_eq!(
            s.ranges().collect::<Vec<_>>(),
            vec![(10, 10)],
            "bridging merge"
        );
        assert_eq!(s.remove(0, 1000), 10);
        assert!(s.is_empty());
        assert_eq!(s.blocks(), 0);
    }

    proptest! {
        /// The set behaves like a plain set of block numbers, and stays merged.
        #[test]
        fn matches_a_set_of_blocks(ops in prop::collection::vec((any::<bool>(), 0u64..64, 1u64..12), 0..60)) {
            let mut s = LostSet::default();
            let mut model = BTreeSet::new();
            for (insert, first, n) in ops {
                if insert {
                    s.insert(first, n);
                    model.extend(first..first + n);
                } else {
                    let expect = (first..first + n).filter(|b| model.remove(b)).count() as u64;
                    prop_assert_eq!(s.remove(first, n), expect);
                }
                prop_assert_eq!(s.blocks(), model.len() as u64);
                let blocks: BTreeSet<u64> = s.ranges().flat_map(|(f, k)| f..f + k).collect();
                prop_assert_eq!(&blocks, &model);
                for w in s.ranges().collect::<Vec<_>>().windows(2) {
                    prop_assert!(w[0].0 + w[0].1 < w[1].0, "ranges merged and disjoint");
                }
                for b in 0..80 {
                    prop_assert_eq!(s.overlaps(b, 1), model.contains(&b));
                    prop_assert_eq!(s.overlaps(b, 3), (b..b + 3).any(|x| model.contains(&x)));
                }
            }
        }
    }
}

//! A lock-free latency histogram: log-linear buckets of relaxed atomics.
//!
//! Every value below 16 has its own bucket; above that, each power of two is split into 16
//! equal buckets, so a bucket's width is at most 1/16 of its lower bound and any percentile read
//! back is within 6.25% of the exact one (tested against sorting below). 976 buckets cover the
//! whole `u64` range: recording is one `leading_zeros`, a shift and three relaxed atomic adds, cheap
//! enough for every I/O request, with no lock for the NBD worker threads to contend on.
//!
//! Readers take a [`HistSnapshot`]; snapshots subtract, which is how `reset-stats` works without
//! touching the live counters (the control layer keeps a baseline snapshot).

use std::sync::atomic::{AtomicU64, Ordering};

/// Sub-buckets per power of two (2^SUB_BITS).
const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
/// Buckets needed for every u64: the 16 exact ones and 16 per power of two from 2^4 to 2^63.
pub const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) * SUB as usize;

/// The bucket holding `v`.
fn bucket_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let mantissa = (v >> (e - SUB_BITS)) & (SUB - 1);
    ((e - SUB_BITS + 1) as u64 * SUB + mantissa) as usize
}

/// The smallest and largest value bucket `i` holds.
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < SUB {
        return (i, i);
    }
    let e = (i / SUB) as u32 + SUB_BITS - 1;
    let mantissa = i % SUB;
    let width = 1u64 << (e - SUB_BITS);
    let lo = (SUB + mantissa) << (e - SUB_BITS);
    (lo, lo + (width - 1))
}

/// Live histogram, shared by every thread that records into it.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum: AtomicU64,
    max: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Adds one value (any unit; the callers use nanoseconds). Lock-free, safe on the I/O path.
    pub fn record(&self, v: u64) {
        self.buckets[bucket_of(v)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
        self.max.fetch_max(v, Ordering::Relaxed);
    }

    /// A copy of the histogram. Not atomic as a whole: a value recorded meanwhile may be in the
    /// buckets but not yet in `count`; percentiles use the bucket total, so they stay consistent.
    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum: self.sum.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
        }
    }
}

/// A histogram at one moment, or the difference of two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistSnapshot {
    buckets: Vec<u64>,
    /// How many values were recorded.
    pub count: u64,
    /// The values' total, for the mean.
    pub sum: u64,
    /// The largest value recorded; in a difference ([`since`](Self::since)), an upper bound.
    pub max: u64,
}

impl Default for HistSnapshot {
    fn default() -> Self {
        HistSnapshot {
            buckets: vec![0; BUCKETS],
            count: 0,
            sum: 0,
            max: 0,
        }
    }
}

impl HistSnapshot {
    /// What was recorded after `earlier` was taken. The maximum of that part is not known
    /// exactly: it is the top of the highest bucket that grew, capped by the overall maximum.
    pub fn since(&self, earlier: &HistSnapshot) -> HistSnapshot {
        let buckets: Vec<u64> = self
            .buckets
            .iter()
            .zip(&earlier.buckets)
            .map(|(a, b)| a.saturating_sub(*b))
            .collect();
        let max = match buckets.iter().rposition(|&n| n > 0) {
            Some(i) => bucket_range(i).1.min(self.max),
            None => 0,
        };
        HistSnapshot {
            buckets,
            count: self.count.saturating_sub(earlier.count),
            sum: self.sum.saturating_sub(earlier.sum),
            max,
        }
    }

    /// Values recorded at or below `bound`, counting only buckets entirely at or below it: a
    /// bucket straddling `bound` (at most 1/16 of it wide) is left out, so this is the count
    /// at some value in `(bound * 15/16, bound]`. Monotonic in `bound`, as Prometheus's
    /// cumulative `le` buckets must be.
    pub fn count_at_most(&self, bound: u64) -> u64 {
        self.buckets
            .iter()
            .enumerate()
            .take_while(|&(i, _)| bucket_range(i).1 <= bound)
            .map(|(_, &c)| c)
            .sum()
    }

    /// The value at quantile `q` (0..=1): the smallest bucket value with at least `ceil(q * n)`
    /// values at or below it, reported as the top of its bucket (never under the true value,
    /// at most 1/16 over it) and capped by the maximum. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n: u64 = self.buckets.iter().sum();
        if n == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_range(i).1.min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_tile_the_whole_range() {
        let mut next = 0u64;
        for i in 0..BUCKETS {
            let (lo, hi) = bucket_range(i);
            assert_eq!(lo, next, "bucket {i}");
            assert_eq!(bucket_of(lo), i);
            assert_eq!(bucket_of(hi), i);
            if lo >= SUB {
                assert!((hi - lo + 1) * SUB <= lo, "bucket {i} too wide");
            }
            next = hi.wrapping_add(1);
        }
        assert_eq!(next, 0, "the last bucket ends at u64::MAX");
    }

    #[test]
    fn empty_and_single_values() {
        let h = Histogram::default();
        assert_eq!(h.snapshot().quantile(0.5), 0);
        h.record(1234);
        let s = h.snapshot();
        assert_eq!((s.count, s.sum, s.max), (1, 1234, 1234));
        for q in [0.0, 0.5, 0.99, 1.0] {
            assert_eq!(s.quantile(q), 1234);
        }
    }

    #[test]
    fn since_keeps_only_the_later_part() {
        let h = Histogram::default();
        for v in 0..1000 {
            h.record(v);
        }
        let before = h.snapshot();
        for _ in 0..10 {
            h.record(50_000);
        }
        let d = h.snapshot().since(&before);
        assert_eq!(d.count, 10);
        assert_eq!(d.sum, 500_000);
        assert_eq!(d.quantile(0.5), 50_000);
        assert_eq!(d.max, 50_000);
        let none = h.snapshot().since(&h.snapshot());
        assert_eq!((none.count, none.max, none.quantile(0.99)), (0, 0, 0));
    }

    #[test]
    fn count_at_most_counts_whole_buckets_up_to_the_bound() {
        let h = Histogram::default();
        for v in [5, 100, 1_000, 1_000_000, 2_000_000] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.count_at_most(4), 0);
        assert_eq!(s.count_at_most(5), 1);
        assert_eq!(
            s.count_at_most(1_000_000),
            3,
            "{{1_000_000}} is near a bucket's top"
        );
        assert_eq!(s.count_at_most(1_999_999), 4);
        assert_eq!(s.count_at_most(u64::MAX), 5);
        // 1000's bucket is [992, 1023]: a bound inside it leaves it out.
        assert_eq!(s.count_at_most(1_000), 2);
    }

    proptest! {
        #[test]
        fn quantiles_match_sorting_within_a_sixteenth(
            values in prop::collection::vec(
                prop_oneof![0u64..100, 0u64..100_000, 0u64..10_000_000_000, any::<u64>()],
                1..400,
            ),
            q in 0.0f64..=1.0,
        ) {
            let h = Histogram::default();
            for &v in &values {
                h.record(v);
            }
            let mut sorted = values.clone();
            sorted.sort_unstable();
            let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
            let exact = sorted[rank - 1];
            let got = h.snapshot().quantile(q);
            prop_assert!(got >= exact, "q {q}: {got} < exact {exact}");
            prop_assert!(got - exact <= exact / 16, "q {q}: {got} too far above {exact}");
            prop_assert_eq!(h.snapshot().max, *sorted.last().unwrap());
        }
    }
}

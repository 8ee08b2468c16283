//! Per-server counters and the latency histogram.
//!
//! Every request updates them, from many threads at once, so they are plain relaxed atomics:
//! no lock on the hot path, and a reader gets each counter's value at some instant (a snapshot is
//! not one consistent cut across counters, which monitoring does not need).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Buckets of [`LatencySnapshot`]: bucket `i` holds round trips of `[2^i, 2^(i+1))` µs (bucket 0
/// also holds 0 µs, the last one everything from about 36 minutes up).
pub const LATENCY_BUCKETS: usize = 32;

/// A histogram of request round-trip latencies in power-of-two microsecond buckets.
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct LatencySnapshot {
    buckets: [u64; LATENCY_BUCKETS],
}

impl LatencySnapshot {
    /// The bucket a round trip of `d` falls in.
    pub fn bucket_of(d: Duration) -> usize {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        (micros.max(1).ilog2() as usize).min(LATENCY_BUCKETS - 1)
    }

    /// The exclusive upper bound of bucket `i`: `2^(i+1)` µs.
    pub fn upper_bound(i: usize) -> Duration {
        Duration::from_micros(1u64 << (i.min(LATENCY_BUCKETS - 1) + 1))
    }

    /// How many round trips were recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The latency at or under which `p` percent of round trips completed (`p` in 0..=100,
    /// clamped), rounded up to its bucket's upper bound; zero when nothing was recorded.
    pub fn percentile(&self, p: f64) -> Duration {
        let count = self.count();
        if count == 0 {
            return Duration::ZERO;
        }
        let p = if p.is_nan() {
            100.0
        } else {
            p.clamp(0.0, 100.0)
        };
        // The rank of the round trip sought, 1-based: at least the first, at most the last.
        let rank = ((p * count as f64 / 100.0).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Self::upper_bound(i);
            }
        }
        Self::upper_bound(LATENCY_BUCKETS - 1)
    }

    /// Round trips per bucket, [`LATENCY_BUCKETS`] of them.
    pub fn buckets(&self) -> &[u64] {
        &self.buckets
    }

    /// What was recorded since `base`, an earlier snapshot of the same histogram (saturating, so
    /// a `base` from elsewhere cannot underflow).
    pub fn sub(&self, base: &LatencySnapshot) -> LatencySnapshot {
        let mut out = self.clone();
        for (o, b) in out.buckets.iter_mut().zip(&base.buckets) {
            *o = o.saturating_sub(*b);
        }
        out
    }

    /// The two histograms merged, e.g. the totals of several servers.
    pub fn add(&self, other: &LatencySnapshot) -> LatencySnapshot {
        let mut out = self.clone();
        for (o, b) in out.buckets.iter_mut().zip(&other.buckets) {
            *o = o.saturating_add(*b);
        }
        out
    }
}

/// What the pool did with one server (or, from [`crate::client::Pool::totals`], with all of
/// them). Every counter only grows.
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct ServerStats {
    /// Keys asked for, in `get`s sent or attempted (a request that failed to connect counts).
    pub gets: u64,
    /// Keys the server returned a value for.
    pub hits: u64,
    /// Keys the server answered without a value.
    pub misses: u64,
    /// `set`s sent or attempted.
    pub sets: u64,
    /// `delete`s sent or attempted.
    pub deletes: u64,
    /// Bytes read from the server's connections.
    pub bytes_read: u64,
    /// Bytes written to the server's connections.
    pub bytes_written: u64,
    /// Requests that failed other than by a timeout (refused connections, resets, protocol
    /// errors, error replies), plus keys or values refused before sending (an invalid key, a value
    /// over the limit) and sets the server rejected (an item too large for it).
    pub errors: u64,
    /// Requests that hit their deadline.
    pub timeouts: u64,
    /// Keys (of gets, sets and deletes) not sent because the server was down.
    pub skipped: u64,
    /// Round trips of the requests that completed.
    pub latency: LatencySnapshot,
}

impl ServerStats {
    /// What happened since `base`, an earlier snapshot of the same counters.
    pub fn sub(&self, base: &ServerStats) -> ServerStats {
        self.zip(base, u64::saturating_sub, LatencySnapshot::sub)
    }

    /// The two summed, e.g. over servers.
    pub fn add(&self, other: &ServerStats) -> ServerStats {
        self.zip(other, u64::saturating_add, LatencySnapshot::add)
    }

    fn zip(
        &self,
        o: &ServerStats,
        f: fn(u64, u64) -> u64,
        h: fn(&LatencySnapshot, &LatencySnapshot) -> LatencySnapshot,
    ) -> ServerStats {
        ServerStats {
            gets: f(self.gets, o.gets),
            hits: f(self.hits, o.hits),
            misses: f(self.misses, o.misses),
            sets: f(self.sets, o.sets),
            deletes: f(self.deletes, o.deletes),
            bytes_read: f(self.bytes_read, o.bytes_read),
            bytes_written: f(self.bytes_written, o.bytes_written),
            errors: f(self.errors, o.errors),
            timeouts: f(self.timeouts, o.timeouts),
            skipped: f(self.skipped, o.skipped),
            latency: h(&self.latency, &o.latency),
        }
    }
}

/// The live histogram behind a [`LatencySnapshot`].
pub(crate) struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl LatencyHistogram {
    pub(crate) fn record(&self, d: Duration) {
        self.buckets[LatencySnapshot::bucket_of(d)].fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Relaxed)),
        }
    }
}

/// The live counters behind a [`ServerStats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) gets: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) sets: AtomicU64,
    pub(crate) deletes: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) latency: LatencyHistogram,
}

/// Adds `n` to a counter.
pub(crate) fn bump(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> ServerStats {
        ServerStats {
            gets: self.gets.load(Relaxed),
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            sets: self.sets.load(Relaxed),
            deletes: self.deletes.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            errors: self.errors.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
            skipped: self.skipped.load(Relaxed),
            latency: self.latency.snapshot(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(LatencySnapshot::bucket_of(Duration::ZERO), 0);
        assert_eq!(LatencySnapshot::bucket_of(Duration::from_nanos(999)), 0);
        assert_eq!(LatencySnapshot::bucket_of(us(1)), 0);
        assert_eq!(LatencySnapshot::bucket_of(us(2)), 1);
        assert_eq!(LatencySnapshot::bucket_of(us(3)), 1);
        assert_eq!(LatencySnapshot::bucket_of(us(4)), 2);
        assert_eq!(LatencySnapshot::bucket_of(us(1023)), 9);
        assert_eq!(LatencySnapshot::bucket_of(us(1024)), 10);
        assert_eq!(LatencySnapshot::bucket_of(us(1 << 31)), 31);
        assert_eq!(LatencySnapshot::bucket_of(Duration::MAX), 31);
        assert_eq!(LatencySnapshot::upper_bound(0), us(2));
        assert_eq!(LatencySnapshot::upper_bound(10), us(2048));
    }

    #[test]
    fn percentiles_are_bucket_upper_bounds() {
        let h = LatencyHistogram::default();
        assert_eq!(h.snapshot().percentile(50.0), Duration::ZERO);
        // 90 round trips of ~100 µs (bucket 6, up to 128 µs), 9 of ~1 ms (bucket 9, 1024 µs),
        // 1 of 5 ms (bucket 12, 8192 µs).
        for _ in 0..90 {
            h.record(us(100));
        }
        for _ in 0..9 {
            h.record(us(1000));
        }
        h.record(us(5000));
        let s = h.snapshot();
        assert_eq!(s.count(), 100);
        assert_eq!(s.buckets().len(), LATENCY_BUCKETS);
        assert_eq!(
            (s.buckets()[6], s.buckets()[9], s.buckets()[12]),
            (90, 9, 1)
        );
        assert_eq!(s.percentile(0.0), us(128));
        assert_eq!(s.percentile(50.0), us(128));
        assert_eq!(s.percentile(90.0), us(128));
        assert_eq!(s.percentile(90.5), us(1024));
        assert_eq!(s.percentile(99.0), us(1024));
        assert_eq!(s.percentile(99.9), us(8192));
        assert_eq!(s.percentile(100.0), us(8192));
        assert_eq!(s.percentile(250.0), us(8192));
        assert_eq!(s.percentile(f64::NAN), us(8192));
    }

    #[test]
    fn snapshots_subtract_and_add() {
        let h = LatencyHistogram::default();
        h.record(us(10));
        let base = h.snapshot();
        h.record(us(10));
        h.record(us(300));
        let delta = h.snapshot().sub(&base);
        assert_eq!(delta.count(), 2);
        assert_eq!((delta.buckets()[3], delta.buckets()[8]), (1, 1));
        assert_eq!(delta.add(&base), h.snapshot());
        assert_eq!(base.sub(&h.snapshot()), LatencySnapshot::default());

        let c = Counters::default();
        bump(&c.gets, 3);
        bump(&c.hits, 2);
        c.latency.record(us(5));
        let a = c.snapshot();
        bump(&c.gets, 1);
        let b = c.snapshot();
        let d = b.sub(&a);
        assert_eq!(
            d,
            ServerStats {
                gets: 1,
                ..Default::default()
            }
        );
        assert_eq!(a.add(&d), b);
    }
}

//! The working set: how many distinct 4 KiB blocks the clients touched in the last 5 minutes,
//! hour and day, and since the start (or the last `reset-stats`).
//!
//! **Why.** A cache is sized from what the clients keep coming back to, not from how much they
//! move: a job that reads the same 1 GiB a hundred times an hour wants a 1 GiB cache, a backup
//! streaming 1 TiB once wants none. Counters say how much was moved; this says how much of the
//! device it was. It is measured in [`Timed`](crate::timed::Timed), which every client request
//! passes, so it exists with or without a cache and whatever the cache does with the request.
//!
//! **How.** Counting distinct blocks exactly needs a set of them (16 bytes or more per block,
//! growing with the device: a day of scanning 10 TiB is 2.7 billion blocks). A HyperLogLog
//! sketch counts them in fixed memory: each block's 64-bit hash (the splitmix64 finaliser, a
//! bijection, so distinct blocks never collide) picks one of 4,096 one-byte registers by its top
//! 12 bits, and the register keeps the most leading zeros (plus one) seen in the other 52. A
//! request touches every 4 KiB block it reads or writes any byte of (trims, zeroing and flushes
//! are not accesses a cache serves, and do not count), whatever the cache's own block size.
//!
//! **Error.** With m = 4,096 registers the estimate's relative standard error is 1.04/√m ≈
//! 1.6% (about 95% of estimates within 3.3%), whatever the count. Below 2.5m (10,240 blocks,
//! 40 MiB) the estimate is linear counting from the registers still empty (off by a few blocks
//! for a few hundred); above, the harmonic mean of the registers with the usual bias correction
//! (alpha_m). 64-bit hashes need no large-range correction.
//!
//! **Windows.** The sketch of a union is the register-wise maximum of the sketches, exactly, so
//! a window adds no error of its own: it is the union of the sketches inside it. The current
//! minute's sketch ([`LiveSketch`]) is atomics, updated by the requests; once a minute the
//! controller's ticker swaps it out into a plain one ([`WorkingSet::tick`]), kept for an hour,
//! and merged into the current hour's, kept (once the hour is over) for a day, and into the
//! total. The 5 minute and hour windows are the minutes that began inside them plus the live
//! one, so they cover between their length less a minute and their length; the day is made of
//! whole hours the same way; each window's `secs` says what it really covers. Early on (up
//! less than a window) a window is everything since the start, as the counters' windows are.
//!
//! **Cost.** Per block a request touches, one hash and one relaxed load, and an atomic max only
//! when a register grows, which becomes rare once the minute's sketch has filled; no lock, no
//! allocation. Memory: 60 minutes, 24 hours, the current hour and the total, 4 KiB each, about
//! 350 KiB; a window merges at most 61 sketches (the hour's minutes and the live one).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::windows::{TOTAL, WINDOWS};

/// The unit counted, in bytes: a request touches every block it reads or writes a byte of.
pub const BLOCK_SIZE: u64 = 4096;

/// Bits of the hash that choose a register.
const PRECISION: u32 = 12;
const REGISTERS: usize = 1 << PRECISION;

/// The relative standard error of every estimate, 1.04/√4096.
pub const STANDARD_ERROR: f64 = 1.04 / 64.0;

const MINUTE: u64 = 60;
const HOUR: u64 = 3600;
const DAY: u64 = 86_400;

/// The splitmix64 finaliser, after adding its golden-ratio increment so that block 0 does not
/// hash to 0 (a fixed point of the finaliser alone). A bijection of the 64-bit integers.
fn hash(block: u64) -> u64 {
    let mut z = block.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The register `block` goes to and the value it offers it: leading zeros of the 52 bits the
/// index did not use, plus one (a sentinel bit caps it at 53).
fn register_of(block: u64) -> (usize, u8) {
    let h = hash(block);
    let index = (h >> (64 - PRECISION)) as usize;
    let rest = (h << PRECISION) | (1 << (PRECISION - 1));
    (index, rest.leading_zeros() as u8 + 1)
}

/// The blocks `len` bytes at `offset` touch (none for zero bytes).
fn blocks(offset: u64, len: u64) -> std::ops::Range<u64> {
    if len == 0 {
        return 0..0;
    }
    let end = offset.saturating_add(len - 1) / BLOCK_SIZE + 1;
    offset / BLOCK_SIZE..end
}

/// A frozen HyperLogLog sketch: a minute's, an hour's, the total, or a window's union.
#[derive(Clone, PartialEq, Eq)]
pub struct Sketch {
    registers: Box<[u8; REGISTERS]>,
}

impl Default for Sketch {
    fn default() -> Self {
        Sketch {
            registers: Box::new([0; REGISTERS]),
        }
    }
}

impl fmt::Debug for Sketch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 4,096 registers say nothing to a reader; how many are set and the estimate do.
        let set = self.registers.iter().filter(|&&r| r > 0).count();
        write!(
            f,
            "Sketch({set} of {REGISTERS} registers set, ~{:.0} blocks)",
            self.estimate()
        )
    }
}

impl Sketch {
    /// Counts `block` as touched.
    pub fn insert(&mut self, block: u64) {
        let (i, rank) = register_of(block);
        self.registers[i] = self.registers[i].max(rank);
    }

    /// Counts every block `len` bytes at `offset` touch.
    pub fn insert_range(&mut self, offset: u64, len: u64) {
        for block in blocks(offset, len) {
            self.insert(block);
        }
    }

    /// Makes this the sketch of the union of both sets of blocks: the register-wise maximum.
    pub fn merge(&mut self, other: &Sketch) {
        for (mine, theirs) in self.registers.iter_mut().zip(other.registers.iter()) {
            *mine = (*mine).max(*theirs);
        }
    }

    /// The estimated number of distinct blocks: linear counting while the raw estimate is at
    /// most 2.5 × 4,096 and some register is empty, else the bias-corrected harmonic mean.
    pub fn estimate(&self) -> f64 {
        let m = REGISTERS as f64;
        let (mut sum, mut empty) = (0.0, 0u32);
        for &r in self.registers.iter() {
            sum += (-f64::from(r)).exp2();
            empty += u32::from(r == 0);
        }
        let alpha = 0.7213 / (1.0 + 1.079 / m);
        let raw = alpha * m * m / sum;
        if raw <= 2.5 * m && empty > 0 {
            m * (m / f64::from(empty)).ln()
        } else {
            raw
        }
    }

    /// [`Self::estimate`] rounded to whole blocks.
    pub fn blocks(&self) -> u64 {
        self.estimate().round() as u64
    }
}

/// The current minute's sketch, updated by every request without a lock: registers only grow
/// ([`AtomicU8::fetch_max`]) until the ticker swaps them back to zero ([`Self::take`]), so a
/// request racing the swap counts in one minute or the next, never in neither.
pub struct LiveSketch {
    registers: Box<[AtomicU8; REGISTERS]>,
}

impl Default for LiveSketch {
    fn default() -> Self {
        LiveSketch {
            registers: Box::new(std::array::from_fn(|_| AtomicU8::new(0))),
        }
    }
}

impl fmt::Debug for LiveSketch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Live{:?}", self.snapshot())
    }
}

impl LiveSketch {
    /// Counts every 4 KiB block `len` bytes at `offset` touch: the request path, atomics only.
    pub fn record(&self, offset: u64, len: u64) {
        for block in blocks(offset, len) {
            let (i, rank) = register_of(block);
            let register = &self.registers[i];
            // Most blocks do not raise their register once the minute is under way; a plain
            // load keeps the cache line shared between the cores instead of writing it.
            if register.load(Ordering::Relaxed) < rank {
                register.fetch_max(rank, Ordering::Relaxed);
            }
        }
    }

    /// The registers as they are now, left as they are.
    pub fn snapshot(&self) -> Sketch {
        let mut s = Sketch::default();
        for (to, from) in s.registers.iter_mut().zip(self.registers.iter()) {
            *to = from.load(Ordering::Relaxed);
        }
        s
    }

    /// The registers as they are now, each swapped for zero in the same step.
    pub fn take(&self) -> Sketch {
        let mut s = Sketch::default();
        for (to, from) in s.registers.iter_mut().zip(self.registers.iter()) {
            *to = from.swap(0, Ordering::Relaxed);
        }
        s
    }
}

/// A frozen sketch and the time its first request could have come.
#[derive(Debug, Clone)]
struct Span {
    since: u64,
    sketch: Sketch,
}

impl Span {
    fn empty(since: u64) -> Span {
        Span {
            since,
            sketch: Sketch::default(),
        }
    }
}

/// One window's estimate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowEstimate {
    /// The window's name in reports: one of [`WINDOWS`], or [`TOTAL`].
    pub name: &'static str,
    /// Seconds the window really covers (see the module's "Windows").
    pub secs: u64,
    /// Distinct 4 KiB blocks touched in it, estimated.
    pub blocks: u64,
}

/// The working set's history: the live minute, the last hour's minutes, the last day's hours
/// and the total. Time is passed in (whole seconds on any monotonic clock), as for
/// [`crate::windows::Sampler`], which keeps this testable.
#[derive(Debug)]
pub struct WorkingSet {
    live: Arc<LiveSketch>,
    /// The start of the history: the server's start or the last reset.
    origin: u64,
    /// When the live minute began.
    live_since: u64,
    /// Frozen minutes, oldest first, none older than an hour.
    minutes: VecDeque<Span>,
    /// The minutes frozen since the current hour began, merged.
    this_hour: Span,
    /// Finished hours, oldest first, none older than a day.
    hours: VecDeque<Span>,
    /// Every minute frozen since `origin`, merged.
    total: Sketch,
}

impl WorkingSet {
    /// A history of what `live` records, starting at `now`.
    pub fn new(live: Arc<LiveSketch>, now: u64) -> WorkingSet {
        WorkingSet {
            live,
            origin: now,
            live_since: now,
            minutes: VecDeque::new(),
            this_hour: Span::empty(now),
            hours: VecDeque::new(),
            total: Sketch::default(),
        }
    }

    /// Forgets everything, the live minute too: every window starts again at `now`
    /// (reset-stats).
    pub fn restart(&mut self, now: u64) {
        self.live.take();
        *self = WorkingSet::new(self.live.clone(), now);
    }

    /// Freezes the live minute once it is a minute old (call about once a second; calls in
    /// between do nothing). A late call freezes what the live sketch has gathered since, as
    /// one longer "minute".
    pub fn tick(&mut self, now: u64) {
        if now < self.live_since + MINUTE {
            return;
        }
        let minute = Span {
            since: self.live_since,
            sketch: self.live.take(),
        };
        self.live_since = now;
        self.this_hour.sketch.merge(&minute.sketch);
        self.total.merge(&minute.sketch);
        self.minutes.push_back(minute);
        if now >= self.this_hour.since + HOUR {
            let hour = std::mem::replace(&mut self.this_hour, Span::empty(now));
            self.hours.push_back(hour);
        }
        // A window takes only sketches that began inside it, so older ones are never used.
        trim(&mut self.minutes, now.saturating_sub(HOUR));
        trim(&mut self.hours, now.saturating_sub(DAY));
    }

    /// The estimate of every window of [`WINDOWS`] and then [`TOTAL`], at `now`.
    pub fn windows(&self, now: u64) -> Vec<WindowEstimate> {
        let live = self.live.snapshot();
        let mut out: Vec<WindowEstimate> = WINDOWS
            .iter()
            .map(|&(name, len)| {
                let since = now.saturating_sub(len);
                let mut union = live.clone();
                let mut start = self.live_since;
                let mut add = |span: &Span| {
                    if span.since >= since {
                        union.merge(&span.sketch);
                        start = start.min(span.since);
                    }
                };
                if len <= HOUR {
                    self.minutes.iter().for_each(&mut add);
                } else {
                    self.hours.iter().for_each(&mut add);
                    add(&self.this_hour);
                }
                WindowEstimate {
                    name,
                    secs: now.saturating_sub(start),
                    blocks: union.blocks(),
                }
            })
            .collect();
        let mut total = live;
        total.merge(&self.total);
        out.push(WindowEstimate {
            name: TOTAL,
            secs: now.saturating_sub(self.origin),
            blocks: total.blocks(),
        });
        out
    }
}

/// Drops the sketches that began before `keep_from`.
fn trim(ring: &mut VecDeque<Span>, keep_from: u64) {
    while ring.front().is_some_and(|s| s.since < keep_from) {
        ring.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sketch_of(blocks: impl IntoIterator<Item = u64>) -> Sketch {
        let mut s = Sketch::default();
        blocks.into_iter().for_each(|b| s.insert(b));
        s
    }

    fn window(w: &[WindowEstimate], name: &str) -> WindowEstimate {
        w.iter().find(|e| e.name == name).unwrap().clone()
    }

    fn assert_near(estimate: u64, exact: u64, tolerance: f64, what: &str) {
        let error = (estimate as f64 - exact as f64).abs() / (exact.max(1) as f64);
        assert!(
            error <= tolerance,
            "{what}: estimated {estimate} for {exact} ({:.2}% off)",
            error * 100.0
        );
    }

    #[test]
    fn distinct_blocks_are_estimated_within_five_percent() {
        for n in [0u64, 1, 100, 10_000, 1_000_000] {
            // Two unrelated sets of each size: neither may be lucky alone.
            for first in [0, 7 << 40] {
                let live = LiveSketch::default();
                live.record(first * BLOCK_SIZE, n * BLOCK_SIZE);
                let estimate = live.snapshot().blocks();
                assert_near(estimate, n, 0.05, &format!("{n} blocks from {first}"));
                if n <= 1 {
                    assert_eq!(estimate, n, "linear counting is exact without collisions");
                }
            }
        }
    }

    /// Many sets of 50,000 blocks: on average the estimate is unbiased and its spread is the
    /// 1.6% HyperLogLog promises at this size, not just within a loose bound once.
    #[test]
    fn the_error_has_the_promised_spread() {
        let n = 50_000u64;
        let errors: Vec<f64> = (0..40u64)
            .map(|i| {
                let s = sketch_of((0..n).map(|b| b + (i << 32)));
                s.estimate() / n as f64 - 1.0
            })
            .collect();
        let mean = errors.iter().sum::<f64>() / errors.len() as f64;
        let rms = (errors.iter().map(|e| e * e).sum::<f64>() / errors.len() as f64).sqrt();
        assert!(mean.abs() < 0.01, "biased: mean error {mean:.4}");
        assert!(rms < 1.5 * STANDARD_ERROR, "rms error {rms:.4}");
    }

    #[test]
    fn requests_count_every_block_they_touch_and_partial_blocks_whole() {
        let live = LiveSketch::default();
        live.record(4095, 2); // the last byte of block 0, the first of block 1
        live.record(8192 + 100, 10); // inside block 2
        live.record(123 * 4096, 0); // nothing
        assert_eq!(live.snapshot(), sketch_of(0..3));
        assert_eq!(live.snapshot().blocks(), 3);
    }

    #[test]
    fn duplicates_do_not_count_again() {
        let live = LiveSketch::default();
        live.record(0, 1000 * BLOCK_SIZE);
        let once = live.snapshot();
        for _ in 0..5 {
            live.record(0, 1000 * BLOCK_SIZE);
            live.record(500 * BLOCK_SIZE, 10);
        }
        assert_eq!(live.snapshot(), once);
        assert_near(once.blocks(), 1000, 0.02, "1000 blocks");
    }

    #[test]
    fn take_empties_the_live_sketch() {
        let live = LiveSketch::default();
        live.record(0, 64 * BLOCK_SIZE);
        let taken = live.take();
        assert_eq!(taken, sketch_of(0..64));
        assert_near(taken.blocks(), 64, 0.05, "64 blocks");
        assert_eq!(live.snapshot(), Sketch::default());
        assert_eq!(live.snapshot().blocks(), 0);
    }

    #[test]
    fn merging_is_the_register_wise_maximum() {
        let mut a = sketch_of(0..5000);
        let b = sketch_of(3000..9000);
        let before = a.clone();
        a.merge(&b);
        for i in 0..REGISTERS {
            assert_eq!(a.registers[i], before.registers[i].max(b.registers[i]));
        }
        assert_eq!(a, sketch_of(0..9000), "the sketch of the union");
        assert_near(a.blocks(), 9000, 0.05, "the union");
    }

    /// Minute 0 touches blocks 0..1000, every later minute the same 100 blocks 10,000..10,100.
    #[test]
    fn windows_slide_a_minute_at_a_time() {
        let live = Arc::new(LiveSketch::default());
        let mut ws = WorkingSet::new(live.clone(), 0);
        live.record(0, 1000 * BLOCK_SIZE);
        let hot = 10_000..10_100;
        let everything = sketch_of((0..1000).chain(hot.clone())).blocks();
        // Early on, every window is everything so far.
        let w = ws.windows(30);
        for name in ["5min", "hour", "day", "total"] {
            assert_eq!(window(&w, name).secs, 30, "{name}");
            assert_eq!(
                window(&w, name).blocks,
                sketch_of(0..1000).blocks(),
                "{name}"
            );
        }
        for now in 1..=400 {
            ws.tick(now);
            if now >= 60 {
                live.record(hot.start * BLOCK_SIZE, 100 * BLOCK_SIZE);
            }
            if now == 299 {
                let five = window(&ws.windows(now), "5min");
                assert_eq!((five.secs, five.blocks), (299, everything));
            }
        }
        let w = ws.windows(400);
        let five = window(&w, "5min");
        assert_eq!(five.secs, 280, "the minutes that began at 100 s or later");
        assert_eq!(five.blocks, sketch_of(hot).blocks(), "minute 0 is out");
        for name in ["hour", "day", "total"] {
            assert_eq!(window(&w, name).secs, 400, "{name}");
            assert_eq!(window(&w, name).blocks, everything, "{name}");
        }
        assert_near(everything, 1100, 0.02, "the estimate itself");
    }

    /// Blocks 0..5000 in minute 0, then 10 new blocks each minute for two days, with the ticker
    /// and the report on the minute: each window holds exactly the minutes that began inside
    /// it, the hour and day windows drop minute 0 after an hour and a day, the total keeps it,
    /// and memory stays bounded.
    #[test]
    fn hours_and_days_slide_and_the_total_keeps_everything() {
        let live = Arc::new(LiveSketch::default());
        let mut ws = WorkingSet::new(live.clone(), 0);
        let minute_zero = 0..5000u64;
        live.record(0, 5000 * BLOCK_SIZE);
        // The blocks recorded at `t`, a whole minute after 0.
        let blocks_at = |t: u64| {
            let first = (1 << 30) + t / MINUTE * 10;
            first..first + 10
        };
        // What a window that begins at `start` (a whole minute) holds at `now`.
        let expected = |start: u64, now: u64| {
            let mut s = sketch_of((start.max(MINUTE)..=now).step_by(60).flat_map(blocks_at));
            if start == 0 {
                s.merge(&sketch_of(minute_zero.clone()));
            }
            s.blocks()
        };
        let end = 2 * DAY;
        for now in (MINUTE..=end).step_by(MINUTE as usize) {
            ws.tick(now);
            let b = blocks_at(now);
            live.record(b.start * BLOCK_SIZE, 10 * BLOCK_SIZE);
            if now == HOUR + 2 * MINUTE {
                let w = ws.windows(now);
                let hour = window(&w, "hour");
                assert_eq!((hour.secs, hour.blocks), (HOUR, expected(2 * MINUTE, now)));
                let day = window(&w, "day");
                assert_eq!((day.secs, day.blocks), (now, expected(0, now)));
                assert_near(day.blocks, 5000 + 62 * 10, 0.05, "day after an hour");
            }
        }
        let w = ws.windows(end);
        let hour = window(&w, "hour");
        assert_eq!((hour.secs, hour.blocks), (HOUR, expected(end - HOUR, end)));
        assert_near(hour.blocks, 610, 0.05, "hour");
        let day = window(&w, "day");
        assert_eq!((day.secs, day.blocks), (DAY, expected(end - DAY, end)));
        assert_near(day.blocks, 24 * 600 + 10, 0.05, "day");
        let total = window(&w, "total");
        assert_eq!((total.secs, total.blocks), (end, expected(0, end)));
        assert_near(total.blocks, 5000 + 2880 * 10, 0.05, "total");
        assert!(ws.minutes.len() <= 61, "{}", ws.minutes.len());
        assert!(ws.hours.len() <= 24, "{}", ws.hours.len());
    }

    #[test]
    fn restart_begins_every_window_again() {
        let live = Arc::new(LiveSketch::default());
        let mut ws = WorkingSet::new(live.clone(), 0);
        live.record(0, 2000 * BLOCK_SIZE);
        for now in 1..=200 {
            ws.tick(now);
        }
        live.record(1 << 40, 10 * BLOCK_SIZE);
        ws.restart(200);
        let w = ws.windows(210);
        for name in ["5min", "hour", "day", "total"] {
            let e = window(&w, name);
            assert_eq!((e.secs, e.blocks), (10, 0), "{name}");
        }
        live.record(0, 7 * BLOCK_SIZE);
        let w = ws.windows(220);
        for name in ["5min", "hour", "day", "total"] {
            assert_eq!(window(&w, name).blocks, 7, "{name}");
        }
    }

    /// A ticker that stalls (a suspended machine): what the live sketch gathered meanwhile is
    /// frozen as one span and leaves the windows by when it began.
    #[test]
    fn a_late_tick_freezes_one_long_span() {
        let live = Arc::new(LiveSketch::default());
        let mut ws = WorkingSet::new(live.clone(), 0);
        live.record(0, 300 * BLOCK_SIZE);
        ws.tick(1000);
        live.record(1 << 40, 20 * BLOCK_SIZE);
        let w = ws.windows(1010);
        let late = (1 << 28)..(1 << 28) + 20;
        let five = window(&w, "5min");
        assert_eq!(
            (five.secs, five.blocks),
            (10, sketch_of(late.clone()).blocks())
        );
        let hour = window(&w, "hour");
        let both = sketch_of((0..300).chain(late)).blocks();
        assert_eq!((hour.secs, hour.blocks), (1010, both));
    }

    proptest! {
        /// The sketch depends only on the set of blocks: order, repetition and how requests
        /// split them do not matter, and merging two sketches is the sketch of the union.
        #[test]
        fn a_sketch_is_a_function_of_the_set(
            a in prop::collection::vec((0u64..1 << 20, 1u64..64), 0..200),
            b in prop::collection::vec(any::<u64>(), 0..200),
        ) {
            let live = LiveSketch::default();
            let mut exact = std::collections::BTreeSet::new();
            for &(first, n) in &a {
                live.record(first * BLOCK_SIZE, n * BLOCK_SIZE);
                exact.extend(first..first + n);
            }
            let mut mixed = sketch_of(b.iter().copied());
            mixed.merge(&live.snapshot());
            exact.extend(b.iter().copied());
            let mut reversed: Vec<u64> = exact.iter().rev().copied().collect();
            reversed.extend(exact.iter().step_by(3));
            prop_assert_eq!(&mixed, &sketch_of(reversed));
            // Small sets are counted by linear counting, whose standard deviation for n blocks
            // in m registers is sqrt(m (e^t - t - 1)), t = n/m; five of them (and a block) make
            // a bound no honest sketch misses, while a wrong formula misses it by far.
            let (n, m) = (exact.len() as f64, REGISTERS as f64);
            let t = n / m;
            let bound = 1.0 + 5.0 * (m * (t.exp() - t - 1.0)).sqrt();
            let error = mixed.estimate() - n;
            prop_assert!(error.abs() <= bound, "{} for {}", mixed.estimate(), n);
        }
    }
}

//! The background cleaner: writes dirty blocks back while the cache serves, so that dirty data
//! drains smoothly instead of all at once when reclaim needs room.
//!
//! One thread, active in write-back mode only. Every tick (100 ms, or at once when a parameter
//! changes) it decides what to write back, in this order:
//!
//! 1. **Watermark**: dirty above `writeback_dirty_high_pct` → full speed (every in-flight slot,
//!    no rate limit, no yielding to clients) until it is down to `writeback_dirty_low_pct`.
//! 2. **Backing idle**: no client I/O has gone to the backing store for `writeback_idle_delay_ms`
//!    → write back (at full speed, up to the rate cap) while that lasts.
//! 3. **Max age**: dirty blocks written more than `writeback_max_age_secs` ago → write those.
//! 4. **Controller** (`writeback_controller = pi`): above `writeback_dirty_target_pct`, at the
//!    rate the PI controller ([`pi`]) sets once a second from the excess.
//!
//! Rates are spent through a token bucket: a pass waits until it has a second's worth of bytes
//! (at most a full pass) and takes no more; the wait happens between passes, holding no lock.
//! Within the pass its writes are paced at the same rate (`PassIo::pace`), so the backing store
//! sees a steady trickle, not a second's worth at once: one burst a second made the clients'
//! per-second p99 saw-tooth. A second's worth per pass keeps one log sync and one backing flush
//! a second. `writeback_rate_max_kib` caps 2 to 4.
//!
//! Each pass is an ordinary cleaning pass (`cleaner`): the log synced first, writes sorted by
//! address and coalesced, the backing store flushed before anything is marked clean, a block
//! rewritten meanwhile left dirty. Passes are small (at most `writeback_max_inflight` ×
//! `writeback_max_io_kib`, and [`MAX_RUNS_PER_PASS`] writes) because passes run one at a time:
//! reclaim or a flush waits for the one running (and a paced one stops pacing when they do).
//!
//! Which blocks a pass takes: the dirty blocks of the segments in `writeback_order` (FIFO: log
//! order, oldest written first; LRU: least recently read segments first, their unreferenced
//! blocks first), each *extended with its dirty neighbours by address* (up to the coalescing
//! limit): random writes over a region make it dirty almost throughout, and writing it back in
//! large sequential pieces is what a disk does fastest. For max age only old blocks qualify,
//! neighbours included.
//!
//! Clients keep priority: the I/O paths count their backing requests in flight
//! ([`Foreground`](crate::backing::Foreground)); while there are any, a background pass below the high watermark keeps one
//! write in flight. The time of the last one drives the idle delay.
//!
//! Failures: a failed pass is retried after a backoff like reclaim's (100 ms doubling to 5 s,
//! reset by a pass that succeeds), counted in `writeback_retries` while the backing store is
//! degraded. The blocks stay dirty; nothing is ever dropped.

pub mod pi;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cleaner::{self, PassIo};
use crate::engine::Engine;
use crate::policy::{Mode, ReclaimPolicy};
use crate::state::{DirtyBlock, State};
use crate::stats::Stats;
use crate::writeback_control::WritebackState;

use pi::{Pi, PiConfig};

/// How often the cleaner looks at the dirty level.
const TICK: Duration = Duration::from_millis(100);
/// How often the controller updates its rate.
const CONTROLLER_PERIOD: Duration = Duration::from_secs(1);
/// Most backing writes per background pass (passes run one at a time).
pub(crate) const MAX_RUNS_PER_PASS: usize = 256;
/// Backoff after a failed pass (as reclaim's).
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(crate) fn spawn(e: Arc<Engine>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("writeback".into())
        .spawn(move || Cleaner::new().run(&e))
        .expect("cannot spawn the write-back thread")
}

/// Stops the thread (a pass in progress stops before its next backing write).
pub(crate) fn stop(e: &Engine) {
    e.writeback.stop();
}

/// Why a pass runs, and how.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    /// Nothing to write back (`state` says why).
    Nothing(WritebackState),
    Pass {
        state: WritebackState,
        /// Bytes per second, `None` = as fast as it goes.
        rate: Option<f64>,
        /// Only blocks written before this second of engine uptime (max age).
        written_before: Option<u32>,
        /// Yield to client backing I/O.
        yield_to_foreground: bool,
        /// Most blocks to write back (down to the low watermark or the target, not beyond).
        limit: Option<u64>,
    },
}

struct Cleaner {
    pi: Pi,
    cfg: PiConfig,
    /// Draining from the high watermark down to the low one.
    draining: bool,
    /// When the controller last updated, and bytes written back since.
    last_update: Option<Instant>,
    written_since_update: u64,
    /// Token bucket: bytes that may be written now, refilled at the plan's rate.
    tokens: f64,
    last_refill: Instant,
    backoff: Duration,
}

impl Cleaner {
    fn new() -> Cleaner {
        Cleaner {
            pi: Pi::default(),
            cfg: PiConfig::default(),
            draining: false,
            last_update: None,
            written_since_update: 0,
            tokens: 0.0,
            last_refill: Instant::now(),
            backoff: FIRST_BACKOFF,
        }
    }

    fn run(mut self, e: &Engine) {
        loop {
            if e.writeback.stopping() {
                return;
            }
            let plan = self.plan(e);
            let wait = match plan {
                Plan::Nothing(state) => {
                    self.publish(e, state);
                    self.tokens = 0.0;
                    Some(TICK)
                }
                Plan::Pass {
                    state,
                    rate,
                    written_before,
                    yield_to_foreground,
                    limit,
                } => {
                    self.publish(e, state);
                    self.pass(e, rate, written_before, yield_to_foreground, limit)
                }
            };
            if let Some(d) = wait {
                if !e.writeback.wait(d, true) {
                    return;
                }
            }
        }
    }

    fn publish(&self, e: &Engine, state: WritebackState) {
        let target = target_blocks(e);
        let mut st = e.writeback.status.lock();
        st.state = state;
        st.rate_bytes_per_sec = if state == WritebackState::Controller {
            self.pi.rate() as u64
        } else {
            0
        };
        st.target_blocks = target;
    }

    /// Decides what to do now; updates the controller once a period.
    fn plan(&mut self, e: &Engine) -> Plan {
        let t = &e.tunables;
        if e.mode() != Mode::WriteBack {
            self.draining = false;
            self.pi.reset();
            self.last_update = None;
            return Plan::Nothing(WritebackState::Off);
        }
        let (dirty, oldest) = {
            let st = e.state.read();
            (st.segs.total_dirty(), oldest_dirty_second(e, &st))
        };
        let capacity = e.geo.segment_count as u64 * e.geo.blocks_per_segment() as u64;
        let pct = |p: u32| capacity * p as u64 / 100;
        if dirty == 0 {
            self.draining = false;
        }
        let cap = t.writeback_rate_max_bytes().map(|b| b as f64);

        // The controller is updated every period whatever else runs, so its rate follows the
        // dirty level (and what was achieved) when it takes over.
        let now = Instant::now();
        let bs = e.geo.block_size as f64;
        if t.writeback_pi() {
            let due = self
                .last_update
                .is_none_or(|u| now.duration_since(u) >= CONTROLLER_PERIOD);
            if due {
                let dt = self
                    .last_update
                    .map_or(CONTROLLER_PERIOD.as_secs_f64(), |u| {
                        now.duration_since(u).as_secs_f64()
                    });
                let achieved = self.written_since_update as f64 / dt.max(1e-3);
                self.pi.update(
                    &self.cfg,
                    dirty as f64 * bs,
                    target_blocks(e) as f64 * bs,
                    dt,
                    cap.unwrap_or(f64::INFINITY),
                    achieved,
                );
                self.last_update = Some(now);
                self.written_since_update = 0;
            }
        } else {
            self.pi.reset();
            self.last_update = None;
        }

        if dirty == 0 {
            return Plan::Nothing(WritebackState::Idle);
        }
        let high = pct(t.writeback_high_pct());
        let low = pct(t.writeback_low_pct());
        if dirty >= high.max(1) {
            self.draining = true;
        }
        if self.draining && dirty > low {
            return Plan::Pass {
                state: WritebackState::Watermark,
                rate: None,
                written_before: None,
                yield_to_foreground: false,
                limit: Some(dirty - low),
            };
        }
        self.draining = false;
        if let Some(delay) = t.writeback_idle_delay_ms() {
            if e.backing.foreground.idle_ms() >= delay as u64 {
                return Plan::Pass {
                    state: WritebackState::BackingIdle,
                    rate: cap,
                    written_before: None,
                    yield_to_foreground: true,
                    limit: None,
                };
            }
        }
        if let Some(age) = t.writeback_max_age_secs() {
            // Blocks dated before this second are more than `age` seconds old.
            let before = e.now_secs().saturating_sub(age);
            if oldest.is_some_and(|o| o < before) {
                return Plan::Pass {
                    state: WritebackState::Age,
                    rate: cap,
                    written_before: Some(before),
                    yield_to_foreground: true,
                    limit: None,
                };
            }
        }
        let target = target_blocks(e);
        if t.writeback_pi() && self.pi.rate() > 0.0 && dirty > target {
            return Plan::Pass {
                state: WritebackState::Controller,
                rate: Some(self.pi.rate()),
                written_before: None,
                yield_to_foreground: true,
                limit: Some(dirty - target),
            };
        }
        Plan::Nothing(WritebackState::Idle)
    }

    /// Runs one pass if the token bucket allows; returns how long to wait before the next plan
    /// (`None`: plan again at once).
    fn pass(
        &mut self,
        e: &Engine,
        rate: Option<f64>,
        written_before: Option<u32>,
        yield_to_foreground: bool,
        limit: Option<u64>,
    ) -> Option<Duration> {
        let t = &e.tunables;
        let bs = e.geo.block_size as u64;
        let max_io = t.writeback_max_io_bytes().max(bs);
        let inflight = t.writeback_max_inflight();
        let full_pass = (inflight as u64 * max_io).max(bs);
        let now = Instant::now();
        let elapsed = now.duration_since(self.last_refill).as_secs_f64();
        self.last_refill = now;
        let budget = match rate {
            None => {
                self.tokens = 0.0;
                full_pass
            }
            Some(rate) => {
                // A pass waits for a second's worth (so a slow rate still makes passes of
                // a useful size, each with one backing flush), at most a full pass.
                let want = (rate as u64).clamp(bs, full_pass) as f64;
                self.tokens = (self.tokens + rate * elapsed).min(want);
                if self.tokens < want {
                    let missing = (want - self.tokens) / rate.max(1.0);
                    return Some(Duration::from_secs_f64(missing).min(TICK));
                }
                self.tokens as u64
            }
        };
        let budget_blocks = (budget / bs).min(limit.unwrap_or(u64::MAX)).max(1) as usize;
        let pass_io = PassIo {
            inflight: if yield_to_foreground && e.backing.foreground.busy() {
                1
            } else {
                inflight
            },
            max_io,
            yield_to_foreground,
            pace: rate,
        };
        let order = t.writeback_order();
        let per_run = (max_io / bs).max(1) as usize;
        let result = cleaner::clean_pass_with(
            e,
            |st| {
                select(
                    e,
                    st,
                    order,
                    budget_blocks,
                    per_run,
                    MAX_RUNS_PER_PASS,
                    written_before,
                )
            },
            Some(&e.writeback.cancel),
            pass_io,
        );
        match result {
            Ok(n) => {
                self.backoff = FIRST_BACKOFF;
                Stats::add(&e.stats.background_cleaned_blocks, n);
                let bytes = n * bs;
                self.written_since_update += bytes;
                self.tokens = (self.tokens - bytes as f64).max(0.0);
                // Nothing selectable (e.g. every dirty block is younger than the max age):
                // look again next tick.
                (n == 0).then_some(TICK)
            }
            Err(err) => {
                let backing = e.backing.health.is_degraded();
                tracing::warn!(
                    error = %err,
                    retry_in_ms = self.backoff.as_millis() as u64,
                    backing_degraded = backing,
                    "background write-back failed; dirty data kept, retrying"
                );
                if backing {
                    Stats::add(&e.stats.writeback_retries, 1);
                }
                e.writeback.status.lock().state = WritebackState::Retrying;
                let wait = self.backoff;
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                if !e.writeback.wait(wait, false) {
                    return Some(Duration::ZERO);
                }
                None
            }
        }
    }
}

/// The controller's target in blocks.
fn target_blocks(e: &Engine) -> u64 {
    let capacity = e.geo.segment_count as u64 * e.geo.blocks_per_segment() as u64;
    capacity * e.tunables.writeback_target_pct() as u64 / 100
}

/// When the oldest dirty block was written (seconds of engine uptime), if any is dirty: the
/// first dirty block of the oldest segment holding dirty blocks (segments fill in log order).
fn oldest_dirty_second(e: &Engine, st: &State) -> Option<u32> {
    let seg = st.segs.oldest_dirty_segment()?;
    let bps = e.geo.blocks_per_segment();
    st.index
        .slots_in(e.geo.first_slot(seg), bps)
        .find(|(_, i)| i.dirty)
        .map(|(slot, _)| st.segs.written_at(slot))
}

/// Chooses up to `budget` dirty blocks in at most `max_runs` runs: the segments' dirty blocks
/// in `order`, each extended with its dirty neighbours by address, up to `per_run` blocks a
/// run. With `written_before`, only blocks written before that second.
pub(crate) fn select(
    e: &Engine,
    st: &State,
    order: ReclaimPolicy,
    budget: usize,
    per_run: usize,
    max_runs: usize,
    written_before: Option<u32>,
) -> Vec<DirtyBlock> {
    let geo = e.geo;
    let bps = geo.blocks_per_segment();
    let eligible = |slot: u32| written_before.is_none_or(|b| st.segs.written_at(slot) < b);
    let dirty_eligible = |lba: u64| cleaner::dirty_at(st, lba).filter(|b| eligible(b.slot));
    let mut taken: HashSet<u64> = HashSet::new();
    let mut chosen = Vec::new();
    let mut runs = 0;
    for seg in st.segs.dirty_segments(order) {
        let mut seeds: Vec<DirtyBlock> = st
            .index
            .slots_in(geo.first_slot(seg), bps)
            .filter(|(slot, i)| i.dirty && eligible(*slot))
            .map(|(slot, i)| DirtyBlock { lba: i.lba, slot })
            .collect();
        if order == ReclaimPolicy::Lru {
            // Blocks read since they were written go last (stable: slot order otherwise).
            seeds.sort_by_key(|b| st.index.slot(b.slot).is_some_and(|i| i.referenced));
        }
        for seed in seeds {
            if taken.contains(&seed.lba) {
                continue;
            }
            let room = per_run.min(budget - chosen.len());
            let mut first = seed.lba;
            let mut run = vec![seed];
            // Forward first (where sequential writes continue), then backward.
            let mut lba = seed.lba + 1;
            while run.len() < room && !taken.contains(&lba) {
                match dirty_eligible(lba) {
                    Some(b) => run.push(b),
                    None => break,
                }
                lba += 1;
            }
            while run.len() < room && first > 0 && !taken.contains(&(first - 1)) {
                match dirty_eligible(first - 1) {
                    Some(b) => run.push(b),
                    None => break,
                }
                first -= 1;
            }
            taken.extend(run.iter().map(|b| b.lba));
            chosen.extend(run);
            runs += 1;
            if chosen.len() >= budget || runs >= max_runs {
                return chosen;
            }
        }
    }
    chosen
}

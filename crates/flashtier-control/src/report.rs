//! [`Report`]: everything the control plane knows at one moment, as one serde value.
//!
//! `flashtier stats --json`, the stats file's `.json`, the stats text file, the tables and the
//! Prometheus output are all renderings of this one object, so they cannot disagree. Top-level
//! keys (a contract with scripts and tests): `status`, `job`, `scrub`, `counters`, `derived`,
//! `windows`, `window_secs`, `working_set`, `latency`, `wear`, `ram`, `memcached`, `params`,
//! `generated_unix_ms`.
//!
//! Maps keep their order (engine counters in the engine's order, windows shortest first), so
//! JSON read by a person and tables read the same way.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::trace::TraceStatus;

/// A JSON object whose keys keep their order.
#[derive(Debug, Clone, PartialEq)]
pub struct Ordered<V>(pub Vec<(String, V)>);

impl<V> Default for Ordered<V> {
    fn default() -> Self {
        Ordered(Vec::new())
    }
}

impl<V> Ordered<V> {
    /// The value under `key`; a linear search, as these maps hold tens of keys.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The entries in their order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }
}

impl<V, K: Into<String>> FromIterator<(K, V)> for Ordered<V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Ordered(iter.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }
}

impl<V: Serialize> Serialize for Ordered<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V_<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V_<V> {
            type Value = Ordered<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0));
                while let Some(entry) = a.next_entry()? {
                    out.push(entry);
                }
                Ok(Ordered(out))
            }
        }
        d.deserialize_map(V_(PhantomData))
    }
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// What is served and its health; the part `flashtier status` shows.
    pub status: StatusReport,
    /// The mode switch or flush in progress, or the last one (until the next starts).
    pub job: Option<JobReport>,
    /// The scrub in progress, or the last one (until the next starts); null before any.
    #[serde(default)]
    pub scrub: Option<ScrubStatus>,
    /// The trace being recorded (`flashtier trace start`, `serve --trace`), or the last one if
    /// it stopped on a write error; null otherwise.
    #[serde(default)]
    pub trace: Option<TraceStatus>,
    /// Every counter since the server started or the last `reset-stats`.
    pub counters: Ordered<u64>,
    /// Figures computed from the counters and the status.
    pub derived: Derived,
    /// `5min`, `hour`, `day`, `total` -> counter deltas over that window.
    pub windows: Ordered<Ordered<u64>>,
    /// How many seconds each window really covers (less than its length early on).
    pub window_secs: Ordered<u64>,
    /// Distinct blocks the clients read or wrote per window, estimated; null only from a
    /// server too old to measure it.
    #[serde(default)]
    pub working_set: Option<WorkingSetReport>,
    /// Operation (`read`, `write`, `flush`, `trim`, `write_zeroes`) -> latency since the start or
    /// the last reset, as the NBD clients see it.
    pub latency: Ordered<LatencyReport>,
    /// Cache device writes and the endurance forecast.
    pub wear: Wear,
    /// The RAM tier; null when the server has none.
    #[serde(default)]
    pub ram: Option<RamReport>,
    /// The memcached tier and its servers; null when the server has none.
    #[serde(default)]
    pub memcached: Option<MemcachedReport>,
    /// Every live parameter -> its current value (empty without a cache).
    pub params: Ordered<String>,
    /// When the report was made (wall clock), to match the stats file with its JSON.
    pub generated_unix_ms: u64,
}

/// What is served and how it is doing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The server's version, as `flashtier --version` prints it (version, commit, build date).
    /// Empty from a server too old to send it.
    #[serde(default)]
    pub version: String,
    /// The exported device, e.g. `flashtier cache over file /srv/disk.img`.
    pub device: String,
    /// The exported size, as clients see it.
    pub size_bytes: u64,
    /// Whether there is a cache (false: the backing store is served as is).
    pub cache: bool,
    /// `attached`, `detached` (by `flashtier detach`; `flashtier attach` brings it back) or
    /// `none` (started without one).
    pub cache_state: String,
    /// The cache mode; null without a cache.
    pub mode: Option<String>,
    /// `failed: ...` once the cache device failed; else `degraded: <reasons>` while data is
    /// lost (see `integrity`) or the backing store fails (dirty data kept, write-back retried),
    /// both named when both hold; else `ok`.
    pub health: String,
    /// Seconds since the server started (its controller was created).
    pub uptime_secs: u64,
    /// The cache's figures; absent without a cache.
    #[serde(flatten)]
    pub cache_status: Option<CacheStatus>,
}

/// The cache's sizes and occupancy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheStatus {
    /// The cache's block size in bytes: the unit of caching and of every block count here.
    pub block_size: u32,
    /// Most blocks the cache can hold at once.
    pub capacity_blocks: u64,
    /// Blocks cached now, clean or dirty.
    pub cached_blocks: u64,
    /// Cached blocks newer than the backing store's copy, still to be written back.
    pub dirty_blocks: u64,
    /// `dirty_blocks` in bytes.
    pub dirty_bytes: u64,
    /// Cached blocks as a percentage of the capacity.
    pub used_pct: f64,
    /// Blocks the log can still write before reclaim must empty another segment (free
    /// segments, emptied ones waiting for their FREE records, the open segment's unwritten
    /// rest): the space kept free for the log and reclaim.
    #[serde(default)]
    pub unwritten_blocks: u64,
    /// Blocks neither cached nor unwritten: slots of data overwritten, trimmed or evicted since
    /// it was written, the log's batch headers, and the unused ends of segments sealed early
    /// (a batch that did not fit, a restart), until reclaim empties their segments.
    /// `capacity_blocks` = `cached_blocks` + `unwritten_blocks` + `stale_blocks`.
    #[serde(default)]
    pub stale_blocks: u64,
    /// Segments on the cache device (the unit of log allocation and reclaim).
    pub segments: u32,
    /// Segments holding nothing, ready for the log.
    pub free_segments: u64,
    /// Segment size in bytes.
    pub segment_size: u32,
    /// RAM used by the index.
    pub index_bytes: u64,
    /// Largest write that is all-or-nothing after a crash.
    pub atomic_write_bytes: u32,
    /// Which segment reclaim empties first: `fifo` or `lru`.
    pub reclaim_policy: String,
    /// The background cleaner.
    #[serde(default)]
    pub writeback: WritebackReport,
    /// Blocks whose newest data was lost (reads fail until they are written again or
    /// `flashtier forget-lost`).
    #[serde(default)]
    pub lost_blocks: u64,
    /// The lost blocks as `[first block, blocks]`, in address order.
    #[serde(default)]
    pub lost_ranges: Vec<[u64; 2]>,
    /// Why the cache's data is not whole (lost blocks, records recovery could not place);
    /// null while it is.
    #[serde(default)]
    pub integrity: Option<String>,
    /// Why the backing store is failing; null while it works.
    #[serde(default)]
    pub backing_degraded: Option<String>,
    /// What recovery found damaged, and repaired or reported, when the cache was opened.
    #[serde(default)]
    pub recovery: Vec<String>,
}

impl CacheStatus {
    /// Lost blocks within `[first, end)` (`None`: all of them).
    pub fn lost_within(&self, blocks: Option<(u64, u64)>) -> u64 {
        self.lost_ranges
            .iter()
            .map(|&[first, n]| match blocks {
                None => n,
                Some((lo, hi)) => hi.min(first + n).saturating_sub(lo.max(first)),
            })
            .sum()
    }
}

/// The blocks `[first, end)` that `length` bytes at `offset` touch (`length` `None`: the one
/// block holding `offset`), as `forget-lost --range` names them.
pub fn blocks_touched(offset: u64, length: Option<u64>, block_size: u64) -> (u64, u64) {
    let end = offset.saturating_add(length.unwrap_or(1).max(1));
    (offset / block_size, end.div_ceil(block_size))
}

/// A scrub (`flashtier scrub`): every cached block read back and checked.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ScrubStatus {
    /// Whether it has ended (finished, cancelled or failed).
    pub done: bool,
    /// Asked to stop (`flashtier scrub --cancel`, or a detach); once `done`, it checked only
    /// part of the cache.
    pub cancelled: bool,
    /// Why it stopped early (a cache device read failed).
    pub error: Option<String>,
    /// Segments checked so far; with `segments_total`, the progress.
    pub segments_done: u64,
    /// Segments to check in all.
    pub segments_total: u64,
    /// Cached blocks read back and checked so far.
    pub checked_blocks: u64,
    /// Clean blocks that failed their checksum: dropped from the cache (read from the backing
    /// store from now on).
    pub dropped_blocks: u64,
    /// Dirty blocks that failed their checksum: lost.
    pub lost_blocks: u64,
    /// The rate limit; null: as fast as the device goes.
    pub rate_bytes_per_sec: Option<u64>,
    /// Seconds since it started; frozen once `done`.
    pub elapsed_secs: f64,
}

/// What the background cleaner is doing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WritebackReport {
    /// `off` (not write-back), `idle`, `controller`, `watermark`, `age`, `backing-idle`, or
    /// `retrying` (the last pass failed; backing off).
    pub state: String,
    /// The controller's current rate; 0 when it is not running.
    pub rate_bytes_per_sec: u64,
    /// The controller's target (`writeback_dirty_target_pct` of the capacity).
    pub target_blocks: u64,
}

impl From<&flashtier_engine::WritebackStatus> for WritebackReport {
    fn from(w: &flashtier_engine::WritebackStatus) -> Self {
        WritebackReport {
            state: w.state.as_str().to_string(),
            rate_bytes_per_sec: w.rate_bytes_per_sec,
            target_blocks: w.target_blocks,
        }
    }
}

/// A background job: a mode switch or a manual flush.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobReport {
    /// e.g. `mode writeback -> writethrough`, `flush`.
    pub what: String,
    /// `mode` or `flush`.
    pub kind: String,
    /// The mode before and after (the same for a flush).
    pub from: String,
    /// The mode it ends in (`detached` for a detach).
    pub to: String,
    /// Whether it has ended, successfully or not.
    pub done: bool,
    /// A flush asked to stop (`flashtier flush --cancel`); once `done`, the blocks it had not
    /// written back are still dirty.
    pub cancelled: bool,
    /// Why it failed (then `done` is true; a failed switch leaves the mode unchanged, a failed
    /// flush leaves what it did not write back dirty).
    pub error: Option<String>,
    /// Dirty blocks still to write back. While the job runs this is an estimate: dirty blocks
    /// less what was written to the backing store since it started (the engine marks blocks
    /// clean only at the end of each write-back pass).
    pub dirty_blocks_left: u64,
    /// Dirty blocks when it started; with `dirty_blocks_left`, the progress.
    pub dirty_blocks_at_start: u64,
    /// Seconds since it started; once `done`, how long it took.
    pub elapsed_secs: f64,
}

/// Figures derived from the counters since the start or the last reset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Derived {
    /// Read blocks found in the cache, percent (null before any read).
    pub read_hit_pct: Option<f64>,
    /// Written blocks that replaced a cached version, percent (null before any write).
    pub write_hit_pct: Option<f64>,
    /// The status's `dirty_bytes`; null without a cache.
    pub dirty_bytes: Option<u64>,
    /// The status's `used_pct`; null without a cache.
    pub used_pct: Option<f64>,
}

/// Latency of one operation, in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencyReport {
    /// Requests measured.
    pub count: u64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Slowest request (an upper bound after a reset: see
    /// [`HistSnapshot::since`](crate::histogram::HistSnapshot::since)).
    pub max_us: f64,
    /// All requests' latencies added up, for the mean and Prometheus's `_sum`.
    pub sum_us: f64,
    /// `[bound_us, requests at or below it]` for each of [`LATENCY_BUCKETS_US`], cumulative:
    /// the Prometheus histogram's buckets (quantiles over any window, e.g.
    /// `histogram_quantile(0.99, rate(...[5m]))`). A bucket straddling a bound (at most 1/16 of
    /// it wide) is counted above it.
    #[serde(default)]
    pub buckets: Vec<[u64; 2]>,
}

/// The bounds of the Prometheus latency histogram's buckets, in microseconds: 25 µs to 10 s.
pub const LATENCY_BUCKETS_US: [u64; 18] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// The working set (`crate::working_set`): distinct 4 KiB blocks the clients read or wrote in
/// each window, estimated by a HyperLogLog sketch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkingSetReport {
    /// The unit counted, in bytes: a request touches every block it reads or writes a byte
    /// of, whatever the cache's block size.
    pub block_size: u64,
    /// The estimates' relative standard error, percent (about 95% of them are within twice
    /// that).
    pub standard_error_pct: f64,
    /// `5min`, `hour`, `day`, `total` -> the estimate over that window, as the counters'
    /// windows are named (and restarted by reset-stats).
    pub windows: Ordered<WorkingSetWindow>,
}

impl WorkingSetReport {
    /// The estimate of the window called `name`, in bytes.
    pub fn bytes(&self, name: &str) -> Option<u64> {
        self.windows.get(name).map(|w| w.bytes)
    }
}

/// The working set over one window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkingSetWindow {
    /// Seconds the window really covers: less than its length early on, and the 5 minute and
    /// hour windows are made of whole minutes, the day of whole hours, that began inside it.
    pub secs: u64,
    /// Distinct blocks read or written in it, estimated.
    pub blocks: u64,
    /// `blocks` × `block_size`.
    pub bytes: u64,
}

/// Flash wear: what this server wrote to the cache device.
///
/// Counts only the writes of this flashtier process since it started (log, checkpoints,
/// superblocks); the device's own lifetime total (SMART "Data Units Written") is not known
/// here, so the forecast is for a device that had this rate all its life from now on, minus
/// what this process wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wear {
    /// Bytes written to the cache device since this server started (reset-stats does not clear it).
    pub cache_bytes_written: u64,
    /// The write rate over the last day (or what there is of it), per day; null during the
    /// first minute. Not restarted by reset-stats.
    pub bytes_per_day: Option<f64>,
    /// The device's rated endurance in TB written (`--endurance-tbw`), if given.
    pub endurance_tbw: Option<f64>,
    /// Days until the rated TBW at `bytes_per_day`; null without a rating or without writes.
    pub days_to_rated_tbw: Option<f64>,
    /// Bytes written to the cache device per byte the clients wrote, over the same window as
    /// `bytes_per_day` (log headers, blocks reclaim copied forward, checkpoints and promotions
    /// on top of the clients' data); null during the first minute or without client writes.
    #[serde(default)]
    pub write_amplification: Option<f64>,
}

/// The RAM tier (`serve --ram-cache`): its eviction order, its sizes and its counters.
///
/// The sizes are what the tier holds now (reset-stats leaves them); the counters and the hit
/// percentage count since the server started or the last reset-stats, as `counters` do:
/// `counters` are the `ram_*` counters of the same report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RamReport {
    /// The order it evicts in: `lru` or `fifo` (`ram_cache_policy`).
    pub policy: String,
    /// What it may hold: its size, in whole 4 KiB blocks.
    pub capacity_bytes: u64,
    /// What it holds now.
    pub used_bytes: u64,
    /// The memory it allocated: the copies, their index and the version table.
    pub memory_bytes: u64,
    /// Blocks answered from memory over blocks looked up, percent (null before a lookup).
    pub hit_pct: Option<f64>,
    /// Its counters.
    pub counters: RamCounters,
}

/// The RAM tier's counters (`flashtier_ram::RamStats`, sizes apart), as the `ram_<name>`
/// counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamCounters {
    /// Blocks looked up.
    pub lookup_blocks: u64,
    /// Blocks answered from memory.
    pub hit_blocks: u64,
    /// Blocks looked up but read from the tier below.
    pub miss_blocks: u64,
    /// Blocks read below and kept.
    pub inserted_blocks: u64,
    /// Blocks pushed out to make room.
    pub evicted_blocks: u64,
    /// Copies dropped by a write, trim or write-zeroes.
    pub invalidated_blocks: u64,
    /// Copies a write replaced with its own data.
    pub updated_blocks: u64,
    /// Reads made again from below because a write ran through them.
    pub reread_requests: u64,
    /// Reads passed below without a lookup (not whole blocks, or longer than 1 MiB).
    pub bypassed_requests: u64,
}

impl RamCounters {
    /// The names of these counters in `counters`, in the order of [`Self::values`].
    pub const NAMES: [&'static str; 9] = [
        "ram_lookup_blocks",
        "ram_hit_blocks",
        "ram_miss_blocks",
        "ram_inserted_blocks",
        "ram_evicted_blocks",
        "ram_invalidated_blocks",
        "ram_updated_blocks",
        "ram_reread_requests",
        "ram_bypassed_requests",
    ];

    /// The values, in the order of [`Self::NAMES`].
    pub fn values(&self) -> [u64; 9] {
        [
            self.lookup_blocks,
            self.hit_blocks,
            self.miss_blocks,
            self.inserted_blocks,
            self.evicted_blocks,
            self.invalidated_blocks,
            self.updated_blocks,
            self.reread_requests,
            self.bypassed_requests,
        ]
    }

    /// The counters of that name in `counters` (0 for any missing).
    pub fn from_counters(counters: &Ordered<u64>) -> Self {
        let [lookup_blocks, hit_blocks, miss_blocks, inserted_blocks, evicted_blocks, invalidated_blocks, updated_blocks, reread_requests, bypassed_requests] =
            Self::NAMES.map(|n| counters.get(n).copied().unwrap_or(0));
        RamCounters {
            lookup_blocks,
            hit_blocks,
            miss_blocks,
            inserted_blocks,
            evicted_blocks,
            invalidated_blocks,
            updated_blocks,
            reread_requests,
            bypassed_requests,
        }
    }

    /// Blocks answered from memory over blocks looked up, percent (null before a lookup).
    pub fn hit_pct(&self) -> Option<f64> {
        pct(&self.hit_blocks, self.lookup_blocks)
    }
}

/// The memcached tier (`serve --memcached`): its state, its counters and its servers.
///
/// Every number counts since the server started or the last reset-stats, as `counters` do:
/// `tier` and `pool` are the `memcached_*` and `memcached_pool_*` counters of the same report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemcachedReport {
    /// Whether reads look in the pool and blocks are stored (`flashtier memcached on|off`).
    pub enabled: bool,
    /// What the tier stores: `inclusive` or `victim` (the live parameter `memcached_mode`).
    pub mode: String,
    /// The tier's own counters.
    pub tier: MemcachedTierCounters,
    /// The servers' counters added up, including those of servers removed since.
    pub pool: MemcachedServerCounters,
    /// One entry per server in the pool now, in the pool's order.
    pub servers: Vec<MemcachedServerReport>,
}

impl MemcachedReport {
    /// Servers answering now.
    pub fn servers_up(&self) -> usize {
        self.servers.iter().filter(|s| s.health == "up").count()
    }
}

/// The tier's counters (`flashtier_memcached::TierStats`), as the `memcached_<name>` counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemcachedTierCounters {
    /// Blocks looked up in the pool.
    pub lookup_blocks: u64,
    /// Blocks answered from the pool.
    pub hit_blocks: u64,
    /// Blocks looked up but read from the store below.
    pub miss_blocks: u64,
    /// Values found but older than their block (never used).
    pub stale_values: u64,
    /// Values found but corrupt or of another block (never used).
    pub corrupt_values: u64,
    /// Blocks stored in the pool.
    pub stored_blocks: u64,
    /// Stores the pool did not take (a server down, full or failing).
    pub store_failures: u64,
    /// Values removed after a hit (`victim` mode).
    pub removed_blocks: u64,
    /// Requests passed below without a lookup (unaligned, over 1 MiB, tier off, no server).
    pub bypassed_requests: u64,
}

impl MemcachedTierCounters {
    /// The names of these counters in `counters`, in the order of [`Self::values`].
    pub const NAMES: [&'static str; 9] = [
        "memcached_lookup_blocks",
        "memcached_hit_blocks",
        "memcached_miss_blocks",
        "memcached_stale_values",
        "memcached_corrupt_values",
        "memcached_stored_blocks",
        "memcached_store_failures",
        "memcached_removed_blocks",
        "memcached_bypassed_requests",
    ];

    /// The values, in the order of [`Self::NAMES`].
    pub fn values(&self) -> [u64; 9] {
        [
            self.lookup_blocks,
            self.hit_blocks,
            self.miss_blocks,
            self.stale_values,
            self.corrupt_values,
            self.stored_blocks,
            self.store_failures,
            self.removed_blocks,
            self.bypassed_requests,
        ]
    }

    /// The counters of that name in `counters` (0 for any missing).
    pub fn from_counters(counters: &Ordered<u64>) -> Self {
        let [lookup_blocks, hit_blocks, miss_blocks, stale_values, corrupt_values, stored_blocks, store_failures, removed_blocks, bypassed_requests] =
            Self::NAMES.map(|n| counters.get(n).copied().unwrap_or(0));
        MemcachedTierCounters {
            lookup_blocks,
            hit_blocks,
            miss_blocks,
            stale_values,
            corrupt_values,
            stored_blocks,
            store_failures,
            removed_blocks,
            bypassed_requests,
        }
    }

    /// Blocks answered from the pool over blocks looked up, percent (null before a lookup).
    pub fn hit_pct(&self) -> Option<f64> {
        pct(&self.hit_blocks, self.lookup_blocks)
    }
}

/// One memcached server's counters (`flashtier_memcached::client::ServerStats`, latency
/// apart), or the pool's: the `memcached_pool_<name>` counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemcachedServerCounters {
    /// Keys asked for.
    pub gets: u64,
    /// Keys the server had.
    pub hits: u64,
    /// Keys it did not have.
    pub misses: u64,
    /// Values stored.
    pub sets: u64,
    /// Values deleted.
    pub deletes: u64,
    /// Bytes received from the server.
    pub read_bytes: u64,
    /// Bytes sent to the server.
    pub written_bytes: u64,
    /// Requests that failed (connection or protocol errors).
    pub errors: u64,
    /// Requests that took longer than `memcached_timeout_ms`.
    pub timeouts: u64,
    /// Requests not sent because the server was down (its keys were misses).
    pub skipped: u64,
}

impl MemcachedServerCounters {
    /// The field names, in the order of [`Self::values`]: the per-server Prometheus series
    /// are `flashtier_memcached_server_<name>_total`.
    pub const NAMES: [&'static str; 10] = [
        "gets",
        "hits",
        "misses",
        "sets",
        "deletes",
        "read_bytes",
        "written_bytes",
        "errors",
        "timeouts",
        "skipped",
    ];

    /// The pool's totals in `counters`: `memcached_pool_<name>`. Not `memcached_server_*`:
    /// Prometheus renders a counter `c` as `flashtier_<c>_total` without labels, and that
    /// name belongs to the per-server series.
    pub const POOL_NAMES: [&'static str; 10] = [
        "memcached_pool_gets",
        "memcached_pool_hits",
        "memcached_pool_misses",
        "memcached_pool_sets",
        "memcached_pool_deletes",
        "memcached_pool_read_bytes",
        "memcached_pool_written_bytes",
        "memcached_pool_errors",
        "memcached_pool_timeouts",
        "memcached_pool_skipped",
    ];

    /// The values, in the order of [`Self::NAMES`].
    pub fn values(&self) -> [u64; 10] {
        [
            self.gets,
            self.hits,
            self.misses,
            self.sets,
            self.deletes,
            self.read_bytes,
            self.written_bytes,
            self.errors,
            self.timeouts,
            self.skipped,
        ]
    }

    /// The counters from values in the order of [`Self::NAMES`].
    pub fn from_values(v: [u64; 10]) -> Self {
        let [gets, hits, misses, sets, deletes, read_bytes, written_bytes, errors, timeouts, skipped] =
            v;
        MemcachedServerCounters {
            gets,
            hits,
            misses,
            sets,
            deletes,
            read_bytes,
            written_bytes,
            errors,
            timeouts,
            skipped,
        }
    }

    /// The pool's totals in `counters` ([`Self::POOL_NAMES`]; 0 for any missing).
    pub fn pool_from_counters(counters: &Ordered<u64>) -> Self {
        Self::from_values(Self::POOL_NAMES.map(|n| counters.get(n).copied().unwrap_or(0)))
    }
}

/// One server of the pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemcachedServerReport {
    /// `HOST:PORT`, as added.
    pub addr: String,
    /// `up`, or `down` (skipped until `retry_in_secs`, then tried again).
    pub health: String,
    /// Seconds it has been down; null while up.
    pub down_secs: Option<f64>,
    /// Seconds until it is tried again (0: at the next request); null while up.
    pub retry_in_secs: Option<f64>,
    /// Why it went down; null while up.
    pub last_error: Option<String>,
    /// Its counters, since it was added or the last reset-stats, whichever is later.
    #[serde(flatten)]
    pub counters: MemcachedServerCounters,
    /// Its request latency, since it was added or the last reset-stats.
    pub latency: MemcachedLatency,
}

/// The latency of one server's requests, in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemcachedLatency {
    /// Requests measured.
    pub count: u64,
    /// Median (null before any request).
    pub p50_us: Option<f64>,
    /// 99th percentile (null before any request).
    pub p99_us: Option<f64>,
    /// `[bound_us, requests at or below it]`, cumulative, bounds doubling: the Prometheus
    /// histogram's buckets.
    pub buckets: Vec<[u64; 2]>,
}

/// Read hit percent of a set of counters: hit blocks over hit + missed blocks.
pub fn read_hit_pct(counters: &Ordered<u64>) -> Option<f64> {
    pct(
        counters.get("read_hit_blocks")?,
        counters.get("read_hit_blocks")? + counters.get("read_miss_blocks")?,
    )
}

/// Write hit percent: written blocks that replaced a cached version over written blocks.
pub fn write_hit_pct(counters: &Ordered<u64>) -> Option<f64> {
    pct(
        counters.get("write_hit_blocks")?,
        *counters.get("write_blocks")?,
    )
}

fn pct(part: &u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| *part as f64 * 100.0 / whole as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_maps_keep_their_order_through_json() {
        let m: Ordered<u64> = [("zeta", 1), ("alpha", 2), ("mid", 3)]
            .into_iter()
            .collect();
        let s = serde_json::to_string(&m).unwrap();
        assert_eq!(s, r#"{"zeta":1,"alpha":2,"mid":3}"#);
        let back: Ordered<u64> = serde_json::from_str(&s).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn hit_percentages() {
        let c: Ordered<u64> = [
            ("read_hit_blocks", 3),
            ("read_miss_blocks", 1),
            ("write_blocks", 0),
            ("write_hit_blocks", 0),
        ]
        .into_iter()
        .collect();
        assert_eq!(read_hit_pct(&c), Some(75.0));
        assert_eq!(write_hit_pct(&c), None);
        assert_eq!(read_hit_pct(&Ordered::default()), None);
    }
}

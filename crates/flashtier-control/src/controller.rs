//! [`Controller`]: the one object every control path goes through (socket, stats file, metrics).
//!
//! It owns what the engine does not keep: the reset-stats baseline (the engine's counters only
//! grow, so a reset is a remembered starting point, and a second reader is never surprised by
//! counters going backwards under it), the window history (the counters' and the working
//! set's), the latency baselines and the background mode-switch job. A server without a cache
//! (pass-through) still reports its device, health, latencies and working set; anything that
//! needs a cache fails with [`ControlError::NoCache`].
//!
//! The cache can come and go while the server runs (`flashtier detach` / `attach`, see
//! [`DetachOptions`]): the exported [`Switchable`] is swapped between the cache and the backing
//! store, and the engine counters of every released cache are kept as an offset added to the
//! next one's, so the counters the windows sample never go backwards.
//!
//! A server may also have a memcached tier (`serve --memcached`), with or without a cache: it
//! sits below the cache, so detach and attach leave it alone. Its counters join the others
//! (`memcached_*`, `memcached_pool_*`), its mode is the live parameter `memcached_mode`, and
//! `{"op":"memcached"}` requests add and remove its servers and turn it on and off.
//!
//! A server may have a RAM tier too (`serve --ram-cache`), above the cache (or above the
//! memcached tier or the backing store without one); it is not part of what detach and attach
//! swap either. Its counters join the others (`ram_*`) and its sizes are the report's `ram`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flashtier_engine::{
    format, read_superblock, tunables, BackingIdentity, Cache, EngineError, FormatError,
    FormatOptions, Mode, ParamError, ReleaseError,
};
use flashtier_io::BlockDev;
use flashtier_memcached::client::{ClientError as PoolError, Health, LatencySnapshot, ServerStats};
use flashtier_memcached::{MemcachedMode, MemcachedTier, TierStats};
use flashtier_ram::{RamStats, RamTier};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::histogram::HistSnapshot;
use crate::protocol::MemcachedRequest;
use crate::report::{
    read_hit_pct, write_hit_pct, CacheStatus, Derived, JobReport, LatencyReport, MemcachedLatency,
    MemcachedReport, MemcachedServerCounters, MemcachedServerReport, MemcachedTierCounters,
    Ordered, RamCounters, RamReport, Report, StatusReport, Wear, WorkingSetReport,
    WorkingSetWindow, LATENCY_BUCKETS_US,
};
use crate::scrub_job::{ScrubError, Scrubber};
use crate::switch::Switchable;
use crate::timed::{Latencies, Op};
use crate::trace::{TraceStartError, TraceStatus, Tracer};
use crate::windows::{Counters, Sampler, TOTAL};
use crate::working_set::{self, LiveSketch, WorkingSet};

/// Writes settings (`(name, value)`, `name` = `mode` for the mode) to the config file the
/// server was started with, all or none. `serve` passes `config::persist` bound to the file's
/// path.
pub type PersistFn = Box<
    dyn Fn(&[(String, String)]) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
        + Send
        + Sync,
>;

/// Opens a cache device named by `flashtier attach --cache PATH` (`serve` passes the function
/// it opens `--cache` with).
pub type OpenDeviceFn = Box<
    dyn Fn(&str) -> Result<Arc<dyn BlockDev>, Box<dyn std::error::Error + Send + Sync>>
        + Send
        + Sync,
>;

/// The values `mode` accepts, as shown in errors and `get --all`.
pub const MODES: &str = "writeback | writethrough | writearound | passthrough";

/// The live parameter of the memcached tier: what it stores.
pub const MEMCACHED_MODE: &str = "memcached_mode";

/// Why a control request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The request needs a cache and the server was started without one.
    #[error(
        "no cache: this server exports its backing store as is (pass-through), so it has no \
         parameters or modes; `flashtier attach --cache PATH` adds one (or start `flashtier \
         serve` with --cache)"
    )]
    NoCache,
    /// The request needs a cache and it was detached.
    #[error("the cache is detached; `flashtier attach` brings it back")]
    Detached,
    /// Detach or attach asked of a server started without [`DetachOptions`].
    #[error("this server cannot detach or attach a cache")]
    NotDetachable,
    /// Attach asked while a cache is attached; one cache at a time.
    #[error("a cache is attached already (`flashtier detach` first)")]
    Attached,
    /// Attach without `--cache`, and no cache was detached to bring back.
    #[error(
        "no cache was detached from this server, so there is none to bring back; name one with \
         `flashtier attach --cache PATH`"
    )]
    NothingToAttach,
    /// The device to attach holds a cache of another backing store; refused without `--force`
    /// because it may hold that store's only copy of some data.
    #[error(
        "{path} holds another flashtier cache (for backing store '{backing}'), not the one \
         detached from this server; it may hold dirty data no backing store has yet. To keep \
         it, serve it with its own backing store in passthrough mode first (which writes it \
         back); to format it for this backing store anyway, pass --force"
    )]
    ForeignCache {
        /// The device, as named to attach.
        path: String,
        /// The backing store its superblock names.
        backing: String,
    },
    /// Opening, formatting or opening as a cache the device to attach failed.
    #[error("cannot attach {path}: {cause}")]
    Attach {
        /// The device, as named to attach (or the detached one's description).
        path: String,
        /// What failed, as text so it can travel over the socket.
        cause: String,
    },
    /// The engine refused a parameter: unknown name or a value out of range.
    #[error(transparent)]
    Param(#[from] ParamError),
    /// Values that constrain each other (the watermarks) would not fit together.
    #[error(
        "{0}; nothing was changed. To move both past each other, set them in one command, e.g. \
         `flashtier set writeback_dirty_high_pct 90 writeback_dirty_low_pct 80`"
    )]
    Conflict(ParamError),
    /// `mode` was in a set of several parameters; it is a job, so it goes alone.
    #[error(
        "mode is switched on its own (`flashtier set mode M` or `flashtier mode M`), not \
             together with other parameters"
    )]
    ModeWithOthers,
    /// Not one of [`MODES`]; holds the value given.
    #[error("invalid value '{0}' for mode: allowed {MODES}")]
    BadMode(String),
    /// Another job (mode switch, flush, detach) is running; holds its name.
    #[error("a {0} is in progress; wait for it to finish (see `flashtier status`)")]
    Busy(String),
    /// Flush cancel asked while no job runs.
    #[error("no flush is running")]
    NoFlush,
    /// Flush cancel asked while another kind of job runs; holds its name.
    #[error("the {0} cannot be cancelled; only a flush can")]
    NotCancellable(String),
    /// `--persist` asked of a server started without a config file.
    #[error(
        "--persist needs a config file, and this server was started without --config; \
         the value was not changed"
    )]
    NoConfig,
    /// Writing the config file for `--persist` failed; the live value was left as it was.
    // The cause is part of the message: it travels to the CLI as text over the socket.
    #[error("could not write {what} to the config file (nothing was changed): {cause}")]
    Persist {
        /// `name = value`, comma-separated.
        what: String,
        /// Why the write failed ([`PersistFn`]'s error).
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The metrics listener's address could not be parsed or bound.
    #[error(transparent)]
    Listen(#[from] flashtier_nbd::ServerError),
    /// A scrub could not be started or cancelled.
    #[error(transparent)]
    Scrub(#[from] ScrubError),
    /// A trace could not be started or stopped.
    #[error(transparent)]
    Trace(#[from] TraceStartError),
    /// A byte range given to `forget-lost` starts past the exported device's end.
    #[error("{what} is beyond the end of the device ({size} bytes)")]
    OutOfRange {
        /// The offending value, e.g. `offset 1234`.
        what: String,
        /// The exported device's size, in bytes.
        size: u64,
    },
    /// A memcached request (or `memcached_mode`) to a server started without a memcached tier.
    #[error(
        "this server has no memcached tier; start `flashtier serve` with --memcached \
         HOST:PORT[,...]"
    )]
    NoMemcached,
    /// The pool refused to add or remove a server (a duplicate, one not in the pool, an address
    /// that does not parse or resolve).
    // The cause is part of the message: it travels to the CLI as text over the socket.
    #[error("cannot {action} a memcached server: {cause}")]
    MemcachedServer {
        /// `add` or `remove`.
        action: &'static str,
        /// The address as given.
        server: String,
        /// The pool's reason.
        cause: PoolError,
    },
    /// Not a memcached mode; the message (the tier's) names the allowed values.
    #[error("{0}")]
    BadMemcachedMode(String),
    /// `--persist` asked for `memcached_mode`, which is a `[serve]` option of the config file
    /// (read at start), not a `[policy]` parameter.
    #[error(
        "memcached_mode is not saved by --persist (nothing was changed): set it live without \
         --persist, and edit `memcached_mode` in the [serve] section of the config file to keep \
         it across restarts"
    )]
    MemcachedModePersist,
    /// A system call failed: binding the control socket, writing the stats file, spawning a
    /// job's thread.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What the controller controls.
pub struct ControllerOptions {
    /// The server's version, for the status report (`flashtier status`, `flashtier_info`).
    pub version: String,
    /// The exported device (described in the status).
    pub dev: Arc<dyn BlockDev>,
    /// The cache behind it, if any.
    pub cache: Option<Arc<Cache>>,
    /// The exported device's measurements (see [`crate::timed::Timed`]).
    pub latencies: Arc<Latencies>,
    /// The recorder of the exported device's requests ([`crate::timed::Timed::tracer`]).
    pub tracer: Arc<Tracer>,
    /// The exported device's working-set sketch ([`crate::timed::Timed::working_set`]).
    pub working_set: Arc<LiveSketch>,
    /// The cache device's rated endurance in TB written, for the wear forecast.
    pub endurance_tbw: Option<f64>,
    /// How to persist a setting; `None` when the server has no config file.
    pub persist: Option<PersistFn>,
    /// What detach and attach need; `None`: they are refused.
    pub detach: Option<DetachOptions>,
    /// The memcached tier below the cache (or exported itself), if the server has one.
    pub memcached: Option<Arc<MemcachedTier>>,
    /// The RAM tier above the cache (or above the memcached tier or the backing store without
    /// one), if the server has one: its counters and sizes join the report.
    pub ram: Option<Arc<RamTier>>,
}

/// What `detach` and `attach` work with.
pub struct DetachOptions {
    /// The exported device (under [`crate::Timed`]), switched between cache and backing store.
    pub export: Arc<Switchable>,
    /// The backing store, served directly while no cache is attached.
    pub backing: Arc<dyn BlockDev>,
    /// The backing store's identity, recorded in the superblock of every cache attach formats.
    pub identity: BackingIdentity,
    /// Opens `attach --cache PATH`.
    pub open_device: OpenDeviceFn,
    /// Live parameters for an attached cache: the config file's `[policy]`, then `--set`.
    pub policy: Vec<(String, String)>,
    /// The mode of an attached cache when neither `attach --mode` nor a detached cache says
    /// (`serve --mode`).
    pub mode: Option<Mode>,
    /// Where an attached cache hands the clean blocks it evicts (the memcached tier's victim
    /// mode), as `serve` set it for the cache it opened.
    pub victim_sink: Option<Arc<dyn flashtier_engine::VictimSink>>,
}

/// The result of `attach`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attached {
    /// The cache device, as it describes itself.
    pub device: String,
    /// The mode it runs in: `attach --mode`, else the detached cache's, else `serve --mode`,
    /// else the device's default.
    pub mode: String,
    /// Bytes of cache space, after the device's metadata.
    pub capacity_bytes: u64,
}

/// What a running detach leaves for `attach`.
struct Detached {
    /// The released device (formatted empty), for `attach` without `--cache`.
    device: Arc<dyn BlockDev>,
    /// Its cache's uuid, when the release got as far as formatting it.
    uuid: Option<[u8; 16]>,
    /// The mode and live parameters the cache had.
    mode: Mode,
    params: Vec<(String, String)>,
}

/// The cache, if one is attached, and what detach left behind.
#[derive(Default)]
struct Attachment {
    cache: Option<Arc<Cache>>,
    detached: Option<Detached>,
    /// The final engine counters of every released cache, added to the attached cache's.
    offset: Counters,
}

impl Attachment {
    /// The engine's counters, monotonic across detach and attach.
    fn engine_counters(&self) -> Counters {
        match &self.cache {
            Some(cache) => add_counters(cache.stats().fields(), &self.offset),
            None => self.offset.clone(),
        }
    }

    fn state(&self) -> &'static str {
        match (&self.cache, &self.detached) {
            (Some(_), _) => "attached",
            (None, Some(_)) => "detached",
            (None, None) => "none",
        }
    }
}

/// `counters` plus `offset`, by name (names only in `offset` are kept too).
fn add_counters(mut counters: Counters, offset: &Counters) -> Counters {
    for &(name, v) in offset {
        match counters.iter_mut().find(|c| c.0 == name) {
            Some(c) => c.1 += v,
            None => counters.push((name, v)),
        }
    }
    counters
}

/// The tier's counters, as the report names them.
fn tier_counters(s: &TierStats) -> MemcachedTierCounters {
    MemcachedTierCounters {
        lookup_blocks: s.lookup_blocks,
        hit_blocks: s.hit_blocks,
        miss_blocks: s.miss_blocks,
        stale_values: s.stale_values,
        corrupt_values: s.corrupt_values,
        stored_blocks: s.stored_blocks,
        store_failures: s.store_failures,
        removed_blocks: s.removed_blocks,
        bypassed_requests: s.bypassed_requests,
    }
}

/// The RAM tier's counters (its sizes apart).
fn ram_counters(s: &RamStats) -> RamCounters {
    RamCounters {
        lookup_blocks: s.lookup_blocks,
        hit_blocks: s.hit_blocks,
        miss_blocks: s.miss_blocks,
        inserted_blocks: s.inserted_blocks,
        evicted_blocks: s.evicted_blocks,
        invalidated_blocks: s.invalidated_blocks,
        updated_blocks: s.updated_blocks,
        reread_requests: s.reread_requests,
        bypassed_requests: s.bypassed_requests,
    }
}

/// The counters of a server's statistics (its latency apart).
fn server_counters(s: &ServerStats) -> MemcachedServerCounters {
    MemcachedServerCounters {
        gets: s.gets,
        hits: s.hits,
        misses: s.misses,
        sets: s.sets,
        deletes: s.deletes,
        read_bytes: s.bytes_read,
        written_bytes: s.bytes_written,
        errors: s.errors,
        timeouts: s.timeouts,
        skipped: s.skipped,
    }
}

/// One row of `get --all`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamRow {
    /// The name `get` and `set` take.
    pub name: String,
    /// The live value, as `set` would accept it.
    pub value: String,
    /// The value a new cache starts with.
    pub default: String,
    /// The values accepted, e.g. a range with its unit, for errors and help.
    pub allowed: String,
    /// What the parameter does, for the CLI to show.
    pub doc: String,
}

/// What a background job does.
#[derive(Debug, Clone, Copy)]
enum JobKind {
    /// `Cache::set_mode`.
    Mode { from: Mode, to: Mode },
    /// `Cache::write_back_all_cancellable` (`flashtier flush`), in this mode.
    Flush { mode: Mode },
    /// `flashtier detach`: write back (unless `force`), serve the backing store, release.
    Detach { from: Mode, force: bool },
}

impl JobKind {
    fn what(&self) -> String {
        match self {
            JobKind::Mode { from, to } => format!("mode {from} -> {to}"),
            JobKind::Flush { .. } => "flush".into(),
            JobKind::Detach { force: false, .. } => "detach".into(),
            JobKind::Detach { force: true, .. } => "detach --force (dirty data discarded)".into(),
        }
    }

    /// As named in errors: `mode switch writeback -> writethrough`, `flush`.
    fn long_name(&self) -> String {
        match self {
            JobKind::Mode { from, to } => format!("mode switch {from} -> {to}"),
            JobKind::Flush { .. } => "flush".into(),
            JobKind::Detach { .. } => "detach".into(),
        }
    }

    /// `kind`, `from` and `to` in the report (a flush keeps the mode; a detach ends detached).
    fn names(&self) -> (&'static str, String, String) {
        match *self {
            JobKind::Mode { from, to } => ("mode", from.to_string(), to.to_string()),
            JobKind::Flush { mode } => ("flush", mode.to_string(), mode.to_string()),
            JobKind::Detach { from, .. } => ("detach", from.to_string(), "detached".into()),
        }
    }

    fn thread_name(&self) -> &'static str {
        match self {
            JobKind::Mode { .. } => "flashtier-mode",
            JobKind::Flush { .. } => "flashtier-flush",
            JobKind::Detach { .. } => "flashtier-detach",
        }
    }
}

struct Job {
    kind: JobKind,
    started: Instant,
    dirty_at_start: u64,
    /// `backing_write_bytes` when the job started: the progress within a write-back pass.
    backing_written_at_start: u64,
    /// Set to stop a flush between two backing writes.
    cancel: Arc<AtomicBool>,
    /// Set when the job returns: how long it took and the error, if any.
    finished: Option<(Duration, Option<String>)>,
}

/// Answers every control request and builds every [`Report`]; shared (`Arc`) by the control
/// socket, the metrics listener, the ticker and `serve`.
pub struct Controller {
    version: String,
    dev: Arc<dyn BlockDev>,
    att: Arc<RwLock<Attachment>>,
    detach: Option<Arc<DetachOptions>>,
    lat: Arc<Latencies>,
    tracer: Arc<Tracer>,
    endurance_tbw: Option<f64>,
    persist: Option<PersistFn>,
    started: Instant,
    sampler: Mutex<Sampler>,
    /// The working set's windows, frozen from the live sketch by [`Self::tick`].
    working_set: Mutex<WorkingSet>,
    /// Cache device writes only, never reset: the wear rate must not restart with reset-stats.
    wear_sampler: Mutex<Sampler>,
    lat_baseline: Mutex<Vec<HistSnapshot>>,
    job: Arc<Mutex<Option<Job>>>,
    scrub: Arc<Scrubber>,
    /// Held from checking a change of parameters to applying it (persisting in between), so
    /// two control clients cannot interleave and leave a file or a cache neither checked.
    setting: Mutex<()>,
    memcached: Option<Arc<MemcachedTier>>,
    /// Each memcached server's statistics at the last reset-stats (the pool's only grow, as the
    /// engine's do); a server added since has none and counts from zero.
    pool_baseline: Mutex<HashMap<String, ServerStats>>,
    ram: Option<Arc<RamTier>>,
}

impl Controller {
    /// A controller whose statistics start now: windows, reset baseline and latency baselines
    /// all begin at the counters' current values.
    pub fn new(opts: ControllerOptions) -> Controller {
        let c = Controller {
            version: opts.version,
            dev: opts.dev,
            att: Arc::new(RwLock::new(Attachment {
                cache: opts.cache,
                ..Attachment::default()
            })),
            detach: opts.detach.map(Arc::new),
            lat: opts.latencies,
            tracer: opts.tracer,
            endurance_tbw: opts.endurance_tbw,
            persist: opts.persist,
            started: Instant::now(),
            sampler: Mutex::new(Sampler::new(0, &[])),
            working_set: Mutex::new(WorkingSet::new(opts.working_set, 0)),
            wear_sampler: Mutex::new(Sampler::new(0, &[])),
            lat_baseline: Mutex::new(vec![HistSnapshot::default(); Op::ALL.len()]),
            job: Arc::default(),
            scrub: Arc::default(),
            setting: Mutex::new(()),
            memcached: opts.memcached,
            pool_baseline: Mutex::default(),
            ram: opts.ram,
        };
        let raw = c.raw_counters();
        *c.sampler.lock() = Sampler::new(0, &raw);
        *c.wear_sampler.lock() = Sampler::new(0, &wear_counter(&raw));
        c
    }

    /// The cache attached now.
    pub fn cache(&self) -> Option<Arc<Cache>> {
        self.att.read().cache.clone()
    }

    fn need_cache(&self) -> Result<Arc<Cache>, ControlError> {
        let att = self.att.read();
        match (&att.cache, &att.detached) {
            (Some(c), _) => Ok(c.clone()),
            (None, Some(_)) => Err(ControlError::Detached),
            (None, None) => Err(ControlError::NoCache),
        }
    }

    /// The memcached tier, or the error saying how to get one.
    fn need_memcached(&self) -> Result<&Arc<MemcachedTier>, ControlError> {
        self.memcached.as_ref().ok_or(ControlError::NoMemcached)
    }

    fn now_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Every counter as it is now, monotonic: the engine's (of every cache this server had)
    /// and the client side's.
    fn raw_counters(&self) -> Counters {
        let mut c = self.att.read().engine_counters();
        c.extend(self.lat.counters());
        if let Some(ram) = &self.ram {
            let counters = ram_counters(&ram.stats());
            c.extend(RamCounters::NAMES.into_iter().zip(counters.values()));
        }
        if let Some(tier) = &self.memcached {
            let counters = tier_counters(&tier.stats());
            c.extend(
                MemcachedTierCounters::NAMES
                    .into_iter()
                    .zip(counters.values()),
            );
            // Removed servers included, so the totals never go back.
            let pool = server_counters(&tier.pool().totals());
            c.extend(
                MemcachedServerCounters::POOL_NAMES
                    .into_iter()
                    .zip(pool.values()),
            );
        }
        c
    }

    /// Keeps a sample for the windows; the ticker calls this every second.
    pub fn tick(&self) {
        let (now, raw) = (self.now_secs(), self.raw_counters());
        self.sampler.lock().record(now, &raw);
        self.wear_sampler.lock().record(now, &wear_counter(&raw));
        self.working_set.lock().tick(now);
    }

    /// Starts every counter, window and latency histogram again from zero (the engine's own
    /// counters keep growing; this moves the baseline).
    pub fn reset_stats(&self) {
        let raw = self.raw_counters();
        self.sampler.lock().restart(self.now_secs(), &raw);
        self.working_set.lock().restart(self.now_secs());
        *self.lat_baseline.lock() = Op::ALL.iter().map(|&op| self.lat.histogram(op)).collect();
        if let Some(tier) = &self.memcached {
            *self.pool_baseline.lock() = tier
                .pool()
                .servers()
                .into_iter()
                .map(|s| (s.addr, s.stats))
                .collect();
        }
        tracing::info!("statistics reset");
    }

    /// Everything an operator can see, built once from one reading of the counters so that
    /// every view agrees.
    pub(crate) fn report(&self) -> Report {
        let now = self.now_secs();
        let raw = self.raw_counters();
        let (total, windows) = {
            let s = self.sampler.lock();
            (s.total(&raw), s.windows(now, &raw))
        };
        let counters: Ordered<u64> = total.into_iter().collect();
        let status = self.status_report(now);
        let cache_status = status.cache_status.as_ref();
        let derived = Derived {
            read_hit_pct: read_hit_pct(&counters),
            write_hit_pct: write_hit_pct(&counters),
            dirty_bytes: cache_status.map(|c| c.dirty_bytes),
            used_pct: cache_status.map(|c| c.used_pct),
        };
        let wear = self.wear(now, &raw);
        let ram = self.ram_report(&counters);
        let memcached = self.memcached_report(&counters);
        Report {
            status,
            job: self.job_report(),
            scrub: self.scrub.status(),
            trace: self.tracer.status(),
            counters,
            derived,
            window_secs: windows.iter().map(|w| (w.name, w.secs)).collect(),
            windows: windows
                .into_iter()
                .map(|w| (w.name, w.deltas.into_iter().collect()))
                .collect(),
            working_set: Some(self.working_set_report(now)),
            latency: self.latency_report(),
            wear,
            ram,
            memcached,
            params: self.param_values(),
            generated_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    fn working_set_report(&self, now: u64) -> WorkingSetReport {
        let windows = self.working_set.lock().windows(now);
        WorkingSetReport {
            block_size: working_set::BLOCK_SIZE,
            standard_error_pct: working_set::STANDARD_ERROR * 100.0,
            windows: windows
                .into_iter()
                .map(|w| {
                    let window = WorkingSetWindow {
                        secs: w.secs,
                        blocks: w.blocks,
                        bytes: w.blocks * working_set::BLOCK_SIZE,
                    };
                    (w.name, window)
                })
                .collect(),
        }
    }

    /// Every live parameter's value: the cache's, then `memcached_mode`.
    fn param_values(&self) -> Ordered<String> {
        let mut params: Ordered<String> = match self.cache() {
            Some(c) => c.params().into_iter().map(|(p, v)| (p.name, v)).collect(),
            None => Ordered::default(),
        };
        if let Some(tier) = &self.memcached {
            params
                .0
                .push((MEMCACHED_MODE.into(), tier.mode().to_string()));
        }
        params
    }

    /// The RAM tier's part of the report: its sizes now, and its counters from `counters`, the
    /// report's (since the last reset), so they are the same numbers as theirs.
    fn ram_report(&self, counters: &Ordered<u64>) -> Option<RamReport> {
        let tier = self.ram.as_ref()?;
        let s = tier.stats();
        let counters = RamCounters::from_counters(counters);
        Some(RamReport {
            policy: tier.policy().to_string(),
            capacity_bytes: s.capacity_bytes,
            used_bytes: s.used_bytes,
            memory_bytes: s.memory_bytes,
            hit_pct: counters.hit_pct(),
            counters,
        })
    }

    /// The memcached tier's part of the report; `counters` are the report's (since the last
    /// reset), so the tier's and the pool's figures are the same numbers as theirs.
    fn memcached_report(&self, counters: &Ordered<u64>) -> Option<MemcachedReport> {
        let tier = self.memcached.as_ref()?;
        let baseline = self.pool_baseline.lock();
        let now = Instant::now();
        let servers = tier
            .pool()
            .servers()
            .into_iter()
            .map(|s| {
                let stats = match baseline.get(&s.addr) {
                    Some(base) => s.stats.sub(base),
                    None => s.stats,
                };
                let (health, down_secs, retry_in_secs, last_error) = match s.health {
                    Health::Up => ("up", None, None, None),
                    Health::Down {
                        since,
                        retry_at,
                        last_error,
                    } => (
                        "down",
                        Some(now.saturating_duration_since(since).as_secs_f64()),
                        Some(retry_at.saturating_duration_since(now).as_secs_f64()),
                        Some(last_error),
                    ),
                };
                MemcachedServerReport {
                    health: health.into(),
                    down_secs,
                    retry_in_secs,
                    last_error,
                    counters: server_counters(&stats),
                    latency: server_latency(&stats.latency),
                    addr: s.addr,
                }
            })
            .collect();
        drop(baseline);
        Some(MemcachedReport {
            enabled: tier.enabled(),
            mode: tier.mode().to_string(),
            tier: MemcachedTierCounters::from_counters(counters),
            pool: MemcachedServerCounters::pool_from_counters(counters),
            servers,
        })
    }

    fn status_report(&self, now: u64) -> StatusReport {
        let (st, lost_ranges, cache_state) = {
            let att = self.att.read();
            let cache = att.cache.as_ref();
            (
                cache.map(|c| c.status()),
                cache.map(|c| c.lost_ranges()).unwrap_or_default(),
                att.state(),
            )
        };
        let health = st.as_ref().map_or_else(
            || "ok".to_string(),
            |s| {
                health(
                    s.failed,
                    s.integrity.as_deref(),
                    s.backing_degraded.as_deref(),
                )
            },
        );
        StatusReport {
            version: self.version.clone(),
            device: self.dev.describe(),
            size_bytes: self.dev.info().size,
            cache: st.is_some(),
            cache_state: cache_state.into(),
            mode: st.as_ref().map(|s| s.mode.to_string()),
            health,
            uptime_secs: now,
            cache_status: st.map(|s| CacheStatus {
                block_size: s.block_size,
                capacity_blocks: s.capacity_blocks,
                cached_blocks: s.cached_blocks,
                dirty_blocks: s.dirty_blocks,
                dirty_bytes: s.dirty_blocks * s.block_size as u64,
                used_pct: if s.capacity_blocks == 0 {
                    0.0
                } else {
                    s.cached_blocks as f64 * 100.0 / s.capacity_blocks as f64
                },
                unwritten_blocks: s.unwritten_blocks,
                stale_blocks: s.stale_blocks,
                segments: s.segments,
                free_segments: s.free_segments as u64,
                segment_size: s.segment_size,
                index_bytes: s.index_bytes as u64,
                atomic_write_bytes: s.atomic_write_bytes,
                reclaim_policy: s.reclaim.to_string(),
                writeback: (&s.writeback).into(),
                lost_blocks: s.lost_blocks,
                lost_ranges: lost_ranges.iter().map(|&(f, n)| [f, n]).collect(),
                integrity: s.integrity,
                backing_degraded: s.backing_degraded,
                recovery: s.recovery,
            }),
        }
    }

    fn latency_report(&self) -> Ordered<LatencyReport> {
        let base = self.lat_baseline.lock().clone();
        Op::ALL
            .iter()
            .zip(base)
            .map(|(&op, base)| {
                let h = self.lat.histogram(op).since(&base);
                let us = |ns: u64| ns as f64 / 1000.0;
                let r = LatencyReport {
                    count: h.count,
                    p50_us: us(h.quantile(0.5)),
                    p99_us: us(h.quantile(0.99)),
                    p999_us: us(h.quantile(0.999)),
                    max_us: us(h.max),
                    sum_us: us(h.sum),
                    buckets: LATENCY_BUCKETS_US
                        .iter()
                        .map(|&b| [b, h.count_at_most(b * 1000)])
                        .collect(),
                };
                (op.name(), r)
            })
            .collect()
    }

    fn wear(&self, now: u64, raw: &Counters) -> Wear {
        let counters = wear_counter(raw);
        // The day window (or what there is of it), once it spans a minute: a rate extrapolated
        // from a few seconds of start-up writes would be noise.
        let windows = self.wear_sampler.lock().windows(now, &counters);
        let day = windows.iter().rev().find(|w| w.name != TOTAL);
        let value = |cs: &[(&'static str, u64)], name: &str| {
            cs.iter().find(|c| c.0 == name).map_or(0, |c| c.1)
        };
        let written = value(&counters, DEVICE_WRITES);
        let (bytes_per_day, days_to_rated_tbw, write_amplification) = match (day, self.cache()) {
            (Some(w), Some(_)) => {
                let device = value(&w.deltas, DEVICE_WRITES);
                let (rate, days) = forecast(device, w.secs, written, self.endurance_tbw);
                let clients = value(&w.deltas, CLIENT_WRITES);
                (rate, days, amplification(device, clients, w.secs))
            }
            _ => (None, None, None),
        };
        Wear {
            cache_bytes_written: written,
            bytes_per_day,
            endurance_tbw: self.endurance_tbw,
            days_to_rated_tbw,
            write_amplification,
        }
    }

    fn job_report(&self) -> Option<JobReport> {
        let job = self.job.lock();
        let j = job.as_ref()?;
        let (dirty_now, backing_written, block_size) = match self.cache() {
            Some(c) => {
                let st = c.status();
                (
                    st.dirty_blocks,
                    c.stats().backing_write_bytes,
                    st.block_size as u64,
                )
            }
            None => (0, 0, 1),
        };
        // The engine marks blocks clean only when a whole pass has been written back and
        // flushed, so while it runs, what it wrote to the backing store so far is the progress.
        let dirty_left = if j.finished.is_some() {
            dirty_now
        } else {
            let written = backing_written.saturating_sub(j.backing_written_at_start) / block_size;
            dirty_now.saturating_sub(written)
        };
        let (elapsed, error) = match &j.finished {
            Some((took, err)) => (*took, err.clone()),
            None => (j.started.elapsed(), None),
        };
        let (kind, from, to) = j.kind.names();
        Some(JobReport {
            what: j.kind.what(),
            kind: kind.into(),
            from,
            to,
            done: j.finished.is_some(),
            cancelled: j.cancel.load(Ordering::Acquire),
            error,
            dirty_blocks_left: dirty_left,
            dirty_blocks_at_start: j.dirty_at_start,
            elapsed_secs: elapsed.as_secs_f64(),
        })
    }

    /// The current value of a parameter, `mode` or `memcached_mode`.
    pub fn get(&self, name: &str) -> Result<String, ControlError> {
        if name.trim() == MEMCACHED_MODE {
            return Ok(self.need_memcached()?.mode().to_string());
        }
        let cache = self.need_cache()?;
        if name == "mode" {
            return Ok(cache.mode().to_string());
        }
        cache.get_param(name).map_err(with_mode)
    }

    /// Sets a parameter live (for `mode`: starts the switch). With `persist`, the config file is
    /// written first, so a value is never live-but-lost or saved-but-refused. Returns the value
    /// as stored. `memcached_mode` needs no cache, and refuses `persist`.
    pub fn set(&self, name: &str, value: &str, persist: bool) -> Result<String, ControlError> {
        if name.trim() == MEMCACHED_MODE {
            let mode = self.check_memcached_mode(value, persist)?;
            self.apply_memcached_mode(mode);
            return Ok(mode.to_string());
        }
        let cache = self.need_cache()?;
        if name == "mode" {
            let mode = parse_mode(value)?;
            self.start_switch(mode, persist)?;
            return Ok(mode.to_string());
        }
        let set = self.set_params(&cache, &[(name.to_string(), value.to_string())], persist)?;
        Ok(set.into_iter().next().map(|(_, v)| v).unwrap_or_default())
    }

    /// Sets several parameters at once: checked together (each value, then values that
    /// constrain each other against the rest of the current values), persisted together with
    /// `persist`, applied together; all or nothing. Returns `(name, value as stored)` for each.
    /// `mode` is refused here: it starts a job, not a setting. `memcached_mode` may be among
    /// them (it cannot fail once checked, so it is applied last).
    pub fn set_many(
        &self,
        settings: &[(String, String)],
        persist: bool,
    ) -> Result<Vec<(String, String)>, ControlError> {
        let is_memcached = |n: &str| n.trim() == MEMCACHED_MODE;
        let memcached = settings
            .iter()
            .filter(|(n, _)| is_memcached(n))
            .map(|(_, v)| self.check_memcached_mode(v, persist))
            .collect::<Result<Vec<_>, _>>()?;
        let rest: Vec<(String, String)> = settings
            .iter()
            .filter(|(n, _)| !is_memcached(n))
            .cloned()
            .collect();
        let mut set = if rest.is_empty() {
            Vec::new()
        } else {
            let cache = self.need_cache()?;
            if rest.iter().any(|(n, _)| n == "mode") {
                match &rest[..] {
                    [(_, mode)] if memcached.is_empty() => {
                        return Ok(vec![("mode".into(), self.set("mode", mode, persist)?)]);
                    }
                    _ => return Err(ControlError::ModeWithOthers),
                }
            }
            self.set_params(&cache, &rest, persist)?
        }
        .into_iter();
        // The last value given wins, as for the engine's parameters.
        if let Some(&mode) = memcached.last() {
            self.apply_memcached_mode(mode);
        }
        // In the order given.
        Ok(settings
            .iter()
            .filter_map(|(n, _)| match memcached.last() {
                Some(mode) if is_memcached(n) => Some((MEMCACHED_MODE.into(), mode.to_string())),
                _ => set.next(),
            })
            .collect())
    }

    /// `value` as a memcached mode, if this server has a tier and `persist` is not asked.
    fn check_memcached_mode(
        &self,
        value: &str,
        persist: bool,
    ) -> Result<MemcachedMode, ControlError> {
        self.need_memcached()?;
        if persist {
            return Err(ControlError::MemcachedModePersist);
        }
        value.trim().parse().map_err(ControlError::BadMemcachedMode)
    }

    fn apply_memcached_mode(&self, mode: MemcachedMode) {
        if let Some(tier) = &self.memcached {
            let from = tier.mode();
            tier.set_mode(mode);
            if from != mode {
                tracing::info!("memcached_mode {from} -> {mode}");
            }
        }
    }

    fn set_params(
        &self,
        cache: &Cache,
        settings: &[(String, String)],
        persist: bool,
    ) -> Result<Vec<(String, String)>, ControlError> {
        let settings: Vec<(String, String)> = settings
            .iter()
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect();
        let _setting = self.setting.lock();
        for (name, value) in &settings {
            tunables::validate(name, value).map_err(with_mode)?;
        }
        cache.check_params(&settings).map_err(conflict)?;
        if persist {
            self.persist(&settings)?;
        }
        cache.set_params(&settings).map_err(conflict)?;
        settings
            .into_iter()
            .map(|(name, _)| {
                let value = cache.get_param(&name).map_err(with_mode)?;
                Ok((name, value))
            })
            .collect()
    }

    fn persist(&self, settings: &[(String, String)]) -> Result<(), ControlError> {
        let persist = self.persist.as_ref().ok_or(ControlError::NoConfig)?;
        let what = settings
            .iter()
            .map(|(n, v)| format!("{n} = {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        persist(settings).map_err(|cause| ControlError::Persist {
            what: what.clone(),
            cause,
        })?;
        tracing::info!(settings = what, "persisted to the config file");
        Ok(())
    }

    /// Every parameter, `mode` first and `memcached_mode` last, with value, default and allowed
    /// values. Without a cache, only `memcached_mode` (an error without a tier either).
    pub fn params(&self) -> Result<Vec<ParamRow>, ControlError> {
        let mut rows = match (self.need_cache(), &self.memcached) {
            (Ok(cache), _) => self.cache_params(&cache),
            (Err(_), Some(_)) => Vec::new(),
            (Err(e), None) => return Err(e),
        };
        if let Some(tier) = &self.memcached {
            rows.push(ParamRow {
                name: MEMCACHED_MODE.into(),
                value: tier.mode().to_string(),
                default: MemcachedMode::default().to_string(),
                allowed: flashtier_memcached::tier::MODES.into(),
                doc: "What the memcached tier stores: inclusive (blocks read from and written \
                      to the store below; a hit leaves them) or victim (blocks a faster tier \
                      evicts; a hit removes them). Not saved by --persist: it is \
                      `memcached_mode` in the config file's [serve]."
                    .into(),
            });
        }
        Ok(rows)
    }

    fn cache_params(&self, cache: &Cache) -> Vec<ParamRow> {
        let mut rows = vec![ParamRow {
            name: "mode".into(),
            value: cache.mode().to_string(),
            default: "as formatted".into(),
            allowed: MODES.into(),
            doc: "The cache mode. Leaving writeback writes every dirty block back first; \
                  `flashtier mode` shows the progress."
                .into(),
        }];
        rows.extend(cache.params().into_iter().map(|(p, value)| ParamRow {
            name: p.name.into(),
            value,
            default: p.default.into(),
            allowed: p.allowed.into(),
            doc: p.doc.into(),
        }));
        rows
    }

    /// Answers a `{"op":"memcached"}` request: does what it asks, then reports the tier.
    pub fn memcached(&self, req: MemcachedRequest) -> Result<MemcachedReport, ControlError> {
        let tier = self.need_memcached()?;
        let server_err = |action, server: &str| {
            let server = server.to_string();
            move |cause| ControlError::MemcachedServer {
                action,
                server,
                cause,
            }
        };
        match req {
            MemcachedRequest::List => {}
            MemcachedRequest::Add { server } => {
                let server = server.trim();
                tier.pool()
                    .add_server(server)
                    .map_err(server_err("add", server))?;
            }
            MemcachedRequest::Remove { server } => {
                let server = server.trim();
                tier.pool()
                    .remove_server(server)
                    .map_err(server_err("remove", server))?;
                // Added again later, it starts from zero.
                self.pool_baseline.lock().remove(server);
            }
            MemcachedRequest::Mode { mode } => {
                let mode = self.check_memcached_mode(&mode, false)?;
                self.apply_memcached_mode(mode);
            }
            MemcachedRequest::On => turn(tier, true),
            MemcachedRequest::Off => turn(tier, false),
        }
        self.report().memcached.ok_or(ControlError::NoMemcached)
    }

    /// Starts switching to `mode` on a background thread and returns at once; the report's
    /// `job` shows the progress. Refused while another switch runs.
    pub fn start_mode_switch(&self, mode: &str) -> Result<String, ControlError> {
        self.need_cache()?;
        let mode = parse_mode(mode)?;
        self.start_switch(mode, false)?;
        Ok(mode.to_string())
    }

    fn start_switch(&self, to: Mode, persist: bool) -> Result<(), ControlError> {
        let from = self.need_cache()?.mode();
        let before = || {
            if persist {
                self.persist(&[("mode".into(), to.name().into())])?;
            }
            Ok(())
        };
        self.start_job(JobKind::Mode { from, to }, before, move |cache, _| {
            cache.set_mode(to)
        })
    }

    /// Starts a manual flush on a background thread and returns at once: every block dirty now
    /// is written back and the backing store flushed; the report's `job` shows the progress.
    /// Refused while another job runs.
    pub fn start_flush(&self) -> Result<(), ControlError> {
        let mode = self.need_cache()?.mode();
        self.start_job(
            JobKind::Flush { mode },
            || Ok(()),
            |cache, cancel| cache.write_back_all_cancellable(cancel).map(drop),
        )
    }

    /// Asks the running flush to stop after the backing write in flight; blocks written back
    /// stay clean, the rest stay dirty. Returns at once; the job's `done` says when it stopped.
    pub fn cancel_flush(&self) -> Result<(), ControlError> {
        self.need_cache()?;
        let job = self.job.lock();
        match job.as_ref().filter(|j| j.finished.is_none()) {
            Some(j) if matches!(j.kind, JobKind::Flush { .. }) => {
                j.cancel.store(true, Ordering::Release);
                tracing::info!("flush cancelled");
                Ok(())
            }
            Some(j) => Err(ControlError::NotCancellable(j.kind.long_name())),
            None => Err(ControlError::NoFlush),
        }
    }

    /// Runs `work` as the one background job (after `before`, while no other job can start),
    /// with the report's `job` following it.
    fn start_job(
        &self,
        kind: JobKind,
        before: impl FnOnce() -> Result<(), ControlError>,
        work: impl FnOnce(&Arc<Cache>, &AtomicBool) -> std::io::Result<()> + Send + 'static,
    ) -> Result<(), ControlError> {
        let cache = self.need_cache()?;
        // Held until the job is in place, so two requests cannot both start one.
        let mut job = self.job.lock();
        if let Some(j) = job.as_ref().filter(|j| j.finished.is_none()) {
            return Err(ControlError::Busy(j.kind.long_name()));
        }
        before()?;
        let cancel = Arc::new(AtomicBool::new(false));
        *job = Some(Job {
            kind,
            started: Instant::now(),
            dirty_at_start: cache.status().dirty_blocks,
            backing_written_at_start: cache.stats().backing_write_bytes,
            cancel: cancel.clone(),
            finished: None,
        });
        drop(job);
        let what = kind.what();
        tracing::info!("{what} started");
        let slot = self.job.clone();
        let spawned = std::thread::Builder::new()
            .name(kind.thread_name().into())
            .spawn(move || {
                let result = work(&cache, &cancel);
                match &result {
                    Ok(()) => tracing::info!("{what} done"),
                    Err(e) => tracing::error!("{what} failed: {e}"),
                }
                if let Some(j) = slot.lock().as_mut() {
                    j.finished = Some((j.started.elapsed(), result.err().map(|e| e.to_string())));
                }
            });
        if let Err(e) = spawned {
            if let Some(j) = self.job.lock().as_mut() {
                j.finished = Some((Duration::ZERO, Some(format!("cannot start: {e}"))));
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// Starts recording the clients' requests to a new file at `path` (absolute; must not
    /// exist yet).
    pub fn start_trace(&self, path: &std::path::Path) -> Result<TraceStatus, ControlError> {
        self.tracer.start(path, self.dev.info().size)?;
        Ok(self.tracer.status().ok_or(TraceStartError::NotRunning)?)
    }

    /// Stops the trace (with `only`: only if it goes to that file), once everything recorded is
    /// in the file (synced).
    pub fn stop_trace(&self, only: Option<&std::path::Path>) -> Result<TraceStatus, ControlError> {
        Ok(self.tracer.stop(only)?)
    }

    /// Starts a scrub on a background thread (see [`Cache::scrub`]) and returns at once; the
    /// report's `scrub` shows the progress. `rate` caps the bytes read per second. Refused
    /// while a detach runs (it releases the cache the scrub would read).
    pub fn start_scrub(&self, rate: Option<u64>) -> Result<(), ControlError> {
        let cache = self.need_cache()?;
        // Held while the scrub starts: a detach starting now stops it before releasing.
        let job = self.job.lock();
        if let Some(j) = job.as_ref().filter(|j| j.finished.is_none()) {
            if matches!(j.kind, JobKind::Detach { .. }) {
                return Err(ControlError::Busy(j.kind.long_name()));
            }
        }
        self.scrub.start(cache, rate)?;
        Ok(())
    }

    /// Asks the running scrub to stop; returns at once.
    pub fn cancel_scrub(&self) -> Result<(), ControlError> {
        Ok(self.scrub.cancel()?)
    }

    /// Acknowledges lost blocks (see [`Cache::forget_lost`]): every one (`offset` `None`), or
    /// those the byte range `offset`, `length` touches (`length` `None`: the one block at
    /// `offset`). Returns how many were forgotten.
    pub fn forget_lost(
        &self,
        offset: Option<u64>,
        length: Option<u64>,
    ) -> Result<u64, ControlError> {
        let cache = self.need_cache()?;
        let size = self.dev.info().size;
        let bs = cache.info().min_block as u64;
        let range = match offset {
            None => None,
            Some(off) if off >= size => {
                return Err(ControlError::OutOfRange {
                    what: format!("offset {off}"),
                    size,
                })
            }
            Some(off) => {
                let (first, end) = crate::report::blocks_touched(off, length, bs);
                Some((first, end.min(size.div_ceil(bs)) - first))
            }
        };
        let forgotten = cache.forget_lost(range)?;
        if forgotten > 0 {
            tracing::warn!(
                blocks = forgotten,
                "lost blocks forgotten: reads of them return the backing store's older data"
            );
        }
        Ok(forgotten)
    }

    /// Starts detaching the cache on a background thread and returns the dirty blocks it
    /// holds now: unless `force`, every dirty block is written back and the cache switched to
    /// pass-through (the report's `job` shows the progress, as for a mode switch); then the
    /// export serves the backing store directly, once the requests in flight through the cache
    /// are done, and the cache is released (closed, its device formatted empty). With `force`,
    /// nothing is written back: the dirty blocks are discarded.
    pub fn start_detach(&self, force: bool) -> Result<u64, ControlError> {
        let d = self.detach.clone().ok_or(ControlError::NotDetachable)?;
        let cache = self.need_cache()?;
        let from = cache.mode();
        let dirty = cache.status().dirty_blocks;
        if force && dirty > 0 {
            tracing::warn!(
                dirty_blocks = dirty,
                dirty_bytes = dirty * cache.status().block_size as u64,
                "detach --force: the cache's dirty blocks will be discarded; the backing store \
                 does not have these writes"
            );
        }
        let att = self.att.clone();
        let scrub = self.scrub.clone();
        self.start_job(
            JobKind::Detach { from, force },
            || Ok(()),
            move |cache, _| {
                scrub.stop();
                detach(cache, force, &d, &att)
            },
        )?;
        Ok(dirty)
    }

    /// Attaches a cache and serves through it from now on: the device `detach` released, or
    /// `path` (opened as `serve --cache` opens it). The device is formatted empty for this
    /// backing store first: whatever it held is stale, the backing store changed while no
    /// cache was in front of it. A device holding another flashtier cache than the one detached
    /// (it may hold someone's dirty data) is refused unless `force`. The mode is `mode`, else
    /// the detached cache's, else the server's; the live parameters are the server's (config
    /// file, `--set`), then those the detached cache had.
    pub fn attach(
        &self,
        path: Option<&str>,
        mode: Option<&str>,
        force: bool,
    ) -> Result<Attached, ControlError> {
        let d = self.detach.clone().ok_or(ControlError::NotDetachable)?;
        let mode = mode.map(parse_mode).transpose()?;
        // No job may start (or run) meanwhile.
        let job = self.job.lock();
        if let Some(j) = job.as_ref().filter(|j| j.finished.is_none()) {
            return Err(ControlError::Busy(j.kind.long_name()));
        }
        let mut att = self.att.write();
        if att.cache.is_some() {
            return Err(ControlError::Attached);
        }
        if d.backing.info().read_only {
            return Err(ControlError::Attach {
                path: path.unwrap_or("the cache").into(),
                cause: "a cache needs a writable backing store, and this server serves it \
                        read-only"
                    .into(),
            });
        }
        let (device, name) = match path {
            Some(p) => {
                let dev = (d.open_device)(p).map_err(|e| ControlError::Attach {
                    path: p.into(),
                    cause: e.to_string(),
                })?;
                (dev, p.to_string())
            }
            None => match &att.detached {
                Some(det) => (det.device.clone(), det.device.describe()),
                None => return Err(ControlError::NothingToAttach),
            },
        };
        let attach_err = |cause: String| ControlError::Attach {
            path: name.clone(),
            cause,
        };
        let detached_uuid = att.detached.as_ref().and_then(|det| det.uuid);
        let opts = match read_superblock(&*device) {
            // The released device is this server's own, whatever a failed release left on it.
            Ok(sb) if path.is_some() && Some(sb.uuid) != detached_uuid && !force => {
                return Err(ControlError::ForeignCache {
                    path: name,
                    backing: sb.backing.name,
                })
            }
            // Same geometry as before: a device sized for it.
            Ok(sb) => FormatOptions {
                block_size: sb.geometry.block_size,
                segment_size: sb.geometry.segment_size,
                mode: sb.default_mode,
                reclaim: sb.reclaim,
            },
            Err(EngineError::Format(FormatError::NotACache)) => FormatOptions::default(),
            Err(e @ EngineError::Format(_)) if !force => {
                return Err(attach_err(format!(
                    "{e}; pass --force to format it for this backing store anyway"
                )))
            }
            Err(EngineError::Format(_)) => FormatOptions::default(),
            Err(e) => return Err(attach_err(e.to_string())),
        };
        let mode = mode
            .or(att.detached.as_ref().map(|det| det.mode))
            .or(d.mode)
            .unwrap_or(opts.mode);
        format(&*device, d.identity.clone(), opts).map_err(|e| attach_err(e.to_string()))?;
        let cache = Cache::open(device, d.backing.clone(), &d.identity, Some(mode))
            .map_err(|e| attach_err(e.to_string()))?;
        cache.set_victim_sink(d.victim_sink.clone());
        // One change (the carried values win): applied one at a time, a pair of watermarks
        // could be refused halfway between the defaults and the values carried.
        let carried = att.detached.iter().flat_map(|det| det.params.iter());
        let params: Vec<(String, String)> = d.policy.iter().chain(carried).cloned().collect();
        if let Err(e) = cache.set_params(&params) {
            tracing::warn!("attach: the parameters were not applied (the defaults are): {e}");
        }
        let cache = Arc::new(cache);
        d.export.switch_to(cache.clone());
        let st = cache.status();
        let attached = Attached {
            device: cache.describe(),
            mode: st.mode.to_string(),
            capacity_bytes: st.capacity_blocks * st.block_size as u64,
        };
        att.cache = Some(cache);
        att.detached = None;
        drop(att);
        drop(job);
        tracing::info!(
            device = %attached.device,
            mode = %attached.mode,
            "cache attached (empty); the export serves through it"
        );
        Ok(attached)
    }

    /// Takes the attached cache out for shutdown (waiting for a detach that is releasing it):
    /// the caller closes it.
    pub fn take_cache(&self) -> Option<Arc<Cache>> {
        self.scrub.stop();
        let mut att = self.att.write();
        let cache = att.cache.take()?;
        att.offset = add_counters(cache.stats().fields(), &att.offset);
        Some(cache)
    }

    /// Whether a job (mode switch or flush) is still running (shutdown logs it: the cache keeps
    /// its dirty blocks safely, and the next start resumes in the mode the device records).
    pub fn job_running(&self) -> bool {
        self.job
            .lock()
            .as_ref()
            .is_some_and(|j| j.finished.is_none())
    }
}

/// The health line (see [`StatusReport::health`]): a failed cache device first, then lost
/// data, then a failing backing store; a volume that is degraded for two reasons says both.
fn health(failed: bool, integrity: Option<&str>, backing: Option<&str>) -> String {
    if failed {
        return "failed: the cache device failed; the cache refuses writes until it works \
                again (see the log)"
            .into();
    }
    let reasons: Vec<&str> = [integrity, backing].into_iter().flatten().collect();
    if reasons.is_empty() {
        "ok".into()
    } else {
        format!("degraded: {}", reasons.join("; "))
    }
}

/// The detach job: write back and switch to pass-through (unless `force`), serve the backing
/// store, release the cache.
fn detach(
    cache: &Arc<Cache>,
    force: bool,
    d: &DetachOptions,
    att: &RwLock<Attachment>,
) -> std::io::Result<()> {
    let from = cache.mode();
    let params: Vec<(String, String)> = cache
        .params()
        .into_iter()
        .map(|(p, v)| (p.name.to_string(), v))
        .collect();
    if !force {
        // Writes everything back while the cache keeps serving; pass-through keeps nothing
        // dirty from then on.
        cache.set_mode(Mode::PassThrough)?;
    }
    // Held until the state says detached: a report never sees the cache gone but its
    // counters not yet in the offset, and a shutdown waits for the release to finish.
    let mut att = att.write();
    if !att.cache.as_ref().is_some_and(|c| Arc::ptr_eq(c, cache)) {
        // Taken for shutdown, which closed it: it stays as it is, safely.
        return Err(std::io::Error::other("the server is shutting down"));
    }
    d.export.switch_to(d.backing.clone());
    let device = cache.device();
    let released = match cache.release(force) {
        Err(e @ ReleaseError::Dirty { .. }) => {
            // Something made a block dirty after the write-back: keep serving from the cache.
            d.export.switch_to(cache.clone());
            drop(att);
            if let Err(e) = cache.set_mode(from) {
                tracing::error!("detach: could not switch the cache back to {from}: {e}");
            }
            return Err(std::io::Error::other(e.to_string()));
        }
        r => r,
    };
    att.offset = add_counters(cache.stats().fields(), &att.offset);
    att.cache = None;
    att.detached = Some(Detached {
        device,
        uuid: released.as_ref().ok().map(|r| r.superblock.uuid),
        mode: from,
        params,
    });
    match released {
        Ok(r) if r.discarded_blocks > 0 => tracing::warn!(
            blocks = r.discarded_blocks,
            "detached: dirty blocks discarded; the export serves the backing store"
        ),
        Ok(_) => tracing::info!("detached: the export serves the backing store"),
        Err(e) => {
            tracing::error!("detached, but releasing the cache failed: {e}");
            return Err(std::io::Error::other(e.to_string()));
        }
    }
    Ok(())
}

/// A conflict between values gets the hint on how to change both.
fn conflict(e: ParamError) -> ControlError {
    match e {
        e @ ParamError::Conflict { .. } => ControlError::Conflict(e),
        e => with_mode(e),
    }
}

/// The engine's error, with `mode` among the known names (the control layer adds it).
fn with_mode(e: ParamError) -> ControlError {
    match e {
        ParamError::Unknown { name, known } => ParamError::Unknown {
            name,
            known: format!("mode, {known}, {MEMCACHED_MODE}"),
        }
        .into(),
        e => e.into(),
    }
}

/// The shortest history a wear rate is computed from.
const MIN_RATE_SECS: u64 = 60;

/// `(bytes per day, days to the rated TBW)` from `delta` bytes written in the last `secs`
/// seconds, `written` bytes so far and the rating in TB.
fn forecast(delta: u64, secs: u64, written: u64, tbw: Option<f64>) -> (Option<f64>, Option<f64>) {
    if secs < MIN_RATE_SECS {
        return (None, None);
    }
    let rate = delta as f64 * 86_400.0 / secs as f64;
    let days = tbw
        .filter(|_| rate > 0.0)
        .map(|tbw| (tbw * 1e12 - written as f64).max(0.0) / rate);
    (Some(rate), days)
}

/// Bytes the cache device's wear figures count, and the clients' writes they are set against.
const DEVICE_WRITES: &str = "cache_write_bytes";
const CLIENT_WRITES: &str = "client_write_bytes";

/// The counters the wear figures come from: bytes written to the cache device and by clients.
fn wear_counter(raw: &Counters) -> Counters {
    raw.iter()
        .filter(|c| c.0 == DEVICE_WRITES || c.0 == CLIENT_WRITES)
        .copied()
        .collect()
}

/// Bytes written to the cache device per byte clients wrote over a window of `secs`: what the
/// cache's own writes (log headers, blocks reclaim copies forward, checkpoints, promotions)
/// multiply the clients' by. None before a minute (as the rate) or without client writes.
fn amplification(device: u64, clients: u64, secs: u64) -> Option<f64> {
    (secs >= MIN_RATE_SECS && clients > 0).then(|| device as f64 / clients as f64)
}

/// Turns the memcached tier on or off, saying so in the log when that changes something.
fn turn(tier: &MemcachedTier, on: bool) {
    if tier.enabled() != on {
        tier.set_enabled(on);
        tracing::info!("memcached tier turned {}", if on { "on" } else { "off" });
    }
}

/// The bounds of a memcached server's latency buckets in reports: the upper bounds of the
/// pool's power-of-two buckets from 16 µs to about 16.8 s (round trips shorter or longer than
/// that are rare, and Prometheus wants few buckets).
const POOL_BUCKETS: std::ops::RangeInclusive<usize> = 3..=23;

/// A server's latency as reported (percentiles are bucket upper bounds, as the pool rounds).
fn server_latency(h: &LatencySnapshot) -> MemcachedLatency {
    let count = h.count();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut cumulative = 0;
    let buckets = h
        .buckets()
        .iter()
        .enumerate()
        .filter_map(|(i, &n)| {
            cumulative += n;
            let bound = LatencySnapshot::upper_bound(i).as_micros() as u64;
            POOL_BUCKETS.contains(&i).then_some([bound, cumulative])
        })
        .collect();
    MemcachedLatency {
        count,
        p50_us: (count > 0).then(|| us(h.percentile(50.0))),
        p99_us: (count > 0).then(|| us(h.percentile(99.0))),
        buckets,
    }
}

fn parse_mode(s: &str) -> Result<Mode, ControlError> {
    s.trim()
        .parse::<Mode>()
        .map_err(|_| ControlError::BadMode(s.to_string()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::timed::Timed;
    use flashtier_engine::{format, BackingIdentity, FormatOptions, PARAMS};
    use flashtier_memcached::{Pool, PoolOptions};
    use flashtier_ram::RamPolicy;
    use flashtier_testkit::MemDev;

    /// A controller over a write-back cache on memory devices (1 MiB segments, 16 MiB cache,
    /// 8 MiB backing), and the timed device clients would use.
    pub(crate) fn cached(persist: Option<PersistFn>) -> (Arc<Controller>, Arc<Timed>) {
        cached_on(Arc::new(MemDev::new(8 << 20)), persist)
    }

    fn cached_on(
        backing: Arc<dyn BlockDev>,
        persist: Option<PersistFn>,
    ) -> (Arc<Controller>, Arc<Timed>) {
        cached_with(Arc::new(MemDev::new(16 << 20)), backing, persist)
    }

    /// [`cached_on`] with the cache on `dev`.
    /// A cache formatted on `dev` (1 MiB segments) for an 8 MiB `backing`, opened.
    fn test_cache(dev: Arc<dyn BlockDev>, backing: Arc<dyn BlockDev>) -> Arc<Cache> {
        let ident = BackingIdentity {
            size: 8 << 20,
            name: "test-backing".into(),
            fingerprint: Vec::new(),
        };
        let opts = FormatOptions {
            segment_size: 1 << 20,
            ..Default::default()
        };
        format(&*dev, ident.clone(), opts).unwrap();
        Arc::new(Cache::open(dev, backing, &ident, None).unwrap())
    }

    fn cached_with(
        dev: Arc<dyn BlockDev>,
        backing: Arc<dyn BlockDev>,
        persist: Option<PersistFn>,
    ) -> (Arc<Controller>, Arc<Timed>) {
        controller(Some(test_cache(dev, backing)), persist)
    }

    pub(crate) fn passthrough() -> (Arc<Controller>, Arc<Timed>) {
        controller(None, None)
    }

    /// A memcached tier in inclusive mode over an 8 MiB memory backing store, with an empty
    /// pool whose requests may take 200 ms (a loaded test machine, a real server).
    pub(crate) fn tier() -> Arc<MemcachedTier> {
        let opts = PoolOptions {
            timeout: Duration::from_millis(200),
            backoff_min: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            ..PoolOptions::default()
        };
        let pool = Arc::new(Pool::new(&[], opts).unwrap());
        let backing = Arc::new(MemDev::new(8 << 20));
        Arc::new(MemcachedTier::new(backing, pool, 1, MemcachedMode::Inclusive).unwrap())
    }

    /// A controller over a memcached tier ([`tier`]) without a cache, the device clients use,
    /// and the tier.
    pub(crate) fn memcached_only() -> (Arc<Controller>, Arc<Timed>, Arc<MemcachedTier>) {
        let t = tier();
        let (c, dev) = controller_with(None, None, Some(t.clone()));
        (c, dev, t)
    }

    /// A write-back cache (as [`cached`]) over a memcached tier over the backing store, as
    /// `serve --cache --memcached` stacks them.
    fn memcached_under_cache(
        persist: Option<PersistFn>,
    ) -> (Arc<Controller>, Arc<Timed>, Arc<MemcachedTier>) {
        let t = tier();
        let dev = Arc::new(MemDev::new(16 << 20));
        let cache = test_cache(dev, t.clone());
        let (c, timed) = controller_with(Some(cache), persist, Some(t.clone()));
        (c, timed, t)
    }

    fn controller(
        cache: Option<Arc<Cache>>,
        persist: Option<PersistFn>,
    ) -> (Arc<Controller>, Arc<Timed>) {
        controller_with(cache, persist, None)
    }

    /// Clients reach the cache if there is one, else the memcached tier, else an 8 MiB backing
    /// store.
    fn controller_with(
        cache: Option<Arc<Cache>>,
        persist: Option<PersistFn>,
        memcached: Option<Arc<MemcachedTier>>,
    ) -> (Arc<Controller>, Arc<Timed>) {
        controller_stacked(cache, persist, memcached, None)
    }

    /// A RAM tier of `bytes` evicting in `policy` order over an 8 MiB memory backing store,
    /// without a cache.
    pub(crate) fn ram_tier(bytes: u64, policy: RamPolicy) -> Arc<RamTier> {
        Arc::new(RamTier::new(
            Arc::new(MemDev::new(8 << 20)),
            bytes,
            policy,
            None,
        ))
    }

    /// A controller over a RAM tier ([`ram_tier`]) without a cache, the device clients use, and
    /// the tier.
    pub(crate) fn ram_only(
        bytes: u64,
        policy: RamPolicy,
    ) -> (Arc<Controller>, Arc<Timed>, Arc<RamTier>) {
        let t = ram_tier(bytes, policy);
        let (c, dev) = controller_stacked(None, None, None, Some(t.clone()));
        (c, dev, t)
    }

    /// [`controller_with`] with a RAM tier, which clients then reach first (it sits on the rest
    /// already).
    fn controller_stacked(
        cache: Option<Arc<Cache>>,
        persist: Option<PersistFn>,
        memcached: Option<Arc<MemcachedTier>>,
        ram: Option<Arc<RamTier>>,
    ) -> (Arc<Controller>, Arc<Timed>) {
        let inner: Arc<dyn BlockDev> = match (&ram, &cache, &memcached) {
            (Some(r), _, _) => r.clone(),
            (None, Some(c), _) => c.clone(),
            (None, None, Some(t)) => t.clone(),
            (None, None, None) => Arc::new(MemDev::new(8 << 20)),
        };
        let timed = Arc::new(Timed::new(inner));
        let c = Controller::new(ControllerOptions {
            version: "1.2.3 (git test)".into(),
            dev: timed.clone(),
            cache,
            latencies: timed.latencies(),
            tracer: timed.tracer(),
            working_set: timed.working_set(),
            endurance_tbw: Some(600.0),
            persist,
            detach: None,
            memcached,
            ram,
        });
        (Arc::new(c), timed)
    }

    /// A write-back cache (as [`cached`]) served through a [`Switchable`], so it can be detached
    /// and attached; `attach --cache spare` opens `spare` (a 16 MiB memory device). Returns the
    /// backing store too.
    fn detachable(spare: Arc<MemDev>) -> (Arc<Controller>, Arc<Timed>, Arc<MemDev>) {
        let backing = Arc::new(MemDev::new(8 << 20));
        let ident = BackingIdentity {
            size: 8 << 20,
            name: "test-backing".into(),
            fingerprint: Vec::new(),
        };
        let dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(16 << 20));
        let opts = FormatOptions {
            segment_size: 1 << 20,
            ..Default::default()
        };
        format(&*dev, ident.clone(), opts).unwrap();
        let cache = Arc::new(Cache::open(dev, backing.clone(), &ident, None).unwrap());
        // As serve does with its [policy].
        cache.set_param("promotion", "nhit").unwrap();
        let export = Arc::new(Switchable::new(cache.clone()));
        let timed = Arc::new(Timed::new(export.clone()));
        let c = Controller::new(ControllerOptions {
            version: "1.2.3 (git test)".into(),
            dev: timed.clone(),
            cache: Some(cache),
            latencies: timed.latencies(),
            tracer: timed.tracer(),
            working_set: timed.working_set(),
            endurance_tbw: None,
            persist: None,
            detach: Some(DetachOptions {
                export,
                backing: backing.clone(),
                identity: ident,
                open_device: Box::new(move |name: &str| match name {
                    "spare" => Ok(spare.clone() as Arc<dyn BlockDev>),
                    _ => Err(format!("no device {name}").into()),
                }),
                policy: vec![("promotion".into(), "nhit".into())],
                mode: None,
                victim_sink: None,
            }),
            memcached: None,
            ram: None,
        });
        (Arc::new(c), timed, backing)
    }

    fn engine_counter(r: &Report, name: &str) -> u64 {
        *r.counters.get(name).unwrap()
    }

    /// Detach writes everything back and serves the backing store; the engine counters, the
    /// windows and the total keep growing across detach and attach (the released cache's are an
    /// offset), commands needing a cache say it is detached, and attach brings back an empty
    /// cache with the server's and the detached cache's parameters.
    #[test]
    fn detach_and_attach_keep_the_counters_monotonic() {
        let spare = Arc::new(MemDev::new(16 << 20));
        let (c, dev, backing) = detachable(spare.clone());
        c.set("sequential_cutoff_read_kib", "0", false).unwrap();
        dev.write_at(&[3u8; 64 << 10], 0, false).unwrap();
        c.tick();
        let before = c.report();
        assert_eq!(before.status.cache_state, "attached");
        assert_eq!(engine_counter(&before, "writes"), 1);
        let e = c.attach(None, None, false).unwrap_err();
        assert!(matches!(e, ControlError::Attached), "{e}");

        assert_eq!(c.start_detach(false).unwrap(), 16);
        let j = wait_job(&c);
        assert_eq!((j.kind.as_str(), j.error), ("detach", None));
        assert_eq!((j.from.as_str(), j.to.as_str()), ("writeback", "detached"));
        let mut out = vec![0u8; 64 << 10];
        backing.read_at(&mut out, 0).unwrap();
        assert!(out.iter().all(|&b| b == 3), "not written back");
        let r = c.report();
        assert_eq!(
            (r.status.cache, r.status.cache_state.as_str()),
            (false, "detached")
        );
        assert!(
            r.render_status().contains("detached"),
            "{}",
            r.render_status()
        );
        assert_eq!(r.status.mode, None);
        let cleaned = engine_counter(&r, "cleaned_blocks");
        assert!(cleaned >= 16, "{cleaned}");
        assert_eq!(engine_counter(&r, "writes"), 1, "kept after release");
        for e in [
            c.get("promotion").unwrap_err(),
            c.set("promotion", "nhit", false).unwrap_err(),
            c.start_flush().unwrap_err(),
            c.start_mode_switch("writeback").unwrap_err(),
            c.params().unwrap_err(),
            c.start_detach(false).unwrap_err(),
        ] {
            assert!(
                e.to_string()
                    .contains("the cache is detached; `flashtier attach` brings it back"),
                "{e}"
            );
        }

        // Served directly: a write reaches the backing store, the engine counts nothing.
        dev.write_at(&[4u8; 4096], 0, false).unwrap();
        backing.read_at(&mut out[..4096], 0).unwrap();
        assert_eq!(out[0], 4);
        c.tick();
        let r = c.report();
        assert_eq!(engine_counter(&r, "writes"), 1);
        assert_eq!(r.counters.get("client_writes"), Some(&2));

        // Attach: empty, with the detached cache's mode and parameters (the server's policy,
        // and what was set live).
        let a = c.attach(None, None, false).unwrap();
        assert_eq!(a.mode, "writeback");
        let r = c.report();
        assert_eq!(r.status.cache_state, "attached");
        assert_eq!(r.status.cache_status.as_ref().unwrap().cached_blocks, 0);
        assert_eq!(c.get("promotion").unwrap(), "nhit");
        assert_eq!(c.get("sequential_cutoff_read_kib").unwrap(), "0");
        let mut got = vec![0u8; 8192];
        dev.read_at(&mut got, 0).unwrap();
        assert!(
            got[..4096].iter().all(|&b| b == 4),
            "stale data after attach"
        );
        assert!(got[4096..].iter().all(|&b| b == 3));
        dev.write_at(&[5u8; 4096], 0, false).unwrap();
        c.tick();
        let r = c.report();
        assert_eq!(engine_counter(&r, "writes"), 2, "offset + the new cache's");
        assert!(engine_counter(&r, "cleaned_blocks") >= cleaned);
        let w = r.windows.get("5min").unwrap();
        assert_eq!(w.get("writes"), Some(&2), "windows see no step back");
        assert_eq!(r.windows.get("total").unwrap().get("writes"), Some(&2));
        for (name, v) in before.counters.iter() {
            assert!(r.counters.get(name).unwrap() >= v, "{name} went back");
        }
        let e = c.attach(Some("spare"), None, false).unwrap_err();
        assert!(matches!(e, ControlError::Attached), "{e}");
        assert!(c.take_cache().is_some());
    }

    /// A client writing all the time while the cache is detached and attached again: every
    /// write succeeds, and each block ends up with what was last written to it on the backing
    /// store (none lost in the released cache). The forced detach may drop writes, but every
    /// block is written again after it.
    #[test]
    fn writes_in_flight_survive_detach_and_attach() {
        let (c, dev, backing) = detachable(Arc::new(MemDev::new(16 << 20)));
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let ended = Arc::new(AtomicBool::new(false));
        // Waits until the writer has written every block twice more.
        let progress = || {
            let from = done.load(Ordering::Acquire);
            while done.load(Ordering::Acquire) < from + 128 {
                assert!(
                    !ended.load(Ordering::Acquire),
                    "the writer stopped: a write failed"
                );
                std::thread::yield_now();
            }
        };
        /// Tells the test the writer ended, even by a panic.
        struct Ended(Arc<AtomicBool>);
        impl Drop for Ended {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let writer = {
            let (dev, stop, done) = (dev.clone(), stop.clone(), done.clone());
            let ended = Ended(ended.clone());
            std::thread::spawn(move || {
                let _ended = ended;
                let mut last = vec![0u8; 64];
                let mut k = 0u64;
                while !stop.load(Ordering::Acquire) || k < 1000 {
                    let (block, byte) = ((k % 64) as usize, (k / 64 % 250 + 1) as u8);
                    dev.write_at(&[byte; 4096], block as u64 * 4096, false)
                        .unwrap_or_else(|e| panic!("write {k} failed: {e}"));
                    last[block] = byte;
                    k += 1;
                    done.store(k, Ordering::Release);
                }
                last
            })
        };
        for force in [false, true] {
            progress();
            c.start_detach(force).unwrap();
            assert_eq!(wait_job(&c).error, None);
            progress();
            c.attach(None, None, false).unwrap();
        }
        progress();
        c.start_detach(false).unwrap();
        assert_eq!(wait_job(&c).error, None);
        progress();
        stop.store(true, Ordering::Release);
        let last = writer.join().unwrap();
        let mut got = [0u8; 4096];
        for (block, &byte) in last.iter().enumerate() {
            backing.read_at(&mut got, block as u64 * 4096).unwrap();
            assert!(got.iter().all(|&b| b == byte), "block {block} lost a write");
        }
    }

    /// `--force` discards dirty data; attaching another device refuses one holding a foreign
    /// cache unless forced, and formats it empty.
    #[test]
    fn forced_detach_discards_and_attach_checks_the_device() {
        let spare = Arc::new(MemDev::new(16 << 20));
        let ident = BackingIdentity {
            size: 8 << 20,
            name: "another-backing".into(),
            fingerprint: Vec::new(),
        };
        let opts = FormatOptions {
            segment_size: 1 << 20,
            ..Default::default()
        };
        format(&*spare, ident, opts).unwrap();
        let (c, dev, backing) = detachable(spare.clone());
        dev.write_at(&[3u8; 8192], 0, false).unwrap();
        assert_eq!(c.start_detach(true).unwrap(), 2);
        let j = wait_job(&c);
        assert_eq!(j.error, None);
        assert!(j.what.contains("discarded"), "{}", j.what);
        let mut out = vec![0u8; 8192];
        backing.read_at(&mut out, 0).unwrap();
        assert!(
            out.iter().all(|&b| b == 0),
            "discarded data reached the backing store"
        );
        dev.read_at(&mut out, 0).unwrap();
        assert!(out.iter().all(|&b| b == 0));

        let e = c.attach(Some("nowhere"), None, false).unwrap_err();
        assert!(e.to_string().contains("no device nowhere"), "{e}");
        let e = c.attach(Some("spare"), None, false).unwrap_err();
        assert!(matches!(e, ControlError::ForeignCache { .. }), "{e}");
        assert!(e.to_string().contains("another-backing"), "{e}");
        assert_eq!(c.report().status.cache_state, "detached");
        let a = c.attach(Some("spare"), Some("wt"), true).unwrap();
        assert_eq!(a.mode, "writethrough");
        let sb = read_superblock(&*spare).unwrap();
        assert_eq!(sb.backing.name, "test-backing");
        dev.write_at(&[6u8; 4096], 0, false).unwrap();
        backing.read_at(&mut out[..4096], 0).unwrap();
        assert_eq!(out[0], 6, "write-through reaches the backing store");
        c.take_cache().unwrap().close().unwrap();
    }

    #[test]
    fn detach_and_attach_need_a_detachable_server() {
        let (c, _) = cached(None);
        assert!(matches!(
            c.start_detach(false).unwrap_err(),
            ControlError::NotDetachable
        ));
        let (c, _) = passthrough();
        assert!(matches!(
            c.attach(None, None, false).unwrap_err(),
            ControlError::NotDetachable
        ));
    }

    pub(crate) fn wait_job(c: &Controller) -> JobReport {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let j = c.report().job.expect("a job");
            if j.done {
                return j;
            }
            assert!(Instant::now() < deadline, "the job did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn report_counts_since_reset_and_engine_counters_stay_monotonic() {
        let (c, dev) = cached(None);
        let buf = vec![7u8; 64 << 10];
        dev.write_at(&buf, 0, false).unwrap();
        let mut out = vec![0u8; 64 << 10];
        dev.read_at(&mut out, 0).unwrap();
        let r = c.report();
        assert_eq!(r.counters.get("writes"), Some(&1));
        assert_eq!(r.counters.get("client_write_bytes"), Some(&(64 << 10)));
        assert_eq!(r.status.mode.as_deref(), Some("writeback"));
        assert_eq!(r.status.health, "ok");
        assert_eq!(r.status.cache_status.as_ref().unwrap().dirty_blocks, 16);
        assert_eq!(r.derived.read_hit_pct, Some(100.0));
        assert_eq!(r.latency.get("write").unwrap().count, 1);
        assert!(r.wear.cache_bytes_written > 0);
        assert_eq!(
            r.windows.get("total").unwrap().get("writes"),
            Some(&1),
            "windows have every counter"
        );
        assert_eq!(r.params.0.len(), PARAMS.len());

        c.reset_stats();
        let r = c.report();
        assert_eq!(r.counters.get("writes"), Some(&0));
        assert_eq!(r.latency.get("write").unwrap().count, 0);
        assert_eq!(r.windows.get("5min").unwrap().get("writes"), Some(&0));
        assert!(r.wear.cache_bytes_written > 0, "wear is not reset");
        dev.write_at(&buf, 0, false).unwrap();
        assert_eq!(c.report().counters.get("writes"), Some(&1));
        assert!(c.cache().unwrap().stats().writes >= 2, "engine unchanged");
    }

    /// While the backing store fails writes, health is `degraded: <reason>` in the report, the
    /// stats file and Prometheus (with `flashtier_backing_degraded 1`); a successful write-back
    /// after the fault clears makes it `ok` again.
    #[test]
    fn a_failing_backing_store_shows_as_degraded() {
        use flashtier_testkit::{Fault, FaultDev};
        let backing = Arc::new(FaultDev::new(Arc::new(MemDev::new(8 << 20))));
        let (c, dev) = cached_on(backing.clone(), None);
        dev.write_at(&[7u8; 64 << 10], 0, false).unwrap();
        backing.add(Fault::FailWritesFrom(1));
        let cache = c.cache().unwrap();
        assert!(cache.write_back_all().is_err());
        let r = c.report();
        assert!(
            r.status
                .health
                .starts_with("degraded: backing store write failed"),
            "{}",
            r.status.health
        );
        assert!(r.to_stats_text().contains("\nhealth degraded: "));
        let prom = r.to_prometheus();
        assert!(prom.contains("\nflashtier_backing_degraded 1\n"), "{prom}");
        assert!(prom.contains("\nflashtier_healthy 0\n"), "{prom}");
        assert_eq!(r.status.cache_status.as_ref().unwrap().dirty_blocks, 16);

        backing.clear();
        assert_eq!(cache.write_back_all().unwrap(), 16);
        let r = c.report();
        assert_eq!(r.status.health, "ok");
        let prom = r.to_prometheus();
        assert!(prom.contains("\nflashtier_backing_degraded 0\n"), "{prom}");
        assert!(prom.contains("\nflashtier_healthy 1\n"), "{prom}");
    }

    /// A dirty block damaged on the cache device: the scrub finds it, the report, the stats
    /// text and Prometheus show it, reads of it fail, and `forget-lost` clears it.
    #[test]
    fn a_scrub_reports_a_damaged_dirty_block_until_it_is_forgotten() {
        let cache_dev = Arc::new(MemDev::new(16 << 20));
        let (c, dev) = cached_with(cache_dev.clone(), Arc::new(MemDev::new(8 << 20)), None);
        let data = [0xa7u8; 4096];
        dev.write_at(&data, 8192, true).unwrap();
        // Find the block on the cache device by its content and flip one byte of it.
        let mut block = [0u8; 4096];
        let slot = (0..(16u64 << 20) / 4096)
            .map(|i| i * 4096)
            .find(|&off| {
                cache_dev.read_at(&mut block, off).unwrap();
                block == data
            })
            .expect("the block on the cache device");
        cache_dev.read_at(&mut block[..1], slot + 100).unwrap();
        block[0] ^= 0x01;
        cache_dev.write_at(&block[..1], slot + 100, false).unwrap();

        c.start_scrub(None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let scrub = loop {
            let s = c.report().scrub.expect("a scrub");
            if s.done {
                break s;
            }
            assert!(Instant::now() < deadline, "the scrub did not finish");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!((scrub.lost_blocks, &scrub.error), (1, &None));
        assert!(scrub.checked_blocks >= 1 && !scrub.cancelled, "{scrub:?}");
        let r = c.report();
        let cs = r.status.cache_status.as_ref().unwrap();
        assert_eq!((cs.lost_blocks, &cs.lost_ranges[..]), (1, &[[2, 1]][..]));
        assert!(
            r.status.health.starts_with("degraded: 1 block(s) lost"),
            "{}",
            r.status.health
        );
        assert!(r.render_status().contains("offset 8192 (block 2)"));
        assert!(r.to_stats_text().contains("\nlost_blocks 1\n"));
        let prom = r.to_prometheus();
        for line in [
            "flashtier_lost_blocks 1",
            "flashtier_integrity_degraded 1",
            "flashtier_backing_degraded 0",
            "flashtier_healthy 0",
        ] {
            assert!(prom.contains(&format!("\n{line}\n")), "{line}: {prom}");
        }
        let e = dev.read_at(&mut block, 8192).unwrap_err();
        assert!(
            e.get_ref()
                .is_some_and(|e| e.is::<flashtier_engine::IntegrityError>()),
            "{e}"
        );

        // Only the range named is forgotten; a range elsewhere forgets nothing.
        assert_eq!(c.forget_lost(Some(0), Some(8192)).unwrap(), 0);
        assert!(matches!(
            c.forget_lost(Some(8 << 20), None).unwrap_err(),
            ControlError::OutOfRange { .. }
        ));
        assert_eq!(c.forget_lost(Some(8192 + 100), None).unwrap(), 1);
        let r = c.report();
        assert_eq!(r.status.health, "ok");
        assert!(r.to_prometheus().contains("\nflashtier_lost_blocks 0\n"));
        dev.read_at(&mut block, 8192).unwrap();
        assert_eq!(block, [0u8; 4096], "the backing store's older data");
        c.take_cache().unwrap().close().unwrap();
    }

    #[test]
    fn health_names_the_worst_first_and_every_reason() {
        assert_eq!(health(false, None, None), "ok");
        assert_eq!(health(false, None, Some("EIO")), "degraded: EIO");
        assert_eq!(health(false, Some("1 lost"), None), "degraded: 1 lost");
        assert_eq!(
            health(false, Some("1 lost"), Some("EIO")),
            "degraded: 1 lost; EIO"
        );
        assert!(health(true, Some("1 lost"), Some("EIO")).starts_with("failed: "));
    }

    #[test]
    fn wear_forecast() {
        assert_eq!(
            forecast(1 << 30, 30, 0, Some(1.0)),
            (None, None),
            "too early"
        );
        // 1 TB a day against a 600 TB rating, 100 TB already written by us.
        let (rate, days) = forecast(500_000_000_000, 43_200, 100_000_000_000_000, Some(600.0));
        assert_eq!(rate, Some(1e12));
        assert_eq!(days, Some(500.0));
        assert_eq!(
            forecast(0, 3600, 0, Some(600.0)),
            (Some(0.0), None),
            "no writes"
        );
        assert_eq!(forecast(10, 3600, 0, None).1, None, "no rating");
    }

    #[test]
    fn write_amplification_sets_the_device_against_the_clients() {
        assert_eq!(amplification(4 << 30, 1 << 30, 3600), Some(4.0));
        assert_eq!(amplification(3 << 20, 2 << 20, 60), Some(1.5));
        assert_eq!(amplification(4 << 30, 1 << 30, 59), None, "too early");
        assert_eq!(
            amplification(1 << 20, 0, 3600),
            None,
            "promotions alone: no client write to set them against"
        );
    }

    #[test]
    fn set_validates_and_applies_live() {
        let (c, _) = cached(None);
        assert_eq!(
            c.set("sequential_cutoff_read_kib", "0", false).unwrap(),
            "0"
        );
        assert_eq!(c.get("sequential_cutoff_read_kib").unwrap(), "0");
        let e = c
            .set("sequential_cutoff_read_kib", "99999999", false)
            .unwrap_err();
        assert!(e.to_string().contains("0..=1048576"), "{e}");
        let e = c.set("no_such", "1", false).unwrap_err();
        assert!(e.to_string().contains("promotion_nhit"), "{e}");
        assert!(e.to_string().contains("mode, "), "{e}");
        let e = c.set("promotion", "nhit", true).unwrap_err();
        assert!(matches!(e, ControlError::NoConfig), "{e}");
        assert_eq!(c.get("promotion").unwrap(), "auto", "not applied");
        assert_eq!(c.params().unwrap()[0].name, "mode");
    }

    #[test]
    fn persist_writes_first_and_a_failure_changes_nothing() {
        let saved = Arc::new(Mutex::new(Vec::<(String, String)>::new()));
        let s = saved.clone();
        let (c, _) = cached(Some(Box::new(move |settings: &[(String, String)]| {
            if settings.iter().any(|(_, v)| v == "13") {
                return Err("disk full".into());
            }
            s.lock().extend(settings.iter().cloned());
            Ok(())
        })));
        c.set("promotion_nhit", " 5", true).unwrap();
        assert_eq!(c.get("promotion_nhit").unwrap(), "5");
        let e = c.set("promotion_nhit", "13", true).unwrap_err();
        assert!(e.to_string().contains("disk full"), "{e}");
        assert_eq!(c.get("promotion_nhit").unwrap(), "5");
        c.set("mode", "writethrough", true).unwrap();
        wait_job(&c);
        assert_eq!(
            *saved.lock(),
            vec![
                ("promotion_nhit".to_string(), "5".to_string()),
                ("mode".to_string(), "writethrough".to_string())
            ]
        );
    }

    #[test]
    fn related_values_change_together_or_not_at_all() {
        let saved = Arc::new(Mutex::new(Vec::<(String, String)>::new()));
        let s = saved.clone();
        let (c, _) = cached(Some(Box::new(move |settings: &[(String, String)]| {
            s.lock().extend(settings.iter().cloned());
            Ok(())
        })));
        let pair = |low: &str, high: &str| {
            vec![
                ("writeback_dirty_low_pct".to_string(), low.to_string()),
                ("writeback_dirty_high_pct".to_string(), high.to_string()),
            ]
        };
        let get = |n: &str| c.get(n).unwrap();
        // One at a time: refused naming both values, with the way out; nothing changes,
        // nothing is persisted.
        let e = c
            .set("writeback_dirty_low_pct", "80", true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct \
                        (70, the current value)"
            ) && e.contains("in one command"),
            "{e}"
        );
        let e = c.set_many(&pair("80", "10"), true).unwrap_err().to_string();
        assert!(
            e.contains("writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (10)"),
            "{e}"
        );
        assert_eq!(
            (
                get("writeback_dirty_low_pct"),
                get("writeback_dirty_high_pct")
            ),
            ("50".into(), "70".into())
        );
        assert!(saved.lock().is_empty(), "a refused change was persisted");
        // Both at once, in either order.
        let set = c.set_many(&pair("80", "90"), true).unwrap();
        assert_eq!(set, pair("80", "90"));
        assert_eq!(get("writeback_dirty_low_pct"), "80");
        assert_eq!(*saved.lock(), pair("80", "90"));
        let mut down = pair("10", "20");
        down.reverse();
        c.set_many(&down, false).unwrap();
        assert_eq!(
            (
                get("writeback_dirty_low_pct"),
                get("writeback_dirty_high_pct")
            ),
            ("10".into(), "20".into())
        );
        // A bad value anywhere refuses the lot.
        let mut bad = pair("5", "95");
        bad.push(("promotion_nhit".into(), "0".into()));
        assert!(c
            .set_many(&bad, false)
            .unwrap_err()
            .to_string()
            .contains("1..=255"));
        assert_eq!(get("writeback_dirty_low_pct"), "10");
        // mode is a job, not a setting.
        let mut with_mode = pair("5", "95");
        with_mode.push(("mode".into(), "writethrough".into()));
        assert!(matches!(
            c.set_many(&with_mode, false),
            Err(ControlError::ModeWithOthers)
        ));
    }

    /// Two clients at once, each change valid against the values it started from: low
    /// 10 -> 60 (below high 90) and high 90 -> 15 (above low 10). Together they would cross,
    /// so exactly one must win, every round. `set` is the path under test.
    fn race_watermarks(
        set: impl Fn(&str, &str) -> bool + Send + Sync + 'static,
        get: impl Fn(&str) -> u32,
    ) {
        const ROUNDS: u64 = 20_000;
        let set = Arc::new(set);
        // Spinning, not sleeping, so both changes start within a fraction of a microsecond
        // of each other and their checks overlap often.
        let go = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let other = {
            let (set, go) = (set.clone(), go.clone());
            std::thread::spawn(move || {
                for round in 1..=ROUNDS {
                    let mut spins = 0u32;
                    while go.load(Ordering::Acquire) < round {
                        // Spin while the other side is running; yield if it was descheduled
                        // (two cores shared with other work).
                        spins += 1;
                        if spins & 4095 == 0 {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    tx.send(set("writeback_dirty_high_pct", "15")).unwrap();
                }
            })
        };
        for round in 1..=ROUNDS {
            assert!(set("writeback_dirty_high_pct", "90"));
            assert!(set("writeback_dirty_low_pct", "10"));
            go.store(round, Ordering::Release);
            let low_ok = set("writeback_dirty_low_pct", "60");
            let high_ok = rx.recv().unwrap();
            let (low, high) = (
                get("writeback_dirty_low_pct"),
                get("writeback_dirty_high_pct"),
            );
            assert!(low < high, "round {round}: crossed: low {low}, high {high}");
            assert!(
                low_ok != high_ok,
                "round {round}: low set {low_ok}, high set {high_ok}"
            );
        }
        other.join().unwrap();
    }

    #[test]
    fn racing_watermark_changes_never_leave_them_crossed() {
        let (c, _) = cached(None);
        let (c2, c3) = (c.clone(), c.clone());
        race_watermarks(
            move |n, v| c2.set(n, v, false).is_ok(),
            move |n| c3.get(n).unwrap().parse().unwrap(),
        );
        // The engine's own guarantee, for callers other than the controller.
        let cache = c.cache().unwrap();
        let cache2 = cache.clone();
        race_watermarks(
            move |n, v| cache2.set_param(n, v).is_ok(),
            move |n| cache.get_param(n).unwrap().parse().unwrap(),
        );
    }

    #[test]
    fn a_change_saved_to_the_config_file_is_never_refused_after() {
        // While one client's change is being written to the config file, another changes the
        // value it was checked against: the second must wait, or the first would be saved and
        // then refused (the file and the cache disagreeing).
        let (tx, rx) = std::sync::mpsc::channel();
        let (c, _) = cached(Some(Box::new(move |_: &[(String, String)]| {
            let _ = tx.send(());
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })));
        let first = {
            let c = c.clone();
            std::thread::spawn(move || c.set("writeback_dirty_low_pct", "60", true))
        };
        rx.recv().unwrap();
        let second = c.set("writeback_dirty_high_pct", "55", false);
        let first = first.join().unwrap();
        assert!(first.is_ok(), "saved, then refused: {first:?}");
        assert!(second.is_err(), "{second:?}");
        assert_eq!(c.get("writeback_dirty_low_pct").unwrap(), "60");
        assert_eq!(c.get("writeback_dirty_high_pct").unwrap(), "70");
    }

    #[test]
    fn mode_switch_runs_in_the_background_and_writes_back() {
        let (c, dev) = cached(None);
        dev.write_at(&vec![1u8; 1 << 20], 0, false).unwrap();
        assert!(c.report().status.cache_status.unwrap().dirty_blocks > 0);
        assert!(c.start_mode_switch("bogus").is_err());
        assert_eq!(c.start_mode_switch("wt").unwrap(), "writethrough");
        let j = wait_job(&c);
        assert_eq!(j.error, None);
        assert_eq!(j.dirty_blocks_left, 0);
        assert_eq!(j.dirty_blocks_at_start, 256);
        assert_eq!(j.what, "mode writeback -> writethrough");
        assert_eq!(c.get("mode").unwrap(), "writethrough");
        assert!(!c.job_running());
    }

    /// A cache over a backing store whose every write takes 20 ms, with 20 scattered dirty
    /// blocks: writing them back takes 0.4 s.
    fn slow_with_dirty_blocks() -> (Arc<Controller>, Arc<Timed>) {
        let slow =
            flashtier_io::SlowDev::new(Arc::new(MemDev::new(8 << 20)), Duration::from_millis(20));
        let (c, dev) = cached_on(Arc::new(slow), None);
        for i in 0..20u64 {
            dev.write_at(&[9u8; 4096], i * 65536, false).unwrap();
        }
        (c, dev)
    }

    #[test]
    fn one_switch_at_a_time_with_progress() {
        let (c, _dev) = slow_with_dirty_blocks();
        c.start_mode_switch("writearound").unwrap();
        let e = c.start_mode_switch("writeback").unwrap_err();
        assert!(e.to_string().contains("writeback -> writearound"), "{e}");
        let j = c.report().job.unwrap();
        assert!(!j.done && j.dirty_blocks_left <= 20, "{j:?}");
        assert!(c.job_running());
        let j = wait_job(&c);
        assert_eq!((j.error, j.dirty_blocks_left), (None, 0));
        c.start_mode_switch("writeback").unwrap();
        assert_eq!(wait_job(&c).to, "writeback");
    }

    #[test]
    fn flush_runs_in_the_background_and_can_be_cancelled() {
        let (c, dev) = slow_with_dirty_blocks();
        let e = c.cancel_flush().unwrap_err();
        assert!(matches!(e, ControlError::NoFlush), "{e}");

        c.start_flush().unwrap();
        let e = c.start_flush().unwrap_err();
        assert!(e.to_string().contains("a flush is in progress"), "{e}");
        let e = c.start_mode_switch("writethrough").unwrap_err();
        assert!(e.to_string().contains("flush"), "{e}");
        let j = c.report().job.unwrap();
        assert_eq!((j.kind.as_str(), j.what.as_str()), ("flush", "flush"));
        assert_eq!((j.from.as_str(), j.to.as_str()), ("writeback", "writeback"));
        assert!(
            !j.done && !j.cancelled && j.dirty_blocks_at_start == 20,
            "{j:?}"
        );
        c.cancel_flush().unwrap();
        let j = wait_job(&c);
        assert!(j.cancelled && j.error.is_none(), "{j:?}");
        assert!(
            j.dirty_blocks_left > 0,
            "cancelled at once, yet all written: {j:?}"
        );
        assert_eq!(
            c.report().status.cache_status.unwrap().dirty_blocks,
            j.dirty_blocks_left
        );
        assert!(c.report().render_status().contains("cancelled"));

        c.start_flush().unwrap();
        let j = wait_job(&c);
        assert!(!j.cancelled && j.error.is_none(), "{j:?}");
        assert_eq!(j.dirty_blocks_left, 0);
        assert_eq!(c.report().status.cache_status.unwrap().dirty_blocks, 0);
        assert_eq!(
            c.get("mode").unwrap(),
            "writeback",
            "a flush keeps the mode"
        );

        // Only a flush can be cancelled.
        dev.write_at(&[9u8; 4096], 0, false).unwrap();
        c.start_mode_switch("writethrough").unwrap();
        if let Err(e) = c.cancel_flush() {
            assert!(
                matches!(e, ControlError::NotCancellable(_) | ControlError::NoFlush),
                "{e}"
            );
        }
        assert_eq!(wait_job(&c).error, None);
    }

    #[test]
    fn passthrough_reports_what_exists_and_refuses_the_rest() {
        let (c, dev) = passthrough();
        dev.flush().unwrap();
        let r = c.report();
        assert!(!r.status.cache);
        assert_eq!(r.status.mode, None);
        assert_eq!(r.latency.get("flush").unwrap().count, 1);
        assert_eq!(r.counters.get("client_flushes"), Some(&1));
        assert_eq!(r.wear.bytes_per_day, None);
        let json = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        for e in [
            c.get("mode").unwrap_err(),
            c.set("promotion", "nhit", false).unwrap_err(),
            c.start_mode_switch("writeback").unwrap_err(),
            c.start_flush().unwrap_err(),
            c.cancel_flush().unwrap_err(),
            c.params().unwrap_err(),
        ] {
            assert!(e.to_string().contains("no cache"), "{e}");
        }
    }

    fn mc(c: &Controller, req: MemcachedRequest) -> Result<MemcachedReport, ControlError> {
        c.memcached(req)
    }

    fn add(server: &str) -> MemcachedRequest {
        MemcachedRequest::Add {
            server: server.into(),
        }
    }

    fn remove(server: &str) -> MemcachedRequest {
        MemcachedRequest::Remove {
            server: server.into(),
        }
    }

    /// What `flashtier status` says on its `memcached` row.
    fn memcached_row(r: &Report) -> String {
        let status = r.render_status();
        let row = status.lines().find_map(|l| l.strip_prefix("memcached "));
        row.unwrap_or_else(|| panic!("no memcached row:\n{status}"))
            .trim()
            .to_string()
    }

    fn addrs(m: &MemcachedReport) -> Vec<&str> {
        m.servers.iter().map(|s| s.addr.as_str()).collect()
    }

    /// Without a tier, every memcached request and `memcached_mode` say how to get one, and
    /// nothing of memcached shows in the report.
    #[test]
    fn memcached_requests_without_a_tier_say_how_to_get_one() {
        for (c, _) in [cached(None), passthrough()] {
            for e in [
                mc(&c, MemcachedRequest::List).unwrap_err(),
                mc(&c, add("127.0.0.1:1")).unwrap_err(),
                c.get(MEMCACHED_MODE).unwrap_err(),
                c.set(MEMCACHED_MODE, "victim", false).unwrap_err(),
                c.set_many(&[(MEMCACHED_MODE.into(), "victim".into())], false)
                    .unwrap_err(),
            ] {
                assert!(matches!(e, ControlError::NoMemcached), "{e}");
                assert_eq!(
                    e.to_string(),
                    "this server has no memcached tier; start `flashtier serve` with \
                     --memcached HOST:PORT[,...]"
                );
            }
            let r = c.report();
            assert_eq!(r.memcached, None);
            assert!(r.params.get(MEMCACHED_MODE).is_none());
            assert!(!r.counters.iter().any(|(k, _)| k.starts_with("memcached")));
            assert!(!r.to_prometheus().contains("memcached"));
            assert!(!r.render_status().contains("memcached"));
        }
    }

    /// Servers are added and removed live; what the pool refuses comes back as its reason.
    #[test]
    fn memcached_servers_come_and_go_and_refusals_say_why() {
        let (c, _, t) = memcached_only();
        let m = mc(&c, MemcachedRequest::List).unwrap();
        assert!(
            m.enabled && m.mode == "inclusive" && m.servers.is_empty(),
            "{m:?}"
        );

        let m = mc(&c, add(" 127.0.0.1:1 ")).unwrap();
        assert_eq!(addrs(&m), ["127.0.0.1:1"]);
        let s = &m.servers[0];
        assert_eq!(
            (s.health.as_str(), s.down_secs, &s.last_error),
            ("up", None, &None)
        );
        assert_eq!(s.counters, MemcachedServerCounters::default());
        assert_eq!(t.pool().servers().len(), 1);

        let e = mc(&c, add("127.0.0.1:1")).unwrap_err().to_string();
        assert_eq!(
            e,
            "cannot add a memcached server: server 127.0.0.1:1 is already in the pool"
        );
        let e = mc(&c, add("no-port")).unwrap_err().to_string();
        assert!(
            e.starts_with("cannot add a memcached server: bad server address"),
            "{e}"
        );
        let e = mc(&c, remove("127.0.0.1:2")).unwrap_err().to_string();
        assert_eq!(
            e,
            "cannot remove a memcached server: server 127.0.0.1:2 is not in the pool"
        );

        mc(&c, add("127.0.0.1:2")).unwrap();
        let m = mc(&c, remove("127.0.0.1:1")).unwrap();
        assert_eq!(addrs(&m), ["127.0.0.1:2"]);
        // Through the control socket's handler: the answer is the report, as JSON.
        let v = crate::server::handle(&c, crate::protocol::Request::Memcached(add("127.0.0.1:1")))
            .unwrap();
        assert_eq!(v["servers"][1]["addr"], "127.0.0.1:1");
        assert_eq!(v["servers"][1]["health"], "up");
        assert_eq!(v["mode"], "inclusive");
    }

    /// `memcached_mode` is a live parameter without a cache; on and off switch the tier.
    #[test]
    fn memcached_mode_and_on_off_without_a_cache() {
        let (c, dev, t) = memcached_only();
        assert_eq!(c.get(MEMCACHED_MODE).unwrap(), "inclusive");
        assert_eq!(c.set(MEMCACHED_MODE, " victim ", false).unwrap(), "victim");
        assert_eq!(t.mode(), MemcachedMode::Victim);
        assert_eq!(c.get(MEMCACHED_MODE).unwrap(), "victim");
        let e = c.set(MEMCACHED_MODE, "lru", false).unwrap_err().to_string();
        assert!(
            e.contains("'lru'") && e.contains("inclusive | victim"),
            "{e}"
        );
        let e = c.set(MEMCACHED_MODE, "inclusive", true).unwrap_err();
        assert!(matches!(e, ControlError::MemcachedModePersist), "{e}");
        assert!(e.to_string().contains("[serve]"), "{e}");
        assert_eq!(t.mode(), MemcachedMode::Victim, "changed though refused");
        let m = mc(
            &c,
            MemcachedRequest::Mode {
                mode: "inclusive".into(),
            },
        )
        .unwrap();
        assert_eq!(
            (m.mode.as_str(), t.mode()),
            ("inclusive", MemcachedMode::Inclusive)
        );
        let e = mc(&c, MemcachedRequest::Mode { mode: "x".into() }).unwrap_err();
        assert!(matches!(e, ControlError::BadMemcachedMode(_)), "{e}");

        // The only parameter of a server without a cache; the cache's still need one.
        let rows = c.params().unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (
                rows[0].name.as_str(),
                rows[0].value.as_str(),
                rows[0].default.as_str()
            ),
            (MEMCACHED_MODE, "inclusive", "inclusive")
        );
        assert_eq!(rows[0].allowed, "inclusive | victim");
        assert!(matches!(
            c.get("promotion").unwrap_err(),
            ControlError::NoCache
        ));
        assert!(matches!(c.get("mode").unwrap_err(), ControlError::NoCache));
        assert_eq!(
            c.report().params.get(MEMCACHED_MODE).map(String::as_str),
            Some("inclusive")
        );

        assert!(!mc(&c, MemcachedRequest::Off).unwrap().enabled);
        assert!(!t.enabled());
        let before = t.stats().bypassed_requests;
        dev.read_at(&mut [0u8; 4096], 0).unwrap();
        assert_eq!(t.stats().bypassed_requests, before + 1);
        assert!(memcached_row(&c.report()).starts_with("inclusive, off, 0 servers"));
        assert!(mc(&c, MemcachedRequest::On).unwrap().enabled);
        assert!(t.enabled());
    }

    /// With a cache, `memcached_mode` joins the cache's parameters: listed last, changed with
    /// them all or nothing, never persisted; the mode of the cache is untouched.
    #[test]
    fn memcached_mode_beside_the_cache_parameters() {
        let saved = Arc::new(Mutex::new(Vec::<(String, String)>::new()));
        let s = saved.clone();
        let (c, _, t) =
            memcached_under_cache(Some(Box::new(move |settings: &[(String, String)]| {
                s.lock().extend(settings.iter().cloned());
                Ok(())
            })));
        let rows = c.params().unwrap();
        assert_eq!(rows.len(), PARAMS.len() + 2);
        assert_eq!(rows[0].name, "mode");
        assert_eq!(rows.last().unwrap().name, MEMCACHED_MODE);
        assert_eq!(c.report().params.0.len(), PARAMS.len() + 1);

        let pair = |nhit: &str, mode: &str| {
            vec![
                ("promotion_nhit".to_string(), nhit.to_string()),
                (MEMCACHED_MODE.to_string(), mode.to_string()),
            ]
        };
        assert_eq!(
            c.set_many(&pair("3", "victim"), false).unwrap(),
            pair("3", "victim")
        );
        assert_eq!(t.mode(), MemcachedMode::Victim);
        assert_eq!(c.get("promotion_nhit").unwrap(), "3");
        // A bad value anywhere changes nothing.
        assert!(c.set_many(&pair("0", "inclusive"), false).is_err());
        assert!(c.set_many(&pair("4", "bogus"), false).is_err());
        assert_eq!(
            (t.mode(), c.get("promotion_nhit").unwrap()),
            (MemcachedMode::Victim, "3".into())
        );
        // Never half persisted.
        let e = c.set_many(&pair("4", "inclusive"), true).unwrap_err();
        assert!(matches!(e, ControlError::MemcachedModePersist), "{e}");
        assert!(saved.lock().is_empty());
        assert_eq!(c.get("promotion_nhit").unwrap(), "3");
        // The cache's mode is another thing, and still goes alone.
        let mut with_mode = pair("4", "inclusive");
        with_mode[0] = ("mode".into(), "writethrough".into());
        assert!(matches!(
            c.set_many(&with_mode, false),
            Err(ControlError::ModeWithOthers)
        ));
        assert_eq!(c.get("mode").unwrap(), "writeback");
        let e = c.set("no_such", "1", false).unwrap_err().to_string();
        assert!(e.contains(MEMCACHED_MODE), "{e}");
        c.take_cache().unwrap().close().unwrap();
    }

    /// A pool whose server is down: lookups miss, the server shows down with its error in the
    /// report, the status, the stats text and Prometheus, and reset-stats zeroes the tier's,
    /// the pool's and the server's counters alike.
    #[test]
    fn a_down_memcached_server_shows_everywhere_and_resets_with_the_rest() {
        let (c, dev, t) = memcached_only();
        // Nothing listens on port 1: the connection is refused at once.
        mc(&c, add("127.0.0.1:1")).unwrap();
        let mut buf = vec![0u8; 4 << 12];
        dev.read_at(&mut buf, 0).unwrap();
        let r = c.report();
        let m = r.memcached.as_ref().unwrap();
        assert_eq!(
            (m.tier.lookup_blocks, m.tier.miss_blocks, m.tier.hit_blocks),
            (4, 4, 0)
        );
        assert_eq!(m.tier, MemcachedTierCounters::from_counters(&r.counters));
        assert_eq!(r.counters.get("memcached_lookup_blocks"), Some(&4));
        let s = &m.servers[0];
        assert_eq!(s.health, "down", "{s:?}");
        assert!(s.down_secs.is_some() && s.retry_in_secs.is_some(), "{s:?}");
        assert!(
            s.last_error.as_deref().is_some_and(|e| !e.is_empty()),
            "{s:?}"
        );
        assert!(s.counters.errors + s.counters.timeouts >= 1, "{s:?}");
        assert_eq!(
            m.pool,
            MemcachedServerCounters::pool_from_counters(&r.counters)
        );
        assert_eq!(m.pool.errors, s.counters.errors);
        assert_eq!(m.servers_up(), 0);

        assert_eq!(
            memcached_row(&r),
            "inclusive, on, 1 server (0 up, 1 down), hits 0 of 4 blocks looked up (0.0%), 0 \
             stale, 0 corrupt"
        );
        let status = r.render_status();
        assert!(status.contains("127.0.0.1:1 down "), "{status}");
        assert!(status.contains("last error: "), "{status}");
        let text = r.to_stats_text();
        for line in [
            "memcached_lookup_blocks 4",
            "memcached_miss_blocks 4",
            &format!("memcached_pool_errors {}", m.pool.errors),
            "memcached_enabled true",
            "memcached_mode inclusive",
            "memcached_servers 1",
            "memcached_servers_up 0",
            "memcached_hit_pct 0.00",
        ] {
            assert!(text.contains(&format!("\n{line}\n")), "{line}:\n{text}");
        }
        let table = r.render_table();
        assert!(table.contains("memcached hit %"), "{table}");
        assert!(table.contains("127.0.0.1:1"), "{table}");
        let prom = r.to_prometheus();
        for line in [
            "flashtier_memcached_lookup_blocks_total 4",
            "flashtier_memcached_enabled 1",
            "flashtier_memcached_hit_ratio 0",
            "flashtier_memcached_server_up{server=\"127.0.0.1:1\"} 0",
            &format!(
                "flashtier_memcached_server_errors_total{{server=\"127.0.0.1:1\"}} {}",
                s.counters.errors
            ),
            &format!("flashtier_memcached_pool_errors_total {}", m.pool.errors),
            "flashtier_memcached_server_duration_seconds_bucket{server=\"127.0.0.1:1\",le=\"+Inf\"} 0",
            "flashtier_param{name=\"memcached_mode\",value=\"inclusive\"} 1",
        ] {
            assert!(prom.contains(&format!("\n{line}\n")), "{line}:\n{prom}");
        }
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), r);

        c.reset_stats();
        let m = c.report().memcached.unwrap();
        assert_eq!(m.tier, MemcachedTierCounters::default());
        assert_eq!(m.pool, MemcachedServerCounters::default());
        assert_eq!(m.servers[0].counters, MemcachedServerCounters::default());
        // Removed and added again, a server counts from zero; the pool's totals go on.
        dev.read_at(&mut buf, 0).unwrap();
        mc(&c, remove("127.0.0.1:1")).unwrap();
        let m = mc(&c, add("127.0.0.1:1")).unwrap();
        assert_eq!(m.servers[0].counters, MemcachedServerCounters::default());
        assert_eq!(m.tier.lookup_blocks, 4);
        assert!(t.pool().totals().gets >= m.pool.gets);
    }

    /// What `flashtier status` says on its `working set` row.
    fn working_set_row(r: &Report) -> String {
        let status = r.render_status();
        let row = status.lines().find_map(|l| l.strip_prefix("working set "));
        row.unwrap_or_else(|| panic!("no working set row:\n{status}"))
            .trim()
            .to_string()
    }

    /// Reads and writes through the served device, with or without a cache, make the working
    /// set in the report (every window, as nothing is older than a minute), the status, the
    /// stats table and text and Prometheus; a cache's capacity is compared with it; trims do
    /// not count, repeats do not count again, and reset-stats starts it from nothing.
    #[test]
    fn the_working_set_shows_everywhere_and_resets_with_the_rest() {
        use crate::render::fmt_bytes;
        let (ram_c, ram_dev, _) = ram_only(1 << 20, RamPolicy::Lru);
        for (c, dev) in [passthrough(), cached(None), (ram_c, ram_dev)] {
            let r = c.report();
            let ws = r.working_set.as_ref().unwrap();
            assert_eq!(ws.block_size, 4096);
            assert!((ws.standard_error_pct - 1.625).abs() < 1e-9);
            let names: Vec<&str> = ws.windows.iter().map(|(n, _)| n).collect();
            assert_eq!(names, ["5min", "hour", "day", "total"]);
            assert!(ws
                .windows
                .iter()
                .all(|(_, w)| w.blocks == 0 && w.bytes == 0));

            // 2 MiB written, 4 MiB read over it (2 MiB new), read again, 1 MiB trimmed: 1,024
            // distinct blocks.
            dev.write_at(&vec![1u8; 2 << 20], 0, false).unwrap();
            let mut buf = vec![0u8; 4 << 20];
            dev.read_at(&mut buf, 0).unwrap();
            dev.read_at(&mut buf[..1 << 20], 1 << 20).unwrap();
            dev.trim(6 << 20, 1 << 20).unwrap();
            let r = c.report();
            let ws = r.working_set.as_ref().unwrap();
            for (name, w) in ws.windows.iter() {
                assert!(w.blocks.abs_diff(1024) <= 51, "{name}: {w:?}");
                assert_eq!(w.bytes, w.blocks * 4096, "{name}");
                assert_eq!(Some(&w.secs), r.window_secs.get(name), "{name}");
            }
            let hour = ws.windows.get("hour").unwrap();
            let row = working_set_row(&r);
            assert!(
                row.starts_with(&format!(
                    "5min {}, hour {}, day ",
                    fmt_bytes(hour.bytes),
                    fmt_bytes(hour.bytes)
                )) && row.contains("(estimated, standard error 1.6%)"),
                "{row}"
            );
            let capacities: Vec<(&str, u64)> = r
                .status
                .cache_status
                .iter()
                .map(|s| ("cache", s.capacity_blocks * s.block_size as u64))
                .chain(r.ram.iter().map(|r| ("ram", r.capacity_bytes)))
                .collect();
            for (name, capacity) in &capacities {
                let share = format!("; {name} {} = ", fmt_bytes(*capacity));
                assert!(row.contains(&share), "{row}");
            }
            assert_eq!(
                row.matches(" the hour's").count(),
                capacities.len(),
                "{row}"
            );
            assert!(r.render_table().contains("working set (est.)"));
            let text = r.to_stats_text();
            assert!(
                text.contains(&format!("\nworking_set_hour_bytes {}\n", hour.bytes)),
                "{text}"
            );
            assert!(text.contains(&format!(
                "\nworking_set_total_blocks {}\n",
                ws.windows.get("total").unwrap().blocks
            )));
            let prom = r.to_prometheus();
            crate::prometheus::tests::check_exposition(&prom);
            assert!(prom.contains("# TYPE flashtier_working_set_bytes gauge\n"));
            assert!(
                prom.contains(&format!(
                    "\nflashtier_working_set_bytes{{window=\"hour\"}} {}\n",
                    hour.bytes
                )),
                "{prom}"
            );

            c.tick();
            c.reset_stats();
            let r = c.report();
            let ws = r.working_set.as_ref().unwrap();
            assert!(ws.windows.iter().all(|(_, w)| w.blocks == 0), "{ws:?}");
            assert!(working_set_row(&r).starts_with("5min 0 B, hour 0 B, day 0 B"));
            dev.read_at(&mut buf[..16 << 12], 0).unwrap();
            let total = c
                .report()
                .working_set
                .unwrap()
                .windows
                .get("total")
                .unwrap()
                .blocks;
            assert!(total.abs_diff(16) <= 1, "{total}");
        }
    }

    /// What `flashtier status` says on its `ram` row.
    fn ram_row(r: &Report) -> String {
        let status = r.render_status();
        let row = status.lines().find_map(|l| l.strip_prefix("ram "));
        row.unwrap_or_else(|| panic!("no ram row:\n{status}"))
            .trim()
            .to_string()
    }

    /// Without a RAM tier, nothing of it shows in the report or any rendering of it.
    #[test]
    fn without_a_ram_tier_nothing_of_it_shows() {
        for (c, _) in [cached(None), passthrough()] {
            let r = c.report();
            assert_eq!(r.ram, None);
            assert!(!r.counters.iter().any(|(k, _)| k.starts_with("ram_")));
            assert!(!r.to_prometheus().contains("flashtier_ram_"));
            assert!(!r.render_status().lines().any(|l| l.starts_with("ram ")));
            assert!(!r.render_table().contains("ram"));
            assert!(!r.to_stats_text().contains("\nram_"));
        }
        let (c, ..) = memcached_only();
        assert_eq!(c.report().ram, None);
    }

    /// A RAM tier of 64 blocks over a memory backing store: reads through it show as the
    /// `ram_*` counters and the `ram` section in the report, the status, the stats table and
    /// text and Prometheus; reset-stats zeroes the counters and leaves the sizes.
    #[test]
    fn a_ram_tier_shows_everywhere_and_resets_with_the_rest() {
        let (c, dev, t) = ram_only(256 << 10, RamPolicy::Lru);
        let r = c.report();
        let ram = r.ram.as_ref().unwrap();
        assert_eq!(ram.counters, RamCounters::default());
        assert_eq!((ram.used_bytes, ram.hit_pct), (0, None));
        assert!(
            ram_row(&r).ends_with("no blocks looked up yet, 0 evicted"),
            "{r:?}"
        );

        let mut buf = vec![0u8; 16 << 12];
        dev.read_at(&mut buf, 0).unwrap(); // 16 misses, kept
        dev.read_at(&mut buf, 0).unwrap(); // 16 hits
        dev.read_at(&mut [0u8; 512], 0).unwrap(); // not a whole block: bypassed
        dev.write_at(&[7u8; 4096], 0, false).unwrap(); // block 0 held: updated
        dev.trim(4096, 4096).unwrap(); // block 1 held: invalidated
        c.tick();
        let r = c.report();
        let ram = r.ram.as_ref().unwrap();
        let expected = RamCounters {
            lookup_blocks: 32,
            hit_blocks: 16,
            miss_blocks: 16,
            inserted_blocks: 16,
            evicted_blocks: 0,
            invalidated_blocks: 1,
            updated_blocks: 1,
            reread_requests: 0,
            bypassed_requests: 1,
        };
        assert_eq!(ram.counters, expected);
        assert_eq!(RamCounters::from_counters(&r.counters), expected);
        assert_eq!(ram_counters(&t.stats()), expected);
        for (name, v) in RamCounters::NAMES.into_iter().zip(expected.values()) {
            assert_eq!(r.counters.get(name), Some(&v), "{name}");
            let total = r.windows.get("total").unwrap();
            assert_eq!(total.get(name), Some(&v), "{name} in the total window");
        }
        let stats = t.stats();
        assert_eq!(ram.policy, "lru");
        assert_eq!(ram.capacity_bytes, 256 << 10);
        assert_eq!(ram.used_bytes, 15 << 12);
        assert_eq!(ram.memory_bytes, stats.memory_bytes);
        assert!(ram.memory_bytes > ram.capacity_bytes, "{ram:?}");
        assert_eq!(ram.hit_pct, Some(50.0));

        let memory = crate::render::fmt_bytes(ram.memory_bytes);
        assert_eq!(
            ram_row(&r),
            format!(
                "lru, 60.00 KiB of 256.00 KiB held, {memory} of memory, hits 16 of 32 blocks \
                 looked up (50.0%), 0 evicted"
            )
        );
        let table = r.render_table();
        assert!(table.contains("ram hit %"), "{table}");
        assert!(
            table.contains("\nram: lru, 60.00 KiB of 256.00 KiB held"),
            "{table}"
        );
        let text = r.to_stats_text();
        for line in [
            "ram_lookup_blocks 32",
            "ram_hit_blocks 16",
            "ram_invalidated_blocks 1",
            "ram_updated_blocks 1",
            "ram_bypassed_requests 1",
            "ram_policy lru",
            "ram_capacity_bytes 262144",
            "ram_used_bytes 61440",
            &format!("ram_memory_bytes {}", ram.memory_bytes),
            "ram_hit_pct 50.00",
        ] {
            assert!(text.contains(&format!("\n{line}\n")), "{line}:\n{text}");
        }
        let prom = r.to_prometheus();
        for line in [
            "flashtier_ram_lookup_blocks_total 32",
            "flashtier_ram_hit_blocks_total 16",
            "flashtier_ram_miss_blocks_total 16",
            "flashtier_ram_reread_requests_total 0",
            "flashtier_ram_capacity_bytes 262144",
            "flashtier_ram_used_bytes 61440",
            &format!("flashtier_ram_memory_bytes {}", ram.memory_bytes),
            "flashtier_ram_hit_ratio 0.5",
            "# TYPE flashtier_ram_evicted_blocks_total counter",
            "# TYPE flashtier_ram_used_bytes gauge",
        ] {
            assert!(prom.contains(&format!("\n{line}\n")), "{line}:\n{prom}");
        }
        crate::prometheus::tests::check_exposition(&prom);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), r);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["ram"]["policy"], "lru");
        assert_eq!(v["ram"]["hit_pct"], 50.0);
        assert_eq!(v["counters"]["ram_hit_blocks"], 16);

        // 256 more blocks through 64 slots: the tier fills and evicts; what it holds is what it
        // kept less what it evicted and what writes dropped.
        let mut big = vec![0u8; 1 << 20];
        dev.read_at(&mut big, 1 << 20).unwrap();
        let ram = c.report().ram.unwrap();
        let k = &ram.counters;
        assert_eq!((k.lookup_blocks, k.miss_blocks), (288, 272));
        assert_eq!(ram.used_bytes, ram.capacity_bytes);
        assert!(k.evicted_blocks > 0, "{k:?}");
        assert_eq!(
            k.inserted_blocks - k.evicted_blocks - k.invalidated_blocks,
            ram.used_bytes / 4096,
            "{k:?}"
        );

        c.reset_stats();
        let r = c.report();
        let after = r.ram.as_ref().unwrap();
        assert_eq!(after.counters, RamCounters::default());
        assert_eq!(after.hit_pct, None);
        assert!(RamCounters::NAMES
            .iter()
            .all(|n| r.counters.get(n) == Some(&0)));
        assert_eq!(
            (after.capacity_bytes, after.used_bytes, after.memory_bytes),
            (ram.capacity_bytes, ram.used_bytes, ram.memory_bytes),
            "reset-stats left the sizes"
        );
        assert!(r.to_stats_text().contains("\nram_hit_pct -\n"));
        // The last block read is held: a hit, counted from zero.
        dev.read_at(&mut [0u8; 4096], (2 << 20) - 4096).unwrap();
        let after = c.report().ram.unwrap();
        assert_eq!(
            (after.counters.lookup_blocks, after.counters.hit_blocks),
            (1, 1)
        );
        assert_eq!(after.hit_pct, Some(100.0));
    }

    /// A RAM tier above a cache (as `serve --ram-cache --cache` stacks them): its hits never
    /// reach the cache, whose counters and hit % are reported beside the tier's.
    #[test]
    fn a_ram_tier_above_a_cache_reports_beside_it() {
        let cache = test_cache(
            Arc::new(MemDev::new(16 << 20)),
            Arc::new(MemDev::new(8 << 20)),
        );
        let t = Arc::new(RamTier::new(cache.clone(), 1 << 20, RamPolicy::Fifo, None));
        let (c, dev) = controller_stacked(Some(cache), None, None, Some(t));
        let mut buf = vec![0u8; 4 << 12];
        dev.read_at(&mut buf, 0).unwrap();
        dev.read_at(&mut buf, 0).unwrap();
        let r = c.report();
        let ram = r.ram.as_ref().unwrap();
        assert_eq!(ram.policy, "fifo");
        assert_eq!(ram.capacity_bytes, 1 << 20);
        assert_eq!((ram.counters.hit_blocks, ram.counters.miss_blocks), (4, 4));
        assert_eq!(
            r.counters.get("reads"),
            Some(&1),
            "the cache saw the first read only"
        );
        assert!(ram_row(&r).starts_with("fifo, 16.00 KiB of 1.00 MiB held"));
        let table = r.render_table();
        assert!(
            table.contains("read hit %") && table.contains("ram hit %"),
            "{table}"
        );
        crate::prometheus::tests::check_exposition(&r.to_prometheus());
        c.take_cache().unwrap().close().unwrap();
    }

    /// Against a real memcached: blocks written are stored, read back as hits, and the server's
    /// gets, hits, sets and latency are in the report and Prometheus.
    #[test]
    fn a_real_memcached_server_reports_hits_and_latency() {
        let server = flashtier_testkit::memcached::Memcached::start(&["-m", "16"]);
        let (c, dev, _t) = memcached_only();
        mc(&c, add(&server.addr())).unwrap();
        dev.write_at(&[5u8; 8 << 12], 0, false).unwrap();
        let mut buf = vec![0u8; 8 << 12];
        dev.read_at(&mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 5));
        let r = c.report();
        let m = r.memcached.as_ref().unwrap();
        assert_eq!((m.tier.stored_blocks, m.tier.hit_blocks), (8, 8), "{m:?}");
        let s = &m.servers[0];
        assert_eq!(s.health, "up");
        assert_eq!(
            (s.counters.sets, s.counters.gets, s.counters.hits),
            (8, 8, 8),
            "{s:?}"
        );
        assert!(s.counters.written_bytes > 8 * 4096 && s.counters.read_bytes > 8 * 4096);
        assert!(s.latency.count >= 2, "{s:?}");
        let (p50, p99) = (s.latency.p50_us.unwrap(), s.latency.p99_us.unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{s:?}");
        let inf = s.latency.count;
        assert!(s
            .latency
            .buckets
            .windows(2)
            .all(|w| w[0][1] <= w[1][1] && w[0][0] < w[1][0]));
        assert_eq!(s.latency.buckets.last().unwrap()[1], inf, "all under 16 s");
        assert!(r
            .render_status()
            .contains("hits 8 of 8 blocks looked up (100.0%)"));
        let list = m.render_servers();
        assert!(list.starts_with("server "), "{list}");
        assert!(
            list.contains(&server.addr()) && list.contains(" up "),
            "{list}"
        );
        let prom = r.to_prometheus();
        let addr = server.addr();
        for line in [
            format!("flashtier_memcached_server_up{{server=\"{addr}\"}} 1"),
            format!("flashtier_memcached_server_hits_total{{server=\"{addr}\"}} 8"),
            format!("flashtier_memcached_server_duration_seconds_count{{server=\"{addr}\"}} {inf}"),
            format!(
                "flashtier_memcached_server_duration_seconds_bucket{{server=\"{addr}\",le=\"16.777216\"}} {inf}"
            ),
            "flashtier_memcached_hit_ratio 1".to_string(),
        ] {
            assert!(prom.contains(&format!("\n{line}\n")), "{line}:\n{prom}");
        }
        crate::prometheus::tests::check_exposition(&prom);
    }
}

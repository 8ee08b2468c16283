//! Live parameters: every policy knob an operator can read and change while the cache serves,
//! by name, with one place that knows each one's meaning, default and allowed values.
//!
//! Each parameter is one entry of a table (`DEFS`): its name, documentation, default, allowed
//! values and how its values are parsed and stored. Everything else is derived from that entry:
//! [`PARAMS`] (which `flashtier get --all`, `set --help`, the config file and its example show),
//! parsing and range checks, the stored value and the defaults a cache starts with, and
//! [`Cache::get_param`](crate::Cache::get_param). Adding a parameter is adding an entry (and, if the I/O paths read it,
//! an accessor on `Tunables`).
//!
//! The control API, the config file and `flashtier config check` all go through [`PARAMS`],
//! [`validate`], [`validate_all`] and [`Cache::set_params`](crate::Cache::set_params), so a value is checked the same way
//! wherever it comes from, and an error always names what is allowed.
//!
//! Some parameters constrain each other ([`ORDERED`]: the low write-back watermark must stay
//! below the high one). A set of values is checked as a whole, against the values it leaves in
//! force: a config file's `[policy]` and `--set` in any order, against the defaults; a live
//! change against the current values. So moving both watermarks past each other is one change
//! of both (`flashtier set writeback_dirty_high_pct 90 writeback_dirty_low_pct 80`), applied
//! together or not at all, and an error names both values. Values are plain atomics the I/O paths read
//! on every request: a change applies to the next request, with no detach and no restart.
//!
//! The cache mode is not here: switching it may write back every dirty block first, which is a
//! long operation with progress, not a setting (see [`Cache::set_mode`](crate::Cache::set_mode)).

use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

use crate::policy::{PromotionPolicy, ReclaimPolicy};

/// What an operator needs to know about one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    /// Its name, as `flashtier config` and the control socket take it.
    pub name: &'static str,
    /// One or two sentences: what it does and when to change it.
    pub doc: &'static str,
    /// The value a cache starts with.
    pub default: &'static str,
    /// The allowed values, as shown in errors and `--help`.
    pub allowed: &'static str,
}

/// How a parameter's values are written and checked. Every value is stored as a `u32` (a
/// number as is, a word as its code), so one array of atomics holds them all.
#[derive(Clone, Copy)]
enum Kind {
    /// A number in `lo..=hi`.
    Range(u32, u32),
    /// One of a few words (any case), stored as the code `parse` gives it.
    Choice {
        parse: fn(&str) -> Option<u32>,
        name: fn(u32) -> &'static str,
    },
}

/// One parameter: what the operator sees, and how its values are parsed and kept.
struct Param {
    info: ParamInfo,
    kind: Kind,
}

/// A parameter whose values are words: a type with a code per word.
trait Choice: FromStr + Copy {
    fn code(self) -> u32;
    fn from_code(code: u32) -> Option<Self>;
    fn name(self) -> &'static str;
}

fn parse_choice<T: Choice>(v: &str) -> Option<u32> {
    v.parse::<T>().ok().map(T::code)
}

fn choice_name<T: Choice + Default>(code: u32) -> &'static str {
    T::from_code(code).unwrap_or_default().name()
}

impl Choice for ReclaimPolicy {
    fn code(self) -> u32 {
        self as u32
    }
    fn from_code(code: u32) -> Option<Self> {
        ReclaimPolicy::from_u8(u8::try_from(code).ok()?)
    }
    fn name(self) -> &'static str {
        ReclaimPolicy::name(self)
    }
}

impl Choice for PromotionPolicy {
    fn code(self) -> u32 {
        self as u32
    }
    fn from_code(code: u32) -> Option<Self> {
        PromotionPolicy::from_u8(u8::try_from(code).ok()?)
    }
    fn name(self) -> &'static str {
        PromotionPolicy::name(self)
    }
}

/// `writeback_controller`: whether the PI controller steers the dirty level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Controller {
    Off = 0,
    #[default]
    Pi = 1,
}

impl FromStr for Controller {
    type Err = ();
    fn from_str(s: &str) -> Result<Controller, ()> {
        match s.to_ascii_lowercase().as_str() {
            "pi" => Ok(Controller::Pi),
            "off" => Ok(Controller::Off),
            _ => Err(()),
        }
    }
}

impl Choice for Controller {
    fn code(self) -> u32 {
        self as u32
    }
    fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(Controller::Off),
            1 => Some(Controller::Pi),
            _ => None,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Controller::Off => "off",
            Controller::Pi => "pi",
        }
    }
}

/// One table entry. The allowed values shown to the operator are spelled out from the same
/// tokens the checks use (`lo..=hi`, the words), so the two cannot disagree; the default is
/// checked against them by a test.
macro_rules! param {
    (
        name: $name:literal,
        range: $lo:literal ..= $hi:literal,
        default: $default:literal,
        doc: $doc:literal $(,)?
    ) => {
        Param {
            info: ParamInfo {
                name: $name,
                doc: $doc,
                default: concat!($default),
                allowed: concat!($lo, "..=", $hi),
            },
            kind: Kind::Range($lo, $hi),
        }
    };
    (
        name: $name:literal,
        choice: $ty:ty [$first:literal $(| $word:literal)*],
        default: $default:literal,
        doc: $doc:literal $(,)?
    ) => {
        Param {
            info: ParamInfo {
                name: $name,
                doc: $doc,
                default: $default,
                allowed: concat!($first $(, " | ", $word)*),
            },
            kind: Kind::Choice {
                parse: parse_choice::<$ty>,
                name: choice_name::<$ty>,
            },
        }
    };
}

/// Every live parameter, in the order tables show them.
const DEFS: &[Param] = &[
    param! {
        name: "reclaim_policy",
        choice: ReclaimPolicy["fifo" | "lru"],
        default: "lru",
        doc: "Which segment reclaim empties, evicting what it holds, once no segment is sparse \
              enough to compact (reclaim_compact_pct): fifo (the oldest) or lru (the least \
              recently read; blocks read since they were cached are copied forward).",
    },
    param! {
        name: "reclaim_compact_pct",
        // At most 90 (reclaim::MAX_COMPACT_PCT): a victim copied forward must free a tenth of a
        // segment.
        range: 0..=90,
        default: 75,
        doc: "Before evicting anything, reclaim empties the sealed segment with the fewest live \
              blocks by copying all of them forward, as long as that segment is at most this many \
              percent live; only when every segment is fuller does it follow reclaim_policy and \
              evict. A cache larger than its working set then keeps all of it, however scattered \
              the garbage of overwrites, and a smaller one stays mostly live. The price is cache \
              device writes: a victim p% live costs p/(100-p) blocks copied per block freed (1 at \
              50, 3 at 75, 9 at 90). Only while reclaim is ahead of the writers: once they wait \
              for space, reclaim evicts by the policy, which frees a segment faster. 0 = always \
              follow reclaim_policy (evict from its victim).",
    },
    param! {
        name: "sequential_cutoff_read_kib",
        range: 0..=1048576,
        default: 4096,
        doc: "Reads continuing a sequential stream longer than this many KiB are not promoted into \
              the cache (a table scan or backup does not flush the hot set). Hits are still served \
              from the cache. 0 = off.",
    },
    param! {
        name: "sequential_cutoff_write_kib",
        range: 0..=1048576,
        default: 0,
        doc: "Writes continuing a sequential stream longer than this many KiB go around the cache to \
              the backing store (cached copies are invalidated first; blocks dirty in the cache stay \
              there), in write-back and write-through. Such writes are only as atomic as the backing \
              store makes them. Off by default: a database's redo log is a sequential stream that \
              needs the cache's write latency and atomic writes. 0 = off.",
    },
    param! {
        name: "promotion",
        choice: PromotionPolicy["always" | "nhit" | "auto"],
        default: "auto",
        doc: "When a block read from the backing store is cached: always (on its first miss), \
              nhit (only after promotion_nhit misses within promotion_window_secs, so blocks read \
              once never displace the working set), or auto (as nhit while reclaim has evicted \
              blocks within promotion_window_secs, else always: a cache that is filling, or \
              larger than what is read, caches every miss).",
    },
    param! {
        name: "promotion_nhit",
        range: 1..=255,
        default: 2,
        doc: "With promotion = nhit or auto: misses of a block, within the window, that promote \
              it.",
    },
    param! {
        name: "promotion_window_secs",
        // A day.
        range: 1..=86400,
        default: 300,
        doc: "With promotion = nhit or auto: how long a block's misses are remembered; with \
              auto, also how long after reclaim's last eviction misses are still counted.",
    },
    param! {
        name: "writeback_controller",
        choice: Controller["pi" | "off"],
        default: "pi",
        doc: "In write-back mode, pi steers the dirty share of the cache toward \
              writeback_dirty_target_pct with a rate that follows how far above the target it is \
              (bcache's proportional-integral write-back controller), so dirty data drains smoothly \
              instead of in bursts at the watermark; off leaves the watermarks, max age and idle \
              delay.",
    },
    param! {
        name: "writeback_dirty_target_pct",
        range: 0..=100,
        default: 10,
        doc: "The dirty share of the cache (percent of its capacity) the pi controller aims for: \
              below it the controller writes nothing back; above it the write-back rate grows \
              with the excess and with how long it lasts.",
    },
    param! {
        name: "writeback_dirty_high_pct",
        range: 1..=100,
        default: 70,
        doc: "Above this dirty share the cache writes back at full speed (every in-flight slot, no \
              rate limit, ahead of client backing I/O) until the dirty share is down to \
              writeback_dirty_low_pct.",
    },
    param! {
        name: "writeback_dirty_low_pct",
        range: 0..=99,
        default: 50,
        doc: "Where a full-speed drain started at writeback_dirty_high_pct stops; must be below \
              it. To move both watermarks past each other, change them together (one `flashtier \
              set` with both, or the config file).",
    },
    param! {
        name: "writeback_max_age_secs",
        // A day.
        range: 0..=86400,
        default: 0,
        doc: "Dirty blocks written to the cache longer ago than this are written back (within \
              about a second); blocks copied forward by reclaim count from their copy. 0 = off.",
    },
    param! {
        name: "writeback_idle_delay_ms",
        // An hour.
        range: 0..=3600000,
        default: 0,
        doc: "Once no client I/O has gone to the backing store for this long, dirty blocks are \
              written back (at full speed, up to writeback_rate_max_kib, while it stays idle). \
              0 = off.",
    },
    param! {
        name: "writeback_rate_max_kib",
        // 16 GiB/s: beyond any backing store.
        range: 0..=16777216,
        default: 0,
        doc: "Cap in KiB/s on background write-back (controller, max age, idle); not applied above \
              writeback_dirty_high_pct, nor to flush, mode switches or reclaim. 0 = no cap. The \
              cleaner reads every block it writes back from the cache device, one 4 KiB read \
              each after random writes; where those reads slow a database's commits, a cap \
              spreads them out (a virtual disk: QD1 commits during a drain at 0.56x the raw \
              device uncapped, 0.84x at 4096).",
    },
    param! {
        name: "writeback_order",
        choice: ReclaimPolicy["fifo" | "lru"],
        default: "fifo",
        doc: "Which dirty blocks background write-back takes first: fifo (the oldest written) or \
              lru (those in the least recently read segments). Each pass then writes them sorted \
              by address, merged with their dirty neighbours.",
    },
    param! {
        name: "writeback_max_inflight",
        range: 1..=64,
        default: 4,
        doc: "Backing writes in flight at once in a write-back pass (every pass: background, \
              flush, mode switch, reclaim). Background write-back drops to one while clients \
              read or write the backing store, unless above writeback_dirty_high_pct.",
    },
    param! {
        name: "writeback_max_io_kib",
        range: 4..=16384,
        default: 1024,
        doc: "Largest backing write: dirty blocks at consecutive addresses are merged up to this \
              size (every pass: background, flush, mode switch, reclaim).",
    },
];

const COUNT: usize = DEFS.len();

const fn infos() -> [ParamInfo; COUNT] {
    let mut out = [DEFS[0].info; COUNT];
    let mut i = 0;
    while i < COUNT {
        out[i] = DEFS[i].info;
        i += 1;
    }
    out
}

/// Every live parameter, in the order tables show them.
pub const PARAMS: &[ParamInfo] = &infos();

/// The position of parameter `name` in the table; a name that is not there fails the build.
const fn index(name: &str) -> usize {
    let mut i = 0;
    while i < COUNT {
        let (a, b) = (DEFS[i].info.name.as_bytes(), name.as_bytes());
        if a.len() == b.len() {
            let mut j = 0;
            while j < a.len() && a[j] == b[j] {
                j += 1;
            }
            if j == a.len() {
                return i;
            }
        }
        i += 1;
    }
    panic!("no such parameter")
}

const RECLAIM_POLICY: usize = index("reclaim_policy");
const RECLAIM_COMPACT_PCT: usize = index("reclaim_compact_pct");
const CUTOFF_READ_KIB: usize = index("sequential_cutoff_read_kib");
const CUTOFF_WRITE_KIB: usize = index("sequential_cutoff_write_kib");
const PROMOTION: usize = index("promotion");
const PROMOTION_NHIT: usize = index("promotion_nhit");
const PROMOTION_WINDOW_SECS: usize = index("promotion_window_secs");
const WRITEBACK_CONTROLLER: usize = index("writeback_controller");
const WRITEBACK_TARGET_PCT: usize = index("writeback_dirty_target_pct");
const WRITEBACK_HIGH_PCT: usize = index("writeback_dirty_high_pct");
const WRITEBACK_LOW_PCT: usize = index("writeback_dirty_low_pct");
const WRITEBACK_MAX_AGE_SECS: usize = index("writeback_max_age_secs");
const WRITEBACK_IDLE_DELAY_MS: usize = index("writeback_idle_delay_ms");
const WRITEBACK_RATE_MAX_KIB: usize = index("writeback_rate_max_kib");
const WRITEBACK_ORDER: usize = index("writeback_order");
const WRITEBACK_MAX_INFLIGHT: usize = index("writeback_max_inflight");
const WRITEBACK_MAX_IO_KIB: usize = index("writeback_max_io_kib");

/// Pairs of numeric parameters where the first must stay below the second.
pub const ORDERED: &[(&str, &str)] = &[("writeback_dirty_low_pct", "writeback_dirty_high_pct")];

/// A parameter name or value that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    /// A name that is not a parameter.
    #[error("unknown parameter '{name}' (known: {known})")]
    Unknown {
        /// The name given.
        name: String,
        /// The parameters there are, for the message.
        known: String,
    },
    /// A value the parameter does not take.
    #[error("invalid value '{value}' for {name}: allowed {allowed}")]
    Invalid {
        /// The parameter.
        name: &'static str,
        /// The value given.
        value: String,
        /// What it takes, as `--help` shows it.
        allowed: &'static str,
    },
    /// Two values that must be ordered are not. Each value says where it comes from when it is
    /// not one being set ("70, the current value", "70, the default").
    #[error("{below} ({below_value}) must be below {above} ({above_value})")]
    Conflict {
        /// The parameter that must be the lower.
        below: &'static str,
        /// Its value, and where it comes from.
        below_value: String,
        /// The parameter that must be the higher.
        above: &'static str,
        /// Its value, and where it comes from.
        above_value: String,
    },
}

/// The table position of `name`.
fn position(name: &str) -> Result<usize, ParamError> {
    PARAMS
        .iter()
        .position(|p| p.name == name)
        .ok_or_else(|| ParamError::Unknown {
            name: name.to_string(),
            known: PARAMS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })
}

/// The description of `name`.
pub fn info(name: &str) -> Result<&'static ParamInfo, ParamError> {
    position(name).map(|i| &PARAMS[i])
}

/// Checks `value` for `name` without a cache (for config files).
pub fn validate(name: &str, value: &str) -> Result<(), ParamError> {
    parse(name, value).map(|_| ())
}

/// Checks a whole set of values (a config file's `[policy]` with `--set`; later entries win)
/// as a cache starting with them would take them: each value, then [`ORDERED`] over the
/// defaults they leave.
pub fn validate_all<N: AsRef<str>, V: AsRef<str>>(settings: &[(N, V)]) -> Result<(), ParamError> {
    let parsed = parse_all(settings)?;
    check_order(&parsed, default_code, "the default")
}

/// Each entry parsed.
fn parse_all<N: AsRef<str>, V: AsRef<str>>(
    settings: &[(N, V)],
) -> Result<Vec<Setting>, ParamError> {
    settings
        .iter()
        .map(|(n, v)| parse(n.as_ref(), v.as_ref()))
        .collect()
}

/// The stored form of parameter `i`'s default (valid: a test parses every default).
fn default_code(i: usize) -> u32 {
    parse(PARAMS[i].name, PARAMS[i].default)
        .map(|s| s.code)
        .unwrap_or(0)
}

/// Checks [`ORDERED`] over `changes` (the last one of a name wins) on top of `base` (by table
/// position), which `base_is` describes in the error ("the current value").
fn check_order(
    changes: &[Setting],
    base: impl Fn(usize) -> u32,
    base_is: &str,
) -> Result<(), ParamError> {
    let value = |name: &str| -> (u32, String) {
        let i = position(name).expect("ORDERED names parameters");
        match changes.iter().rev().find(|s| s.index == i) {
            Some(s) => (s.code, s.code.to_string()),
            None => {
                let v = base(i);
                (v, format!("{v}, {base_is}"))
            }
        }
    };
    for &(below, above) in ORDERED {
        let ((b, below_value), (a, above_value)) = (value(below), value(above));
        if b >= a {
            return Err(ParamError::Conflict {
                below,
                below_value,
                above,
                above_value,
            });
        }
    }
    Ok(())
}

/// A checked value of one parameter: its table position and stored form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Setting {
    index: usize,
    code: u32,
}

impl Setting {
    fn name(&self) -> &'static str {
        PARAMS[self.index].name
    }
}

fn parse(name: &str, value: &str) -> Result<Setting, ParamError> {
    let index = position(name)?;
    let p = &DEFS[index];
    let v = value.trim();
    let code = match p.kind {
        Kind::Range(lo, hi) => v.parse::<u32>().ok().filter(|n| (lo..=hi).contains(n)),
        Kind::Choice { parse, .. } => parse(v),
    };
    code.map(|code| Setting { index, code })
        .ok_or_else(|| ParamError::Invalid {
            name: p.info.name,
            value: value.to_string(),
            allowed: p.info.allowed,
        })
}

/// A stored value as `set_param` takes it.
fn show(index: usize, code: u32) -> String {
    match DEFS[index].kind {
        Kind::Range(..) => code.to_string(),
        Kind::Choice { name, .. } => name(code).to_string(),
    }
}

/// The live values the I/O paths read, one per parameter in table order: the one place each is
/// kept (the superblock records the reclaim policy a cache reopens with, copied from here when
/// it is closed).
pub(crate) struct Tunables {
    values: [AtomicU32; COUNT],
    /// Held while a set of values is checked against the current ones and applied, so two
    /// changes racing cannot together leave what neither would have been allowed to.
    changing: Mutex<()>,
}

impl Default for Tunables {
    fn default() -> Self {
        Tunables {
            values: std::array::from_fn(|i| AtomicU32::new(default_code(i))),
            changing: Mutex::new(()),
        }
    }
}

impl Tunables {
    /// The defaults, with the reclaim policy the cache was formatted or last closed with.
    pub(crate) fn opened_with(reclaim: ReclaimPolicy) -> Tunables {
        let t = Tunables::default();
        t.values[RECLAIM_POLICY].store(reclaim.code(), Ordering::Relaxed);
        t
    }

    fn get(&self, index: usize) -> u32 {
        self.values[index].load(Ordering::Relaxed)
    }

    /// Which segment reclaim empties first.
    pub fn reclaim_policy(&self) -> ReclaimPolicy {
        ReclaimPolicy::from_code(self.get(RECLAIM_POLICY)).unwrap_or_default()
    }

    /// How live (percent) the sparsest segment may be for reclaim to copy it forward whole
    /// instead of evicting from the policy's victim; 0 = never.
    pub fn reclaim_compact_pct(&self) -> u32 {
        self.get(RECLAIM_COMPACT_PCT)
    }

    /// Bytes a read stream may run before its misses stop being promoted; `None` = off.
    pub fn sequential_cutoff_read_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.get(CUTOFF_READ_KIB))
    }

    /// Bytes a write stream may run before its writes go around the cache; `None` = off.
    pub fn sequential_cutoff_write_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.get(CUTOFF_WRITE_KIB))
    }

    pub fn promotion(&self) -> PromotionPolicy {
        PromotionPolicy::from_code(self.get(PROMOTION)).unwrap_or_default()
    }

    pub fn promotion_nhit(&self) -> u32 {
        self.get(PROMOTION_NHIT)
    }

    pub fn promotion_window_secs(&self) -> u32 {
        self.get(PROMOTION_WINDOW_SECS)
    }

    /// Whether the PI controller steers the dirty level.
    pub fn writeback_pi(&self) -> bool {
        Controller::from_code(self.get(WRITEBACK_CONTROLLER)) == Some(Controller::Pi)
    }

    pub fn writeback_target_pct(&self) -> u32 {
        self.get(WRITEBACK_TARGET_PCT)
    }

    pub fn writeback_high_pct(&self) -> u32 {
        self.get(WRITEBACK_HIGH_PCT)
    }

    /// The low watermark in effect: below the high one even when read halfway through a
    /// change of both (each is its own atomic; [`Cache::set_params`](crate::Cache::set_params) keeps the stored pair
    /// ordered).
    pub fn writeback_low_pct(&self) -> u32 {
        let high = self.writeback_high_pct();
        self.get(WRITEBACK_LOW_PCT).min(high.saturating_sub(1))
    }

    /// `None` = off.
    pub fn writeback_max_age_secs(&self) -> Option<u32> {
        Some(self.get(WRITEBACK_MAX_AGE_SECS)).filter(|&v| v > 0)
    }

    /// `None` = off.
    pub fn writeback_idle_delay_ms(&self) -> Option<u32> {
        Some(self.get(WRITEBACK_IDLE_DELAY_MS)).filter(|&v| v > 0)
    }

    /// Cap on background write-back in bytes per second; `None` = no cap.
    pub fn writeback_rate_max_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.get(WRITEBACK_RATE_MAX_KIB))
    }

    pub fn writeback_order(&self) -> ReclaimPolicy {
        ReclaimPolicy::from_code(self.get(WRITEBACK_ORDER)).unwrap_or_default()
    }

    pub fn writeback_max_inflight(&self) -> usize {
        self.get(WRITEBACK_MAX_INFLIGHT).max(1) as usize
    }

    pub fn writeback_max_io_bytes(&self) -> u64 {
        self.get(WRITEBACK_MAX_IO_KIB) as u64 * 1024
    }

    /// Stores a checked value.
    fn apply(&self, s: Setting) {
        self.values[s.index].store(s.code, Ordering::Relaxed);
    }
}

fn kib_to_bytes(kib: u32) -> Option<u64> {
    (kib > 0).then_some(kib as u64 * 1024)
}

/// Reading and changing the values in force, for `Cache`'s `get_param`, `set_params`,
/// `check_params` and `params`.
impl Tunables {
    /// The current value of `name`, formatted as `set_param` accepts it.
    pub(crate) fn value_of(&self, name: &str) -> Result<String, ParamError> {
        let i = position(name)?;
        Ok(show(i, self.get(i)))
    }

    /// Checks `settings` (later entries win) against each other and the current values, and
    /// applies all of them or none. Returns the names changed.
    pub(crate) fn set_all<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<Vec<&'static str>, ParamError> {
        let _changing = self.changing.lock();
        let parsed = self.parse_checked(settings)?;
        for s in &parsed {
            self.apply(*s);
            let (name, value) = (s.name(), show(s.index, s.code));
            tracing::info!(name, value, "parameter changed");
        }
        Ok(parsed.iter().map(|s| s.name()).collect())
    }

    /// What [`Tunables::set_all`] would say, without changing anything.
    pub(crate) fn check_all<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<(), ParamError> {
        self.parse_checked(settings).map(drop)
    }

    fn parse_checked<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<Vec<Setting>, ParamError> {
        let parsed = parse_all(settings)?;
        check_order(&parsed, |i| self.get(i), "the current value")?;
        Ok(parsed)
    }

    /// Every parameter with its current value.
    pub(crate) fn values(&self) -> Vec<(&'static ParamInfo, String)> {
        PARAMS
            .iter()
            .enumerate()
            .map(|(i, p)| (p, show(i, self.get(i))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each table entry agrees with itself: a unique name, a documented meaning, a default the
    /// entry's own parser takes and shows back unchanged, and allowed values (as shown in errors
    /// and help) that are exactly what the parser takes.
    #[test]
    fn every_entry_is_consistent() {
        assert_eq!(PARAMS.len(), DEFS.len());
        for (i, (p, d)) in PARAMS.iter().zip(DEFS).enumerate() {
            assert_eq!(*p, d.info);
            assert_eq!(index(p.name), i, "{} is not unique", p.name);
            assert!(p.doc.ends_with('.') && p.doc.len() > 20, "{}: doc", p.name);
            let s = parse(p.name, p.default).unwrap_or_else(|e| panic!("{}: {e}", p.name));
            assert_eq!(show(i, s.code), p.default, "{}: default", p.name);
            match d.kind {
                Kind::Range(lo, hi) => {
                    assert!(
                        lo <= hi && p.allowed == format!("{lo}..={hi}"),
                        "{}",
                        p.name
                    );
                    for ok in [lo, hi] {
                        assert_eq!(parse(p.name, &ok.to_string()).unwrap().code, ok);
                    }
                    for bad in [lo.checked_sub(1), hi.checked_add(1)].into_iter().flatten() {
                        assert!(validate(p.name, &bad.to_string()).is_err(), "{}", p.name);
                    }
                }
                Kind::Choice { .. } => {
                    let mut codes = Vec::new();
                    for word in p.allowed.split(" | ") {
                        let s = parse(p.name, word).unwrap_or_else(|e| panic!("{e}"));
                        assert_eq!(show(i, s.code), word, "{}", p.name);
                        assert_eq!(parse(p.name, &word.to_uppercase()), Ok(s));
                        codes.push(s.code);
                    }
                    codes.dedup();
                    assert_eq!(codes.len(), p.allowed.split(" | ").count(), "{}", p.name);
                    assert!(validate(p.name, "neither").is_err());
                }
            }
        }
        for &(below, above) in ORDERED {
            for name in [below, above] {
                assert!(matches!(DEFS[index(name)].kind, Kind::Range(..)), "{name}");
            }
            assert!(default_code(index(below)) < default_code(index(above)));
        }
        let t = Tunables::default();
        for (i, p) in PARAMS.iter().enumerate() {
            assert_eq!(
                show(i, t.get(i)),
                p.default,
                "{}: starts at its default",
                p.name
            );
        }
    }

    #[test]
    fn every_default_is_valid_and_applied() {
        for p in PARAMS {
            validate(p.name, p.default).unwrap_or_else(|e| panic!("{}: {e}", p.name));
        }
        let t = Tunables::default();
        assert_eq!(t.sequential_cutoff_read_bytes(), Some(4096 * 1024));
        assert_eq!(t.sequential_cutoff_write_bytes(), None);
        assert_eq!(t.promotion(), PromotionPolicy::Auto);
        assert_eq!(t.promotion_nhit(), 2);
        assert_eq!(t.promotion_window_secs(), 300);
        assert!(t.writeback_pi());
        assert_eq!(t.writeback_target_pct(), 10);
        assert_eq!(t.writeback_high_pct(), 70);
        assert_eq!(t.writeback_low_pct(), 50);
        assert_eq!(t.writeback_max_age_secs(), None);
        assert_eq!(t.writeback_idle_delay_ms(), None);
        assert_eq!(t.writeback_rate_max_bytes(), None);
        assert_eq!(t.writeback_order(), ReclaimPolicy::Fifo);
        assert_eq!(t.writeback_max_inflight(), 4);
        assert_eq!(t.writeback_max_io_bytes(), 1 << 20);
    }

    #[test]
    fn writeback_values_apply_and_the_low_watermark_stays_below_the_high_one() {
        let t = Tunables::default();
        for (name, value) in [
            ("writeback_controller", "OFF"),
            ("writeback_dirty_high_pct", "30"),
            ("writeback_dirty_low_pct", "60"),
            ("writeback_max_age_secs", "86400"),
            ("writeback_idle_delay_ms", "3600000"),
            ("writeback_rate_max_kib", "16777216"),
            ("writeback_order", "lru"),
            ("writeback_max_inflight", "64"),
            ("writeback_max_io_kib", "4"),
        ] {
            t.apply(parse(name, value).unwrap_or_else(|e| panic!("{e}")));
        }
        assert!(!t.writeback_pi());
        assert_eq!(
            t.writeback_low_pct(),
            29,
            "effective low is min(low, high - 1)"
        );
        assert_eq!(t.writeback_max_age_secs(), Some(86_400));
        assert_eq!(t.writeback_idle_delay_ms(), Some(3_600_000));
        assert_eq!(t.writeback_rate_max_bytes(), Some(16 << 30));
        assert_eq!(t.writeback_order(), ReclaimPolicy::Lru);
        assert_eq!(t.writeback_max_inflight(), 64);
        assert_eq!(t.writeback_max_io_bytes(), 4096);
        t.apply(parse("writeback_dirty_high_pct", "1").unwrap());
        assert_eq!(t.writeback_low_pct(), 0);
    }

    #[test]
    fn values_out_of_range_are_refused_naming_the_range() {
        for (name, value) in [
            ("sequential_cutoff_read_kib", "1048577"),
            ("sequential_cutoff_write_kib", "-1"),
            ("promotion_nhit", "0"),
            ("promotion_nhit", "256"),
            ("promotion_window_secs", "0"),
            ("promotion", "sometimes"),
            ("reclaim_policy", "random"),
            ("sequential_cutoff_read_kib", "4M"),
            ("writeback_controller", "pid"),
            ("writeback_dirty_target_pct", "101"),
            ("writeback_dirty_high_pct", "0"),
            ("writeback_dirty_high_pct", "101"),
            ("writeback_dirty_low_pct", "100"),
            ("writeback_max_age_secs", "86401"),
            ("writeback_idle_delay_ms", "3600001"),
            ("writeback_rate_max_kib", "16777217"),
            ("writeback_order", "random"),
            ("writeback_max_inflight", "0"),
            ("writeback_max_inflight", "65"),
            ("writeback_max_io_kib", "3"),
            ("writeback_max_io_kib", "16385"),
        ] {
            let e = validate(name, value).unwrap_err();
            let allowed = info(name).unwrap().allowed;
            assert!(e.to_string().contains(allowed), "{e}");
            assert!(e.to_string().contains(value), "{e}");
        }
        for (name, value) in [
            ("sequential_cutoff_read_kib", "0"),
            ("sequential_cutoff_read_kib", "1048576"),
            ("promotion_nhit", "255"),
            ("promotion", "NHIT"),
            ("reclaim_policy", "fifo"),
            ("writeback_controller", "pi"),
            ("writeback_dirty_target_pct", "0"),
            ("writeback_dirty_target_pct", "100"),
            ("writeback_dirty_high_pct", "1"),
            ("writeback_dirty_low_pct", "99"),
            ("writeback_max_age_secs", "0"),
            ("writeback_rate_max_kib", "0"),
            ("writeback_order", "FIFO"),
            ("writeback_max_inflight", "1"),
            ("writeback_max_io_kib", "16384"),
        ] {
            validate(name, value).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn watermarks_are_checked_together_in_any_order_naming_both_values() {
        let conflict = |settings: &[(&str, &str)]| match validate_all(settings) {
            Err(e @ ParamError::Conflict { .. }) => e.to_string(),
            other => panic!("{settings:?}: {other:?}"),
        };
        for order in [
            [
                ("writeback_dirty_low_pct", "80"),
                ("writeback_dirty_high_pct", "10"),
            ],
            [
                ("writeback_dirty_high_pct", "10"),
                ("writeback_dirty_low_pct", "80"),
            ],
        ] {
            assert_eq!(
                conflict(&order),
                "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (10)"
            );
        }
        // Against the defaults they leave (high 70, low 50).
        assert_eq!(
            conflict(&[("writeback_dirty_low_pct", "80")]),
            "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (70, the \
             default)"
        );
        assert_eq!(
            conflict(&[("writeback_dirty_high_pct", "50")]),
            "writeback_dirty_low_pct (50, the default) must be below writeback_dirty_high_pct \
             (50)"
        );
        // The last value of a name wins; moving both past each other at once is fine.
        for ok in [
            &[
                ("writeback_dirty_low_pct", "80"),
                ("writeback_dirty_high_pct", "90"),
            ][..],
            &[
                ("writeback_dirty_high_pct", "90"),
                ("writeback_dirty_low_pct", "80"),
            ][..],
            &[
                ("writeback_dirty_low_pct", "95"),
                ("writeback_dirty_low_pct", "20"),
                ("writeback_dirty_high_pct", "30"),
            ][..],
            &[("writeback_dirty_high_pct", "100"), ("promotion", "nhit")][..],
        ] {
            validate_all(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        // A bad single value is reported as such before any combination.
        let e = validate_all(&[
            ("writeback_dirty_low_pct", "80"),
            ("writeback_dirty_high_pct", "0"),
        ])
        .unwrap_err();
        assert!(matches!(e, ParamError::Invalid { .. }), "{e}");
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = validate("sequential_cutoff", "1").unwrap_err();
        assert!(e.to_string().contains("sequential_cutoff_read_kib"), "{e}");
    }
}

//! Live parameters: every policy knob an operator can read and change while the cache serves,
//! by name, with one place that knows each one's meaning, default and allowed values.
//!
//! The control API, the config file and `flashtier config check` all go through [`PARAMS`],
//! [`validate`], [`validate_all`] and [`Cache::set_params`], so a value is checked the same way
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
//! long operation with progress, not a setting (see [`Cache::set_mode`]).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};

use parking_lot::Mutex;

use crate::cache::Cache;
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

/// Largest sequential cutoff: a stream longer than 1 GiB is sequential by any standard.
pub(crate) const MAX_CUTOFF_KIB: u32 = 1 << 20;
/// Largest n for n-hit promotion.
pub(crate) const MAX_PROMOTION_NHIT: u32 = 255;
/// Longest n-hit window: a day.
pub(crate) const MAX_PROMOTION_WINDOW_SECS: u32 = 86_400;
/// Longest write-back age: a day.
pub(crate) const MAX_WRITEBACK_AGE_SECS: u32 = 86_400;
/// Longest backing idle delay: an hour.
pub(crate) const MAX_WRITEBACK_IDLE_MS: u32 = 3_600_000;
/// Largest write-back rate cap: 16 GiB/s (beyond any backing store).
pub(crate) const MAX_WRITEBACK_RATE_KIB: u32 = 16 << 20;
/// Most backing writes in flight per cleaning pass.
pub(crate) const MAX_WRITEBACK_INFLIGHT: u32 = 64;
/// Smallest and largest coalesced backing write.
pub(crate) const MIN_WRITEBACK_IO_KIB: u32 = 4;
pub(crate) const MAX_WRITEBACK_IO_KIB: u32 = 16 << 10;

/// Every live parameter, in the order tables show them.
pub const PARAMS: &[ParamInfo] = &[
    ParamInfo {
        name: "reclaim_policy",
        doc: "Which segment reclaim empties first when the cache is full: fifo (the oldest) or lru \
              (the least recently read; blocks read since they were cached are copied forward).",
        default: "lru",
        allowed: "fifo | lru",
    },
    ParamInfo {
        name: "sequential_cutoff_read_kib",
        doc: "Reads continuing a sequential stream longer than this many KiB are not promoted into \
              the cache (a table scan or backup does not flush the hot set). Hits are still served \
              from the cache. 0 = off.",
        default: "4096",
        allowed: "0..=1048576",
    },
    ParamInfo {
        name: "sequential_cutoff_write_kib",
        doc: "Writes continuing a sequential stream longer than this many KiB go around the cache to \
              the backing store (cached copies are invalidated first; blocks dirty in the cache stay \
              there), in write-back and write-through. Such writes are only as atomic as the backing \
              store makes them. Off by default: a database's redo log is a sequential stream that \
              needs the cache's write latency and atomic writes. 0 = off.",
        default: "0",
        allowed: "0..=1048576",
    },
    ParamInfo {
        name: "promotion",
        doc: "When a block read from the backing store is cached: always (on its first miss), or \
              nhit (only after promotion_nhit misses within promotion_window_secs, so blocks read \
              once never displace the working set).",
        default: "always",
        allowed: "always | nhit",
    },
    ParamInfo {
        name: "promotion_nhit",
        doc: "With promotion = nhit: misses of a block, within the window, that promote it.",
        default: "2",
        allowed: "1..=255",
    },
    ParamInfo {
        name: "promotion_window_secs",
        doc: "With promotion = nhit: how long a block's misses are remembered.",
        default: "300",
        allowed: "1..=86400",
    },
    ParamInfo {
        name: "writeback_controller",
        doc: "In write-back mode, pi steers the dirty share of the cache toward \
              writeback_dirty_target_pct with a rate that follows how far above the target it is \
              (bcache's proportional-integral write-back controller), so dirty data drains smoothly \
              instead of in bursts at the watermark; off leaves the watermarks, max age and idle \
              delay.",
        default: "pi",
        allowed: "pi | off",
    },
    ParamInfo {
        name: "writeback_dirty_target_pct",
        doc: "The dirty share of the cache (percent of its capacity) the pi controller aims for: \
              below it the controller writes nothing back; above it the write-back rate grows \
              with the excess and with how long it lasts.",
        default: "10",
        allowed: "0..=100",
    },
    ParamInfo {
        name: "writeback_dirty_high_pct",
        doc: "Above this dirty share the cache writes back at full speed (every in-flight slot, no \
              rate limit, ahead of client backing I/O) until the dirty share is down to \
              writeback_dirty_low_pct.",
        default: "70",
        allowed: "1..=100",
    },
    ParamInfo {
        name: "writeback_dirty_low_pct",
        doc: "Where a full-speed drain started at writeback_dirty_high_pct stops; must be below \
              it. To move both watermarks past each other, change them together (one `flashtier \
              set` with both, or the config file).",
        default: "50",
        allowed: "0..=99",
    },
    ParamInfo {
        name: "writeback_max_age_secs",
        doc: "Dirty blocks written to the cache longer ago than this are written back (within \
              about a second); blocks copied forward by reclaim count from their copy. 0 = off.",
        default: "0",
        allowed: "0..=86400",
    },
    ParamInfo {
        name: "writeback_idle_delay_ms",
        doc: "Once no client I/O has gone to the backing store for this long, dirty blocks are \
              written back (at full speed, up to writeback_rate_max_kib, while it stays idle). \
              0 = off.",
        default: "0",
        allowed: "0..=3600000",
    },
    ParamInfo {
        name: "writeback_rate_max_kib",
        doc: "Cap in KiB/s on background write-back (controller, max age, idle); not applied above \
              writeback_dirty_high_pct, nor to flush, mode switches or reclaim. 0 = no cap.",
        default: "0",
        allowed: "0..=16777216",
    },
    ParamInfo {
        name: "writeback_order",
        doc: "Which dirty blocks background write-back takes first: fifo (the oldest written) or \
              lru (those in the least recently read segments). Each pass then writes them sorted \
              by address, merged with their dirty neighbours.",
        default: "fifo",
        allowed: "fifo | lru",
    },
    ParamInfo {
        name: "writeback_max_inflight",
        doc: "Backing writes in flight at once in a write-back pass (every pass: background, \
              flush, mode switch, reclaim). Background write-back drops to one while clients \
              read or write the backing store, unless above writeback_dirty_high_pct.",
        default: "4",
        allowed: "1..=64",
    },
    ParamInfo {
        name: "writeback_max_io_kib",
        doc: "Largest backing write: dirty blocks at consecutive addresses are merged up to this \
              size (every pass: background, flush, mode switch, reclaim).",
        default: "1024",
        allowed: "4..=16384",
    },
];

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

/// The description of `name`.
pub fn info(name: &str) -> Result<&'static ParamInfo, ParamError> {
    PARAMS
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| ParamError::Unknown {
            name: name.to_string(),
            known: PARAMS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })
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
    check_order(&parsed, default_number, "the default")
}

/// Each entry parsed, keeping its canonical name.
fn parse_all<N: AsRef<str>, V: AsRef<str>>(
    settings: &[(N, V)],
) -> Result<Vec<(&'static str, Setting)>, ParamError> {
    settings
        .iter()
        .map(|(n, v)| Ok((info(n.as_ref())?.name, parse(n.as_ref(), v.as_ref())?)))
        .collect()
}

fn default_number(name: &str) -> u32 {
    info(name)
        .ok()
        .and_then(|p| p.default.parse().ok())
        .unwrap_or(0)
}

/// Checks [`ORDERED`] over `changes` (the last one of a name wins) on top of `base`, which
/// `base_is` describes in the error ("the current value").
fn check_order(
    changes: &[(&'static str, Setting)],
    base: impl Fn(&str) -> u32,
    base_is: &str,
) -> Result<(), ParamError> {
    let value = |name: &str| -> (u32, String) {
        match changes.iter().rev().find(|(n, _)| *n == name) {
            Some((_, s)) => {
                let v = s.number().unwrap_or(0);
                (v, v.to_string())
            }
            None => {
                let v = base(name);
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

/// A checked value of one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    ReclaimPolicy(ReclaimPolicy),
    CutoffReadKib(u32),
    CutoffWriteKib(u32),
    Promotion(PromotionPolicy),
    PromotionNhit(u32),
    PromotionWindowSecs(u32),
    WritebackController(bool),
    WritebackTargetPct(u32),
    WritebackHighPct(u32),
    WritebackLowPct(u32),
    WritebackMaxAgeSecs(u32),
    WritebackIdleDelayMs(u32),
    WritebackRateMaxKib(u32),
    WritebackOrder(ReclaimPolicy),
    WritebackMaxInflight(u32),
    WritebackMaxIoKib(u32),
}

impl Setting {
    /// The value of a numeric parameter.
    fn number(&self) -> Option<u32> {
        match *self {
            Setting::CutoffReadKib(v)
            | Setting::CutoffWriteKib(v)
            | Setting::PromotionNhit(v)
            | Setting::PromotionWindowSecs(v)
            | Setting::WritebackTargetPct(v)
            | Setting::WritebackHighPct(v)
            | Setting::WritebackLowPct(v)
            | Setting::WritebackMaxAgeSecs(v)
            | Setting::WritebackIdleDelayMs(v)
            | Setting::WritebackRateMaxKib(v)
            | Setting::WritebackMaxInflight(v)
            | Setting::WritebackMaxIoKib(v) => Some(v),
            Setting::ReclaimPolicy(_)
            | Setting::Promotion(_)
            | Setting::WritebackController(_)
            | Setting::WritebackOrder(_) => None,
        }
    }
}

fn parse(name: &str, value: &str) -> Result<Setting, ParamError> {
    let p = info(name)?;
    let bad = || ParamError::Invalid {
        name: p.name,
        value: value.to_string(),
        allowed: p.allowed,
    };
    let v = value.trim();
    let number = |lo: u32, hi: u32| {
        v.parse::<u32>()
            .ok()
            .filter(|n| (lo..=hi).contains(n))
            .ok_or_else(bad)
    };
    Ok(match p.name {
        "reclaim_policy" => Setting::ReclaimPolicy(v.parse().map_err(|_| bad())?),
        "sequential_cutoff_read_kib" => Setting::CutoffReadKib(number(0, MAX_CUTOFF_KIB)?),
        "sequential_cutoff_write_kib" => Setting::CutoffWriteKib(number(0, MAX_CUTOFF_KIB)?),
        "promotion" => Setting::Promotion(v.parse().map_err(|_| bad())?),
        "promotion_nhit" => Setting::PromotionNhit(number(1, MAX_PROMOTION_NHIT)?),
        "promotion_window_secs" => {
            Setting::PromotionWindowSecs(number(1, MAX_PROMOTION_WINDOW_SECS)?)
        }
        "writeback_controller" => {
            Setting::WritebackController(match v.to_ascii_lowercase().as_str() {
                "pi" => true,
                "off" => false,
                _ => return Err(bad()),
            })
        }
        "writeback_dirty_target_pct" => Setting::WritebackTargetPct(number(0, 100)?),
        "writeback_dirty_high_pct" => Setting::WritebackHighPct(number(1, 100)?),
        "writeback_dirty_low_pct" => Setting::WritebackLowPct(number(0, 99)?),
        "writeback_max_age_secs" => {
            Setting::WritebackMaxAgeSecs(number(0, MAX_WRITEBACK_AGE_SECS)?)
        }
        "writeback_idle_delay_ms" => {
            Setting::WritebackIdleDelayMs(number(0, MAX_WRITEBACK_IDLE_MS)?)
        }
        "writeback_rate_max_kib" => {
            Setting::WritebackRateMaxKib(number(0, MAX_WRITEBACK_RATE_KIB)?)
        }
        "writeback_order" => Setting::WritebackOrder(v.parse().map_err(|_| bad())?),
        "writeback_max_inflight" => {
            Setting::WritebackMaxInflight(number(1, MAX_WRITEBACK_INFLIGHT)?)
        }
        "writeback_max_io_kib" => {
            Setting::WritebackMaxIoKib(number(MIN_WRITEBACK_IO_KIB, MAX_WRITEBACK_IO_KIB)?)
        }
        _ => unreachable!("every entry of PARAMS is parsed"),
    })
}

/// The live values the I/O paths read (the reclaim policy lives with the engine's other state).
pub(crate) struct Tunables {
    cutoff_read_kib: AtomicU32,
    cutoff_write_kib: AtomicU32,
    promotion: AtomicU8,
    promotion_nhit: AtomicU32,
    promotion_window_secs: AtomicU32,
    writeback_pi: AtomicBool,
    writeback_target_pct: AtomicU32,
    writeback_high_pct: AtomicU32,
    writeback_low_pct: AtomicU32,
    writeback_max_age_secs: AtomicU32,
    writeback_idle_delay_ms: AtomicU32,
    writeback_rate_max_kib: AtomicU32,
    writeback_order: AtomicU8,
    writeback_max_inflight: AtomicU32,
    writeback_max_io_kib: AtomicU32,
    /// Held while a set of values is checked against the current ones and applied, so two
    /// changes racing cannot together leave what neither would have been allowed to.
    changing: Mutex<()>,
}

impl Default for Tunables {
    fn default() -> Self {
        let t = Tunables {
            cutoff_read_kib: AtomicU32::new(0),
            cutoff_write_kib: AtomicU32::new(0),
            promotion: AtomicU8::new(PromotionPolicy::Always as u8),
            promotion_nhit: AtomicU32::new(0),
            promotion_window_secs: AtomicU32::new(0),
            writeback_pi: AtomicBool::new(false),
            writeback_target_pct: AtomicU32::new(0),
            writeback_high_pct: AtomicU32::new(0),
            writeback_low_pct: AtomicU32::new(0),
            writeback_max_age_secs: AtomicU32::new(0),
            writeback_idle_delay_ms: AtomicU32::new(0),
            writeback_rate_max_kib: AtomicU32::new(0),
            writeback_order: AtomicU8::new(0),
            writeback_max_inflight: AtomicU32::new(1),
            writeback_max_io_kib: AtomicU32::new(MIN_WRITEBACK_IO_KIB),
            changing: Mutex::new(()),
        };
        for p in PARAMS {
            if let Ok(s) = parse(p.name, p.default) {
                t.apply(s);
            }
        }
        t
    }
}

impl Tunables {
    /// Bytes a read stream may run before its misses stop being promoted; `None` = off.
    pub fn sequential_cutoff_read_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.cutoff_read_kib.load(Ordering::Relaxed))
    }

    /// Bytes a write stream may run before its writes go around the cache; `None` = off.
    pub fn sequential_cutoff_write_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.cutoff_write_kib.load(Ordering::Relaxed))
    }

    pub fn promotion(&self) -> PromotionPolicy {
        PromotionPolicy::from_u8(self.promotion.load(Ordering::Relaxed)).unwrap_or_default()
    }

    pub fn promotion_nhit(&self) -> u32 {
        self.promotion_nhit.load(Ordering::Relaxed)
    }

    pub fn promotion_window_secs(&self) -> u32 {
        self.promotion_window_secs.load(Ordering::Relaxed)
    }

    /// Whether the PI controller steers the dirty level.
    pub fn writeback_pi(&self) -> bool {
        self.writeback_pi.load(Ordering::Relaxed)
    }

    pub fn writeback_target_pct(&self) -> u32 {
        self.writeback_target_pct.load(Ordering::Relaxed)
    }

    pub fn writeback_high_pct(&self) -> u32 {
        self.writeback_high_pct.load(Ordering::Relaxed)
    }

    /// The low watermark in effect: below the high one even when read halfway through a
    /// change of both (each is its own atomic; [`Cache::set_params`] keeps the stored pair
    /// ordered).
    pub fn writeback_low_pct(&self) -> u32 {
        let high = self.writeback_high_pct();
        self.writeback_low_pct
            .load(Ordering::Relaxed)
            .min(high.saturating_sub(1))
    }

    /// `None` = off.
    pub fn writeback_max_age_secs(&self) -> Option<u32> {
        Some(self.writeback_max_age_secs.load(Ordering::Relaxed)).filter(|&v| v > 0)
    }

    /// `None` = off.
    pub fn writeback_idle_delay_ms(&self) -> Option<u32> {
        Some(self.writeback_idle_delay_ms.load(Ordering::Relaxed)).filter(|&v| v > 0)
    }

    /// Cap on background write-back in bytes per second; `None` = no cap.
    pub fn writeback_rate_max_bytes(&self) -> Option<u64> {
        kib_to_bytes(self.writeback_rate_max_kib.load(Ordering::Relaxed))
    }

    pub fn writeback_order(&self) -> ReclaimPolicy {
        ReclaimPolicy::from_u8(self.writeback_order.load(Ordering::Relaxed)).unwrap_or_default()
    }

    pub fn writeback_max_inflight(&self) -> usize {
        self.writeback_max_inflight.load(Ordering::Relaxed).max(1) as usize
    }

    pub fn writeback_max_io_bytes(&self) -> u64 {
        self.writeback_max_io_kib.load(Ordering::Relaxed) as u64 * 1024
    }

    /// Stores a checked value; the reclaim policy is the engine's, not stored here.
    fn apply(&self, s: Setting) {
        match s {
            Setting::ReclaimPolicy(_) => {}
            Setting::CutoffReadKib(v) => self.cutoff_read_kib.store(v, Ordering::Relaxed),
            Setting::CutoffWriteKib(v) => self.cutoff_write_kib.store(v, Ordering::Relaxed),
            Setting::Promotion(v) => self.promotion.store(v as u8, Ordering::Relaxed),
            Setting::PromotionNhit(v) => self.promotion_nhit.store(v, Ordering::Relaxed),
            Setting::PromotionWindowSecs(v) => {
                self.promotion_window_secs.store(v, Ordering::Relaxed)
            }
            Setting::WritebackController(v) => self.writeback_pi.store(v, Ordering::Relaxed),
            Setting::WritebackTargetPct(v) => self.writeback_target_pct.store(v, Ordering::Relaxed),
            Setting::WritebackHighPct(v) => self.writeback_high_pct.store(v, Ordering::Relaxed),
            Setting::WritebackLowPct(v) => self.writeback_low_pct.store(v, Ordering::Relaxed),
            Setting::WritebackMaxAgeSecs(v) => {
                self.writeback_max_age_secs.store(v, Ordering::Relaxed)
            }
            Setting::WritebackIdleDelayMs(v) => {
                self.writeback_idle_delay_ms.store(v, Ordering::Relaxed)
            }
            Setting::WritebackRateMaxKib(v) => {
                self.writeback_rate_max_kib.store(v, Ordering::Relaxed)
            }
            Setting::WritebackOrder(v) => self.writeback_order.store(v as u8, Ordering::Relaxed),
            Setting::WritebackMaxInflight(v) => {
                self.writeback_max_inflight.store(v, Ordering::Relaxed)
            }
            Setting::WritebackMaxIoKib(v) => self.writeback_max_io_kib.store(v, Ordering::Relaxed),
        }
    }
}

fn kib_to_bytes(kib: u32) -> Option<u64> {
    (kib > 0).then_some(kib as u64 * 1024)
}

impl Cache {
    /// The current value of `name`, formatted as `set_param` accepts it.
    pub fn get_param(&self, name: &str) -> Result<String, ParamError> {
        let p = info(name)?;
        let t = &self.engine().tunables;
        Ok(match p.name {
            "reclaim_policy" => self.engine().reclaim_policy().to_string(),
            "sequential_cutoff_read_kib" => t.cutoff_read_kib.load(Ordering::Relaxed).to_string(),
            "sequential_cutoff_write_kib" => t.cutoff_write_kib.load(Ordering::Relaxed).to_string(),
            "promotion" => t.promotion().to_string(),
            "promotion_nhit" => t.promotion_nhit().to_string(),
            "promotion_window_secs" => t.promotion_window_secs().to_string(),
            "writeback_controller" => if t.writeback_pi() { "pi" } else { "off" }.to_string(),
            "writeback_dirty_target_pct" => t.writeback_target_pct().to_string(),
            "writeback_dirty_high_pct" => t.writeback_high_pct().to_string(),
            "writeback_dirty_low_pct" => t.writeback_low_pct.load(Ordering::Relaxed).to_string(),
            "writeback_max_age_secs" => {
                t.writeback_max_age_secs.load(Ordering::Relaxed).to_string()
            }
            "writeback_idle_delay_ms" => t
                .writeback_idle_delay_ms
                .load(Ordering::Relaxed)
                .to_string(),
            "writeback_rate_max_kib" => {
                t.writeback_rate_max_kib.load(Ordering::Relaxed).to_string()
            }
            "writeback_order" => t.writeback_order().to_string(),
            "writeback_max_inflight" => t.writeback_max_inflight().to_string(),
            "writeback_max_io_kib" => t.writeback_max_io_kib.load(Ordering::Relaxed).to_string(),
            _ => unreachable!("every entry of PARAMS has a value"),
        })
    }

    /// Checks and applies `value` to `name`; it takes effect from the next request.
    pub fn set_param(&self, name: &str, value: &str) -> Result<(), ParamError> {
        self.set_params(&[(name, value)])
    }

    /// Checks `settings` (later entries win) against each other and the current values, and
    /// applies all of them or none.
    pub fn set_params<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<(), ParamError> {
        let t = &self.engine().tunables;
        let _changing = t.changing.lock();
        let parsed = self.check(settings)?;
        for (name, s) in &parsed {
            match *s {
                Setting::ReclaimPolicy(p) => self.set_reclaim_policy(p),
                s => t.apply(s),
            }
            let value = self.get_param(name)?;
            tracing::info!(name, value, "parameter changed");
        }
        if parsed.iter().any(|(n, _)| n.starts_with("writeback_")) {
            // The cleaner re-plans at once (a new target, rate or watermark).
            self.engine().wake_writeback();
        }
        Ok(())
    }

    /// What [`Cache::set_params`] would say, without changing anything.
    pub fn check_params<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<(), ParamError> {
        self.check(settings).map(drop)
    }

    fn check<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<Vec<(&'static str, Setting)>, ParamError> {
        let parsed = parse_all(settings)?;
        let current = |name: &str| {
            self.get_param(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        check_order(&parsed, current, "the current value")?;
        Ok(parsed)
    }

    /// Every parameter with its current value.
    pub fn params(&self) -> Vec<(&'static ParamInfo, String)> {
        PARAMS
            .iter()
            .map(|p| (p, self.get_param(p.name).expect("known parameter")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_is_valid_and_applied() {
        for p in PARAMS {
            validate(p.name, p.default).unwrap_or_else(|e| panic!("{}: {e}", p.name));
        }
        let t = Tunables::default();
        assert_eq!(t.sequential_cutoff_read_bytes(), Some(4096 * 1024));
        assert_eq!(t.sequential_cutoff_write_bytes(), None);
        assert_eq!(t.promotion(), PromotionPolicy::Always);
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

//! Live parameters: every policy knob an operator can read and change while the cache serves,
//! by name, with one place that knows each one's meaning, default and allowed values.
//!
//! The control API, the config file and `flashtier config check` all go through [`PARAMS`],
//! [`validate`] and [`Cache::set_param`], so a value is checked the same way wherever it comes
//! from, and an error always names what is allowed. Values are plain atomics the I/O paths read
//! on every request: a change applies to the next request, with no detach and no restart.
//!
//! The cache mode is not here: switching it may write back every dirty block first, which is a
//! long operation with progress, not a setting (see [`Cache::set_mode`]).

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

use crate::cache::Cache;
use crate::policy::{PromotionPolicy, ReclaimPolicy};

/// What an operator needs to know about one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    pub name: &'static str,
    /// One or two sentences: what it does and when to change it.
    pub doc: &'static str,
    /// The value a cache starts with.
    pub default: &'static str,
    /// The allowed values, as shown in errors and `--help`.
    pub allowed: &'static str,
}

/// Largest sequential cutoff: a stream longer than 1 GiB is sequential by any standard.
pub const MAX_CUTOFF_KIB: u32 = 1 << 20;
/// Largest n for n-hit promotion.
pub const MAX_PROMOTION_NHIT: u32 = 255;
/// Longest n-hit window: a day.
pub const MAX_PROMOTION_WINDOW_SECS: u32 = 86_400;

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
];

/// A parameter name or value that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    #[error("unknown parameter '{name}' (known: {known})")]
    Unknown { name: String, known: String },
    #[error("invalid value '{value}' for {name}: allowed {allowed}")]
    Invalid {
        name: &'static str,
        value: String,
        allowed: &'static str,
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

/// A checked value of one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    ReclaimPolicy(ReclaimPolicy),
    CutoffReadKib(u32),
    CutoffWriteKib(u32),
    Promotion(PromotionPolicy),
    PromotionNhit(u32),
    PromotionWindowSecs(u32),
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
        _ => unreachable!("every entry of PARAMS is parsed"),
    })
}

/// The live values the I/O paths read (the reclaim policy lives with the engine's other state).
pub struct Tunables {
    cutoff_read_kib: AtomicU32,
    cutoff_write_kib: AtomicU32,
    promotion: AtomicU8,
    promotion_nhit: AtomicU32,
    promotion_window_secs: AtomicU32,
}

impl Default for Tunables {
    fn default() -> Self {
        let t = Tunables {
            cutoff_read_kib: AtomicU32::new(0),
            cutoff_write_kib: AtomicU32::new(0),
            promotion: AtomicU8::new(PromotionPolicy::Always as u8),
            promotion_nhit: AtomicU32::new(0),
            promotion_window_secs: AtomicU32::new(0),
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
            _ => unreachable!("every entry of PARAMS has a value"),
        })
    }

    /// Checks and applies `value` to `name`; it takes effect from the next request.
    pub fn set_param(&self, name: &str, value: &str) -> Result<(), ParamError> {
        match parse(name, value)? {
            Setting::ReclaimPolicy(p) => self.set_reclaim_policy(p),
            s => self.engine().tunables.apply(s),
        }
        tracing::info!(name, value = value.trim(), "parameter changed");
        Ok(())
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
        ] {
            validate(name, value).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = validate("sequential_cutoff", "1").unwrap_err();
        assert!(e.to_string().contains("sequential_cutoff_read_kib"), "{e}");
    }
}

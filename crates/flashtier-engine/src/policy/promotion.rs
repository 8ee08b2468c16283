//! When a block read from the backing store is admitted into the cache.

use std::fmt;
use std::str::FromStr;

/// When a block read from the backing store on a miss is copied into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum PromotionPolicy {
    /// On its first miss.
    Always = 1,
    /// After N misses within a window (blocks read once never displace the working set).
    NHit = 2,
    /// As `NHit` while reclaim evicts, as `Always` while it does not (see [`Self::filters`]).
    #[default]
    Auto = 3,
}

impl PromotionPolicy {
    pub(crate) fn from_u8(v: u8) -> Option<PromotionPolicy> {
        match v {
            1 => Some(PromotionPolicy::Always),
            2 => Some(PromotionPolicy::NHit),
            3 => Some(PromotionPolicy::Auto),
            _ => None,
        }
    }

    /// Its name as a parameter value and in reports.
    pub fn name(self) -> &'static str {
        match self {
            PromotionPolicy::Always => "always",
            PromotionPolicy::NHit => "nhit",
            PromotionPolicy::Auto => "auto",
        }
    }

    /// Whether a miss must pass the n-hit count to be promoted, given whether reclaim has
    /// evicted within the window. `Auto` counts only then: while nothing is evicted, a promotion
    /// displaces nothing, and counting would only slow a cache's warming (strict n-hit left a
    /// cache warmed by one read of the database nearly empty: 26.7 TPS where always-promote
    /// made 120, bench/results/eviction_policy_trials/). Once reclaim evicts, a block read once
    /// would push out one that is read again.
    pub fn filters(self, evicting: bool) -> bool {
        match self {
            PromotionPolicy::Always => false,
            PromotionPolicy::NHit => true,
            PromotionPolicy::Auto => evicting,
        }
    }
}

impl fmt::Display for PromotionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PromotionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<PromotionPolicy, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "always" => Ok(PromotionPolicy::Always),
            "nhit" => Ok(PromotionPolicy::NHit),
            "auto" => Ok(PromotionPolicy::Auto),
            _ => Err("unknown promotion policy (use always, nhit or auto)".to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_counts_misses_only_while_reclaim_evicts() {
        for evicting in [false, true] {
            assert!(!PromotionPolicy::Always.filters(evicting));
            assert!(PromotionPolicy::NHit.filters(evicting));
        }
        assert!(!PromotionPolicy::Auto.filters(false));
        assert!(PromotionPolicy::Auto.filters(true));
    }

    #[test]
    fn names_round_trip() {
        for p in [
            PromotionPolicy::Always,
            PromotionPolicy::NHit,
            PromotionPolicy::Auto,
        ] {
            assert_eq!(p.name().parse::<PromotionPolicy>(), Ok(p));
            assert_eq!(PromotionPolicy::from_u8(p as u8), Some(p));
        }
        assert!("sometimes".parse::<PromotionPolicy>().is_err());
    }
}

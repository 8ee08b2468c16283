//! When a block read from the backing store is admitted into the cache.

use std::fmt;
use std::str::FromStr;

/// When a block read from the backing store on a miss is copied into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum PromotionPolicy {
    /// On its first miss.
    #[default]
    Always = 1,
    /// After N misses within a window (blocks read once never displace the working set).
    NHit = 2,
}

impl PromotionPolicy {
    pub(crate) fn from_u8(v: u8) -> Option<PromotionPolicy> {
        match v {
            1 => Some(PromotionPolicy::Always),
            2 => Some(PromotionPolicy::NHit),
            _ => None,
        }
    }

    /// Its name as a parameter value and in reports.
    pub fn name(self) -> &'static str {
        match self {
            PromotionPolicy::Always => "always",
            PromotionPolicy::NHit => "nhit",
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
            _ => Err("unknown promotion policy (use always or nhit)".to_string()),
        }
    }
}

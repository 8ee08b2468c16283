//! Cache modes and reclaim orderings, with their names on the command line and their codes on the
//! device.

use std::fmt;
use std::str::FromStr;

/// How writes (and reads) use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Mode {
    /// Writes land in the cache and are acknowledged there; the cleaner writes them back later.
    #[default]
    WriteBack = 1,
    /// Writes go to the cache and to the backing store before they are acknowledged.
    WriteThrough = 2,
    /// Writes go to the backing store only (cached copies are invalidated); reads are cached.
    WriteAround = 3,
    /// The cache is bypassed: reads and writes go to the backing store.
    PassThrough = 4,
}

impl Mode {
    /// Every mode, in the order of their codes.
    pub const ALL: [Mode; 4] = [
        Mode::WriteBack,
        Mode::WriteThrough,
        Mode::WriteAround,
        Mode::PassThrough,
    ];

    pub(crate) fn from_u8(v: u8) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| *m as u8 == v)
    }

    /// Its name on the command line, in the config and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::WriteBack => "writeback",
            Mode::WriteThrough => "writethrough",
            Mode::WriteAround => "writearound",
            Mode::PassThrough => "passthrough",
        }
    }

    /// Dirty data (newer than the backing store) may exist only in write-back.
    pub fn keeps_dirty_data(self) -> bool {
        self == Mode::WriteBack
    }

    /// Read misses are promoted into the cache.
    pub fn caches_reads(self) -> bool {
        self != Mode::PassThrough
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        let s = s.to_ascii_lowercase().replace(['-', '_'], "");
        Mode::ALL
            .into_iter()
            .find(|m| {
                m.name() == s
                    || (s == "wb" && *m == Mode::WriteBack)
                    || (s == "wt" && *m == Mode::WriteThrough)
                    || (s == "wa" && *m == Mode::WriteAround)
                    || (s == "pt" && *m == Mode::PassThrough)
            })
            .ok_or_else(|| {
                "unknown mode (use writeback, writethrough, writearound or passthrough)".to_string()
            })
    }
}

/// Which segment reclaim empties first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum ReclaimPolicy {
    /// The oldest segment: cheapest bookkeeping, no reinsertion.
    Fifo = 1,
    /// The least recently read segment; blocks read since they were written are copied forward
    /// instead of dropped.
    #[default]
    Lru = 2,
}

impl ReclaimPolicy {
    pub(crate) fn from_u8(v: u8) -> Option<ReclaimPolicy> {
        match v {
            1 => Some(ReclaimPolicy::Fifo),
            2 => Some(ReclaimPolicy::Lru),
            _ => None,
        }
    }

    /// Its name on the command line, in the config and in reports.
    pub fn name(self) -> &'static str {
        match self {
            ReclaimPolicy::Fifo => "fifo",
            ReclaimPolicy::Lru => "lru",
        }
    }
}

impl fmt::Display for ReclaimPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReclaimPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<ReclaimPolicy, String> {
        match s.to_ascii_lowercase().as_str() {
            "fifo" => Ok(ReclaimPolicy::Fifo),
            "lru" => Ok(ReclaimPolicy::Lru),
            _ => Err("unknown reclaim policy (use fifo or lru)".to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_roundtrip() {
        for m in Mode::ALL {
            assert_eq!(Mode::from_u8(m as u8), Some(m));
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
        }
        assert_eq!("write-back".parse::<Mode>(), Ok(Mode::WriteBack));
        assert_eq!("WT".parse::<Mode>(), Ok(Mode::WriteThrough));
        assert!("sometimes".parse::<Mode>().is_err());
        assert_eq!(Mode::from_u8(0), None);
        for p in [ReclaimPolicy::Fifo, ReclaimPolicy::Lru] {
            assert_eq!(ReclaimPolicy::from_u8(p as u8), Some(p));
            assert_eq!(p.name().parse::<ReclaimPolicy>(), Ok(p));
        }
    }
}

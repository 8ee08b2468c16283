//! Cache policies: pure decisions, no I/O. The engine asks, the policy answers.

pub mod admission;
mod ghost;
mod mode;
mod promotion;
pub mod sequential;

pub(crate) use ghost::Ghost;
pub use mode::{Mode, ReclaimPolicy};
pub use promotion::PromotionPolicy;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use admission::MissTable;
use sequential::StreamDetector;

/// What the request plan remembers between requests: the recent read and write streams, for
/// the sequential cutoffs, the recent read misses per block, for n-hit promotion, when reclaim
/// last evicted, for `promotion = auto`, and the recently evicted blocks, for the ghost hits that
/// tell whether a bigger cache would help.
pub(crate) struct RequestHistory {
    pub(crate) read_streams: StreamDetector,
    pub(crate) write_streams: StreamDetector,
    /// Allocated when n-hit promotion is first used (RAM is spent only then).
    misses: OnceLock<MissTable>,
    /// Entries of the miss table, sized for the cache.
    miss_entries: usize,
    pub(crate) ghost: Ghost,
    /// The engine-clock second of the last eviction, plus one; 0: none since the cache opened.
    last_eviction: AtomicU32,
}

impl RequestHistory {
    /// For a cache of `slots` blocks.
    pub(crate) fn new(slots: u64) -> RequestHistory {
        RequestHistory {
            read_streams: StreamDetector::default(),
            write_streams: StreamDetector::default(),
            misses: OnceLock::new(),
            miss_entries: admission::entries_for_cache(slots),
            ghost: Ghost::new(slots),
            last_eviction: AtomicU32::new(0),
        }
    }

    /// Reclaim evicted `lbas` at engine-clock second `now`.
    pub(crate) fn evicted(&self, lbas: &[u64], now: u32) {
        self.ghost.evicted(lbas);
        if !lbas.is_empty() {
            self.last_eviction
                .store(now.saturating_add(1), Ordering::Relaxed);
        }
    }

    /// Whether reclaim evicted a block within the `window` seconds up to `now`.
    pub(crate) fn evicting(&self, now: u32, window: u32) -> bool {
        admission::evicted_within(self.last_eviction.load(Ordering::Relaxed), now, window)
    }

    /// The n-hit miss table.
    pub(crate) fn misses(&self) -> &MissTable {
        self.misses
            .get_or_init(|| MissTable::with_capacity(self.miss_entries))
    }
}

//! Deciding once how a request is served: its effective mode after the sequential cutoffs,
//! promotion, the uncached tail and a failed log (Open CAS's `ocf_resolve_effective_cache_mode`).
//! The handlers (`read`, and `write_back`, `write_through`, `write_around`, `pass_through` for
//! writes) then follow the plan and never look at the mode again, so a request is served in one
//! mode from start to end.
//!
//! A write's plan is made under `Engine::writes_gate` (shared), which a mode switch takes
//! exclusively: the mode it was planned in stays in force until the write is done. A read needs
//! no such hold: a mode switch writes back and invalidates nothing a read could find stale.

use crate::policy::Mode;

use super::Cache;

/// Which of a read's misses are promoted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Promote {
    /// Every one: a prefetch, the client asking for the range to be cached.
    All,
    /// Those the promotion policy admits.
    Admitted,
    /// None: the read continued a sequential stream past the read cutoff.
    Sequential,
    /// None: a read-modify-write's edge blocks, about to be overwritten (a write stamps its
    /// blocks, so their promotion would be dropped anyway).
    Never,
}

/// How a read is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadPlan {
    /// From the backing store only: pass-through, or past the last whole cache block.
    Backing,
    /// Hits from the cache device, misses from the backing store, promoted as it says.
    Cached(Promote),
}

/// How a write's cached part is served (the uncached tail goes to the backing store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WritePlan {
    /// A dirty WRITE record, acknowledged once written to the cache device (`write_back`).
    WriteBack,
    /// A WRITE record synced, then the backing store (`write_through`).
    WriteThrough,
    /// An INVALIDATE synced, then the backing store: write-around and pass-through
    /// (`write_around`).
    Around,
    /// Write-back or write-through (the mode kept) continuing a sequential stream past the
    /// write cutoff: around the cache, except blocks dirty there, which take the mode's own
    /// path (`write_around::write_past_cutoff`).
    PastCutoff(Mode),
}

impl WritePlan {
    /// A whole-block write's plan in `mode`, within the cutoff.
    pub(super) fn of_mode(mode: Mode) -> WritePlan {
        match mode {
            Mode::WriteBack => WritePlan::WriteBack,
            Mode::WriteThrough => WritePlan::WriteThrough,
            Mode::WriteAround | Mode::PassThrough => WritePlan::Around,
        }
    }
}

impl Cache {
    /// The plan of a read of `len` bytes at `offset`; `prefetch`: the client asked for the range
    /// to be cached. Observes the read stream (once per request: this is where it is counted).
    pub(super) fn plan_read(&self, offset: u64, len: u64, prefetch: bool) -> ReadPlan {
        let e = &*self.e;
        if !self.mode().caches_reads() || offset >= self.uncached_tail() {
            return ReadPlan::Backing;
        }
        let promote = match e.tunables.sequential_cutoff_read_bytes() {
            // A failed log takes no records; the read is still served from what is cached.
            _ if e.log.failed() => Promote::Never,
            _ if prefetch => Promote::All,
            Some(cutoff) if e.history.read_streams.observe(offset, len) > cutoff => {
                Promote::Sequential
            }
            _ => Promote::Admitted,
        };
        ReadPlan::Cached(promote)
    }

    /// Whether a write of `len` bytes at `offset` continues a sequential stream past the write
    /// cutoff. Observes the write stream, once per request, when it arrives; the modes that go
    /// around the cache anyway need no stream tracking.
    pub(super) fn past_write_cutoff(&self, offset: u64, len: u64) -> bool {
        let e = &*self.e;
        matches!(self.mode(), Mode::WriteBack | Mode::WriteThrough)
            && e.tunables
                .sequential_cutoff_write_bytes()
                .is_some_and(|cutoff| e.history.write_streams.observe(offset, len) > cutoff)
    }

    /// The plan of a write that `past_cutoff` says continues a stream past the cutoff. The
    /// caller holds `writes_gate`.
    pub(super) fn plan_write(&self, past_cutoff: bool) -> WritePlan {
        match self.mode() {
            mode @ (Mode::WriteBack | Mode::WriteThrough) if past_cutoff => {
                WritePlan::PastCutoff(mode)
            }
            mode => WritePlan::of_mode(mode),
        }
    }
}

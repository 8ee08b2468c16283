//! # flashtier-engine: the persistent SSD cache
//!
//! The SSD tier is a log. Every change to the cache, whether a client write, a block promoted after a
//! read miss, a block copied forward by reclaim, an invalidation or a "this block is clean now",
//! is a *record* appended to the log on the cache device, and the in-memory index is nothing but
//! the result of applying those records in order. Recovery after a crash loads the last
//! checkpoint (a snapshot of the index) and applies the records written since, with the very same
//! function the live path uses ([`state::State::apply`]). That one idea carries the durability
//! contract:
//!
//! - **One write = one record**, checksummed together with its data, so a write up to the atomic
//!   size is all-or-nothing after a crash, whatever the device tore.
//! - **Group commit**: records are written (not synced) before a write is acknowledged, like a disk
//!   with a volatile cache; FLUSH and FUA wait for one `fdatasync` shared by everyone waiting.
//!   Nothing is ever written to the slow backing store to satisfy a FLUSH.
//! - **Prefix recovery**: replay stops at the first record that does not check out, so what comes
//!   back is exactly the history up to some point: every durable write, nothing later without
//!   everything earlier.
//! - **Invalidate before bypass**: before any write reaches the backing store around the cache,
//!   the records that map those blocks are durably superseded, so a crash cannot bring back a
//!   cached copy older than the backing store.
//! - **Dirty data is written back, never dropped**: reclaim copies a victim's dirty blocks forward
//!   or writes them back before evicting anything, and blocks are marked clean only after the
//!   backing store is flushed.
//!
//! Random client writes become sequential device writes (segments filled front to back), which
//! is both the write-throughput trick and what keeps flash wear down. The index maps each cached
//! block to its slot in ~13 bytes of RAM per cache block.
//!
//! Modules: [`layout`] (the on-device format), [`index`], [`segments`], [`log`] (the writer
//! thread), [`recover`], [`cache`] (the volume and its per-mode I/O paths), [`cleaner`],
//! [`reclaim`], [`writeback`] (the background cleaner and its controller), [`guards`] (keeping promotions from caching stale data), [`policy`] (modes,
//! sequential stream detection, n-hit admission), [`stats`], [`tunables`] (the live parameters).

pub mod adopt;
pub mod cache;
pub mod cleaner;
pub mod detach;
pub mod engine;
pub mod guards;
pub mod health;
pub mod index;
pub mod integrity;
pub mod layout;
pub mod log;
pub mod lost;
pub mod policy;
mod range_lock;
pub mod reclaim;
pub mod recover;
pub mod scan;
pub mod scrub;
pub mod segments;
pub mod state;
pub mod stats;
pub mod tunables;
pub mod writeback;

pub use cache::{Cache, Status};
pub use detach::{ReleaseError, Released};
pub use engine::{format, FormatOptions, OpenReport, DEFAULT_BLOCK_SIZE, DEFAULT_SEGMENT_SIZE};
pub use integrity::IntegrityError;
pub use layout::superblock::{
    BackingIdentity, FieldDiff, IdentityCheck, IdentityField, Superblock,
};
pub use layout::{Corruption, Structure};
pub use policy::{Mode, PromotionPolicy, ReclaimPolicy};
pub use recover::{read_superblock, Damage};
pub use scrub::{ScrubProgress, ScrubReport};
pub use stats::StatsSnapshot;
pub use tunables::{ParamError, ParamInfo, PARAMS};
pub use writeback::{WritebackState, WritebackStatus};

/// Errors reading or writing the on-device format.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("not a flashtier cache (no flashtier superblock)")]
    NotACache,
    #[error("cache format version {0} is not supported by this flashtier (it reads version {v})", v = layout::FORMAT_VERSION)]
    UnsupportedVersion(u32),
    #[error("cache metadata is damaged: {0}")]
    Corrupt(layout::Corruption),
    #[error("{0}")]
    Invalid(String),
}

/// Errors opening, formatting or closing a cache.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(
        "this cache belongs to backing store '{}' ({} bytes), and '{}' is another one ({}); \
         use the backing store it was formatted for, or, if this one deliberately replaces it, \
         `serve --accept-new-backing` (the cache then starts empty)",
        expected.name, expected.size, found.name,
        mismatches.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    WrongBacking {
        expected: Box<BackingIdentity>,
        found: Box<BackingIdentity>,
        /// Each required fact that differs, expected vs found.
        mismatches: Vec<FieldDiff>,
    },
    #[error(
        "the cache holds {} of its old backing store '{backing}' not written back yet; \
         write it back to that store first (serve it, then `flashtier flush`), or pass \
         --discard-dirty to lose it",
        match dirty_blocks {
            Some(n) => format!("{n} dirty blocks ({} bytes)", n * *block_size as u64),
            None => "dirty data (how much cannot be told: its log does not recover)".to_string(),
        }
    )]
    DirtyData {
        backing: String,
        /// None: the cache does not recover, so it may hold any amount.
        dirty_blocks: Option<u64>,
        block_size: u32,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("cache device I/O failed: {0}")]
    CacheIo(#[source] std::io::Error),
    #[error("backing store I/O failed: {0}")]
    BackingIo(#[source] std::io::Error),
}

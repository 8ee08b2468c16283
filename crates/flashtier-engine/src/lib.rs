//! # flashtier-engine: the persistent SSD cache
//!
//! The SSD tier is a log. Every change to the cache, whether a client write, a block promoted after a
//! read miss, a block copied forward by reclaim, an invalidation or a "this block is clean now",
//! is a *record* appended to the log on the cache device, and the in-memory index is nothing but
//! the result of applying those records in order. Recovery after a crash loads the last
//! checkpoint (a snapshot of the index) and applies the records written since, with the very same
//! function the live path uses (`state::State::apply`). That one idea carries the durability
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
//! Modules: `layout` (the on-device format), `index`, `cow` (the copy-on-write arrays that let
//! checkpoints snapshot the index without stalling clients), `segments`, `log` (the records, waiters
//! and queues), `log_writer` (the thread that writes them), `recover`, `cache` (the volume and its per-mode I/O paths), `backing` (the backing store's
//! device, health and locks), `cleaner`, `reclaim`, `writeback` (the background cleaner and its
//! controller), `mailbox` (waking and stopping those threads), `guards` (keeping promotions from
//! caching stale data), `policy` (modes, sequential stream detection, n-hit admission), `stats`,
//! [`tunables`] (the live parameters). `engine` holds the components' handles; `Cache::open` is
//! the composition root that starts the threads with the handles each needs. The modules are
//! private: the crate root re-exports what the binary and the control plane use, [`adopt`] and
//! [`tunables`] are public as the namespaces callers name, and [`internals`] (hidden) serves the
//! integration tests and fuzzers.

#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![warn(unnameable_types)]

pub mod adopt;
mod backing;
mod cache;
mod cleaner;
mod cow;
mod engine;
mod guards;
mod handoff;
mod health;
mod index;
mod integrity;
mod layout;
mod log;
mod log_writer;
mod lost;
mod mailbox;
mod pass_gate;
mod policy;
mod range_lock;
mod reclaim;
mod recover;
mod scan;
mod segments;
mod state;
mod stats;
pub mod tunables;
mod victim_sink;
mod writeback;
mod writeback_control;

pub use cache::{Cache, Status};
pub use cache::{ReleaseError, Released};
pub use cache::{ScrubProgress, ScrubReport};
pub use engine::{format, FormatOptions, OpenReport, DEFAULT_BLOCK_SIZE, DEFAULT_SEGMENT_SIZE};
pub use integrity::IntegrityError;
pub use layout::superblock::{
    BackingIdentity, FieldDiff, IdentityCheck, IdentityField, Superblock,
};
pub use layout::Geometry;
pub use layout::{Corruption, Structure};
pub use policy::{Mode, PromotionPolicy, ReclaimPolicy};
pub use recover::{read_superblock, Damage};
pub use scan::{scan, ScanReport};
pub use stats::StatsSnapshot;
pub use tunables::{ParamError, ParamInfo, PARAMS};
pub use victim_sink::VictimSink;
pub use writeback_control::{WritebackState, WritebackStatus};

/// The on-device format's types and decoders, for the engine's own integration tests and the
/// fuzz harness, not for the crates that use the engine: a power-loss or integrity test has to
/// damage an image in one precise place (a batch header, a checkpoint body, one superblock copy)
/// and a fuzzer calls the decoders directly.
/// Re-exporting those parts of `layout` here, rather than making it public, keeps them out of
/// the documented API and makes every use of them from outside the engine say `internals`. It
/// carries no stability promise.
#[doc(hidden)]
pub mod internals {
    pub use crate::layout::{
        batch, checkpoint, superblock, FORMAT_VERSION, META_BLOCK, OLDEST_READABLE_VERSION,
    };
}

/// Errors reading or writing the on-device format.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The device holds no flashtier superblock.
    #[error("not a flashtier cache (no flashtier superblock)")]
    NotACache,
    /// A cache written in a format version this build does not read.
    #[error("cache format version {0} is not supported by this flashtier (it reads versions {old} to {v})", old = layout::OLDEST_READABLE_VERSION, v = layout::FORMAT_VERSION)]
    UnsupportedVersion(u32),
    /// Metadata that fails its checks (checksums, ranges); says what and where.
    #[error("cache metadata is damaged: {0}")]
    Corrupt(layout::Corruption),
    /// Parameters the format cannot express (sizes, lengths); says which.
    #[error("{0}")]
    Invalid(String),
}

/// Errors opening, formatting or closing a cache.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The on-device format refused the device.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The cache belongs to another backing store than the one it is opened with.
    #[error(
        "this cache belongs to backing store '{}' ({} bytes), and '{}' is another one ({}); \
         use the backing store it was formatted for, or, if this one deliberately replaces it, \
         `serve --accept-new-backing` (the cache then starts empty)",
        expected.name, expected.size, found.name,
        mismatches.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    WrongBacking {
        /// The backing store recorded in the cache.
        expected: Box<BackingIdentity>,
        /// The backing store it is opened with.
        found: Box<BackingIdentity>,
        /// Each required fact that differs, expected vs found.
        mismatches: Vec<FieldDiff>,
    },
    /// Replacing the backing store would lose dirty data of the old one.
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
        /// The name of the backing store the dirty data belongs to.
        backing: String,
        /// None: the cache does not recover, so it may hold any amount.
        dirty_blocks: Option<u64>,
        /// The cache's block size, to tell the bytes.
        block_size: u32,
    },
    /// A request that cannot be carried out as asked; says why.
    #[error("{0}")]
    Invalid(String),
    /// The cache device failed a read, write or flush.
    #[error("cache device I/O failed: {0}")]
    CacheIo(#[source] std::io::Error),
    /// The backing store failed a read, write or flush.
    #[error("backing store I/O failed: {0}")]
    BackingIo(#[source] std::io::Error),
}

//! Releasing a cache (`flashtier detach`): closing it and re-initialising its device empty.
//!
//! Once a cache is released, the backing store is served (and changed) without it. Anything the
//! device still held would then be stale: a restart with `--cache`, or a later attach, must not
//! find it. So release formats the device again, for the same backing store and with the same
//! geometry (a new uuid), instead of only closing it. It refuses while dirty blocks remain, unless
//! told to discard them: they are the only copy of data clients were told is written.

use std::sync::Arc;

use flashtier_io::BlockDev;

use crate::engine::{self, FormatOptions};
use crate::layout::superblock::Superblock;
use crate::policy::Mode;
use crate::{Cache, EngineError};

/// Why [`Cache::release`] refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// Nothing changed: the cache keeps serving with its dirty blocks.
    #[error(
        "the cache holds {dirty_blocks} dirty blocks ({} bytes) not yet written back to the \
         backing store; write them back first (switch to passthrough), or discard them",
        dirty_blocks * *block_size as u64
    )]
    Dirty {
        /// Blocks not written back yet.
        dirty_blocks: u64,
        /// The cache's block size, to tell the bytes.
        block_size: u32,
    },
    /// Nothing changed: serving the backing store directly would return older data for blocks
    /// whose newest version the cache lost.
    #[error(
        "{lost_blocks} block(s) are lost (their newest data failed its checksum in the cache); \
         the backing store holds older data for them. Rewrite them or acknowledge the loss with \
         `flashtier forget-lost`, or discard"
    )]
    Lost {
        /// Blocks whose newest data was lost.
        lost_blocks: u64,
    },
    /// The cache is closed; the device may still hold the old cache (see the error).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// What [`Cache::release`] leaves behind.
pub struct Released {
    /// The cache device, holding an empty cache for the same backing store.
    pub device: Arc<dyn BlockDev>,
    /// The new cache's superblock (its uuid tells it apart from any other cache).
    pub superblock: Superblock,
    /// Dirty blocks dropped (non-zero only when discarding).
    pub discarded_blocks: u64,
}

impl Cache {
    /// The device the cache lives on.
    pub fn device(&self) -> Arc<dyn BlockDev> {
        self.engine().cache.clone()
    }

    /// Closes the cache and formats its device empty, so that nothing it held can be served
    /// again. Refused (nothing changes) while dirty blocks remain, unless `discard_dirty`, which
    /// drops them: the backing store then lacks the writes they held.
    ///
    /// The caller stops sending requests first (the export serves the backing store by then).
    /// Any request that still arrives reads the backing store directly or fails: the old index
    /// must never be used to read slots the next cache on this device may overwrite.
    pub fn release(&self, discard_dirty: bool) -> Result<Released, ReleaseError> {
        let e = self.engine();
        let discarded_blocks = {
            // No write can make a block dirty while this is held (writes hold it shared, and
            // decide what to do by the mode while they hold it).
            let _no_writes = e.writes_gate.write();
            let status = self.status();
            let dirty = status.dirty_blocks;
            if dirty > 0 && !discard_dirty {
                return Err(ReleaseError::Dirty {
                    dirty_blocks: dirty,
                    block_size: e.geo.block_size,
                });
            }
            if status.lost_blocks > 0 && !discard_dirty {
                return Err(ReleaseError::Lost {
                    lost_blocks: status.lost_blocks,
                });
            }
            e.set_mode_flag(Mode::PassThrough);
            dirty
        };
        if discarded_blocks > 0 {
            tracing::warn!(
                blocks = discarded_blocks,
                bytes = discarded_blocks * e.geo.block_size as u64,
                "discarding dirty blocks: the backing store does not have these writes"
            );
        }
        let old = e.superblock.lock().clone();
        // Stops every thread and makes writes that went around the cache durable. Formatted
        // even if that fails (a backing flush error): the device holds nothing the backing
        // store lacks by now, and an old index left on it would turn stale.
        let closed = self.close();
        let formatted = engine::format(
            &*e.cache,
            old.backing.clone(),
            FormatOptions {
                block_size: old.geometry.block_size,
                segment_size: old.geometry.segment_size,
                mode: old.default_mode,
                reclaim: self.engine().reclaim_policy(),
            },
        );
        closed?;
        let superblock = formatted?;
        tracing::info!(
            device = %e.cache.describe(),
            "cache released: its device now holds an empty cache"
        );
        Ok(Released {
            device: e.cache.clone(),
            superblock,
            discarded_blocks,
        })
    }
}

//! Engine counters: relaxed atomics bumped on the I/O paths, read as a consistent-enough snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters.
        #[derive(Default)]
        pub struct Stats {
            $($(#[$doc])* pub $name: AtomicU64,)*
        }

        /// A copy of the counters at one moment.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Stats {
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }

        impl StatsSnapshot {
            /// `(name, value)` for every counter, for tables and machine-readable output.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters! {
    /// Client read requests.
    reads,
    /// Blocks read that were in the cache.
    read_hit_blocks,
    /// Blocks read from the backing store because they were not cached.
    read_miss_blocks,
    /// Read misses that waited for a write of their blocks to land on the backing store, which a
    /// read overlapping it could see half done.
    read_miss_waits,
    /// Client read requests served in a batch of reads together (pipelined READs taken together
    /// by the NBD server: `cache::read_batch`); counted in `reads` too.
    batched_reads,
    /// Client write requests.
    writes,
    /// Client write requests logged in a group with others (pipelined WRITEs taken together by
    /// the NBD server: `cache::write_batch`); counted in `writes` too.
    batched_writes,
    /// Blocks written by clients.
    write_blocks,
    /// Written blocks that replaced a cached version.
    write_hit_blocks,
    /// Edge blocks of writes smaller than a block that needed no read: the previous partial
    /// write of the block was remembered (`cache::partial_blocks`).
    partial_write_blocks_from_memory,
    /// Blocks cached after a read miss.
    promoted_blocks,
    /// Promotions dropped because a write raced with them.
    promotions_dropped,
    /// Read-miss blocks not promoted because the log writer was behind: more promotions were
    /// queued than it may hold (see `MAX_QUEUED_PROMOTION`).
    promotions_shed_blocks,
    /// Read-miss blocks that reclaim had evicted within the last cache-size worth of evictions:
    /// about the extra hits a cache twice the size would have had (estimated from a sample of
    /// blocks on caches over 65,536 blocks; see `policy/ghost.rs`).
    ghost_hit_blocks,
    /// Read-miss blocks not promoted because they continued a sequential stream past the cutoff.
    bypassed_read_blocks,
    /// Read-miss blocks not promoted because they had fewer than promotion_nhit recent misses.
    promotions_skipped_blocks,
    /// Blocks written around the cache because their write continued a sequential stream past
    /// the write cutoff.
    bypassed_write_blocks,
    /// Clean blocks dropped by reclaim.
    evicted_blocks,
    /// Blocks copied forward by reclaim (compacted, recently read, or dirty).
    moved_blocks,
    /// Segments reclaim emptied.
    reclaimed_segments,
    /// Segments reclaim emptied by copying all their blocks forward instead of evicting any
    /// (compaction, `reclaim_compact_pct`); included in reclaimed_segments.
    compacted_segments,
    /// Segments reclaim emptied that a FREE record gave back to the log (the others wait in
    /// quarantine for checkpoints, see `segments`).
    freed_segments,
    /// Dirty blocks written back to the backing store.
    cleaned_blocks,
    /// Writes to the backing store by the cleaner (after coalescing).
    cleaner_writes,
    /// Dirty blocks written back by the background cleaner (controller, watermark, max age,
    /// backing idle); included in cleaned_blocks.
    background_cleaned_blocks,
    /// Times reclaim or the background cleaner retried after a write-back failed on the backing
    /// store (with backoff; the dirty blocks stay in the cache).
    writeback_retries,
    /// Log slots left unused (the seal's included) when the log sealed a segment early because
    /// the next batch did not fit its rest: space lost until reclaim empties the segment.
    sealed_unused_blocks,
    /// Log batches written to the cache device.
    batches,
    /// Records in those batches.
    records,
    /// Writes to the cache device (log batches and their headers, checkpoints).
    cache_writes,
    /// Bytes written to the cache device (log, checkpoints, superblocks).
    cache_write_bytes,
    /// Reads from the cache device (hits, and reclaim and the cleaner reading blocks back).
    cache_reads,
    /// Bytes read from the cache device.
    cache_read_bytes,
    /// Syncs of the cache device.
    cache_syncs,
    /// Checkpoints written.
    checkpoints,
    /// Microseconds the log writer spent syncing the cache device for checkpoints (before each
    /// snapshot and after each image): log rounds wait meanwhile.
    checkpoint_sync_us,
    /// Microseconds the log writer spent taking checkpoint snapshots (under the state lock).
    checkpoint_snapshot_us,
    /// Microseconds checkpoint threads spent encoding and writing images (beside the log).
    checkpoint_write_us,
    /// Reads from the backing store.
    backing_reads,
    /// Bytes read from the backing store.
    backing_read_bytes,
    /// Writes to the backing store (bypassing writes, write-through, the cleaner).
    backing_writes,
    /// Bytes written to the backing store.
    backing_write_bytes,
    /// Flushes of the backing store.
    backing_flushes,
    /// Client FLUSH requests.
    flushes,
    /// I/O errors from the cache device.
    cache_errors,
    /// I/O errors from the backing store.
    backing_errors,
    /// Blocks read from the cache device that failed their checksum twice (clean ones were
    /// dropped and read from the backing store, dirty ones lost).
    checksum_errors,
    /// Blocks that failed their checksum once and read back fine (a transient error).
    checksum_retries,
    /// Blocks whose newest data was lost: dirty blocks that failed their checksum, and blocks
    /// of damaged records recovery had to skip.
    lost_blocks,
    /// Client reads refused (EIO) because they touched lost blocks.
    lost_reads,
    /// Cached blocks the scrub read and checked.
    scrubbed_blocks,
    /// Times the cache log came back after the cache device failed, without a restart.
    log_recoveries,
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

//! Checking what is read from the cache device, and what to do when it does not check out.
//!
//! Every block read from the cache device (client hits, the cleaner's write-back, reclaim's
//! copies, the scrub) is checked against the CRC32C its record carried, kept per slot in memory
//! (`State::crcs`). A block that fails is read once more (a transient transfer error costs
//! nothing), and then:
//!
//! - a clean block is dropped from the cache: the backing store has the same data, and the
//!   caller reads it from there;
//! - a dirty block is *lost*: it is dropped and its address marked lost (see `lost`), so reads
//!   fail with EIO and write-back skips it, rather than serve or write back bad data or fall back
//!   to the backing store's older copy. A LOST record makes that durable;
//! - a block that moved on meanwhile (rewritten, copied forward) is simply read again.

use crate::engine::Engine;
use crate::layout::batch::Kind;
use crate::log::Record;
use crate::stats::Stats;

/// Why a read of the cache failed, for the client's error message (the errno is EIO).
#[derive(Debug, thiserror::Error)]
pub enum IntegrityError {
    #[error(
        "block {lba} is lost: its newest data was in the cache and failed its checksum (rewrite \
         it, or acknowledge the loss with `flashtier forget-lost`)"
    )]
    /// A block whose newest data failed its checksum in the cache.
    Lost {
        /// The block's number (in cache blocks).
        lba: u64,
    },
}

impl From<IntegrityError> for std::io::Error {
    fn from(e: IntegrityError) -> std::io::Error {
        std::io::Error::other(e)
    }
}

/// What became of a block whose cache copy failed its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Read again, it checked out: the buffer holds good data now.
    Repaired,
    /// A clean block, dropped from the cache: read it from the backing store.
    Dropped,
    /// A dirty block, now lost.
    Lost,
    /// The block no longer lives in that slot: look it up again.
    Moved,
}

/// Whether `data` (one block) matches `crc`.
pub(crate) fn intact(data: &[u8], crc: u32) -> bool {
    crc32c::crc32c(data) == crc
}

/// Checks a block of `lba` read from `slot` into `block` against `crc`, and handles it as
/// [`bad_block`] does if it fails. What the log writer checks with, after a failed sync.
pub(crate) fn check_block(e: &Engine, lba: u64, slot: u32, crc: u32, block: &mut [u8]) {
    if !intact(block, crc) {
        bad_block(e, lba, slot, crc, block);
    }
}

/// Handles a block of `lba` read from `slot` into `block` that did not match `crc`. The slot's
/// segment must still be pinned by the caller.
pub(crate) fn bad_block(e: &Engine, lba: u64, slot: u32, crc: u32, block: &mut [u8]) -> Verdict {
    let reread = e.cache.read_at(block, e.geo.slot_offset(slot));
    Stats::add(&e.stats.cache_reads, 1);
    Stats::add(&e.stats.cache_read_bytes, block.len() as u64);
    if reread.is_ok() && intact(block, crc) {
        Stats::add(&e.stats.checksum_retries, 1);
        tracing::warn!(
            lba,
            slot,
            "cache block failed its checksum once, then read back fine"
        );
        return Verdict::Repaired;
    }
    let verdict = {
        let mut st = e.state.write();
        match st.unmap_if(lba, slot) {
            None => Verdict::Moved,
            Some(false) => Verdict::Dropped,
            Some(true) => {
                st.lost.insert(lba, 1);
                e.log.hint_made();
                Verdict::Lost
            }
        }
    };
    match verdict {
        Verdict::Moved => {}
        Verdict::Dropped => {
            Stats::add(&e.stats.checksum_errors, 1);
            tracing::error!(
                lba,
                slot,
                "cache block failed its checksum; clean, so dropped and read from the backing store"
            );
        }
        Verdict::Lost => {
            Stats::add(&e.stats.checksum_errors, 1);
            Stats::add(&e.stats.lost_blocks, 1);
            tracing::error!(
                lba,
                slot,
                "dirty cache block failed its checksum: its data is lost; reads of it fail until \
                 it is written again"
            );
            // Conditional on the slot, so a write that lands meanwhile is never undone by it.
            e.log
                .append_async(Record::new(Kind::Lost, lba, 1, None).aux(slot as u64), true);
            e.log.hint_queued();
        }
        Verdict::Repaired => unreachable!(),
    }
    verdict
}

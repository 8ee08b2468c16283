//! The on-device format of the SSD tier: where everything lives and how it is encoded.
//!
//! ```text
//! 0                  superblock copy A (4 KiB)
//! 4 KiB              superblock copy B (4 KiB)
//! 8 KiB              checkpoint slot 0 (checkpoint_slot_size bytes)
//! 8 KiB + slot size  checkpoint slot 1
//! data_offset        segment 0, segment 1, ... (segment_size bytes each)
//! ```
//!
//! Segments hold the log: batches of records, each batch one header block followed by the data
//! blocks of its records (see [`batch`]). Checkpoints ([`checkpoint`]) hold a snapshot of the
//! index and the segment free list; recovery loads the newest valid one and replays the log after
//! it. The superblock ([`superblock`]) names the geometry, the backing store the cache belongs to,
//! and whether the last shutdown was clean. Every structure carries a magic number and a CRC32C,
//! and every integer is little-endian.

pub mod batch;
pub mod checkpoint;
pub mod superblock;

use crate::FormatError;

use checkpoint::{CheckpointEntry, LogHead};

/// What is wrong with damaged cache metadata: a typed reason, so that callers (recovery's
/// choice between two copies, `format`'s refusal, tests) match on it rather than on text.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Corruption {
    /// Shorter than its format says.
    #[error("{0} is truncated")]
    Truncated(Structure),
    /// Its checksum does not match: torn or damaged.
    #[error("{0} checksum mismatch")]
    Checksum(Structure),
    /// The slot holds no checkpoint at all.
    #[error("no checkpoint")]
    NoCheckpoint,
    /// Neither slot holds a checkpoint that checks out; what was wrong with each.
    #[error("no valid checkpoint ({})", .0.join("; "))]
    NoValidCheckpoint(Vec<String>),
    /// The header's body length disagrees with its entry and free counts.
    #[error("checkpoint body length is inconsistent")]
    CheckpointBodyLength,
    /// Reading the checkpoint slot failed.
    #[error("checkpoint slot unreadable: {0}")]
    Unreadable(std::sync::Arc<std::io::Error>),
    /// The backing store's fingerprint in the superblock is malformed; says how.
    #[error("backing fingerprint: {0}")]
    Fingerprint(&'static str),
    /// The backing store's name is longer than its field.
    #[error("backing identity too long")]
    IdentityTooLong,
    /// The backing store's name is not text.
    #[error("backing identity is not UTF-8")]
    IdentityNotUtf8,
    /// Sizes and offsets that cannot describe a cache device.
    #[error("superblock geometry is inconsistent: {0:?}")]
    Geometry(Geometry),
    /// The cache device is smaller than the geometry it was formatted with.
    #[error("the superblock describes {described} bytes but the device has only {device}")]
    DeviceTooSmall {
        /// Bytes the geometry uses.
        described: u64,
        /// Bytes the device has.
        device: u64,
    },
    /// A default mode this build does not know.
    #[error("unknown mode {0}")]
    UnknownMode(u8),
    /// A reclaim policy this build does not know.
    #[error("unknown reclaim policy {0}")]
    UnknownReclaimPolicy(u8),
    /// A free segment number past the last segment.
    #[error("checkpoint free list has bad segment {0}")]
    BadFreeSegment(u32),
    /// The log head lies outside the segments, or past its segment's end.
    #[error("checkpoint log head is impossible: {0:?}")]
    ImpossibleHead(LogHead),
    /// An index entry whose slot or block lies outside the cache or the backing store.
    #[error("checkpoint entry out of range: {0:?}")]
    EntryOutOfRange(CheckpointEntry),
    /// Two index entries for one slot or one block.
    #[error("checkpoint maps a slot or block twice: {0:?}")]
    MappedTwice(CheckpointEntry),
    /// A lost range past the end of the backing store.
    #[error("checkpoint lost range out of range: {lba}+{blocks}")]
    LostRangeOutOfRange {
        /// First block of the range.
        lba: u64,
        /// Blocks in it.
        blocks: u64,
    },
}

/// A structure of the on-device format, as [`Corruption`] names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Structure {
    /// A superblock copy.
    Superblock,
    /// A checkpoint's fixed header.
    CheckpointHeader,
    /// A checkpoint's body (free list, index entries, lost ranges).
    CheckpointBody,
}

impl std::fmt::Display for Structure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Structure::Superblock => "superblock",
            Structure::CheckpointHeader => "checkpoint header",
            Structure::CheckpointBody => "checkpoint body",
        })
    }
}

/// The format this code writes. Version 3 added the FREE record (`batch::Kind::Free`): reclaim
/// logs the segments it frees instead of waiting two checkpoints to reuse them.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest format this code reads. A version-2 cache is the same but for FREE records, which
/// its log cannot hold, so it opens as it is; opening writes a version-3 superblock, which a
/// flashtier that reads only version 2 refuses (it would take a FREE record for damage).
pub const OLDEST_READABLE_VERSION: u32 = 2;

/// Whether this code reads caches of format `version`.
pub fn readable_version(version: u32) -> bool {
    (OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version)
}

/// Size of a superblock copy and the unit of metadata alignment.
pub const META_BLOCK: u64 = 4096;

/// Byte size of one index entry in a checkpoint.
pub const CHECKPOINT_ENTRY_LEN: u64 = 16;

/// Where things are on a cache device of a given size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Cache block: the unit of caching and of the index (a power of two, 4 KiB..64 KiB).
    pub block_size: u32,
    /// Segment: the unit of log allocation and reclaim (a multiple of the block size).
    pub segment_size: u32,
    /// Segments on the device.
    pub segment_count: u32,
    /// Byte offset of the first checkpoint slot.
    pub checkpoint_offset: u64,
    /// Bytes of one checkpoint slot (room for a full cache's checkpoint).
    pub checkpoint_slot_size: u64,
    /// Byte offset of the first segment.
    pub data_offset: u64,
}

impl Geometry {
    /// Lays out a device of `device_size` bytes: as many segments as fit once the superblocks and
    /// two checkpoint slots large enough for a full cache are set aside.
    pub fn compute(
        device_size: u64,
        block_size: u32,
        segment_size: u32,
    ) -> Result<Geometry, FormatError> {
        if !block_size.is_power_of_two() || !(4096..=65536).contains(&block_size) {
            return Err(FormatError::Invalid(format!(
                "block size {block_size} must be a power of two from 4096 to 65536"
            )));
        }
        if !segment_size.is_multiple_of(block_size) || segment_size / block_size < 16 {
            return Err(FormatError::Invalid(format!(
                "segment size {segment_size} must be a multiple of the block size holding at \
                 least 16 blocks"
            )));
        }
        let checkpoint_offset = 2 * META_BLOCK;
        let fits = |segments: u64| -> Option<Geometry> {
            let slot = Self::checkpoint_slot_bytes(segments, segment_size / block_size);
            let data_offset = (checkpoint_offset + 2 * slot).next_multiple_of(block_size as u64);
            let end = data_offset.checked_add(segments.checked_mul(segment_size as u64)?)?;
            (end <= device_size && segments <= u32::MAX as u64).then_some(Geometry {
                block_size,
                segment_size,
                segment_count: segments as u32,
                checkpoint_offset,
                checkpoint_slot_size: slot,
                data_offset,
            })
        };
        // Checkpoint slots grow with the segment count, so start from an upper bound and step
        // down; the slots are ~0.4% of the device, so this takes a couple of steps.
        let mut segments = device_size.saturating_sub(checkpoint_offset) / segment_size as u64;
        while segments >= 4 {
            if let Some(mut g) = fits(segments) {
                // Stepping down may overshoot by a segment or two; take back what still fits.
                while let Some(bigger) = fits(g.segment_count as u64 + 1) {
                    g = bigger;
                }
                return Ok(g);
            }
            let slot = Self::checkpoint_slot_bytes(segments, segment_size / block_size);
            let overshoot = (checkpoint_offset + 2 * slot + segments * segment_size as u64)
                .saturating_sub(device_size);
            segments -= overshoot.div_ceil(segment_size as u64).max(1);
        }
        Err(FormatError::Invalid(format!(
            "a cache device of {device_size} bytes is too small for segments of {segment_size} \
             bytes (at least 4 segments plus metadata are needed)"
        )))
    }

    /// Bytes of one checkpoint slot able to hold every block of `segments` segments.
    fn checkpoint_slot_bytes(segments: u64, blocks_per_segment: u32) -> u64 {
        let entries = segments * blocks_per_segment as u64;
        let lost = Self::lost_ranges_for(entries);
        (checkpoint::HEADER_LEN as u64 + segments * 4 + (entries + lost) * CHECKPOINT_ENTRY_LEN)
            .next_multiple_of(META_BLOCK)
    }

    /// Ranges of lost blocks a checkpoint has room for, besides a full index.
    fn lost_ranges_for(slots: u64) -> u64 {
        (slots / 64).max(256)
    }

    /// Most ranges of lost blocks the cache can remember (what a checkpoint has room for): past
    /// that much damage the cache fails rather than forget a loss.
    pub fn max_lost_ranges(&self) -> u64 {
        Self::lost_ranges_for(self.slot_count() as u64)
    }

    /// Cache blocks in one segment.
    pub fn blocks_per_segment(&self) -> u32 {
        self.segment_size / self.block_size
    }

    /// Cache blocks ("slots") on the device, including those that will hold batch headers.
    pub fn slot_count(&self) -> u32 {
        self.segment_count * self.blocks_per_segment()
    }

    /// The segment a slot is in.
    pub fn segment_of(&self, slot: u32) -> u32 {
        slot / self.blocks_per_segment()
    }

    /// The first slot of a segment.
    pub fn first_slot(&self, segment: u32) -> u32 {
        segment * self.blocks_per_segment()
    }

    /// Byte offset of a slot on the device.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        self.data_offset + slot as u64 * self.block_size as u64
    }

    /// Byte offset of checkpoint slot 0 or 1 on the device.
    pub fn checkpoint_slot_offset(&self, slot: u32) -> u64 {
        self.checkpoint_offset + slot as u64 * self.checkpoint_slot_size
    }

    /// Bytes of the device the geometry uses.
    pub fn used_size(&self) -> u64 {
        self.checked_used_size()
            .expect("a geometry from compute() or a decoded superblock fits in u64")
    }

    /// `used_size`, or None if a (corrupt) geometry overflows.
    pub fn checked_used_size(&self) -> Option<u64> {
        self.data_offset
            .checked_add(self.segment_count as u64 * self.segment_size as u64)
    }
}

/// Little-endian field access on a byte slice, with bounds checked by the caller's layout.
pub(crate) mod le {
    pub fn u16(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
    }
    pub fn u32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    pub fn u64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }
    pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_the_device_and_reserves_full_checkpoints() {
        for (size, seg) in [
            (64u64 << 20, 1u32 << 20),
            (4 << 30, 4 << 20),
            (1 << 40, 4 << 20),
            ((1 << 30) + 12345, 2 << 20),
        ] {
            let g = Geometry::compute(size, 4096, seg).unwrap();
            assert!(g.used_size() <= size, "{g:?} overflows {size}");
            // Not wasteful: one more segment (and its checkpoint space) would not fit.
            let more =
                Geometry::checkpoint_slot_bytes(g.segment_count as u64 + 1, g.blocks_per_segment());
            let data_offset = (2 * META_BLOCK + 2 * more).next_multiple_of(4096);
            assert!(
                data_offset + (g.segment_count as u64 + 1) * seg as u64 > size,
                "{g:?} leaves room for another segment"
            );
            assert!(
                g.checkpoint_slot_size
                    >= checkpoint::HEADER_LEN as u64 + g.slot_count() as u64 * CHECKPOINT_ENTRY_LEN
            );
            assert_eq!(g.data_offset % 4096, 0);
            assert_eq!(g.slot_offset(g.first_slot(1)), g.data_offset + seg as u64);
            assert_eq!(g.segment_of(g.first_slot(3) + 5), 3);
        }
    }

    #[test]
    fn geometry_rejects_bad_parameters() {
        assert!(Geometry::compute(1 << 30, 3000, 1 << 20).is_err());
        assert!(Geometry::compute(1 << 30, 4096, 4096 * 8).is_err());
        assert!(Geometry::compute(1 << 30, 4096, 4097 * 16).is_err());
        assert!(Geometry::compute(3 << 20, 4096, 1 << 20).is_err());
    }
}

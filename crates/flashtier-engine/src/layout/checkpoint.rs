//! Checkpoints: a snapshot of the index and of the log's position, so recovery replays only the
//! log written since. Two slots alternate (checkpoint n goes to slot n % 2); recovery uses the
//! valid one with the higher number, so a checkpoint torn by a crash costs nothing.
//!
//! ```text
//! header (4 KiB):
//!   off len field
//!     0   8 magic "FLTCKPT\0"
//!     8   4 format version
//!    12   4 reserved (0)
//!    16   8 checkpoint number (increases by one per checkpoint)
//!    24   8 next sequence number: replay starts at the record with this number
//!    32   8 log epoch at the time of the snapshot
//!    40   4 open segment (u32::MAX: none), 44 4 blocks already used in it
//!    48   8 index entries in the body
//!    56   4 free segments in the body
//!    60   4 lost ranges in the body
//!    64   8 body length in bytes
//!    72   4 CRC32C of the body
//!  4092   4 CRC32C of bytes 0..4092
//! body:
//!   free list: u32 segment numbers, in the order the log will use them
//!   index:     16 bytes per cached block: slot u32, CRC32C of the block's data u32,
//!              LBA u64 with bit 63 set when the block is dirty
//!   lost:      16 bytes per range of lost blocks: first LBA u64, block count u64
//! ```

use super::{le, readable_version, Corruption, Structure, FORMAT_VERSION};
use crate::FormatError;

/// The first 8 bytes of every checkpoint.
pub const MAGIC: &[u8; 8] = b"FLTCKPT\0";
/// Bytes of the header; the body follows.
pub const HEADER_LEN: usize = 4096;
const NO_SEGMENT: u32 = u32::MAX;
const LBA_DIRTY: u64 = 1 << 63;
/// Bytes of one index entry, and of one lost range.
pub const ENTRY_LEN: u64 = 16;

/// One cached block in a checkpoint's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointEntry {
    /// Where on the device its data lives.
    pub slot: u32,
    /// Which block it is (in cache blocks).
    pub lba: u64,
    /// It is not on the backing store yet.
    pub dirty: bool,
    /// CRC32C of the block's data in the slot, checked on every read of it.
    pub crc: u32,
}

/// Where the log head was when the checkpoint was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogHead {
    /// The segment the log was filling.
    pub segment: u32,
    /// Blocks of the segment already written.
    pub used: u32,
}

/// A snapshot of the index, the free list, the lost ranges and where the log stood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Increases by one per checkpoint; recovery takes the valid one with the higher number.
    pub number: u64,
    /// Replay starts at the record with this sequence number.
    pub next_seq: u64,
    /// Log epoch at the time of the snapshot.
    pub epoch: u64,
    /// The segment the log was filling, if any.
    pub open: Option<LogHead>,
    /// Free segments in the order the log takes them after this checkpoint.
    pub free: Vec<u32>,
    /// Every cached block.
    pub entries: Vec<CheckpointEntry>,
    /// Ranges `(first LBA, blocks)` whose newest data was lost: reads of them fail.
    pub lost: Vec<(u64, u64)>,
}

/// The fixed part of a checkpoint, decoded before its body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointHeader {
    /// The checkpoint number.
    pub number: u64,
    /// Replay starts at the record with this sequence number.
    pub next_seq: u64,
    /// Log epoch at the time of the snapshot.
    pub epoch: u64,
    /// The segment the log was filling, if any.
    pub open: Option<LogHead>,
    /// Index entries in the body.
    pub entry_count: u64,
    /// Free segments in the body.
    pub free_count: u32,
    /// Lost ranges in the body.
    pub lost_count: u32,
    /// Body length in bytes.
    pub body_len: u64,
    /// CRC32C of the body.
    pub body_crc: u32,
}

/// Everything of a checkpoint but its index entries, which [`Frame::encode_into`] takes from an
/// iterator: the log's checkpoint encodes a snapshot of the index straight into the buffer it
/// writes, without collecting the entries first (for a full 1 TiB cache they are 4 GiB).
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// See [`Checkpoint::number`].
    pub number: u64,
    /// See [`Checkpoint::next_seq`].
    pub next_seq: u64,
    /// See [`Checkpoint::epoch`].
    pub epoch: u64,
    /// See [`Checkpoint::open`].
    pub open: Option<LogHead>,
    /// See [`Checkpoint::free`].
    pub free: &'a [u32],
    /// How many entries the iterator given to [`Frame::encode_into`] yields.
    pub entry_count: u64,
    /// See [`Checkpoint::lost`].
    pub lost: &'a [(u64, u64)],
}

impl Frame<'_> {
    /// Bytes the body takes.
    pub fn body_len(&self) -> u64 {
        self.free.len() as u64 * 4 + (self.entry_count + self.lost.len() as u64) * ENTRY_LEN
    }

    /// Bytes of the encoded checkpoint: header and body, padded to a multiple of 4 KiB.
    pub fn encoded_len(&self) -> u64 {
        (HEADER_LEN as u64 + self.body_len()).next_multiple_of(4096)
    }

    /// Encodes the checkpoint into `out` ([`Frame::encoded_len`] bytes), in one pass over the
    /// entries. Fails, leaving `out` unusable, if `out` has the wrong length or `entries` yields
    /// other than `entry_count` entries.
    pub fn encode_into(
        &self,
        entries: impl Iterator<Item = CheckpointEntry>,
        out: &mut [u8],
    ) -> Result<(), FormatError> {
        if out.len() as u64 != self.encoded_len() {
            return Err(FormatError::Invalid(format!(
                "checkpoint buffer of {} bytes for {} bytes",
                out.len(),
                self.encoded_len()
            )));
        }
        let body_len = self.body_len() as usize;
        let (h, rest) = out.split_at_mut(HEADER_LEN);
        let (body, padding) = rest.split_at_mut(body_len);
        padding.fill(0);
        let mut at = 0;
        for seg in self.free {
            le::put_u32(body, at, *seg);
            at += 4;
        }
        let entries_end = at + (self.entry_count * ENTRY_LEN) as usize;
        for e in entries {
            if at == entries_end {
                return Err(FormatError::Invalid(format!(
                    "more than the {} checkpoint entries announced",
                    self.entry_count
                )));
            }
            le::put_u32(body, at, e.slot);
            le::put_u32(body, at + 4, e.crc);
            le::put_u64(body, at + 8, e.lba | if e.dirty { LBA_DIRTY } else { 0 });
            at += ENTRY_LEN as usize;
        }
        if at != entries_end {
            return Err(FormatError::Invalid(format!(
                "fewer than the {} checkpoint entries announced",
                self.entry_count
            )));
        }
        for &(lba, n) in self.lost {
            le::put_u64(body, at, lba);
            le::put_u64(body, at + 8, n);
            at += ENTRY_LEN as usize;
        }
        let body_crc = crc32c::crc32c(body);
        h.fill(0);
        h[0..8].copy_from_slice(MAGIC);
        le::put_u32(h, 8, FORMAT_VERSION);
        le::put_u64(h, 16, self.number);
        le::put_u64(h, 24, self.next_seq);
        le::put_u64(h, 32, self.epoch);
        let (seg, used) = self.open.map_or((NO_SEGMENT, 0), |o| (o.segment, o.used));
        le::put_u32(h, 40, seg);
        le::put_u32(h, 44, used);
        le::put_u64(h, 48, self.entry_count);
        le::put_u32(h, 56, self.free.len() as u32);
        le::put_u32(h, 60, self.lost.len() as u32);
        le::put_u64(h, 64, body_len as u64);
        le::put_u32(h, 72, body_crc);
        let crc = crc32c::crc32c(&h[..HEADER_LEN - 4]);
        le::put_u32(h, HEADER_LEN - 4, crc);
        Ok(())
    }
}

impl Checkpoint {
    fn frame(&self) -> Frame<'_> {
        Frame {
            number: self.number,
            next_seq: self.next_seq,
            epoch: self.epoch,
            open: self.open,
            free: &self.free,
            entry_count: self.entries.len() as u64,
            lost: &self.lost,
        }
    }

    /// Bytes its body takes once encoded.
    pub fn body_len(&self) -> u64 {
        self.frame().body_len()
    }

    /// Header and body, padded with zeroes to a multiple of 4 KiB.
    pub fn encode(&self) -> Vec<u8> {
        let frame = self.frame();
        let mut out = vec![0u8; frame.encoded_len() as usize];
        frame
            .encode_into(self.entries.iter().copied(), &mut out)
            .expect("the buffer and the entry count come from the checkpoint itself");
        out
    }

    /// Checks and decodes the fixed header (its first [`HEADER_LEN`] bytes), to learn how long the
    /// body is before reading it.
    pub fn decode_header(h: &[u8]) -> Result<CheckpointHeader, FormatError> {
        if h.len() < HEADER_LEN || &h[0..8] != MAGIC {
            return Err(FormatError::Corrupt(Corruption::NoCheckpoint));
        }
        let version = le::u32(h, 8);
        if !readable_version(version) {
            return Err(FormatError::UnsupportedVersion(version));
        }
        if crc32c::crc32c(&h[..HEADER_LEN - 4]) != le::u32(h, HEADER_LEN - 4) {
            return Err(FormatError::Corrupt(Corruption::Checksum(
                Structure::CheckpointHeader,
            )));
        }
        let seg = le::u32(h, 40);
        let header = CheckpointHeader {
            number: le::u64(h, 16),
            next_seq: le::u64(h, 24),
            epoch: le::u64(h, 32),
            open: (seg != NO_SEGMENT).then(|| LogHead {
                segment: seg,
                used: le::u32(h, 44),
            }),
            entry_count: le::u64(h, 48),
            free_count: le::u32(h, 56),
            lost_count: le::u32(h, 60),
            body_len: le::u64(h, 64),
            body_crc: le::u32(h, 72),
        };
        let expected_len = header
            .entry_count
            .checked_add(header.lost_count as u64)
            .and_then(|n| n.checked_mul(ENTRY_LEN))
            .and_then(|n| n.checked_add(header.free_count as u64 * 4));
        if expected_len != Some(header.body_len) {
            return Err(FormatError::Corrupt(Corruption::CheckpointBodyLength));
        }
        Ok(header)
    }

    /// Decodes a checkpoint whose header was decoded from `body`'s slot; `body` holds at least
    /// `header.body_len` bytes.
    pub fn decode_body(header: &CheckpointHeader, body: &[u8]) -> Result<Checkpoint, FormatError> {
        let body = body
            .get(..header.body_len as usize)
            .ok_or(FormatError::Corrupt(Corruption::Truncated(
                Structure::CheckpointBody,
            )))?;
        if crc32c::crc32c(body) != header.body_crc {
            return Err(FormatError::Corrupt(Corruption::Checksum(
                Structure::CheckpointBody,
            )));
        }
        let free_bytes = header.free_count as usize * 4;
        let free = body[..free_bytes]
            .chunks_exact(4)
            .map(|c| le::u32(c, 0))
            .collect();
        let lost_at = free_bytes + (header.entry_count * ENTRY_LEN) as usize;
        let entries = body[free_bytes..lost_at]
            .chunks_exact(ENTRY_LEN as usize)
            .map(|c| CheckpointEntry {
                slot: le::u32(c, 0),
                crc: le::u32(c, 4),
                dirty: le::u64(c, 8) & LBA_DIRTY != 0,
                lba: le::u64(c, 8) & !LBA_DIRTY,
            })
            .collect();
        let lost = body[lost_at..]
            .chunks_exact(ENTRY_LEN as usize)
            .map(|c| (le::u64(c, 0), le::u64(c, 8)))
            .collect();
        Ok(Checkpoint {
            number: header.number,
            next_seq: header.next_seq,
            epoch: header.epoch,
            open: header.open,
            free,
            entries,
            lost,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: an entry count whose byte length wraps around to the recorded one.
    #[test]
    fn counts_that_overflow_the_body_length_are_corrupt() {
        let mut b = sample().encode();
        for (entries, free, body_len) in [(1u64 << 60, 0u32, 0u64), ((1 << 60) - 3, 13, 4)] {
            le::put_u64(&mut b, 48, entries);
            le::put_u32(&mut b, 56, free);
            le::put_u64(&mut b, 64, body_len);
            let crc = crc32c::crc32c(&b[..HEADER_LEN - 4]);
            le::put_u32(&mut b, HEADER_LEN - 4, crc);
            assert!(matches!(
                Checkpoint::decode_header(&b),
                Err(FormatError::Corrupt(_))
            ));
        }
    }

    fn sample() -> Checkpoint {
        Checkpoint {
            number: 12,
            next_seq: 99_000,
            epoch: 4,
            open: Some(LogHead {
                segment: 3,
                used: 17,
            }),
            free: vec![5, 6, 1],
            entries: vec![
                CheckpointEntry {
                    slot: 10,
                    lba: 1 << 33,
                    dirty: true,
                    crc: 0xfeed_f00d,
                },
                CheckpointEntry {
                    slot: 11,
                    lba: 7,
                    dirty: false,
                    crc: 1,
                },
            ],
            lost: vec![(100, 3)],
        }
    }

    #[test]
    fn roundtrip_and_layout() {
        let c = sample();
        let bytes = c.encode();
        assert_eq!(bytes.len(), 8192);
        let h = Checkpoint::decode_header(&bytes).unwrap();
        assert_eq!(h.body_len, 3 * 4 + 3 * 16);
        assert_eq!(
            Checkpoint::decode_body(&h, &bytes[HEADER_LEN..]).unwrap(),
            c
        );
        assert_eq!(&bytes[0..8], b"FLTCKPT\0");
        assert_eq!(&bytes[16..24], &12u64.to_le_bytes());
        assert_eq!(&bytes[40..44], &3u32.to_le_bytes());
        assert_eq!(
            &bytes[4096..4100],
            &5u32.to_le_bytes(),
            "first free segment"
        );
        assert_eq!(&bytes[4108..4112], &10u32.to_le_bytes(), "first entry slot");
        assert_eq!(
            &bytes[4112..4116],
            &0xfeed_f00du32.to_le_bytes(),
            "first entry crc"
        );
        assert_eq!(
            &bytes[4116..4124],
            &((1u64 << 33) | (1 << 63)).to_le_bytes(),
            "first entry lba, dirty"
        );
        assert_eq!(&bytes[4132..4140], &7u64.to_le_bytes(), "clean entry lba");
        assert_eq!(&bytes[60..64], &1u32.to_le_bytes(), "lost ranges");
        assert_eq!(&bytes[4140..4148], &100u64.to_le_bytes(), "lost range lba");
        assert_eq!(&bytes[4148..4156], &3u64.to_le_bytes(), "lost range length");
    }

    #[test]
    fn empty_checkpoint_without_open_segment() {
        let c = Checkpoint {
            number: 0,
            next_seq: 1,
            epoch: 1,
            open: None,
            free: (0..4).collect(),
            entries: vec![],
            lost: vec![],
        };
        let bytes = c.encode();
        let h = Checkpoint::decode_header(&bytes).unwrap();
        assert_eq!(h.open, None);
        assert_eq!(
            Checkpoint::decode_body(&h, &bytes[HEADER_LEN..]).unwrap(),
            c
        );
    }

    #[test]
    fn a_frame_refuses_entries_other_than_announced() {
        let c = sample();
        let frame = Frame {
            entry_count: 3,
            ..c.frame()
        };
        let mut out = vec![0u8; frame.encoded_len() as usize];
        assert!(frame
            .encode_into(c.entries.iter().copied(), &mut out)
            .is_err());
        let frame = Frame {
            entry_count: 1,
            ..c.frame()
        };
        let mut out = vec![0u8; frame.encoded_len() as usize];
        assert!(frame
            .encode_into(c.entries.iter().copied(), &mut out)
            .is_err());
        let mut short = vec![0u8; 4096];
        assert!(c
            .frame()
            .encode_into(c.entries.iter().copied(), &mut short)
            .is_err());
    }

    #[test]
    fn damage_is_detected() {
        let bytes = sample().encode();
        let mut h = bytes.clone();
        h[20] ^= 1;
        assert!(Checkpoint::decode_header(&h).is_err());
        let mut b = bytes.clone();
        b[4100] ^= 1;
        let header = Checkpoint::decode_header(&b).unwrap();
        assert!(Checkpoint::decode_body(&header, &b[HEADER_LEN..]).is_err());
        assert!(Checkpoint::decode_body(&header, &b[HEADER_LEN..HEADER_LEN + 8]).is_err());
        let mut v = bytes.clone();
        v[8] = 4;
        assert!(matches!(
            Checkpoint::decode_header(&v),
            Err(FormatError::UnsupportedVersion(4))
        ));
        // A version-2 checkpoint (before FREE records; the same layout) is read as it is.
        let mut v2 = bytes;
        le::put_u32(&mut v2, 8, 2);
        let crc = crc32c::crc32c(&v2[..HEADER_LEN - 4]);
        le::put_u32(&mut v2, HEADER_LEN - 4, crc);
        let header = Checkpoint::decode_header(&v2).unwrap();
        assert_eq!(
            Checkpoint::decode_body(&header, &v2[HEADER_LEN..]).unwrap(),
            sample()
        );
    }
}

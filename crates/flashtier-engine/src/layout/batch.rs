//! Log batches: the unit the log writer puts on the device in one write.
//!
//! A batch is one header block followed by the data blocks of its records, in entry order. One
//! client write is one record, so a write is all-or-nothing after a crash: its entry and every one
//! of its data blocks must check out, or recovery stops before it.
//!
//! The header block carries two halves of 2 KiB. The first holds this batch's fields under their
//! own checksum; the second is a verbatim copy of the previous header's first half (the batch or
//! seal written just before this one in log order). A damaged header can then be read back from
//! its successor's copy, which is what lets recovery tell exactly which blocks a damaged batch
//! held instead of losing everything after it. Each header also says up to which sequence number
//! the log was durable (synced) when it was written: damage before that point is damage to the
//! media, not a write torn by a crash (see `recover`).
//!
//! ```text
//! header block (one cache block; fields in its first 4 KiB):
//!   off len field
//!     0   8 magic "FLTBATCH"
//!     8   8 sequence number of the first record (records are numbered consecutively)
//!    16   8 log epoch (see the superblock); epochs never decrease along the log
//!    24   2 record count (at most MAX_ENTRIES)
//!    26   2 flags (bit 0 SEAL: no records, the log continues in the next segment;
//!                  bit 1 NOTE: no records, the log ends here for now; only `durable` matters)
//!    28   4 data blocks following the header
//!    32   8 durable: every record with a lower sequence number was synced before this header
//!              was written
//!    40   8 log id: the first 8 bytes of the cache's uuid, so that a log left on the device by
//!              an earlier cache (before a `format` or a release) is never taken for this one's
//!    48  32*n entries
//!    48   4 ordinal, in a header of no records only: tells apart record-less headers written
//!              one after another (the two batches that vouch for a sync), whose other fields
//!              are the same, so that a media fault duplicating one over its successor is seen
//!              (see `recover`). Zero in a header of records, and in caches written before it
//!              existed (a reader that ignores it loses only that check).
//!  2044   4 CRC32C of bytes 0..2044
//!  2048 2048 copy of bytes 0..2048 of the previous header (zeroes: none known)
//! entry:
//!     0   8 first LBA (in cache blocks)
//!     8   8 aux: MOVE → slot the blocks are moved from; CLEANED, LOST → slot of the first block;
//!              FREE → the segment freed
//!    16   4 block count (FREE: 1, the one segment)
//!    20   1 kind (1 WRITE, 2 PROMOTE, 3 MOVE, 4 INVALIDATE, 5 CLEANED, 6 LOST, 7 FREE; FREE
//!              exists since format version 3)
//!    21   1 flags (bit 0: the blocks are dirty)
//!    22   2 volume id
//!    24   4 CRC32C of this record's data blocks (0 when it has none)
//!    28   4 reserved (0)
//! ```

use super::le;

/// The first 8 bytes of every batch header.
pub const MAGIC: &[u8; 8] = b"FLTBATCH";
/// Bytes of the header that carry fields; the rest of a larger cache block is zero.
pub const HEADER_FIELDS: usize = 4096;
/// Bytes of one half: this header's own fields, or the copy of the previous header's.
pub const OWN_LEN: usize = 2048;
const ENTRY_LEN: usize = 32;
const ENTRIES_AT: usize = 48;
/// Records per batch: as many entries as fit in the header's own half.
pub const MAX_ENTRIES: usize = (OWN_LEN - 4 - ENTRIES_AT) / ENTRY_LEN;
const FLAG_SEAL: u16 = 1;
const FLAG_NOTE: u16 = 2;
const ENTRY_DIRTY: u8 = 1;

/// What a record does to the index when applied (live, or replayed after a crash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client data: maps every block to its new slot, replacing any older version.
    Write = 1,
    /// Data read from the backing store on a miss: maps a block only if it is unmapped (and not
    /// lost), so a promotion can never hide a newer write that raced with it.
    Promote = 2,
    /// Blocks copied forward by reclaim from slot `aux..`: maps a block only if it still lives in
    /// the slot it was copied from.
    Move = 3,
    /// Unmaps the range (write-around, trim, zeroing): later reads go to the backing store. The
    /// range holds new data from then on, so it is no longer lost either.
    Invalidate = 4,
    /// The backing store holds the blocks living in slots `aux..`: clears their dirty flag if
    /// they still live there.
    Cleaned = 5,
    /// The dirty blocks living in slots `aux..` failed their checksums: unless they have moved
    /// on since, they are dropped and marked lost (reads fail until the blocks are written again
    /// or the loss is acknowledged with an INVALIDATE). Clean ones are just dropped.
    Lost = 6,
    /// Reclaim emptied segment `aux`: whatever is still mapped there is unmapped (a
    /// checkpoint's view of blocks evicted since; a dirty one is lost, as its move or write-back
    /// was not replayed), and the segment joins the end of the free list, so recovery learns the
    /// order the log takes free segments in from the log itself (see `segments`).
    Free = 7,
}

impl Kind {
    pub(crate) fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Write,
            2 => Kind::Promote,
            3 => Kind::Move,
            4 => Kind::Invalidate,
            5 => Kind::Cleaned,
            6 => Kind::Lost,
            7 => Kind::Free,
            _ => return None,
        })
    }

    pub(crate) fn has_data(self) -> bool {
        matches!(self, Kind::Write | Kind::Promote | Kind::Move)
    }
}

/// One record of a batch, as its header lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// What the record does to the index.
    pub kind: Kind,
    /// The blocks are not on the backing store yet.
    pub dirty: bool,
    /// First block of the range (in cache blocks).
    pub lba: u64,
    /// Blocks in the range.
    pub nblocks: u32,
    /// `Move`: the slot the blocks are moved from; `Cleaned`, `Lost`: the slot of the first block.
    pub aux: u64,
    /// The volume the record belongs to.
    pub volume: u16,
    /// CRC32C of the record's data blocks (0 when it has none).
    pub data_crc: u32,
}

impl Entry {
    /// Data blocks that follow the header for this record (none for records that carry no data).
    pub fn data_blocks(&self) -> u32 {
        if self.kind.has_data() {
            self.nblocks
        } else {
            0
        }
    }
}

/// What a header is: a batch of records, or one of the two record-less markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderKind {
    /// A header followed by its records and their data.
    #[default]
    Batch,
    /// The log continues at the start of the next segment.
    Seal,
    /// Written at the log head when the writer goes idle after a sync, and overwritten by the
    /// next batch: it carries `durable` for the batches before it, which otherwise no later
    /// header would vouch for.
    Note,
}

/// A batch header's own fields, decoded (or to encode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    /// Sequence number of the first record.
    pub seq_first: u64,
    /// Log epoch it was written in.
    pub epoch: u64,
    /// A batch, a seal or a note.
    pub kind: HeaderKind,
    /// Records with lower sequence numbers were durable when this header was written.
    pub durable: u64,
    /// Which cache wrote it (see [`log_id`]).
    pub log: u64,
    /// Its records, in order.
    pub entries: Vec<Entry>,
    /// Headers of no records only (zero otherwise): see the layout above.
    pub ordinal: u32,
}

/// The log id of a cache: the first 8 bytes of its uuid.
pub fn log_id(uuid: &[u8; 16]) -> u64 {
    le::u64(uuid, 0)
}

/// Why a block is not a usable batch header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchError {
    /// Not a batch header at all (stale data, or never written).
    NoBatch,
    /// A header whose checksum fails: a torn or damaged write.
    Checksum,
    /// A checksummed header that breaks the format's rules.
    Malformed(&'static str),
}

/// Most data blocks a batch can hold (a 1 GiB segment of 4 KiB blocks).
const MAX_BATCH_DATA_BLOCKS: u64 = 1 << 18;

impl BatchHeader {
    /// Data blocks following the header.
    pub fn data_blocks(&self) -> u32 {
        self.entries.iter().map(Entry::data_blocks).sum()
    }

    /// Whether it is a seal (the log continues in the next segment).
    pub fn is_seal(&self) -> bool {
        self.kind == HeaderKind::Seal
    }

    /// Sequence number after this header's records.
    pub fn seq_end(&self) -> u64 {
        self.seq_first + self.entries.len() as u64
    }

    /// Encodes this header's own half into `out[..OWN_LEN]`.
    pub fn encode_own(&self, out: &mut [u8]) {
        assert!(self.entries.len() <= MAX_ENTRIES, "too many entries");
        assert!(
            self.entries.is_empty() || self.ordinal == 0,
            "an ordinal in a header of records"
        );
        let out = &mut out[..OWN_LEN];
        out.fill(0);
        out[0..8].copy_from_slice(MAGIC);
        le::put_u64(out, 8, self.seq_first);
        le::put_u64(out, 16, self.epoch);
        le::put_u16(out, 24, self.entries.len() as u16);
        let flags = match self.kind {
            HeaderKind::Batch => 0,
            HeaderKind::Seal => FLAG_SEAL,
            HeaderKind::Note => FLAG_NOTE,
        };
        le::put_u16(out, 26, flags);
        le::put_u32(out, 28, self.data_blocks());
        le::put_u64(out, 32, self.durable);
        le::put_u64(out, 40, self.log);
        if self.entries.is_empty() {
            le::put_u32(out, ENTRIES_AT, self.ordinal);
        }
        for (i, e) in self.entries.iter().enumerate() {
            let at = ENTRIES_AT + i * ENTRY_LEN;
            le::put_u64(out, at, e.lba);
            le::put_u64(out, at + 8, e.aux);
            le::put_u32(out, at + 16, e.nblocks);
            out[at + 20] = e.kind as u8;
            out[at + 21] = if e.dirty { ENTRY_DIRTY } else { 0 };
            le::put_u16(out, at + 22, e.volume);
            le::put_u32(out, at + 24, e.data_crc);
        }
        let crc = crc32c::crc32c(&out[..OWN_LEN - 4]);
        le::put_u32(out, OWN_LEN - 4, crc);
    }

    /// Encodes the whole header block into `out` (at least [`HEADER_FIELDS`] bytes; bytes
    /// beyond are zeroed): this header's own half, then `prev`, the previous header's own half
    /// (all zeroes when there is none).
    pub fn encode(&self, prev: &[u8], out: &mut [u8]) {
        assert_eq!(prev.len(), OWN_LEN, "the previous header's own half");
        out.fill(0);
        self.encode_own(out);
        out[OWN_LEN..2 * OWN_LEN].copy_from_slice(prev);
    }

    /// Decodes a header block's own half.
    pub fn decode(b: &[u8]) -> Result<BatchHeader, BatchError> {
        Self::decode_own(b.get(..OWN_LEN).ok_or(BatchError::NoBatch)?)
    }

    /// Decodes the copy of the previous header that a header block carries in its second half.
    pub fn decode_prev(b: &[u8]) -> Result<BatchHeader, BatchError> {
        Self::decode_own(b.get(OWN_LEN..2 * OWN_LEN).ok_or(BatchError::NoBatch)?)
    }

    /// Decodes an own half (`OWN_LEN` bytes).
    pub fn decode_own(b: &[u8]) -> Result<BatchHeader, BatchError> {
        if b.len() < OWN_LEN || &b[0..8] != MAGIC {
            return Err(BatchError::NoBatch);
        }
        if crc32c::crc32c(&b[..OWN_LEN - 4]) != le::u32(b, OWN_LEN - 4) {
            return Err(BatchError::Checksum);
        }
        let count = le::u16(b, 24) as usize;
        if count > MAX_ENTRIES {
            return Err(BatchError::Malformed("too many entries"));
        }
        let kind = match le::u16(b, 26) {
            0 => HeaderKind::Batch,
            FLAG_SEAL => HeaderKind::Seal,
            FLAG_NOTE => HeaderKind::Note,
            _ => return Err(BatchError::Malformed("unknown flags")),
        };
        if kind != HeaderKind::Batch && count != 0 {
            return Err(BatchError::Malformed("a seal or note carries records"));
        }
        let mut entries = Vec::with_capacity(count);
        for i in 0..count {
            let at = ENTRIES_AT + i * ENTRY_LEN;
            let kind = Kind::from_u8(b[at + 20]).ok_or(BatchError::Malformed("unknown kind"))?;
            let e = Entry {
                kind,
                dirty: b[at + 21] & ENTRY_DIRTY != 0,
                lba: le::u64(b, at),
                aux: le::u64(b, at + 8),
                nblocks: le::u32(b, at + 16),
                volume: le::u16(b, at + 22),
                data_crc: le::u32(b, at + 24),
            };
            if e.nblocks == 0 {
                return Err(BatchError::Malformed("empty record"));
            }
            if e.lba.checked_add(e.nblocks as u64).is_none() {
                return Err(BatchError::Malformed("record range overflows"));
            }
            entries.push(e);
        }
        // Summed wide: crafted entries must not wrap around to the recorded count. No segment
        // holds more than 2^18 blocks (1 GiB of 4 KiB blocks), so neither can a batch.
        let total: u64 = entries.iter().map(|e| e.data_blocks() as u64).sum();
        if total > MAX_BATCH_DATA_BLOCKS {
            return Err(BatchError::Malformed("batch larger than any segment"));
        }
        let header = BatchHeader {
            seq_first: le::u64(b, 8),
            epoch: le::u64(b, 16),
            kind,
            durable: le::u64(b, 32),
            log: le::u64(b, 40),
            ordinal: if count == 0 {
                le::u32(b, ENTRIES_AT)
            } else {
                0
            },
            entries,
        };
        if header.data_blocks() != le::u32(b, 28) {
            return Err(BatchError::Malformed(
                "data block count disagrees with entries",
            ));
        }
        if header.seq_first.checked_add(count as u64).is_none() {
            return Err(BatchError::Malformed("sequence numbers overflow"));
        }
        Ok(header)
    }
}

/// CRC32C of a record's data.
pub fn data_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The CRC32C of each block of a record: inline up to 16 blocks (a 64 KiB record of 4 KiB
/// blocks), so a client write's record needs no allocation for them.
pub type BlockCrcs = smallvec::SmallVec<[u32; 16]>;

/// CRC32C of each `block`-byte block of `data`.
pub fn block_crcs(data: &[u8], block: usize) -> BlockCrcs {
    data.chunks(block.max(1)).map(crc32c::crc32c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NO_PREV: [u8; OWN_LEN] = [0; OWN_LEN];

    /// Found by fuzzing: records whose block counts wrap a 32-bit sum to the recorded total.
    #[test]
    fn block_counts_that_overflow_are_malformed() {
        let mut h = sample();
        h.entries.truncate(1);
        h.entries.push(h.entries[0]);
        let mut b = vec![0u8; HEADER_FIELDS];
        h.encode(&NO_PREV, &mut b);
        for i in 0..2 {
            le::put_u32(&mut b, ENTRIES_AT + i * ENTRY_LEN + 16, 1 << 31);
        }
        le::put_u32(&mut b, 28, 0);
        let crc = crc32c::crc32c(&b[..OWN_LEN - 4]);
        le::put_u32(&mut b, OWN_LEN - 4, crc);
        assert!(matches!(
            BatchHeader::decode(&b),
            Err(BatchError::Malformed(_))
        ));
    }

    fn sample() -> BatchHeader {
        BatchHeader {
            seq_first: 1000,
            epoch: 2,
            kind: HeaderKind::Batch,
            durable: 990,
            log: 0x1234,
            entries: vec![
                Entry {
                    kind: Kind::Write,
                    dirty: true,
                    lba: 77,
                    nblocks: 3,
                    aux: 0,
                    volume: 0,
                    data_crc: 0xdead_beef,
                },
                Entry {
                    kind: Kind::Invalidate,
                    dirty: false,
                    lba: 1 << 40,
                    nblocks: 1 << 20,
                    aux: 0,
                    volume: 1,
                    data_crc: 0,
                },
                Entry {
                    kind: Kind::Cleaned,
                    dirty: false,
                    lba: 5,
                    nblocks: 2,
                    aux: 12345,
                    volume: 0,
                    data_crc: 0,
                },
                Entry {
                    kind: Kind::Lost,
                    dirty: false,
                    lba: 9,
                    nblocks: 4,
                    aux: 0,
                    volume: 0,
                    data_crc: 0,
                },
            ],
            ordinal: 0,
        }
    }

    /// FREE (format version 3) is kind 7, carries no data and names its segment in `aux`.
    #[test]
    fn a_free_record_decodes_as_written() {
        let mut h = sample();
        h.entries = vec![Entry {
            kind: Kind::Free,
            dirty: false,
            lba: 0,
            nblocks: 1,
            aux: 41,
            volume: 0,
            data_crc: 0,
        }];
        let mut b = vec![0u8; HEADER_FIELDS];
        h.encode(&NO_PREV, &mut b);
        assert_eq!(b[ENTRIES_AT + 20], 7);
        assert_eq!(le::u64(&b, ENTRIES_AT + 8), 41);
        let back = BatchHeader::decode(&b).unwrap();
        assert_eq!(back.entries, h.entries);
        assert_eq!(back.data_blocks(), 0);
    }

    /// The two batches of no records that vouch for a sync differ only in their ordinal, at
    /// byte 48 of the own half; a header of records has none.
    #[test]
    fn ordinal_of_a_header_of_no_records() {
        let vouch = |ordinal| BatchHeader {
            seq_first: 7,
            epoch: 1,
            kind: HeaderKind::Batch,
            durable: 7,
            log: 1,
            entries: vec![],
            ordinal,
        };
        let (mut first, mut second) = (vec![0u8; 4096], vec![0u8; 4096]);
        vouch(1).encode(&NO_PREV, &mut first);
        vouch(2).encode(&NO_PREV, &mut second);
        assert_eq!(le::u32(&second, 48), 2);
        assert_eq!(BatchHeader::decode(&second).unwrap(), vouch(2));
        assert_ne!(first[..OWN_LEN], second[..OWN_LEN]);
        // Written before the ordinal existed: zero.
        let mut old = vec![0u8; 4096];
        vouch(0).encode(&NO_PREV, &mut old);
        assert_eq!(old[48..52], [0; 4]);
        assert_eq!(BatchHeader::decode(&old).unwrap().ordinal, 0);
        // In a header of records, byte 48 is the first entry's LBA, not an ordinal.
        let mut b = vec![0u8; 4096];
        sample().encode(&NO_PREV, &mut b);
        assert_eq!(BatchHeader::decode(&b).unwrap().ordinal, 0);
    }

    /// Version-2 header bytes, field by field, and the copy of the previous header.
    #[test]
    fn roundtrip_and_layout() {
        let h = sample();
        let mut prev_block = vec![0u8; 4096];
        let prev = BatchHeader {
            seq_first: 990,
            epoch: 2,
            kind: HeaderKind::Batch,
            durable: 900,
            log: 0x1234,
            entries: vec![h.entries[0]],
            ordinal: 0,
        };
        prev.encode(&NO_PREV, &mut prev_block);
        let mut block = vec![0u8; 8192];
        h.encode(&prev_block[..OWN_LEN], &mut block);
        assert_eq!(BatchHeader::decode(&block).unwrap(), h);
        assert_eq!(BatchHeader::decode_prev(&block).unwrap(), prev);
        assert_eq!(
            BatchHeader::decode_prev(&prev_block),
            Err(BatchError::NoBatch),
            "no previous header"
        );
        assert_eq!(h.data_blocks(), 3);
        assert_eq!(h.seq_end(), 1004);
        assert_eq!(&block[0..8], b"FLTBATCH");
        assert_eq!(&block[8..16], &1000u64.to_le_bytes());
        assert_eq!(&block[16..24], &2u64.to_le_bytes());
        assert_eq!(&block[24..26], &4u16.to_le_bytes());
        assert_eq!(&block[26..28], &0u16.to_le_bytes());
        assert_eq!(&block[28..32], &3u32.to_le_bytes());
        assert_eq!(&block[32..40], &990u64.to_le_bytes(), "durable");
        assert_eq!(&block[40..48], &0x1234u64.to_le_bytes(), "log id");
        assert_eq!(&block[48..56], &77u64.to_le_bytes());
        assert_eq!(block[48 + 20], 1, "kind WRITE");
        assert_eq!(block[48 + 21], 1, "dirty");
        assert_eq!(&block[48 + 24..48 + 28], &0xdead_beefu32.to_le_bytes());
        assert_eq!(block[80 + 20], 4, "kind INVALIDATE");
        assert_eq!(&block[112 + 8..112 + 16], &12345u64.to_le_bytes());
        assert_eq!(block[144 + 20], 6, "kind LOST");
        let crc = crc32c::crc32c(&block[..2044]);
        assert_eq!(&block[2044..2048], &crc.to_le_bytes());
        assert_eq!(
            &block[2048..4096],
            &prev_block[..2048],
            "copy of the previous"
        );
        assert!(block[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn seal_and_note_roundtrip() {
        for kind in [HeaderKind::Seal, HeaderKind::Note] {
            let h = BatchHeader {
                seq_first: 5,
                epoch: 1,
                kind,
                durable: 5,
                log: 1,
                entries: vec![],
                ordinal: 0,
            };
            let mut b = vec![0u8; 4096];
            h.encode(&NO_PREV, &mut b);
            assert_eq!(BatchHeader::decode(&b).unwrap(), h);
            let flags = if kind == HeaderKind::Seal { 1u16 } else { 2 };
            assert_eq!(&b[26..28], &flags.to_le_bytes());
        }
    }

    #[test]
    fn damage_is_detected_in_either_half() {
        let mut b = vec![0u8; 4096];
        let mut prev = [0u8; OWN_LEN];
        sample().encode_own(&mut prev);
        sample().encode(&prev, &mut b);
        assert_eq!(BatchHeader::decode(&[0u8; 4096]), Err(BatchError::NoBatch));
        assert_eq!(BatchHeader::decode(&b[..100]), Err(BatchError::NoBatch));
        for at in [8, 40, 2000, 2047] {
            let mut torn = b.clone();
            torn[at] ^= 0x10;
            assert_eq!(
                BatchHeader::decode(&torn),
                Err(BatchError::Checksum),
                "byte {at}"
            );
            assert!(BatchHeader::decode_prev(&torn).is_ok(), "the copy survives");
        }
        for at in [2048 + 8, 4095] {
            let mut torn = b.clone();
            torn[at] ^= 0x10;
            assert!(BatchHeader::decode(&torn).is_ok(), "the own half survives");
            assert!(BatchHeader::decode_prev(&torn).is_err(), "byte {at}");
        }
    }

    #[test]
    fn the_most_entries_fit_the_own_half() {
        let mut h = sample();
        h.entries = vec![h.entries[0]; MAX_ENTRIES];
        let mut b = vec![0u8; 4096];
        h.encode(&NO_PREV, &mut b);
        assert_eq!(BatchHeader::decode(&b).unwrap(), h);
        assert_eq!(MAX_ENTRIES, 62);
    }

    proptest! {
        /// Any bytes decode to a header or an error, never a panic; a decoded header re-encodes
        /// to the same bytes.
        #[test]
        fn decode_is_total(mut bytes in prop::collection::vec(any::<u8>(), 4096)) {
            bytes[0..8].copy_from_slice(MAGIC);
            let crc = crc32c::crc32c(&bytes[..OWN_LEN - 4]);
            bytes[OWN_LEN - 4..OWN_LEN].copy_from_slice(&crc.to_le_bytes());
            if let Ok(h) = BatchHeader::decode(&bytes) {
                let mut again = vec![0u8; 4096];
                h.encode(&NO_PREV, &mut again);
                prop_assert_eq!(BatchHeader::decode(&again).unwrap(), h);
            }
        }
    }
}

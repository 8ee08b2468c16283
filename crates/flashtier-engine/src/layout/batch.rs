//! Log batches: the unit the log writer puts on the device in one write.
//!
//! A batch is one header block followed by the data blocks of its records, in entry order. One
//! client write is one record, so a write is all-or-nothing after a crash: its entry and every one
//! of its data blocks must check out, or recovery stops before it.
//!
//! ```text
//! header block (one cache block; fields in its first 4 KiB):
//!   off len field
//!     0   8 magic "FLTBATCH"
//!     8   8 sequence number of the first record (records are numbered consecutively)
//!    16   8 log epoch (see the superblock); epochs never decrease along the log
//!    24   2 record count (at most MAX_ENTRIES)
//!    26   2 flags (bit 0: SEAL: no records; the log continues in the next segment)
//!    28   4 data blocks following the header
//!    32  32*n entries
//!  4092   4 CRC32C of bytes 0..4092
//! entry:
//!     0   8 first LBA (in cache blocks)
//!     8   8 aux: MOVE → slot the blocks are moved from; CLEANED → slot of the first block
//!    16   4 block count
//!    20   1 kind (1 WRITE, 2 PROMOTE, 3 MOVE, 4 INVALIDATE, 5 CLEANED)
//!    21   1 flags (bit 0: the blocks are dirty)
//!    22   2 volume id
//!    24   4 CRC32C of this record's data blocks (0 when it has none)
//!    28   4 reserved (0)
//! ```

use super::le;

pub const MAGIC: &[u8; 8] = b"FLTBATCH";
/// Bytes of the header that carry fields; the rest of a larger cache block is zero.
pub const HEADER_FIELDS: usize = 4096;
const ENTRY_LEN: usize = 32;
const ENTRIES_AT: usize = 32;
/// Records per batch: as many entries as fit in the 4 KiB of header fields.
pub const MAX_ENTRIES: usize = (HEADER_FIELDS - 4 - ENTRIES_AT) / ENTRY_LEN;
const FLAG_SEAL: u16 = 1;
const ENTRY_DIRTY: u8 = 1;

/// What a record does to the index when applied (live, or replayed after a crash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client data: maps every block to its new slot, replacing any older version.
    Write = 1,
    /// Data read from the backing store on a miss: maps a block only if it is unmapped, so a
    /// promotion can never hide a newer write that raced with it.
    Promote = 2,
    /// Blocks copied forward by reclaim from slot `aux..`: maps a block only if it still lives in
    /// the slot it was copied from.
    Move = 3,
    /// Unmaps the range (write-around, trim, zeroing): later reads go to the backing store.
    Invalidate = 4,
    /// The backing store holds the blocks living in slots `aux..`: clears their dirty flag if
    /// they still live there.
    Cleaned = 5,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Write,
            2 => Kind::Promote,
            3 => Kind::Move,
            4 => Kind::Invalidate,
            5 => Kind::Cleaned,
            _ => return None,
        })
    }

    pub fn has_data(self) -> bool {
        matches!(self, Kind::Write | Kind::Promote | Kind::Move)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    pub dirty: bool,
    pub lba: u64,
    pub nblocks: u32,
    pub aux: u64,
    pub volume: u16,
    pub data_crc: u32,
}

impl Entry {
    pub fn data_blocks(&self) -> u32 {
        if self.kind.has_data() {
            self.nblocks
        } else {
            0
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub seq_first: u64,
    pub epoch: u64,
    pub seal: bool,
    pub entries: Vec<Entry>,
}

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
    pub fn data_blocks(&self) -> u32 {
        self.entries.iter().map(Entry::data_blocks).sum()
    }

    /// Encodes into `out` (at least [`HEADER_FIELDS`] bytes; bytes beyond are zeroed).
    pub fn encode(&self, out: &mut [u8]) {
        assert!(self.entries.len() <= MAX_ENTRIES, "too many entries");
        out.fill(0);
        out[0..8].copy_from_slice(MAGIC);
        le::put_u64(out, 8, self.seq_first);
        le::put_u64(out, 16, self.epoch);
        le::put_u16(out, 24, self.entries.len() as u16);
        le::put_u16(out, 26, if self.seal { FLAG_SEAL } else { 0 });
        le::put_u32(out, 28, self.data_blocks());
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
        let crc = crc32c::crc32c(&out[..HEADER_FIELDS - 4]);
        le::put_u32(out, HEADER_FIELDS - 4, crc);
    }

    pub fn decode(b: &[u8]) -> Result<BatchHeader, BatchError> {
        if b.len() < HEADER_FIELDS || &b[0..8] != MAGIC {
            return Err(BatchError::NoBatch);
        }
        if crc32c::crc32c(&b[..HEADER_FIELDS - 4]) != le::u32(b, HEADER_FIELDS - 4) {
            return Err(BatchError::Checksum);
        }
        let count = le::u16(b, 24) as usize;
        if count > MAX_ENTRIES {
            return Err(BatchError::Malformed("too many entries"));
        }
        let flags = le::u16(b, 26);
        let seal = flags & FLAG_SEAL != 0;
        if seal && count != 0 {
            return Err(BatchError::Malformed("a seal carries records"));
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
            seal,
            entries,
        };
        if header.data_blocks() != le::u32(b, 28) {
            return Err(BatchError::Malformed(
                "data block count disagrees with entries",
            ));
        }
        Ok(header)
    }
}

/// CRC32C of a record's data.
pub fn data_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: records whose block counts wrap a 32-bit sum to the recorded total.
    #[test]
    fn block_counts_that_overflow_are_malformed() {
        let mut h = sample();
        h.entries.truncate(1);
        h.entries.push(h.entries[0]);
        let mut b = vec![0u8; HEADER_FIELDS];
        h.encode(&mut b);
        for i in 0..2 {
            le::put_u32(&mut b, ENTRIES_AT + i * ENTRY_LEN + 16, 1 << 31);
        }
        le::put_u32(&mut b, 28, 0);
        let crc = crc32c::crc32c(&b[..HEADER_FIELDS - 4]);
        le::put_u32(&mut b, HEADER_FIELDS - 4, crc);
        assert!(matches!(
            BatchHeader::decode(&b),
            Err(BatchError::Malformed(_))
        ));
    }
    use proptest::prelude::*;

    fn sample() -> BatchHeader {
        BatchHeader {
            seq_first: 1000,
            epoch: 2,
            seal: false,
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
            ],
        }
    }

    #[test]
    fn roundtrip_and_layout() {
        let h = sample();
        let mut block = vec![0u8; 8192];
        h.encode(&mut block);
        assert_eq!(BatchHeader::decode(&block).unwrap(), h);
        assert_eq!(h.data_blocks(), 3);
        // Version-1 layout, byte for byte where it matters.
        assert_eq!(&block[0..8], b"FLTBATCH");
        assert_eq!(&block[8..16], &1000u64.to_le_bytes());
        assert_eq!(&block[24..26], &3u16.to_le_bytes());
        assert_eq!(&block[28..32], &3u32.to_le_bytes());
        assert_eq!(&block[32..40], &77u64.to_le_bytes());
        assert_eq!(block[32 + 20], 1, "kind WRITE");
        assert_eq!(block[32 + 21], 1, "dirty");
        assert_eq!(&block[32 + 24..32 + 28], &0xdead_beefu32.to_le_bytes());
        assert_eq!(block[64 + 20], 4, "kind INVALIDATE");
        assert_eq!(&block[96 + 8..96 + 16], &12345u64.to_le_bytes());
        assert!(block[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn seal_roundtrip() {
        let seal = BatchHeader {
            seq_first: 5,
            epoch: 1,
            seal: true,
            entries: vec![],
        };
        let mut b = vec![0u8; 4096];
        seal.encode(&mut b);
        assert_eq!(BatchHeader::decode(&b).unwrap(), seal);
    }

    #[test]
    fn damage_is_detected() {
        let mut b = vec![0u8; 4096];
        sample().encode(&mut b);
        assert_eq!(BatchHeader::decode(&[0u8; 4096]), Err(BatchError::NoBatch));
        assert_eq!(BatchHeader::decode(&b[..100]), Err(BatchError::NoBatch));
        for at in [8, 40, 2000, 4095] {
            let mut torn = b.clone();
            torn[at] ^= 0x10;
            assert_eq!(
                BatchHeader::decode(&torn),
                Err(BatchError::Checksum),
                "byte {at}"
            );
        }
    }

    proptest! {
        /// Any bytes decode to a header or an error, never a panic; a decoded header re-encodes
        /// to the same bytes.
        #[test]
        fn decode_is_total(mut bytes in prop::collection::vec(any::<u8>(), 4096)) {
            bytes[0..8].copy_from_slice(MAGIC);
            let crc = crc32c::crc32c(&bytes[..4092]);
            bytes[4092..].copy_from_slice(&crc.to_le_bytes());
            if let Ok(h) = BatchHeader::decode(&bytes) {
                let mut again = vec![0u8; 4096];
                h.encode(&mut again);
                prop_assert_eq!(BatchHeader::decode(&again).unwrap(), h);
            }
        }
    }
}

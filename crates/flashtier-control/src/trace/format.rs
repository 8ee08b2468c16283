//! The trace file: what `flashtier trace` and `serve --trace` record, one fixed-size record per
//! client request, so that a day of a busy database is a file one can replay or analyse and a
//! recorder that is cheap enough to leave on.
//!
//! Layout (little-endian), version 1:
//!
//! ```text
//! header, 32 bytes:  magic "FTTRACE\0" | version u16 | record_len u16 | reserved u32 (0)
//!                    | start, µs since the Unix epoch u64 | size of the traced export u64
//! record, 24 bytes:  µs since the start u64 | offset u64 | length u32 | op u8 | flags u8
//!                    | reserved u16 (0)
//! ```
//!
//! `op` is 0 read, 1 write, 2 flush, 3 trim, 4 write-zeroes, and 255 *lost*: the recorder could
//! not keep up and dropped `length` records just before this point (a trace says where it has a
//! hole rather than silently having one). `flags` bit 0 is FUA. A record's time is when the
//! request reached the export, and records are in that order.
//!
//! A file cut short (the server died mid-write) reads as far as its last whole record; the
//! reader says how many bytes it left. Readers refuse a newer version rather than guess at it,
//! and reject unknown ops and flags, so a damaged or foreign file is an error, never a plausible
//! trace.

use std::io::{self, Read, Write};

/// The first 8 bytes of every trace file.
pub const MAGIC: [u8; 8] = *b"FTTRACE\0";
/// The version this code writes, and the newest it reads.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = 32;
/// Bytes of each record.
pub const RECORD_LEN: usize = 24;

const FLAG_FUA: u8 = 1;

/// What a trace records of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceOp {
    /// A read.
    Read,
    /// A write (FUA or not).
    Write,
    /// A flush.
    Flush,
    /// A discard.
    Trim,
    /// Zeroing a range.
    WriteZeroes,
    /// Not a request: the recorder dropped `len` records here.
    Lost,
}

impl TraceOp {
    fn code(self) -> u8 {
        match self {
            TraceOp::Read => 0,
            TraceOp::Write => 1,
            TraceOp::Flush => 2,
            TraceOp::Trim => 3,
            TraceOp::WriteZeroes => 4,
            TraceOp::Lost => 255,
        }
    }

    fn from_code(code: u8) -> Option<TraceOp> {
        Some(match code {
            0 => TraceOp::Read,
            1 => TraceOp::Write,
            2 => TraceOp::Flush,
            3 => TraceOp::Trim,
            4 => TraceOp::WriteZeroes,
            255 => TraceOp::Lost,
            _ => return None,
        })
    }

    /// The name `flashtier trace show` prints.
    pub fn name(self) -> &'static str {
        match self {
            TraceOp::Read => "read",
            TraceOp::Write => "write",
            TraceOp::Flush => "flush",
            TraceOp::Trim => "trim",
            TraceOp::WriteZeroes => "write_zeroes",
            TraceOp::Lost => "lost",
        }
    }
}

/// One record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceRecord {
    /// Microseconds since the trace started.
    pub t_us: u64,
    /// What the request was.
    pub op: TraceOp,
    /// Byte offset (0 for a flush or a lost record).
    pub offset: u64,
    /// Bytes (0 for a flush; for a lost record, how many records were dropped).
    pub len: u32,
    /// A write with forced unit access.
    pub fua: bool,
}

impl TraceRecord {
    /// The record as it is stored.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(&self.t_us.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b[20] = self.op.code();
        b[21] = if self.fua { FLAG_FUA } else { 0 };
        b
    }

    /// Reads a stored record.
    pub fn decode(b: &[u8; RECORD_LEN]) -> Result<TraceRecord, TraceError> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let op = TraceOp::from_code(b[20]).ok_or(TraceError::BadOp(b[20]))?;
        if b[21] & !FLAG_FUA != 0 || b[22..24] != [0, 0] {
            return Err(TraceError::BadFlags(b[21]));
        }
        Ok(TraceRecord {
            t_us: u64_at(0),
            op,
            offset: u64_at(8),
            len: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            fua: b[21] & FLAG_FUA != 0,
        })
    }
}

/// A trace file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceHeader {
    /// When the trace started, in µs since the Unix epoch.
    pub start_unix_us: u64,
    /// The size of the traced export in bytes (what a replay needs at least).
    pub device_size: u64,
}

impl TraceHeader {
    /// The header as it is stored.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&(RECORD_LEN as u16).to_le_bytes());
        b[16..24].copy_from_slice(&self.start_unix_us.to_le_bytes());
        b[24..32].copy_from_slice(&self.device_size.to_le_bytes());
        b
    }

    /// Reads a stored header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<TraceHeader, TraceError> {
        if b[0..8] != MAGIC {
            return Err(TraceError::NotATrace);
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(TraceError::Version(version));
        }
        let record_len = u16::from_le_bytes([b[10], b[11]]);
        if record_len as usize != RECORD_LEN || b[12..16] != [0; 4] {
            return Err(TraceError::BadHeader);
        }
        Ok(TraceHeader {
            start_unix_us: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            device_size: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
        })
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The file does not start with the trace magic.
    #[error("not a flashtier trace (no FTTRACE header)")]
    NotATrace,
    /// A version this build does not know.
    #[error("trace format version {0}; this flashtier reads version {VERSION}")]
    Version(u16),
    /// The header's fixed fields are wrong.
    #[error("damaged trace header")]
    BadHeader,
    /// A record names an op that does not exist.
    #[error("damaged trace: unknown op {0}")]
    BadOp(u8),
    /// A record has flags or reserved bytes set that no writer sets.
    #[error("damaged trace: unknown flags {0:#x}")]
    BadFlags(u8),
    /// A line of a fio iolog could not be read.
    #[error("fio iolog line {line}: {why}")]
    Iolog {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
}

/// Reads a trace: the header at once, then records one by one (buffer the reader).
pub struct TraceReader<R> {
    input: R,
    header: TraceHeader,
    /// Bytes of a record cut short at the end of the file.
    partial: usize,
}

impl<R: Read> TraceReader<R> {
    /// Reads and checks the header.
    pub fn new(mut input: R) -> Result<TraceReader<R>, TraceError> {
        let mut b = [0u8; HEADER_LEN];
        input.read_exact(&mut b).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => TraceError::NotATrace,
            _ => TraceError::Io(e),
        })?;
        Ok(TraceReader {
            input,
            header: TraceHeader::decode(&b)?,
            partial: 0,
        })
    }

    /// The header.
    pub fn header(&self) -> TraceHeader {
        self.header
    }

    /// Bytes of a last record cut short, once the records are read (a trace whose writer died).
    pub fn partial_bytes(&self) -> usize {
        self.partial
    }

    fn next_record(&mut self) -> Result<Option<TraceRecord>, TraceError> {
        let mut b = [0u8; RECORD_LEN];
        let mut got = 0;
        while got < RECORD_LEN {
            match self.input.read(&mut b[got..]) {
                Ok(0) => {
                    self.partial = got;
                    return Ok(None);
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        TraceRecord::decode(&b).map(Some)
    }
}

impl<R: Read> Iterator for TraceReader<R> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_record().transpose()
    }
}

/// Writes a trace: the header, then records.
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    /// Writes the header.
    pub fn new(mut out: W, header: TraceHeader) -> io::Result<TraceWriter<W>> {
        out.write_all(&header.encode())?;
        Ok(TraceWriter { out })
    }

    /// Appends one record.
    pub fn write(&mut self, r: &TraceRecord) -> io::Result<()> {
        self.out.write_all(&r.encode())
    }

    /// The output, e.g. to flush and sync it.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// Flushes what is buffered and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = TraceOp> {
        prop_oneof![
            Just(TraceOp::Read),
            Just(TraceOp::Write),
            Just(TraceOp::Flush),
            Just(TraceOp::Trim),
            Just(TraceOp::WriteZeroes),
            Just(TraceOp::Lost),
        ]
    }

    fn record() -> impl Strategy<Value = TraceRecord> {
        (
            any::<u64>(),
            op(),
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
        )
            .prop_map(|(t_us, op, offset, len, fua)| TraceRecord {
                t_us,
                op,
                offset,
                len,
                fua,
            })
    }

    proptest! {
        #[test]
        fn records_survive_a_round_trip(records in prop::collection::vec(record(), 0..50),
                                        start in any::<u64>(), size in any::<u64>()) {
            let header = TraceHeader { start_unix_us: start, device_size: size };
            let mut w = TraceWriter::new(Vec::new(), header).unwrap();
            for r in &records {
                w.write(r).unwrap();
            }
            let bytes = w.finish().unwrap();
            prop_assert_eq!(bytes.len(), HEADER_LEN + RECORD_LEN * records.len());
            let r = TraceReader::new(&bytes[..]).unwrap();
            prop_assert_eq!(r.header(), header);
            let back: Vec<TraceRecord> = r.map(Result::unwrap).collect();
            prop_assert_eq!(back, records);
        }

        #[test]
        fn any_bytes_decode_to_a_trace_or_an_error_never_a_panic(
            bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            for input in [&bytes[..], &with_magic[..]] {
                if let Ok(r) = TraceReader::new(input) {
                    for rec in r {
                        let _ = rec;
                    }
                }
            }
        }
    }

    #[test]
    fn the_stored_bytes_are_the_documented_layout() {
        // The layout is a published format: a change here must be a new version.
        let header = TraceHeader {
            start_unix_us: 0x0102_0304_0506_0708,
            device_size: 1 << 30,
        };
        let h = header.encode();
        assert_eq!(&h[0..8], b"FTTRACE\0");
        assert_eq!(&h[8..12], &[1, 0, 24, 0]);
        assert_eq!(&h[16..24], &[8, 7, 6, 5, 4, 3, 2, 1]);
        let r = TraceRecord {
            t_us: 5,
            op: TraceOp::Write,
            offset: 4096,
            len: 8192,
            fua: true,
        }
        .encode();
        assert_eq!(
            r,
            [5, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 1, 1, 0, 0]
        );
    }

    #[test]
    fn a_foreign_newer_or_damaged_file_is_refused() {
        let good = TraceHeader {
            start_unix_us: 1,
            device_size: 2,
        }
        .encode();
        assert!(matches!(
            TraceReader::new(&b"fio version 3 iolog\n"[..]),
            Err(TraceError::NotATrace)
        ));
        assert!(matches!(
            TraceReader::new(&good[..10]),
            Err(TraceError::NotATrace)
        ));
        let mut newer = good;
        newer[8] = 2;
        assert!(matches!(
            TraceReader::new(&newer[..]),
            Err(TraceError::Version(2))
        ));
        let mut bad_op = good.to_vec();
        let mut rec = TraceRecord {
            t_us: 0,
            op: TraceOp::Read,
            offset: 0,
            len: 4096,
            fua: false,
        }
        .encode();
        rec[20] = 9;
        bad_op.extend_from_slice(&rec);
        let got: Vec<_> = TraceReader::new(&bad_op[..]).unwrap().collect();
        assert!(matches!(got[..], [Err(TraceError::BadOp(9))]));
    }

    #[test]
    fn a_file_cut_short_reads_to_its_last_whole_record() {
        let mut w = TraceWriter::new(
            Vec::new(),
            TraceHeader {
                start_unix_us: 0,
                device_size: 0,
            },
        )
        .unwrap();
        for t_us in 0..3 {
            w.write(&TraceRecord {
                t_us,
                op: TraceOp::Flush,
                offset: 0,
                len: 0,
                fua: false,
            })
            .unwrap();
        }
        let bytes = w.finish().unwrap();
        let cut = &bytes[..bytes.len() - 5];
        let mut r = TraceReader::new(cut).unwrap();
        assert_eq!(r.by_ref().count(), 2);
        assert_eq!(r.partial_bytes(), RECORD_LEN - 5);
    }
}

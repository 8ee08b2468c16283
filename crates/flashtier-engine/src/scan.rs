//! Looking for a cache's dirty data without its superblock: what `format` checks before it
//! overwrites a device whose superblocks are damaged or gone, since the log may still hold the
//! only copy of acknowledged writes.
//!
//! Read-only. Every batch header and checkpoint starts at a multiple of 4 KiB (block sizes and
//! the data offset are multiples of it), so the scan reads the whole device in large chunks
//! (skipping a file's holes) and decodes what carries a batch or checkpoint magic. It
//! over-counts rather than misses: a dirty record already written back still says dirty in its
//! header (the CLEANED hint that followed is not matched up, nor are batches superseded by a
//! checkpoint), so the figures are "up to". A device it finds nothing on is not proof of
//! anything either; it is what lets `format` refuse the case it can tell.

use flashtier_io::{AlignedBuf, BlockDev, Extent};

use crate::layout::batch::{BatchHeader, HEADER_FIELDS, MAGIC as BATCH_MAGIC};
use crate::layout::checkpoint::{Checkpoint, HEADER_LEN, MAGIC as CHECKPOINT_MAGIC};

/// Alignment of every batch header and checkpoint header.
const STEP: u64 = 4096;
/// Bytes read at once.
const CHUNK: u64 = 4 << 20;
/// Checkpoint bodies larger than this are not read: their entries all count as possibly dirty.
const MAX_BODY: u64 = 256 << 20;

/// What a scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Batch headers whose checksum holds.
    pub batches: u64,
    /// Blocks of dirty records in those batches (up to: some may have been written back since).
    pub dirty_log_blocks: u64,
    /// Checkpoint headers whose checksum holds.
    pub checkpoints: u64,
    /// Dirty entries in the checkpoint with the highest number (every entry if its body was not
    /// read).
    pub dirty_checkpoint_blocks: u64,
    /// Bytes read.
    pub scanned_bytes: u64,
}

impl ScanReport {
    /// Whether anything suggests dirty data.
    pub fn found_dirty(&self) -> bool {
        self.dirty_log_blocks > 0 || self.dirty_checkpoint_blocks > 0
    }

    /// Whether anything of a flashtier cache was found.
    pub fn found_cache(&self) -> bool {
        self.batches > 0 || self.checkpoints > 0
    }
}

/// Scans `dev` for flashtier batch headers and checkpoints; `progress` is called after each
/// chunk with the bytes done and the total.
pub fn scan(dev: &dyn BlockDev, mut progress: impl FnMut(u64, u64)) -> std::io::Result<ScanReport> {
    let size = dev.info().size / STEP * STEP;
    let mut report = ScanReport::default();
    let mut newest_checkpoint: Option<u64> = None;
    let mut buf = AlignedBuf::zeroed(CHUNK as usize);
    let mut extents = Vec::new();
    let mut pos = 0;
    while pos < size {
        // Holes of a sparse file read as zeroes: skip them.
        extents.clear();
        dev.extents(pos, (size - pos).min(1 << 30), 1, &mut extents)?;
        if let Some(Extent {
            len, hole: true, ..
        }) = extents.first()
        {
            pos = (pos + len).next_multiple_of(STEP).min(size);
            continue;
        }
        let n = CHUNK.min(size - pos) as usize;
        dev.read_at(&mut buf[..n], pos)?;
        report.scanned_bytes += n as u64;
        for at in (0..n).step_by(STEP as usize) {
            let block = &buf[at..n];
            if block.starts_with(BATCH_MAGIC) && block.len() >= HEADER_FIELDS {
                if let Ok(h) = BatchHeader::decode(&block[..HEADER_FIELDS]) {
                    report.batches += 1;
                    report.dirty_log_blocks += h
                        .entries
                        .iter()
                        .filter(|e| e.dirty && e.kind.has_data())
                        .map(|e| e.nblocks as u64)
                        .sum::<u64>();
                }
            } else if block.starts_with(CHECKPOINT_MAGIC) && block.len() >= HEADER_LEN {
                if let Ok(h) = Checkpoint::decode_header(&block[..HEADER_LEN]) {
                    report.checkpoints += 1;
                    if newest_checkpoint.is_some_and(|n| n >= h.number) {
                        continue;
                    }
                    newest_checkpoint = Some(h.number);
                    let body_at = pos + at as u64 + HEADER_LEN as u64;
                    report.dirty_checkpoint_blocks = if h.body_len <= MAX_BODY
                        && body_at
                            .checked_add(h.body_len)
                            .is_some_and(|end| end <= size)
                    {
                        let mut body =
                            AlignedBuf::zeroed(h.body_len.next_multiple_of(STEP) as usize);
                        dev.read_at(&mut body, body_at)?;
                        match Checkpoint::decode_body(&h, &body) {
                            Ok(c) => c.entries.iter().filter(|e| e.dirty).count() as u64,
                            Err(_) => h.entry_count,
                        }
                    } else {
                        h.entry_count
                    };
                }
            }
        }
        pos += n as u64;
        progress(pos, size);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flashtier_testkit::MemDev;

    use super::*;
    use crate::engine::{format, FormatOptions};
    use crate::{BackingIdentity, Cache};

    /// A cache with dirty blocks, closed cleanly: a checkpoint holds them. With both superblocks
    /// zeroed the scan still finds them; a cache without dirty blocks shows none.
    #[test]
    fn finds_dirty_blocks_without_a_superblock() {
        let cache: Arc<dyn BlockDev> = Arc::new(MemDev::new(16 << 20));
        let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(64 << 20));
        let ident = BackingIdentity {
            size: 64 << 20,
            name: "/b.img".into(),
            fingerprint: Vec::new(),
        };
        let opts = FormatOptions {
            segment_size: 1 << 20,
            ..FormatOptions::default()
        };
        format(&*cache, ident.clone(), opts).unwrap();
        let empty = scan(&*cache, |_, _| {}).unwrap();
        assert!(!empty.found_dirty(), "{empty:?}");
        assert_eq!(empty.checkpoints, 1);

        let c = Cache::open(cache.clone(), backing, &ident, None).unwrap();
        c.write_at(&[7u8; 8192], 1 << 20, false).unwrap();
        c.flush().unwrap();
        // Logged, not yet checkpointed: the batch says so.
        let live = scan(&*cache, |_, _| {}).unwrap();
        assert_eq!(live.dirty_log_blocks, 2, "{live:?}");
        c.close().unwrap();
        cache.write_at(&[0u8; 8192], 0, false).unwrap();
        assert!(crate::read_superblock(&*cache).is_err());
        let mut calls = 0;
        let after = scan(&*cache, |done, total| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
        assert!(calls > 0);
        assert_eq!(after.dirty_checkpoint_blocks, 2, "{after:?}");
        assert!(after.found_dirty() && after.found_cache());
    }

    #[test]
    fn finds_nothing_on_a_blank_device() {
        let dev = MemDev::new(8 << 20);
        let r = scan(&dev, |_, _| {}).unwrap();
        assert!(!r.found_cache() && !r.found_dirty());
        assert_eq!(r.scanned_bytes, 8 << 20);
    }
}

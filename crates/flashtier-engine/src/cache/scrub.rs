//! The scrub: reads every cached block back from the cache device and checks it, so damage is
//! found (and clean copies dropped, dirty ones reported lost) before a client or the cleaner
//! needs the block.
//!
//! It walks the segments in order, reading each segment's live slots in runs of consecutive
//! slots (at most [`MAX_READ`] at once) while the segment is pinned, and hands every block that
//! fails to `integrity::bad_block`, exactly as a client read would. It runs beside the I/O paths
//! (the state lock is held only to list a segment's slots), never faster than the rate asked for,
//! and stops between two reads when cancelled.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use flashtier_io::AlignedBuf;

use crate::integrity::{self, Verdict};
use crate::stats::Stats;
use crate::Cache;

/// Largest single read of the cache device.
const MAX_READ: usize = 1 << 20;

/// How far a scrub has got; shared with whoever watches it.
#[derive(Debug, Default)]
pub struct ScrubProgress {
    /// Segments checked so far.
    pub segments_done: AtomicU64,
    /// Segments to check in all.
    pub segments_total: AtomicU64,
    /// Cached blocks read and checked so far.
    pub checked_blocks: AtomicU64,
    /// Clean blocks that failed and were dropped (they are read from the backing store).
    pub dropped_blocks: AtomicU64,
    /// Dirty blocks that failed: lost.
    pub lost_blocks: AtomicU64,
}

/// What a finished (or cancelled) scrub found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScrubReport {
    /// Cached blocks read and checked.
    pub checked_blocks: u64,
    /// Clean blocks that failed and were dropped (they are read from the backing store).
    pub dropped_blocks: u64,
    /// Dirty blocks that failed: lost.
    pub lost_blocks: u64,
    /// Whether the scrub was cancelled before it checked everything.
    pub cancelled: bool,
}

impl ScrubProgress {
    /// The counts so far, as a report (`cancelled`: the scrub stopped early).
    pub fn report(&self, cancelled: bool) -> ScrubReport {
        ScrubReport {
            checked_blocks: self.checked_blocks.load(Ordering::Relaxed),
            dropped_blocks: self.dropped_blocks.load(Ordering::Relaxed),
            lost_blocks: self.lost_blocks.load(Ordering::Relaxed),
            cancelled,
        }
    }
}

impl Cache {
    /// Checks every cached block (see the module). `rate` caps the bytes read per second
    /// (`None`: as fast as the device goes). Returns what it found; cancelled between reads
    /// when `cancel` is set.
    pub fn scrub(
        &self,
        progress: &ScrubProgress,
        cancel: &AtomicBool,
        rate: Option<u64>,
    ) -> io::Result<ScrubReport> {
        let e = self.engine();
        let geo = e.geo;
        let bs = geo.block_size as usize;
        progress
            .segments_total
            .store(geo.segment_count as u64, Ordering::Relaxed);
        let started = Instant::now();
        let mut read_bytes = 0u64;
        let mut buf = AlignedBuf::zeroed(MAX_READ.max(bs));
        for seg in 0..geo.segment_count {
            // Slots with a live block, and what they must hold, listed with the segment pinned.
            let live: Vec<(u32, u64, u32)> = {
                let st = e.state.read();
                st.segs.reader_enter(seg);
                st.index
                    .slots_in(geo.first_slot(seg), geo.blocks_per_segment())
                    .map(|(slot, info)| (slot, info.lba, st.crcs[slot as usize]))
                    .collect()
            };
            let result = self.scrub_slots(&live, &mut buf, progress, cancel, |bytes| {
                read_bytes += bytes;
                pace(started, read_bytes, rate, cancel);
            });
            e.state.read().segs.reader_exit(seg);
            result?;
            progress.segments_done.fetch_add(1, Ordering::Relaxed);
            if cancel.load(Ordering::Acquire) {
                return Ok(progress.report(true));
            }
        }
        Ok(progress.report(false))
    }

    /// Reads and checks `live` slots `(slot, lba, crc)` of one pinned segment, in runs of
    /// consecutive slots; `read` is told the bytes of each read.
    fn scrub_slots(
        &self,
        live: &[(u32, u64, u32)],
        buf: &mut AlignedBuf,
        progress: &ScrubProgress,
        cancel: &AtomicBool,
        mut read: impl FnMut(u64),
    ) -> io::Result<()> {
        let e = self.engine();
        let bs = e.geo.block_size as usize;
        let per_read = buf.len() / bs;
        let mut i = 0;
        while i < live.len() && !cancel.load(Ordering::Acquire) {
            let mut j = i + 1;
            while j < live.len() && j - i < per_read && live[j].0 == live[j - 1].0 + 1 {
                j += 1;
            }
            let part = &mut buf[..(j - i) * bs];
            e.cache
                .read_at(part, e.geo.slot_offset(live[i].0))
                .inspect_err(|_| Stats::add(&e.stats.cache_errors, 1))?;
            Stats::add(&e.stats.cache_reads, 1);
            Stats::add(&e.stats.cache_read_bytes, part.len() as u64);
            for (block, &(slot, lba, crc)) in part.chunks_mut(bs).zip(&live[i..j]) {
                if integrity::intact(block, crc) {
                    continue;
                }
                match integrity::bad_block(e, lba, slot, crc, block) {
                    Verdict::Dropped => progress.dropped_blocks.fetch_add(1, Ordering::Relaxed),
                    Verdict::Lost => progress.lost_blocks.fetch_add(1, Ordering::Relaxed),
                    Verdict::Repaired | Verdict::Moved => 0,
                };
            }
            let n = (j - i) as u64;
            progress.checked_blocks.fetch_add(n, Ordering::Relaxed);
            Stats::add(&e.stats.scrubbed_blocks, n);
            read(part.len() as u64);
            i = j;
        }
        Ok(())
    }
}

/// Sleeps until `bytes` read since `started` are within `rate` bytes per second (in short naps,
/// so a cancel is noticed).
fn pace(started: Instant, bytes: u64, rate: Option<u64>, cancel: &AtomicBool) {
    let Some(rate) = rate.filter(|&r| r > 0) else {
        return;
    };
    let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
    while started.elapsed() < due && !cancel.load(Ordering::Acquire) {
        std::thread::sleep((due - started.elapsed()).min(Duration::from_millis(50)));
    }
}

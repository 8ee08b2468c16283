//! `Cache`: a backing store with the SSD tier in front, itself a `BlockDev`.
//!
//! Each request is planned once when it arrives (`plan`: its effective mode after the sequential
//! cutoffs, promotion, the uncached tail, a failed log), then served by one handler per mode:
//! - **read** (`read`): blocks found in the index are read from the cache device (runs of
//!   consecutive slots in one read); the others from the backing store, then promoted as the plan
//!   says by an asynchronous PROMOTE record. Pass-through reads the backing store only
//!   (`pass_through`).
//! - **write-back** (`write_back`): one WRITE record per request (split at the atomic size),
//!   dirty; acknowledged once written to the cache device; FUA waits for a sync.
//! - **write-through** (`write_through`): the same record, synced, then the backing store is
//!   written; the blocks are logged clean after the next backing flush.
//! - **write-around, pass-through** (`write_around`): an INVALIDATE record for the range is
//!   synced, then the backing store is written. So is a write-back or write-through write past
//!   the sequential write cutoff, except for its blocks dirty in the cache.
//! - **trim, write-zeroes** (`zero_trim`): trim like write-around; write-zeroes like a write past
//!   the sequential cutoff whose backing store zeroes its blocks itself (dirty blocks in the range
//!   are zeroed in the cache; partial blocks at the edges are zeroed through the write path).
//!
//! What every cached write goes through first (its blocks held, a read-modify-write for partial
//! blocks, which takes the block the previous partial write of it ended in from
//! `partial_blocks` when that is still what the block holds) is in `write`; the backing store's
//! own reads and writes in `pass_through`.
//! **Sequential cutoffs** ([`crate::policy::sequential`]) and **n-hit promotion**
//! ([`crate::policy::admission`]) are decided in `plan` and `read`; prefetch promotes regardless
//! of both.

mod detach;
mod params;
mod partial_blocks;
mod pass_through;
mod plan;
mod read;
mod read_batch;
mod scrub;
mod write;
mod write_around;
mod write_back;
mod write_batch;
mod write_through;
mod zero_trim;

pub use detach::{ReleaseError, Released};
pub use scrub::{ScrubProgress, ScrubReport};

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use flashtier_io::{
    check_range, AlignedBuf, BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts,
};

use crate::cleaner;
use crate::engine::{self, Engine, OpenReport};
use crate::layout::superblock::BackingIdentity;
use crate::log_writer::{Writer, WriterParts};
use crate::policy::{Mode, ReclaimPolicy};
use crate::stats::{Stats, StatsSnapshot};
use crate::EngineError;

/// Why the cache's data is not whole (see `Status::integrity`).
fn integrity_reason(
    lost: &crate::lost::LostSet,
    damage: &[crate::recover::Damage],
) -> Option<String> {
    let unknown: Vec<String> = damage
        .iter()
        .filter(|d| matches!(d, crate::recover::Damage::Unknown { .. }))
        .map(ToString::to_string)
        .collect();
    let mut why = Vec::new();
    if !lost.is_empty() {
        let first: Vec<String> = lost
            .ranges()
            .take(8)
            .map(|(f, n)| {
                if n == 1 {
                    format!("{f}")
                } else {
                    format!("{f}..{}", f + n - 1)
                }
            })
            .collect();
        why.push(format!(
            "{} block(s) lost (their newest data failed its checksum; reads fail until rewritten \
             or `flashtier forget-lost`): blocks {}{}",
            lost.blocks(),
            first.join(", "),
            if lost.range_count() > 8 { ", ..." } else { "" }
        ));
    }
    why.extend(unknown);
    (!why.is_empty()).then(|| why.join("; "))
}

/// How the cache is used right now.
#[derive(Debug, Clone)]
pub struct Status {
    /// The mode writes are served in.
    pub mode: Mode,
    /// Which segment reclaim empties first.
    pub reclaim: ReclaimPolicy,
    /// Cache block size in bytes: the unit of caching.
    pub block_size: u32,
    /// Segment size in bytes: the unit of log allocation and reclaim.
    pub segment_size: u32,
    /// Segments on the cache device.
    pub segments: u32,
    /// Segments holding nothing, ready for the log.
    pub free_segments: usize,
    /// Blocks the index maps (clean and dirty).
    pub cached_blocks: u64,
    /// Blocks the log can still write before reclaim must empty another segment: free
    /// segments, segments reclaim emptied that wait for their FREE records, and the unwritten
    /// rest of the segment the log is filling. Reclaim keeps a few segments here so that it can
    /// always run.
    pub unwritten_blocks: u64,
    /// The rest of the capacity, neither cached nor unwritten: slots whose block was
    /// overwritten, trimmed or evicted since it was written, the log's batch headers, and the
    /// unused ends of segments sealed early (a batch that did not fit, a restart). Reclaim
    /// turns them back into unwritten blocks by emptying the segments that hold them.
    pub stale_blocks: u64,
    /// Mapped blocks not yet written back to the backing store.
    pub dirty_blocks: u64,
    /// Most blocks the cache can hold at once.
    pub capacity_blocks: u64,
    /// RAM the index takes, in bytes.
    pub index_bytes: usize,
    /// Largest write that is all-or-nothing after a crash, in bytes.
    pub atomic_write_bytes: u32,
    /// The cache device failed: the log refuses writes and flushes until it works again (the
    /// log retries by itself).
    pub failed: bool,
    /// Why the cache device failed, while `failed`.
    pub cache_failure: Option<String>,
    /// Why the volume is degraded while the backing store fails (the last backing error, when,
    /// and how many write-back attempts failed in a row); `None` while it works. Dirty data is
    /// kept meanwhile and write-back is retried with backoff.
    pub backing_degraded: Option<String>,
    /// What the background cleaner is doing.
    pub writeback: crate::WritebackStatus,
    /// Blocks whose newest data was lost (reads of them fail until they are written again or
    /// the loss is acknowledged with [`Cache::forget_lost`]).
    pub lost_blocks: u64,
    /// Why the cache's data is not whole, when it is not: lost blocks, or records recovery
    /// could not place. `None` while all is well.
    pub integrity: Option<String>,
    /// What recovery found damaged and repaired or reported when the cache was opened.
    pub recovery: Vec<String>,
}

/// An open cache: a volume over its backing store that serves reads and writes through the
/// cache device, and runs the log writer, reclaim and the write-back cleaner until closed.
pub struct Cache {
    e: Arc<Engine>,
    info: DevInfo,
    threads: parking_lot::Mutex<Threads>,
    report: OpenReport,
    /// What partial writes left in the blocks they ended in (`partial_blocks`).
    partials: partial_blocks::RecentPartials,
}

#[derive(Default)]
struct Threads {
    writer: Option<JoinHandle<()>>,
    reclaimer: Option<JoinHandle<()>>,
    cleaner: Option<JoinHandle<()>>,
}

/// The log writer's handles on the engine's components. A block it reads back after a failed
/// sync is checked as any cache read is (`integrity`), against this engine.
fn writer_parts(e: &Arc<Engine>) -> WriterParts {
    let engine = e.clone();
    WriterParts {
        cache: e.cache.clone(),
        geo: e.geo,
        state: e.state.clone(),
        log: e.log.clone(),
        stats: e.stats.clone(),
        guards: e.guards.clone(),
        reclaim: e.reclaim.clone(),
        started: e.started,
        check_block: Arc::new(move |lba, slot, crc, block| {
            crate::integrity::check_block(&engine, lba, slot, crc, block)
        }),
    }
}

impl Cache {
    /// Opens (recovering if needed) the cache on `cache` for `backing`. With `mode`, overrides
    /// the mode stored on the device; a mode that keeps no dirty data writes all dirty blocks
    /// back before this returns.
    pub fn open(
        cache: Arc<dyn BlockDev>,
        backing: Arc<dyn BlockDev>,
        identity: &BackingIdentity,
        mode: Option<Mode>,
    ) -> Result<Cache, EngineError> {
        let (e, start, report) = engine::open_engine(cache, backing.clone(), identity, mode)?;
        let writer = Writer::new(writer_parts(&e), &start).spawn();
        let reclaimer = crate::reclaim::spawn(e.clone());
        let cleaner = crate::writeback::spawn(e.clone());
        let block_size = e.geo.block_size as usize;
        let info = DevInfo {
            size: backing.info().size,
            read_only: false,
            min_block: e.geo.block_size,
            can_flush: true,
            native_fua: true,
            can_trim: true,
            can_fast_zero: backing.info().can_fast_zero,
            can_extents: false,
            rotational: false,
        };
        let cache = Cache {
            e,
            info,
            threads: parking_lot::Mutex::new(Threads {
                writer: Some(writer),
                reclaimer: Some(reclaimer),
                cleaner: Some(cleaner),
            }),
            report,
            partials: partial_blocks::RecentPartials::new(block_size),
        };
        if !cache.mode().keeps_dirty_data() && cache.report.dirty_blocks > 0 {
            tracing::info!(
                blocks = cache.report.dirty_blocks,
                mode = %cache.mode(),
                "writing back dirty blocks before serving in a mode that keeps none"
            );
            cache.write_back_all().map_err(EngineError::BackingIo)?;
        }
        Ok(cache)
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.e
    }

    /// What opening the cache found (recovery, damage).
    pub fn report(&self) -> &OpenReport {
        &self.report
    }

    /// The mode writes are served in now.
    pub fn mode(&self) -> Mode {
        self.e.mode()
    }

    /// Switches mode. Leaving write-back writes every dirty block back first (while writes
    /// continue in write-back), then holds writes off while it writes back what arrived
    /// meanwhile and switches: a pass-through read must never find a dirty block unwritten.
    pub fn set_mode(&self, mode: Mode) -> io::Result<()> {
        if self.mode() == mode {
            return Ok(());
        }
        if !mode.keeps_dirty_data() {
            self.write_back_all()?;
        }
        // Writes decide what to do by the mode when they start; this waits for those in flight.
        let _no_writes_in_flight = self.e.writes_gate.write();
        if !mode.keeps_dirty_data() {
            self.write_back_all()?;
        }
        self.e.set_mode_flag(mode);
        self.e.writeback.wake();
        Ok(())
    }

    /// Writes every dirty block back to the backing store; returns how many.
    pub fn write_back_all(&self) -> io::Result<u64> {
        cleaner::write_back_all(&self.e, None)
    }

    /// A manual flush: writes back every block dirty when it starts (cleaning passes: sorted,
    /// coalesced, the backing store flushed before blocks are marked clean) and then flushes
    /// the backing store for writes that went around the cache, so that when it returns `Ok`
    /// the backing store durably holds everything written before the call. Blocks rewritten
    /// meanwhile may stay dirty. Returns the blocks written back.
    ///
    /// Setting `cancel` stops the pass before its next backing write: what was written is
    /// flushed and marked clean, the rest stays dirty (and safe in the cache), and it returns
    /// the blocks written so far.
    pub fn write_back_all_cancellable(&self, cancel: &AtomicBool) -> io::Result<u64> {
        let written = cleaner::write_back_all(&self.e, Some(cancel))?;
        if !cancel.load(Ordering::Acquire) {
            self.flush_backing_if_written()?;
        }
        Ok(written)
    }

    /// Hands the clean blocks reclaim evicts to `sink` from now on (None: to nobody). See
    /// `victim_sink.rs` for why a sink's version taken before the read proves the data current.
    pub fn set_victim_sink(&self, sink: Option<Arc<dyn crate::VictimSink>>) {
        *self.e.victim_sink.write() = sink;
    }

    /// The counters since the cache was opened.
    pub fn stats(&self) -> StatsSnapshot {
        self.e.stats.snapshot()
    }

    /// Its configuration, occupancy and health right now.
    pub fn status(&self) -> Status {
        let st = self.e.state.read();
        let geo = self.e.geo;
        let data_blocks = geo.segment_count as u64 * (geo.blocks_per_segment() as u64);
        let (cached, unwritten) = (st.segs.total_live(), st.segs.unwritten_blocks());
        Status {
            mode: self.mode(),
            reclaim: self.e.reclaim_policy(),
            block_size: geo.block_size,
            segment_size: geo.segment_size,
            segments: geo.segment_count,
            free_segments: st.segs.free_count(),
            cached_blocks: cached,
            unwritten_blocks: unwritten,
            stale_blocks: data_blocks.saturating_sub(cached + unwritten),
            dirty_blocks: st.segs.total_dirty(),
            capacity_blocks: data_blocks,
            index_bytes: st.memory_bytes(),
            atomic_write_bytes: self.e.atomic_bytes,
            failed: self.e.log.failed(),
            cache_failure: self.e.log.failure(),
            backing_degraded: self.e.backing.health.reason(),
            writeback: self.e.writeback.status.lock().clone(),
            lost_blocks: st.lost.blocks(),
            integrity: integrity_reason(&st.lost, &self.e.recovery_damage),
            recovery: self
                .e
                .recovery_damage
                .iter()
                .map(|d| d.to_string())
                .collect(),
        }
    }

    /// The lost blocks, as ranges `(first block, blocks)` in address order.
    pub fn lost_ranges(&self) -> Vec<(u64, u64)> {
        self.e.state.read().lost.ranges().collect()
    }

    /// Acknowledges lost blocks (all of them, or those within `range`, `(first block, blocks)`):
    /// reads of them then return whatever the backing store holds, which is older than what was
    /// lost. Returns how many blocks were forgotten.
    pub fn forget_lost(&self, range: Option<(u64, u64)>) -> io::Result<u64> {
        let e = &*self.e;
        let forgotten = {
            // No write is in flight: an INVALIDATE of a range a write just landed in would
            // drop it.
            let _no_writes = e.writes_gate.write();
            let ranges: Vec<(u64, u64)> = {
                let st = e.state.read();
                st.lost
                    .ranges()
                    .filter_map(|(first, n)| match range {
                        None => Some((first, n)),
                        Some((from, len)) => {
                            let (lo, hi) = (first.max(from), (first + n).min(from + len));
                            (lo < hi).then_some((lo, hi - lo))
                        }
                    })
                    .collect()
            };
            for &(first, n) in &ranges {
                self.append_invalidate(first, n)?;
            }
            ranges.iter().map(|&(_, n)| n).sum::<u64>()
        };
        if forgotten > 0 {
            e.log.sync(false)?;
            tracing::warn!(
                blocks = forgotten,
                "lost blocks forgotten: they read the backing store's older data now"
            );
        }
        Ok(forgotten)
    }

    /// Largest write that is all-or-nothing after a crash.
    pub fn atomic_write_bytes(&self) -> u32 {
        self.e.atomic_bytes
    }

    /// Empties victims now, as if the cache were full (tests and benchmarks).
    pub fn reclaim_now(&self) -> io::Result<()> {
        crate::reclaim::reclaim_until_target(&self.e)
    }

    /// Clean shutdown: stops reclaim, writes a final checkpoint and marks the cache clean, so the
    /// next open replays nothing. Dirty blocks stay in the cache (they are safe there). Requests
    /// after this fail; a second call does nothing.
    pub fn close(&self) -> Result<(), EngineError> {
        self.shutdown(true)
    }

    fn shutdown(&self, clean: bool) -> Result<(), EngineError> {
        let mut threads = self.threads.lock();
        if threads.writer.is_none() {
            return Ok(());
        }
        // The cleaner first: its pass in progress stops before its next backing write (what it
        // wrote is flushed and marked clean), and it needs the log and reclaim until then.
        crate::writeback::stop(&self.e);
        if let Some(c) = threads.cleaner.take() {
            let _ = c.join();
        }
        self.e.reclaim.stop();
        if let Some(r) = threads.reclaimer.take() {
            let _ = r.join();
        }
        let mut result = Ok(());
        if clean {
            // Writes that went around the cache become durable with the shutdown, like any
            // other acknowledged write; the next open flushes again in case this fails.
            result = self
                .flush_backing_if_written()
                .map_err(EngineError::BackingIo);
        }
        if clean && !self.e.log.failed() {
            result = result.and(
                self.e
                    .log
                    .checkpoint()
                    .map_err(io::Error::from)
                    .and_then(|()| engine::mark_clean(&self.e))
                    .map_err(EngineError::CacheIo),
            );
        }
        self.e.log.stop();
        if let Some(w) = threads.writer.take() {
            let _ = w.join();
        }
        result
    }

    pub(super) fn block_size(&self) -> u64 {
        self.e.geo.block_size as u64
    }

    /// Flushes the backing store if anything was written there since its last flush. Callers
    /// take turns: a FLUSH must not return while another one's backing flush, which covers
    /// writes this one promises, is still running.
    pub(super) fn flush_backing_if_written(&self) -> io::Result<()> {
        let e = &*self.e;
        let _turn = e.backing.flush_turn.lock();
        if !e.backing.unflushed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let (blocks, generations) = std::mem::take(&mut *e.backing.unflushed_write_through.lock());
        let fg = e.backing.foreground.begin();
        let flushed = engine::flush_backing(e);
        drop(fg);
        if let Err(err) = flushed {
            e.backing.unflushed.store(true, Ordering::Release);
            let mut pending = e.backing.unflushed_write_through.lock();
            pending.0.extend(blocks);
            pending.1.extend(generations);
            return Err(err);
        }
        cleaner::mark_clean(e, &blocks, &generations);
        Ok(())
    }

    /// The part of the export past the last whole cache block is never cached.
    pub(super) fn uncached_tail(&self) -> u64 {
        self.e.cached_blocks * self.block_size()
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        // Not closed: stop the threads without marking the cache clean (like a crash, but with
        // everything acknowledged already in the log).
        let _ = self.shutdown(false);
    }
}

impl BlockDev for Cache {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        format!(
            "{} cached on {} ({})",
            self.e.backing.dev.describe(),
            self.e.cache.describe(),
            self.mode()
        )
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read(buf, offset, false)
    }

    fn read_batch_max(&self) -> usize {
        self.read_batch_limit()
    }

    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        self.read_batch_hits(reads, leave)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, true)?;
        let past_cutoff = self.past_write_cutoff(offset, buf.len() as u64);
        self.write(buf, offset, fua, past_cutoff)
    }

    fn write_batch_max(&self) -> usize {
        self.write_batch_limit()
    }

    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        for w in writes.iter_mut() {
            if let Err(e) = check_range(self.info.size, w.offset, w.buf.len() as u64, true) {
                w.result = Some(Err(e));
            }
        }
        self.write_batch_back(writes)
    }

    fn flush(&self) -> io::Result<()> {
        let e = &*self.e;
        Stats::add(&e.stats.flushes, 1);
        e.log.sync(false)?;
        self.flush_backing_if_written()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.info.size, offset, len, true)?;
        self.trim_range(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        check_range(self.info.size, offset, len, true)?;
        self.zero_range(offset, len, opts)
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        if !self.mode().caches_reads() {
            return Ok(());
        }
        // Reading promotes what is missing (whatever the sequential cutoff and promotion policy
        // say: the client asked for it); bounded so a huge CACHE request cannot pin memory.
        let chunk = 4u64 << 20;
        let end = (offset + len)
            .min(self.uncached_tail())
            .min(offset + (256 << 20));
        let mut buf = AlignedBuf::zeroed(chunk as usize);
        let mut at = offset;
        while at < end {
            let n = (end - at).min(chunk) as usize;
            self.read(&mut buf[..n], at, true)?;
            at += n as u64;
        }
        Ok(())
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        let _ = max_extents;
        out.push(Extent::data(len));
        Ok(())
    }
}

//! `Cache`: a backing store with the SSD tier in front, itself a `BlockDev`.
//!
//! The I/O paths, per mode:
//! - **read**: blocks found in the index are read from the cache device (runs of consecutive
//!   slots in one read); the others from the backing store, then promoted (except in
//!   pass-through) by an asynchronous PROMOTE record.
//! - **write-back**: one WRITE record per request (split at the atomic size), dirty; acknowledged
//!   once written to the cache device; FUA waits for a sync.
//! - **write-through**: the same record, synced, then the backing store is written; the blocks are
//!   logged clean after the next backing flush.
//! - **write-around, pass-through**: an INVALIDATE record for the range is synced, then the backing
//!   store is written.
//! - **trim, write-zeroes**: like write-around (write-zeroes first writes back any dirty blocks in
//!   the range, so a failing backing store cannot lose them; partial blocks at the edges are
//!   zeroed through the write path).
//! - **sequential cutoffs** ([`crate::policy::sequential`]): a read continuing a stream past the
//!   read cutoff promotes none of its misses; a write continuing a stream past the write cutoff
//!   goes around the cache in write-back and write-through, except for blocks dirty in the cache
//!   (see `write_past_cutoff`). **n-hit promotion** ([`crate::policy::admission`]): a miss is
//!   promoted only on its nth recent miss. Prefetch promotes regardless of both.
//!
//! The rule behind the write-around order: before the backing store is written, every record that
//! could map the blocks being written must be durably superseded, or a crash could bring back a
//! cached copy older than what the backing store holds.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use flashtier_io::{check_range, AlignedBuf, BlockDev, DevInfo, Extent, ZeroOpts};

use crate::cleaner;
use crate::engine::{self, Engine, OpenReport};
use crate::guards::BusyRange;
use crate::health::BackingOp;
use crate::integrity::{self, IntegrityError, Verdict};
use crate::layout::batch::Kind;
use crate::layout::superblock::BackingIdentity;
use crate::log::{Record, Writer};
use crate::policy::{Mode, PromotionPolicy, ReclaimPolicy};
use crate::range_lock::RangeGuard;
use crate::state::DirtyBlock;
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

/// The first lost block of `[first, first + n)`, if any.
fn first_lost(st: &crate::state::State, first: u64, n: u64) -> Option<u64> {
    if !st.lost.overlaps(first, n) {
        return None;
    }
    (first..first + n).find(|&lba| st.lost.overlaps(lba, 1))
}

/// Promotion data waiting for the log beyond this is dropped rather than queued.
const MAX_QUEUED_PROMOTION: u64 = 64 << 20;

/// Which of a read's misses are promoted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Promote {
    /// Every one: a prefetch, the client asking for the range to be cached.
    All,
    /// Those the promotion policy admits.
    Admitted,
    /// None: the read continued a sequential stream past the read cutoff.
    Sequential,
    /// None: a read-modify-write's edge blocks, about to be overwritten (a write stamps its
    /// blocks, so their promotion would be dropped anyway).
    Never,
}

/// How a write holds its blocks in `Engine::write_ranges` (shared by whole-block writes,
/// exclusive for partial ones).
enum RmwHeld<'a> {
    /// Exclusively, by the caller, for the whole write (a read-modify-write).
    ByCaller,
    /// Exclusively, until the write's INVALIDATE is applied.
    Exclusive(RangeGuard<'a>),
    Shared {
        _guard: RangeGuard<'a>,
    },
}

impl<'a> RmwHeld<'a> {
    fn downgrade(self) -> RmwHeld<'a> {
        match self {
            RmwHeld::Exclusive(mut g) => {
                g.downgrade();
                RmwHeld::Shared { _guard: g }
            }
            held => held,
        }
    }
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
    pub writeback: crate::writeback::WritebackStatus,
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
}

#[derive(Default)]
struct Threads {
    writer: Option<JoinHandle<()>>,
    reclaimer: Option<JoinHandle<()>>,
    cleaner: Option<JoinHandle<()>>,
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
        let writer = Writer::new(e.clone(), &start);
        let writer = writer.spawn();
        let reclaimer = crate::reclaim::spawn(e.clone());
        let cleaner = crate::writeback::spawn(e.clone());
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
        self.e.wake_writeback();
        Ok(())
    }

    /// Changes which segment reclaim empties first, from the next reclaim on.
    pub fn set_reclaim_policy(&self, policy: ReclaimPolicy) {
        self.e.set_reclaim_policy(policy);
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

    /// The counters since the cache was opened.
    pub fn stats(&self) -> StatsSnapshot {
        self.e.stats.snapshot()
    }

    /// Its configuration, occupancy and health right now.
    pub fn status(&self) -> Status {
        let st = self.e.state.read();
        let geo = self.e.geo;
        let data_blocks = geo.segment_count as u64 * (geo.blocks_per_segment() as u64);
        Status {
            mode: self.mode(),
            reclaim: self.e.reclaim_policy(),
            block_size: geo.block_size,
            segment_size: geo.segment_size,
            segments: geo.segment_count,
            free_segments: st.segs.free_count(),
            cached_blocks: st.segs.total_live(),
            dirty_blocks: st.segs.total_dirty(),
            capacity_blocks: data_blocks,
            index_bytes: st.memory_bytes(),
            atomic_write_bytes: self.e.atomic_bytes,
            failed: self.e.log.failed(),
            cache_failure: self.e.log.failure(),
            backing_degraded: self.e.backing_health.reason(),
            writeback: self.e.writeback_status.lock().clone(),
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
        {
            let mut ctl = self.e.reclaim.lock();
            ctl.stop = true;
        }
        self.e.reclaim_cv.notify_all();
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

    fn block_size(&self) -> u64 {
        self.e.geo.block_size as u64
    }

    /// Reads whole blocks `[first, first + count)` into `out`.
    fn read_blocks(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        promote: Promote,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        // Runs of hits (consecutive slots) and misses, found under one short read lock; the
        // segments holding hits are pinned until their reads are done.
        enum Run {
            Hit { slot: u32, n: u64 },
            Miss { n: u64 },
        }
        let mut runs: Vec<(u64, Run)> = Vec::new();
        let mut pinned: Vec<u32> = Vec::new();
        // The checksum each hit's slot was written with, in order.
        let mut crcs: Vec<u32> = Vec::new();
        {
            let st = e.state.read();
            if let Some(lba) = first_lost(&st, first, count) {
                Stats::add(&e.stats.lost_reads, 1);
                return Err(IntegrityError::Lost { lba }.into());
            }
            let now = e.now_secs();
            for i in 0..count {
                let lba = first + i;
                match st.index.get(lba) {
                    Some(slot) => {
                        st.index.touch(slot);
                        crcs.push(st.crcs[slot as usize]);
                        let seg = e.geo.segment_of(slot);
                        if pinned.last() != Some(&seg) {
                            st.segs.reader_enter(seg);
                            st.segs.note_access(seg, now);
                            pinned.push(seg);
                        }
                        match runs.last_mut() {
                            Some((_, Run::Hit { slot: s, n })) if *s + *n as u32 == slot => *n += 1,
                            _ => runs.push((i, Run::Hit { slot, n: 1 })),
                        }
                    }
                    None => match runs.last_mut() {
                        Some((_, Run::Miss { n })) => *n += 1,
                        _ => runs.push((i, Run::Miss { n: 1 })),
                    },
                }
            }
        }
        let mut result = Ok(());
        let mut hits = 0u64;
        for (at, run) in &runs {
            let (start, n) = (
                *at as usize * bs,
                match run {
                    Run::Hit { n, .. } | Run::Miss { n } => *n as usize,
                },
            );
            let buf = &mut out[start..start + n * bs];
            let r = match run {
                Run::Hit { slot, .. } => {
                    let crcs = &crcs[hits as usize..hits as usize + n];
                    hits += n as u64;
                    let r = e.cache.read_at(buf, e.geo.slot_offset(*slot));
                    if r.is_err() {
                        Stats::add(&e.stats.cache_errors, 1);
                    }
                    Stats::add(&e.stats.cache_reads, 1);
                    Stats::add(&e.stats.cache_read_bytes, buf.len() as u64);
                    r.and_then(|()| self.check_hits(first + at, *slot, crcs, buf, promote))
                }
                Run::Miss { .. } => self.read_miss(first + at, n as u64, buf, promote),
            };
            if r.is_err() {
                result = r;
                break;
            }
        }
        {
            let st = e.state.read();
            for seg in pinned {
                st.segs.reader_exit(seg);
            }
        }
        Stats::add(&e.stats.read_hit_blocks, hits);
        result
    }

    /// Checks a run of hits read from `slot..` into `buf` (blocks from `lba`) against their
    /// checksums (their segments are still pinned). A block that fails is read again, from the
    /// backing store if it was clean; a dirty one fails the read (see `integrity`).
    fn check_hits(
        &self,
        lba: u64,
        slot: u32,
        crcs: &[u32],
        buf: &mut [u8],
        promote: Promote,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        for (i, (block, &crc)) in buf.chunks_mut(bs).zip(crcs).enumerate() {
            if integrity::intact(block, crc) {
                continue;
            }
            let (lba, slot) = (lba + i as u64, slot + i as u32);
            match integrity::bad_block(e, lba, slot, crc, block) {
                Verdict::Repaired => {}
                Verdict::Dropped | Verdict::Moved => self.read_blocks(lba, 1, block, promote)?,
                Verdict::Lost => {
                    Stats::add(&e.stats.lost_reads, 1);
                    return Err(IntegrityError::Lost { lba }.into());
                }
            }
        }
        Ok(())
    }

    /// Reads blocks from the backing store and queues the promotion of those `promote` allows.
    fn read_miss(&self, lba: u64, n: u64, buf: &mut [u8], promote: Promote) -> io::Result<()> {
        let e = &*self.e;
        let since = e.guards.now();
        let bs = self.block_size();
        {
            let _fg = e.foreground_io();
            e.backing
                .read_at(buf, lba * bs)
                .inspect_err(|err| e.backing_failed(BackingOp::Read, err))?;
        }
        e.backing_health.read_succeeded();
        Stats::add(&e.stats.backing_reads, 1);
        Stats::add(&e.stats.backing_read_bytes, buf.len() as u64);
        Stats::add(&e.stats.read_miss_blocks, n);
        if !self.mode().caches_reads() || e.log.failed() {
            return Ok(());
        }
        let policy = match promote {
            Promote::Never => return Ok(()),
            Promote::Sequential => {
                Stats::add(&e.stats.bypassed_read_blocks, n);
                return Ok(());
            }
            Promote::All => PromotionPolicy::Always,
            Promote::Admitted => e.tunables.promotion(),
        };
        if policy == PromotionPolicy::Always {
            self.queue_promotion(lba, buf, since);
            return Ok(());
        }
        // n-hit: promote the runs of blocks that reached their nth recent miss.
        let (table, now) = (e.miss_table(), e.now_secs());
        let (nhit, window) = (
            e.tunables.promotion_nhit(),
            e.tunables.promotion_window_secs(),
        );
        let mut run: Option<u64> = None;
        let mut skipped = 0;
        for i in 0..=n {
            let admitted = i < n && table.record_miss(lba + i, now, nhit, window);
            match (admitted, run) {
                (true, None) => run = Some(i),
                (false, Some(from)) => {
                    let data = &buf[(from * bs) as usize..(i * bs) as usize];
                    self.queue_promotion(lba + from, data, since);
                    run = None;
                }
                _ => {}
            }
            if i < n && !admitted {
                skipped += 1;
            }
        }
        Stats::add(&e.stats.promotions_skipped_blocks, skipped);
        Ok(())
    }

    /// Queues PROMOTE records for `data` (whole blocks from `lba`), read from the backing store
    /// after guard clock `since`; drops what does not fit the promotion queue.
    fn queue_promotion(&self, lba: u64, data: &[u8], since: u64) {
        let e = &*self.e;
        let bs = self.block_size();
        let n = data.len() as u64 / bs;
        let max = (e.atomic_bytes as u64 / bs).max(1);
        let mut done = 0;
        while done < n {
            let k = (n - done).min(max);
            let bytes = k * bs;
            let queued = e
                .log
                .queued_promotion_bytes
                .fetch_add(bytes, Ordering::Relaxed);
            if queued + bytes > MAX_QUEUED_PROMOTION {
                e.log
                    .queued_promotion_bytes
                    .fetch_sub(bytes, Ordering::Relaxed);
                break;
            }
            let mut buf = AlignedBuf::zeroed(bytes as usize);
            let from = (done * bs) as usize;
            buf.copy_from_slice(&data[from..from + bytes as usize]);
            let mut rec = Record::new(Kind::Promote, lba + done, k as u32, Some(buf));
            rec.promote_since = Some(since);
            e.log.append_async(rec, false);
            done += k;
        }
    }

    /// Writes whole blocks `[lba, lba + n)` from `data` into the cache as WRITE records; returns
    /// each record's first block, the slot it landed in, and its length.
    fn log_blocks(&self, lba: u64, data: &[u8], dirty: bool) -> io::Result<Vec<(u64, u32, u32)>> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        let n = (data.len() / bs) as u64;
        let max = (e.atomic_bytes as usize / bs).max(1) as u64;
        {
            let st = e.state.read();
            let hits = (lba..lba + n)
                .filter(|&b| st.index.get(b).is_some())
                .count();
            Stats::add(&e.stats.write_hit_blocks, hits as u64);
        }
        let mut records = Vec::new();
        let mut done = 0;
        while done < n {
            let k = (n - done).min(max);
            let from = done as usize * bs;
            let mut buf = AlignedBuf::zeroed(k as usize * bs);
            buf.copy_from_slice(&data[from..from + k as usize * bs]);
            e.guards.stamp(lba + done, k);
            let rec = Record::new(Kind::Write, lba + done, k as u32, Some(buf)).dirty(dirty);
            let appended = e.log.append(rec, false)?;
            records.push((lba + done, appended.slot, k as u32));
            done += k;
        }
        Stats::add(&e.stats.write_blocks, n);
        Ok(records)
    }

    /// Durably unmaps `[lba, lba + n)` so the backing store may be written there.
    fn invalidate(&self, lba: u64, n: u64) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.append_invalidate(lba, n)?;
        Ok(self.e.log.sync_vouched(false)?)
    }

    /// Unmaps `[lba, lba + n)` (not yet durably: sync before writing the backing store there).
    fn append_invalidate(&self, lba: u64, n: u64) -> io::Result<()> {
        let e = &*self.e;
        let mut done = 0;
        while done < n {
            let k = (n - done).min(u32::MAX as u64);
            e.log.append(
                Record::new(Kind::Invalidate, lba + done, k as u32, None),
                false,
            )?;
            done += k;
        }
        Ok(())
    }

    /// Writes the backing store directly. `busy` (the blocks' guard, if they are cacheable)
    /// learns whether the data is durable there yet.
    fn backing_write(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let _held = self.hold_for_backing(offset, buf.len() as u64);
        self.backing_write_held(buf, offset, fua, busy)
    }

    /// Holds the blocks under `offset..offset + len` in `backing_ranges` (shared): no cleaning
    /// pass writes an older version of them back meanwhile.
    fn hold_for_backing(&self, offset: u64, len: u64) -> RangeGuard<'_> {
        let bs = self.block_size();
        let first = offset / bs;
        self.e
            .backing_ranges
            .lock(first, (offset + len).div_ceil(bs) - first, false)
    }

    /// [`Cache::backing_write`] for a caller that holds the blocks already.
    fn backing_write_held(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let _fg = e.foreground_io();
        e.backing
            .write_at(buf, offset, fua)
            .inspect_err(|err| e.backing_failed(BackingOp::Write, err))?;
        e.backing_health.write_succeeded();
        Stats::add(&e.stats.backing_writes, 1);
        Stats::add(&e.stats.backing_write_bytes, buf.len() as u64);
        if !fua {
            e.backing_unflushed.store(true, Ordering::Release);
            if let Some(busy) = busy {
                busy.written_unflushed();
            }
        }
        Ok(())
    }

    /// Whole-block writes in the current mode.
    fn write_blocks(&self, lba: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let e = &*self.e;
        let n = data.len() as u64 / self.block_size();
        match self.mode() {
            Mode::WriteBack => {
                self.log_blocks(lba, data, true)?;
                if fua {
                    e.log.sync(false)?;
                }
                Ok(())
            }
            Mode::WriteThrough => {
                let _turn = e.guards.write_through_lock(lba, n);
                self.write_through(lba, data, fua)
            }
            Mode::WriteAround | Mode::PassThrough => {
                self.write_around_runs(lba, data, &[(0, n)], fua, || ())
            }
        }
    }

    /// A write-through write of whole blocks; the caller holds their turn lock.
    fn write_through(&self, lba: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let mut busy = e.guards.busy(lba, data.len() as u64 / bs);
        let records = self.log_blocks(lba, data, true)?;
        let blocks = self.written_blocks(&records);
        e.log.sync_vouched(false)?;
        if let Err(err) = self.backing_write(data, lba * bs, fua, Some(&mut busy)) {
            // The client is told this write failed, so the cache must not keep it (and write
            // it back later) as if it had worked: reads go to the backing store again.
            if let Err(inv) = self.invalidate(lba, data.len() as u64 / bs) {
                tracing::error!(lba, error = %inv, "cannot drop a failed write-through write");
            }
            return Err(err);
        }
        if fua {
            cleaner::mark_clean(e, &blocks.0, &blocks.1);
        } else {
            let mut pending = e.unflushed_write_through.lock();
            pending.0.extend(blocks.0);
            pending.1.extend(blocks.1);
        }
        Ok(())
    }

    /// Writes runs of whole blocks around the cache: invalidates them durably, then writes them
    /// to the backing store. `runs` are `(first, count)` blocks of `data`, which starts at block
    /// `lba`. `invalidated` runs once the INVALIDATEs are applied, before they are synced; what
    /// it returns is kept until the backing writes are done.
    ///
    /// The blocks are held in `backing_ranges` from the INVALIDATEs on, not just for the backing
    /// writes: a write-back write that lands in the cache on these blocks after the INVALIDATE is
    /// newer than this one, and a cleaning pass must not write it back and mark it clean before
    /// this write reaches the backing store under it. (Not before the INVALIDATEs: appending may
    /// wait for reclaim, which may wait for a cleaning pass of these blocks. The sync below is a
    /// system request for the same reason.)
    fn write_around_runs<T>(
        &self,
        lba: u64,
        data: &[u8],
        runs: &[(u64, u64)],
        fua: bool,
        invalidated: impl FnOnce() -> T,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let mut busy: Vec<BusyRange<'_>> = runs
            .iter()
            .map(|&(first, n)| e.guards.busy(lba + first, n))
            .collect();
        for &(first, n) in runs {
            self.append_invalidate(lba + first, n)?;
        }
        let _held = self.hold_for_backing(lba * bs, data.len() as u64);
        let _kept = invalidated();
        // As a system request: a client sync waits while client records wait for log space, and
        // the reclaim they wait for may need a cleaning pass, which waits for these blocks.
        e.log.sync_vouched(true)?;
        for (&(first, n), busy) in runs.iter().zip(&mut busy) {
            Stats::add(&e.stats.write_blocks, n);
            let part = &data[(first * bs) as usize..((first + n) * bs) as usize];
            self.backing_write_held(part, (lba + first) * bs, fua, Some(busy))?;
        }
        Ok(())
    }

    /// A write that continued a sequential stream past the write cutoff, in whole blocks, in
    /// write-back or write-through: around the cache like a write-around write, except for its
    /// blocks that are dirty in the cache. (Other modes go around the cache anyway.) What goes
    /// around is only as atomic as the backing store makes it.
    ///
    /// Dirty blocks take the mode's own path: they are the only durable copy of a write that
    /// may be acknowledged and flushed (write-back), or that later writes through the log
    /// depend on for prefix consistency (write-through, until the backing flush). Invalidating
    /// one before the backing store durably holds the new data would let a power loss bring back
    /// the backing store's older version. Clean cached blocks are durable on the backing store,
    /// so they may go. (Write-zeroes writes dirty blocks back first; a write can simply take the
    /// cached path for them. In an unaligned stream that is usually only the block where it
    /// crossed the cutoff: from then on each request's first block was written around.)
    ///
    /// No write may make a block dirty between that check and its INVALIDATE. Write-back writes
    /// of these blocks are held off by their range in `write_ranges`, held exclusively (`held`)
    /// until the INVALIDATEs are applied, then shared like any whole-block write (so a
    /// partial-block write still cannot read these blocks before the backing store has them). Write-through writes take the blocks' turn
    /// lock, held here until the backing writes are done, which also keeps the two in log order
    /// on the backing store.
    fn write_past_cutoff(
        &self,
        lba: u64,
        data: &[u8],
        fua: bool,
        held: RmwHeld<'_>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        let n = (data.len() / bs) as u64;
        // The mode cannot change while the caller holds `writes_gate`.
        let mode = self.mode();
        let turn = match mode {
            Mode::WriteThrough => Some(e.guards.write_through_lock(lba, n)),
            Mode::WriteBack if !matches!(held, RmwHeld::Shared { .. }) => None,
            _ => {
                let _held = held.downgrade();
                return self.write_blocks(lba, data, fua);
            }
        };
        // Runs of dirty blocks (to keep in the cache) and of the others (to write around).
        let (mut cached, mut around) = (Vec::new(), Vec::new());
        {
            let st = e.state.read();
            for i in 0..n {
                let runs: &mut Vec<(u64, u64)> = if cleaner::dirty_at(&st, lba + i).is_some() {
                    &mut cached
                } else {
                    &mut around
                };
                match runs.last_mut() {
                    Some((first, k)) if *first + *k == i => *k += 1,
                    _ => runs.push((i, 1)),
                }
            }
        }
        if around.is_empty() {
            drop(turn);
            let _held = held.downgrade();
            return self.write_blocks(lba, data, fua);
        }
        for &(first, k) in &cached {
            let part = &data[first as usize * bs..(first + k) as usize * bs];
            if turn.is_some() {
                self.write_through(lba + first, part, fua)?;
            } else {
                // Made durable (FUA) by the sync before the backing writes below.
                self.log_blocks(lba + first, part, true)?;
            }
        }
        Stats::add(
            &e.stats.bypassed_write_blocks,
            around.iter().map(|&(_, k)| k).sum(),
        );
        self.write_around_runs(lba, data, &around, fua, move || (turn, held.downgrade()))
    }

    /// Flushes the backing store if anything was written there since its last flush. Callers
    /// take turns: a FLUSH must not return while another one's backing flush, which covers
    /// writes this one promises, is still running.
    fn flush_backing_if_written(&self) -> io::Result<()> {
        let e = &*self.e;
        let _turn = e.backing_flush_turn.lock();
        if !e.backing_unflushed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let (blocks, generations) = std::mem::take(&mut *e.unflushed_write_through.lock());
        let fg = e.foreground_io();
        let flushed = engine::flush_backing(e);
        drop(fg);
        if let Err(err) = flushed {
            e.backing_unflushed.store(true, Ordering::Release);
            let mut pending = e.unflushed_write_through.lock();
            pending.0.extend(blocks);
            pending.1.extend(generations);
            return Err(err);
        }
        cleaner::mark_clean(e, &blocks, &generations);
        Ok(())
    }

    /// The blocks `log_blocks` wrote, with their segments' generations (for `mark_clean`).
    fn written_blocks(&self, records: &[(u64, u32, u32)]) -> (Vec<DirtyBlock>, Vec<u64>) {
        let blocks: Vec<DirtyBlock> = records
            .iter()
            .filter(|(_, slot, _)| *slot != u32::MAX)
            .flat_map(|&(lba, slot, n)| {
                (0..n).map(move |i| DirtyBlock {
                    lba: lba + i as u64,
                    slot: slot + i,
                })
            })
            .collect();
        let generations = cleaner::generations_of(&self.e, &self.e.state.read(), &blocks);
        (blocks, generations)
    }

    /// The part of the export past the last whole cache block is never cached.
    fn uncached_tail(&self) -> u64 {
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
            self.e.backing.describe(),
            self.e.cache.describe(),
            self.mode()
        )
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read(buf, offset, false)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, true)?;
        let e = &*self.e;
        // Modes that go around the cache anyway need no stream tracking.
        let past_cutoff = matches!(self.mode(), Mode::WriteBack | Mode::WriteThrough)
            && e.tunables
                .sequential_cutoff_write_bytes()
                .is_some_and(|cutoff| e.write_streams.observe(offset, buf.len() as u64) > cutoff);
        self.write(buf, offset, fua, past_cutoff)
    }

    fn flush(&self) -> io::Result<()> {
        let e = &*self.e;
        Stats::add(&e.stats.flushes, 1);
        e.log.sync(false)?;
        self.flush_backing_if_written()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.info.size, offset, len, true)?;
        let e = &*self.e;
        let bs = self.block_size();
        // Only whole blocks inside the range are dropped from the cache; the backing store gets
        // the exact range (trimmed bytes may read as anything afterwards).
        let first = offset.div_ceil(bs);
        let last = ((offset + len) / bs).min(e.cached_blocks).max(first);
        let mut busy = e.guards.busy(first, last - first);
        self.invalidate(first, last - first)?;
        let _held = self.hold_for_backing(offset, len);
        e.backing_unflushed.store(true, Ordering::Release);
        busy.written_unflushed();
        let _fg = e.foreground_io();
        e.backing
            .trim(offset, len)
            .inspect_err(|err| e.backing_failed(BackingOp::Trim, err))
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        check_range(self.info.size, offset, len, true)?;
        let e = &*self.e;
        let bs = self.block_size();
        let end = offset + len;
        let first = offset.div_ceil(bs).min(e.cached_blocks);
        let last = (end / bs).min(e.cached_blocks).max(first);
        // Partial blocks at the edges are zeroed as ordinary writes.
        // They are not part of a write stream: the whole blocks between them go around the cache
        // anyway.
        let head_end = (first * bs).min(end);
        if head_end > offset {
            let zeroes = vec![0u8; (head_end - offset) as usize];
            self.write(&zeroes, offset, opts.fua, false)?;
        }
        // `max(offset)`: a range entirely in the uncached tail starts after the last block.
        let tail_start = (last * bs).max(head_end).max(offset);
        if end > tail_start {
            let zeroes = vec![0u8; (end - tail_start) as usize];
            self.write(&zeroes, tail_start, opts.fua, false)?;
        }
        if last > first {
            let n = last - first;
            let slots = e.geo.slot_count();
            cleaner::clean_pass(e, |st| cleaner::dirty_in_range(st, slots, first, n), None)?;
            let mut busy = e.guards.busy(first, n);
            self.invalidate(first, n)?;
            let _held = self.hold_for_backing(first * bs, n * bs);
            let _fg = e.foreground_io();
            e.backing
                .write_zeroes(first * bs, n * bs, opts)
                .inspect_err(|err| e.backing_failed(BackingOp::Write, err))?;
            e.backing_health.write_succeeded();
            if !opts.fua {
                e.backing_unflushed.store(true, Ordering::Release);
                busy.written_unflushed();
            }
        }
        Ok(())
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

impl Cache {
    /// A client read; `prefetch` promotes every miss.
    fn read(&self, buf: &mut [u8], offset: u64, prefetch: bool) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, false)?;
        let e = &*self.e;
        Stats::add(&e.stats.reads, 1);
        let tail = self.uncached_tail();
        let end = offset + buf.len() as u64;
        if self.mode() == Mode::PassThrough || offset >= tail {
            // The backing store's copy of a lost block is older than what was lost.
            let bs = self.block_size();
            let lost = first_lost(&e.state.read(), offset / bs, end.div_ceil(bs) - offset / bs);
            if let Some(lba) = lost {
                Stats::add(&e.stats.lost_reads, 1);
                return Err(IntegrityError::Lost { lba }.into());
            }
            Stats::add(&e.stats.backing_reads, 1);
            Stats::add(&e.stats.backing_read_bytes, buf.len() as u64);
            return self.backing_read(buf, offset);
        }
        let promote = match e.tunables.sequential_cutoff_read_bytes() {
            _ if prefetch => Promote::All,
            Some(cutoff) if e.read_streams.observe(offset, buf.len() as u64) > cutoff => {
                Promote::Sequential
            }
            _ => Promote::Admitted,
        };
        if end > tail {
            let split = (tail - offset) as usize;
            let (cached, rest) = buf.split_at_mut(split);
            Stats::add(&e.stats.backing_reads, 1);
            Stats::add(&e.stats.backing_read_bytes, rest.len() as u64);
            self.backing_read(rest, tail)?;
            return self.read_at_cached(cached, offset, promote);
        }
        self.read_at_cached(buf, offset, promote)
    }

    /// Reads the backing store directly (pass-through, the uncached tail).
    fn backing_read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let e = &*self.e;
        let _fg = e.foreground_io();
        e.backing
            .read_at(buf, offset)
            .inspect_err(|err| e.backing_failed(BackingOp::Read, err))?;
        e.backing_health.read_succeeded();
        Ok(())
    }

    /// A client write; `past_cutoff`: it continued a sequential stream past the write cutoff.
    fn write(&self, buf: &[u8], offset: u64, fua: bool, past_cutoff: bool) -> io::Result<()> {
        let e = &*self.e;
        Stats::add(&e.stats.writes, 1);
        let tail = self.uncached_tail();
        let end = offset + buf.len() as u64;
        if end > tail {
            let split = tail.saturating_sub(offset) as usize;
            self.backing_write(&buf[split..], offset.max(tail), fua, None)?;
            if split == 0 {
                return Ok(());
            }
            return self.write_at_cached(&buf[..split], offset, fua, past_cutoff);
        }
        self.write_at_cached(buf, offset, fua, past_cutoff)
    }

    fn read_at_cached(&self, buf: &mut [u8], offset: u64, promote: Promote) -> io::Result<()> {
        let bs = self.block_size();
        let first = offset / bs;
        let end = offset + buf.len() as u64;
        let last = end.div_ceil(bs);
        if offset.is_multiple_of(bs) && end.is_multiple_of(bs) {
            return self.read_blocks(first, last - first, buf, promote);
        }
        let mut bounce = AlignedBuf::zeroed(((last - first) * bs) as usize);
        self.read_blocks(first, last - first, &mut bounce, promote)?;
        let skip = (offset - first * bs) as usize;
        buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
        Ok(())
    }

    fn write_at_cached(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        past_cutoff: bool,
    ) -> io::Result<()> {
        let bs = self.block_size();
        let end = offset + buf.len() as u64;
        let first = offset / bs;
        let last = end.div_ceil(bs);
        let ranges = &self.e.write_ranges;
        let _gate = self.e.writes_gate.read();
        if offset.is_multiple_of(bs) && end.is_multiple_of(bs) {
            if past_cutoff {
                // Exclusive only where `write_past_cutoff` needs it (see there).
                let exclusive = self.mode() == Mode::WriteBack;
                let guard = ranges.lock(first, last - first, exclusive);
                let held = if exclusive {
                    RmwHeld::Exclusive(guard)
                } else {
                    RmwHeld::Shared { _guard: guard }
                };
                return self.write_past_cutoff(first, buf, fua, held);
            }
            let _shared = ranges.lock(first, last - first, false);
            return self.write_blocks(first, buf, fua);
        }
        // A partial block: read what surrounds the write, patch, write whole blocks, excluding
        // every other writer of these blocks so nothing lands between the read and the write.
        let _exclusive = ranges.lock(first, last - first, true);
        let mut data = AlignedBuf::zeroed(((last - first) * bs) as usize);
        if !offset.is_multiple_of(bs) {
            self.read_blocks(first, 1, &mut data[..bs as usize], Promote::Never)?;
        }
        if !end.is_multiple_of(bs) && (last - 1 > first || offset.is_multiple_of(bs)) {
            let at = ((last - 1 - first) * bs) as usize;
            self.read_blocks(last - 1, 1, &mut data[at..at + bs as usize], Promote::Never)?;
        }
        let skip = (offset - first * bs) as usize;
        data[skip..skip + buf.len()].copy_from_slice(buf);
        if past_cutoff {
            return self.write_past_cutoff(first, &data, fua, RmwHeld::ByCaller);
        }
        self.write_blocks(first, &data, fua)
    }
}

//! Writing dirty blocks back to the backing store.
//!
//! Order, for each cleaning pass:
//! 1. the log is synced, so the version being written back can never be lost from the cache
//!    after the backing store has it (recovery would otherwise bring back an older version);
//! 2. dirty blocks are read from the cache and written to the backing store sorted by address,
//!    consecutive addresses coalesced into one write (up to `writeback_max_io_kib`), with up to
//!    `writeback_max_inflight` writes in flight;
//! 3. the backing store is flushed;
//! 4. only then are the blocks marked clean, each only if it still lives in the slot that was
//!    written back (a block rewritten meanwhile stays dirty).
//!
//! Marking clean happens in memory; CLEANED records follow in the log as a hint, best effort. A
//! lost hint only means a block comes back dirty after a crash and is written back again, which
//! is harmless; the opposite (clean in memory, missing from the backing store) cannot happen
//! because the backing store is flushed first. Not depending on log space is what lets reclaim
//! always make progress, even with the log full of dirty blocks.
//!
//! A pass may be cancelled (`cancel` set, e.g. by `flashtier flush --cancel`): it starts no
//! further backing write, waits for those in flight, flushes the backing store and marks clean
//! only the blocks it wrote; the rest stay dirty, as they were. A failed write stops the pass
//! and marks nothing clean.
//!
//! Who runs passes: reclaim (a victim's dirty blocks), `write_back_all` (flush, mode switch),
//! write-zeroes (dirty blocks in its range) and the background cleaner (`writeback`). Passes run
//! one at a time (`Engine::passes`).
//!
//! A pass must not land an old version of a block on the backing store after a newer version
//! written straight there (write-through, write-around, trim, write-zeroes). Those writes hold
//! their blocks in `Backing::ranges` (shared) from their INVALIDATE, or their record, until
//! the backing store has them; a pass holds each run (exclusive) only while it writes that run,
//! and reads each block's version as the index maps it then, not as it was chosen: one
//! invalidated since is skipped, one cached anew is written in its new version. So a pass waits
//! only for writes of the same blocks, and writes of other blocks never wait for a pass (before,
//! one lock for the whole pass stalled every write around the cache for its length). A version
//! newer than the pass's sync in step 1 is made durable by another sync before it is written
//! back (see `read_current`); only the blocks written back are counted.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flashtier_io::{AlignedBuf, BatchRead};
use parking_lot::Mutex;

use crate::engine::Engine;
use crate::health::BackingOp;
use crate::integrity::{self, Verdict};
use crate::layout::batch::Kind;
use crate::log::Record;
use crate::range_lock::Hold;
use crate::state::{DirtyBlock, State};
use crate::stats::Stats;

/// How often a paced writer looks whether it may stop pacing (another pass waits, a cancel).
const PACE_CHECK: Duration = Duration::from_millis(10);

/// How a pass writes to the backing store.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PassIo {
    /// Backing writes in flight at once.
    pub inflight: usize,
    /// Largest coalesced write, bytes.
    pub max_io: u64,
    /// All but one writer pause while client I/O to the backing store is in flight (background
    /// write-back below the high watermark: clients keep priority).
    pub yield_to_foreground: bool,
    /// Bytes per second to spread the pass's writes over (background write-back at a rate):
    /// a run starts no earlier than the bytes before it allow, so the backing store sees a
    /// steady trickle rather than the whole pass at once. Dropped once another pass waits.
    pub pace: Option<f64>,
}

impl PassIo {
    /// The live parameters' (`writeback_max_inflight`, `writeback_max_io_kib`), at full speed.
    pub(crate) fn of(e: &Engine) -> PassIo {
        PassIo {
            inflight: e.tunables.writeback_max_inflight(),
            max_io: e.tunables.writeback_max_io_bytes(),
            yield_to_foreground: false,
            pace: None,
        }
    }
}

/// Cleans the dirty blocks chosen by `select` (called with the state locked for reading).
/// Returns blocks written back.
///
/// When `cancel` is set during the pass, it stops before the next backing write, flushes the
/// backing store and marks clean only what it wrote (the blocks of the runs written so far).
pub(crate) fn clean_pass(
    e: &Engine,
    select: impl FnOnce(&crate::state::State) -> Vec<DirtyBlock>,
    cancel: Option<&AtomicBool>,
) -> io::Result<u64> {
    clean_pass_with(e, select, cancel, PassIo::of(e))
}

/// [`clean_pass`] with explicit I/O limits.
pub(crate) fn clean_pass_with(
    e: &Engine,
    select: impl FnOnce(&crate::state::State) -> Vec<DirtyBlock>,
    cancel: Option<&AtomicBool>,
    pass_io: PassIo,
) -> io::Result<u64> {
    // Chosen before waiting for another pass: a choice gone stale meanwhile is harmless (each
    // block is looked up again when its run is written), and a pass with nothing to do never
    // waits.
    let (blocks, crcs) = {
        let st = e.state.read();
        let mut blocks = select(&st);
        blocks.sort_unstable();
        blocks.dedup_by_key(|b| b.lba);
        let crcs: Vec<u32> = blocks.iter().map(|b| st.crcs[b.slot as usize]).collect();
        (blocks, crcs)
    };
    if blocks.is_empty() {
        return Ok(0);
    }
    let _one_pass = e.passes.enter();
    e.log.sync_vouched(true)?;
    let backing_errors = e.stats.backing_errors.load(Ordering::Relaxed);
    let result = write_back(e, &blocks, &crcs, cancel, pass_io);
    match &result {
        Ok(n) if *n > 0 => e.backing.health.write_succeeded(),
        Ok(_) => {}
        // Only backing failures count (a cache read error is the cache device's).
        Err(_) if e.stats.backing_errors.load(Ordering::Relaxed) != backing_errors => {
            e.backing.health.writeback_failed()
        }
        Err(_) => {}
    }
    result
}

/// Runs of consecutive addresses in `blocks` (sorted), each at most `per_write` blocks.
fn runs_of(blocks: &[DirtyBlock], per_write: usize) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let mut j = i + 1;
        while j < blocks.len() && j - i < per_write && blocks[j].lba == blocks[j - 1].lba + 1 {
            j += 1;
        }
        runs.push(i..j);
        i = j;
    }
    runs
}

/// Steps 2 to 4 of a pass (see the module's documentation). Up to `pass_io.inflight` writers
/// take runs in address order, each reading its run from the cache and writing it to the
/// backing store. The first failure stops them all, and then nothing of the pass is marked
/// clean (its blocks stay dirty and are written again later): marking only what preceded the
/// failure would need a backing flush that the failing store is unlikely to honour.
fn write_back(
    e: &Engine,
    blocks: &[DirtyBlock],
    crcs: &[u32],
    cancel: Option<&AtomicBool>,
    pass_io: PassIo,
) -> io::Result<u64> {
    let bs = e.geo.block_size as u64;
    let runs = runs_of(blocks, (pass_io.max_io / bs).max(1) as usize);
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Acquire));
    // Paced: the bytes of the runs before each one, and when the first started.
    let started = Instant::now();
    let before: Vec<u64> = runs
        .iter()
        .scan(0, |sum, r| {
            let at = *sum;
            *sum += r.len() as u64 * bs;
            Some(at)
        })
        .collect();
    // Per run, the versions of its blocks that reached the backing store (empty until the run
    // is done).
    let landed: Vec<Mutex<Vec<Version>>> = runs.iter().map(|_| Mutex::new(Vec::new())).collect();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<io::Error>> = Mutex::new(None);
    let writer = |first: bool| {
        let mut buf: Option<AlignedBuf> = None;
        loop {
            // Clients first: all writers but one wait while client backing I/O is in flight.
            while !first
                && pass_io.yield_to_foreground
                && e.backing.foreground.busy()
                && !stop.load(Ordering::Acquire)
                && !cancelled()
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            if stop.load(Ordering::Acquire) || cancelled() {
                return;
            }
            let k = next.fetch_add(1, Ordering::AcqRel);
            let Some(range) = runs.get(k) else { return };
            if let Some(rate) = pass_io.pace {
                let due = started + Duration::from_secs_f64(before[k] as f64 / rate.max(1.0));
                let unpaced =
                    || stop.load(Ordering::Acquire) || cancelled() || e.passes.contended();
                while !unpaced() {
                    let now = Instant::now();
                    if now >= due {
                        break;
                    }
                    std::thread::sleep((due - now).min(PACE_CHECK));
                }
                if stop.load(Ordering::Acquire) || cancelled() {
                    return;
                }
            }
            let run = &blocks[range.clone()];
            let len = run.len() * bs as usize;
            let buf = match &mut buf {
                Some(b) if b.len() >= len => b,
                b => b.insert(AlignedBuf::zeroed(len)),
            };
            // No write straight to the backing store of these blocks is in flight while this is
            // held, and none starts.
            let _run_held = e
                .backing
                .ranges
                .lock(run[0].lba, run.len() as u64, Hold::Exclusive);
            let result =
                read_current(e, run, &crcs[range.clone()], &mut buf[..len]).and_then(|current| {
                    let good: Vec<bool> = current.iter().map(Option::is_some).collect();
                    for part in good_stretches(&good) {
                        let bytes = &buf[part.start * bs as usize..part.end * bs as usize];
                        e.backing
                            .dev
                            .write_at(bytes, run[part.start].lba * bs, false)
                            .inspect_err(|err| e.backing_failed(BackingOp::Write, err))?;
                        Stats::add(&e.stats.backing_writes, 1);
                        Stats::add(&e.stats.backing_write_bytes, bytes.len() as u64);
                        Stats::add(&e.stats.cleaner_writes, 1);
                    }
                    Ok(current.into_iter().flatten().collect())
                });
            match result {
                Ok(versions) => *landed[k].lock() = versions,
                Err(err) => {
                    stop.store(true, Ordering::Release);
                    failure.lock().get_or_insert(err);
                    return;
                }
            }
        }
    };
    let writers = pass_io.inflight.clamp(1, runs.len().max(1));
    if writers == 1 {
        writer(true);
    } else {
        std::thread::scope(|s| {
            for _ in 1..writers {
                s.spawn(|| writer(false));
            }
            writer(true);
        });
    }
    if let Some(err) = failure.into_inner() {
        return Err(err);
    }
    // What was written: every version that landed, of every run done (all of them unless
    // cancelled). A block skipped is not counted: it stays dirty for a later pass.
    let (written, written_generations): (Vec<DirtyBlock>, Vec<u64>) = landed
        .into_iter()
        .flat_map(|l| l.into_inner())
        .map(|v| (v.block, v.generation))
        .unzip();
    if written.is_empty() {
        return Ok(0);
    }
    crate::engine::flush_backing(e)?;

    mark_clean(e, &written, &written_generations);
    Stats::add(&e.stats.cleaned_blocks, written.len() as u64);
    Ok(written.len() as u64)
}

/// The ranges of consecutive `true`s in `good`.
fn good_stretches(good: &[bool]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < good.len() {
        if !good[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < good.len() && good[i] {
            i += 1;
        }
        out.push(start..i);
    }
    out
}

/// The generation of each block's segment, to pass to [`mark_clean`] later.
pub(crate) fn generations_of(e: &Engine, st: &State, blocks: &[DirtyBlock]) -> Vec<u64> {
    blocks
        .iter()
        .map(|b| st.segs.generation(e.geo.segment_of(b.slot)))
        .collect()
}

/// Marks blocks clean where they still live in the slot that was written back, and logs CLEANED
/// hints for runs consecutive in both address and slot. Call only once the backing store holds
/// the blocks durably. `generations` are the blocks' segments' generations when the blocks were
/// chosen: a segment reclaimed and reused since (its dirty blocks copied forward) may hold a
/// newer write of the same block in the same slot, which must stay dirty.
pub(crate) fn mark_clean(e: &Engine, blocks: &[DirtyBlock], generations: &[u64]) {
    let cleaned: Vec<DirtyBlock> = {
        let mut st = e.state.write();
        let mut cleaned = Vec::with_capacity(blocks.len());
        for (b, &g) in blocks.iter().zip(generations) {
            if st.segs.generation(e.geo.segment_of(b.slot)) == g && st.clean(b.lba, b.slot) {
                cleaned.push(*b);
            }
        }
        if !cleaned.is_empty() {
            e.log.hint_made();
        }
        cleaned
    };
    let blocks = &cleaned[..];
    let mut k = 0;
    while k < blocks.len() {
        let mut m = k + 1;
        while m < blocks.len()
            && blocks[m].lba == blocks[m - 1].lba + 1
            && blocks[m].slot == blocks[m - 1].slot + 1
        {
            m += 1;
        }
        let rec = Record::new(Kind::Cleaned, blocks[k].lba, (m - k) as u32, None)
            .aux(blocks[k].slot as u64);
        e.log.append_async(rec, true);
        k = m;
    }
    if !cleaned.is_empty() {
        e.log.hint_queued();
    }
}

/// A version of a block: where it lives, its segment's generation then (a slot is written once
/// per generation: the log only appends), and its data's checksum.
#[derive(Debug, Clone, Copy)]
struct Version {
    block: DirtyBlock,
    generation: u64,
    crc: u32,
}

/// Reads the blocks of `run` (consecutive addresses) into `buf` as the cache holds them now, one
/// device read per stretch of consecutive slots, each checked against its checksum (see
/// `integrity`). `chosen_crcs` are the checksums of the versions the pass chose. Returns, per
/// block, the version read, or None for a block not to write back: clean or uncached now,
/// failed its checksum, or rewritten while this ran.
///
/// The caller holds the run's blocks, so no write of them straight to the backing store is in
/// flight: one that happened since the pass chose them has updated the index (invalidated the
/// block, or cached its new version), and reading what the index maps now never lands an older
/// version over it.
///
/// A version written back must be durable in the log (see the module's documentation). The pass
/// synced the log before its first run, which covers the versions it chose. Reclaim may have
/// copied one forward since (often, in a small busy cache: a segment can be reused within one
/// sync): the copy holds the same data, so it is told by its checksum, as recovery tells a
/// record's data, and read where it is now. A block rewritten since is another version: the log
/// is synced again first, and a block rewritten once more during that sync is skipped. No
/// segment is pinned across the sync (a checkpoint on the log's thread waits for pinned
/// segments).
fn read_current(
    e: &Engine,
    run: &[DirtyBlock],
    chosen_crcs: &[u32],
    buf: &mut [u8],
) -> io::Result<Vec<Option<Version>>> {
    let bs = e.geo.block_size as usize;
    let version_of = |st: &State, lba: u64| {
        dirty_at(st, lba).map(|block| Version {
            block,
            generation: st.segs.generation(e.geo.segment_of(block.slot)),
            crc: st.crcs[block.slot as usize],
        })
    };
    let looked_up: Vec<Option<Version>> = {
        let st = e.state.read();
        run.iter().map(|b| version_of(&st, b.lba)).collect()
    };
    let rewritten = looked_up
        .iter()
        .zip(chosen_crcs)
        .any(|(v, &chosen)| v.is_some_and(|v| v.crc != chosen));
    if rewritten {
        e.log.sync_vouched(true)?;
    }
    let (mut current, pinned) = {
        let st = e.state.read();
        let current: Vec<Option<Version>> = looked_up
            .iter()
            .zip(chosen_crcs)
            .map(|(before, &chosen)| {
                let before = (*before)?;
                let now = version_of(&st, before.block.lba)?;
                let durable = now.crc == chosen || (rewritten && now.crc == before.crc);
                durable.then_some(now)
            })
            .collect();
        let mut pinned: Vec<u32> = current
            .iter()
            .flatten()
            .map(|v| e.geo.segment_of(v.block.slot))
            .collect();
        pinned.sort_unstable();
        pinned.dedup();
        for &s in &pinned {
            st.segs.reader_enter(s);
        }
        (current, pinned)
    };
    // The stretches of consecutive slots `[i, j)` of the run, each one device read. A run is
    // consecutive on the backing store, and random writes put its blocks in scattered slots:
    // read one by one, each block cost the cleaner a system call and a sleep, and under a
    // sustained random-write load the cleaner took 42% of the server's CPU samples, more than
    // the connection's threads (bench/results/write_batch/). So they go to the device
    // [`READ_BATCH`] at a time (`read_batch`: one submission and one sleep each, on a file with
    // io_uring).
    let mut stretches: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < run.len() {
        let Some(first) = current[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while j < run.len()
            && current[j].is_some_and(|v| v.block.slot == first.block.slot + (j - i) as u32)
        {
            j += 1;
        }
        stretches.push((i, j));
        i = j;
    }
    let mut reads: Vec<BatchRead<'_>> = Vec::with_capacity(stretches.len());
    let mut rest = &mut buf[..run.len() * bs];
    let mut at = 0;
    for &(i, j) in &stretches {
        let (_, from) = std::mem::take(&mut rest).split_at_mut((i - at) * bs);
        let (part, after) = from.split_at_mut((j - i) * bs);
        (rest, at) = (after, j);
        let slot = current[i].expect("a stretch starts at a block").block.slot;
        reads.push(BatchRead::new(part, e.geo.slot_offset(slot)));
    }
    if reads.len() > 1 && e.cache.read_batch_max() > 1 {
        for batch in reads.chunks_mut(READ_BATCH) {
            e.cache.read_batch(batch, &mut |_| {});
        }
    }
    let mut result = Ok(());
    for (read, &(i, j)) in reads.iter_mut().zip(&stretches) {
        let done = match read.result.take() {
            Some(done) => done,
            None => e.cache.read_at(read.buf, read.offset),
        };
        if let Err(err) = done {
            result = Err(err);
            break;
        }
        Stats::add(&e.stats.cache_reads, 1);
        Stats::add(&e.stats.cache_read_bytes, ((j - i) * bs) as u64);
        for (k, block) in (i..j).zip(read.buf.chunks_mut(bs)) {
            let Version { block: b, crc, .. } = current[k].expect("in a stretch");
            let good = integrity::intact(block, crc)
                || integrity::bad_block(e, b.lba, b.slot, crc, block) == Verdict::Repaired;
            if !good {
                current[k] = None;
            }
        }
    }
    {
        let st = e.state.read();
        for &s in &pinned {
            st.segs.reader_exit(s);
        }
    }
    result.inspect_err(|_| Stats::add(&e.stats.cache_errors, 1))?;
    Ok(current)
}

/// Most reads of the cache device a cleaning pass has in flight (`read_current`): a client's
/// read or write may queue behind each. While the cleaner drained a backlog, a QD1 commit's
/// (4K write + FLUSH) write p99 was 436–465 µs with the ring's 32, against 222–322 µs with one
/// read at a time; 249–342 µs with 8; with 4, 175–212 µs in one series and 289–403 µs in
/// another, where one at a time had 253–326 µs and wrote back 12–20% less meanwhile
/// (bench/results/write_batch/). Pacing the cleaner is the write-back controller's job.
const READ_BATCH: usize = 4;

/// Passes over what stayed dirty after a full write-back, at most: see [`write_back_all`].
const WRITE_BACK_ALL_RETRIES: usize = 3;

/// Writes back every block dirty when it starts; returns the blocks written back.
///
/// Reclaim may copy a dirty block forward while a pass writes it back: the backing store then
/// has its data, but the pass cannot mark the copy clean (it lives in another slot now, and a
/// newer write would look the same). So the blocks of the first pass still dirty afterwards are
/// passed over again, a few times at most; each retry covers only those, and it stops early
/// when one finds nothing (or on `cancel`).
pub(crate) fn write_back_all(e: &Engine, cancel: Option<&AtomicBool>) -> io::Result<u64> {
    let slots = e.geo.slot_count();
    let mut chosen: Vec<u64> = Vec::new();
    let mut written = clean_pass(
        e,
        |st| {
            let blocks = all_dirty(st, slots);
            chosen = blocks.iter().map(|b| b.lba).collect();
            blocks
        },
        cancel,
    )?;
    for _ in 0..WRITE_BACK_ALL_RETRIES {
        if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
            break;
        }
        let again = clean_pass(
            e,
            |st| chosen.iter().filter_map(|&lba| dirty_at(st, lba)).collect(),
            cancel,
        )?;
        if again == 0 {
            break;
        }
        written += again;
    }
    Ok(written)
}

/// Every dirty block.
pub(crate) fn all_dirty(st: &crate::state::State, slot_count: u32) -> Vec<DirtyBlock> {
    st.index
        .slots_in(0, slot_count)
        .filter(|(_, info)| info.dirty)
        .map(|(slot, info)| DirtyBlock {
            lba: info.lba,
            slot,
        })
        .collect()
}

/// Dirty blocks in `[first, first + count)`.
pub(crate) fn dirty_in_range(
    st: &crate::state::State,
    slot_count: u32,
    first: u64,
    count: u64,
) -> Vec<DirtyBlock> {
    if count > st.index.len() as u64 {
        return all_dirty(st, slot_count)
            .into_iter()
            .filter(|b| b.lba >= first && b.lba < first + count)
            .collect();
    }
    (first..first + count)
        .filter_map(|lba| dirty_at(st, lba))
        .collect()
}

/// Block `lba`, if it is cached and dirty.
pub(crate) fn dirty_at(st: &crate::state::State, lba: u64) -> Option<DirtyBlock> {
    let slot = st.index.get(lba)?;
    st.index
        .slot(slot)
        .filter(|i| i.dirty)
        .map(|_| DirtyBlock { lba, slot })
}

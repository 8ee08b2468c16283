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
//! write-zeroes (dirty blocks in its range) and the background cleaner (`writeback`), which
//! chooses small passes so the exclusive lock below is held briefly.
//!
//! Passes are exclusive with writes that go around the cache (`Engine::backing_order`): a pass
//! that read an old version of a block must not land on the backing store after a newer version
//! written straight there.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use flashtier_io::AlignedBuf;
use parking_lot::Mutex;

use crate::engine::Engine;
use crate::health::BackingOp;
use crate::integrity::{self, Verdict};
use crate::layout::batch::Kind;
use crate::log::Record;
use crate::state::{DirtyBlock, State};
use crate::stats::Stats;

/// How a pass writes to the backing store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PassIo {
    /// Backing writes in flight at once.
    pub inflight: usize,
    /// Largest coalesced write, bytes.
    pub max_io: u64,
    /// All but one writer pause while client I/O to the backing store is in flight (background
    /// write-back below the high watermark: clients keep priority).
    pub yield_to_foreground: bool,
}

impl PassIo {
    /// The live parameters' (`writeback_max_inflight`, `writeback_max_io_kib`), at full speed.
    pub(crate) fn of(e: &Engine) -> PassIo {
        PassIo {
            inflight: e.tunables.writeback_max_inflight(),
            max_io: e.tunables.writeback_max_io_bytes(),
            yield_to_foreground: false,
        }
    }
}

/// Cleans the dirty blocks chosen by `select` (called with the state locked for reading, under
/// the pass's exclusive lock, so no bypass write is in flight). Returns blocks written back.
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
    let _exclusive = e.backing_order.write();
    let (blocks, generations) = {
        let st = e.state.read();
        let mut blocks = select(&st);
        blocks.sort_unstable();
        blocks.dedup_by_key(|b| b.lba);
        let generations = generations_of(e, &st, &blocks);
        (blocks, generations)
    };
    if blocks.is_empty() {
        return Ok(0);
    }
    e.log.sync_vouched(true)?;
    let backing_errors = e.stats.backing_errors.load(Ordering::Relaxed);
    let result = write_back(e, &blocks, &generations, cancel, pass_io);
    match &result {
        Ok(n) if *n > 0 => e.backing_health.write_succeeded(),
        Ok(_) => {}
        // Only backing failures count (a cache read error is the cache device's).
        Err(_) if e.stats.backing_errors.load(Ordering::Relaxed) != backing_errors => {
            e.backing_health.writeback_failed()
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
    generations: &[u64],
    cancel: Option<&AtomicBool>,
    pass_io: PassIo,
) -> io::Result<u64> {
    let bs = e.geo.block_size as u64;
    let runs = runs_of(blocks, (pass_io.max_io / bs).max(1) as usize);
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Acquire));
    let done: Vec<AtomicBool> = runs.iter().map(|_| AtomicBool::new(false)).collect();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<io::Error>> = Mutex::new(None);
    let writer = |first: bool| {
        let mut buf: Option<AlignedBuf> = None;
        loop {
            // Clients first: all writers but one wait while client backing I/O is in flight.
            while !first
                && pass_io.yield_to_foreground
                && e.foreground.busy()
                && !stop.load(Ordering::Acquire)
                && !cancelled()
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            if stop.load(Ordering::Acquire) || cancelled() {
                return;
            }
            let k = next.fetch_add(1, Ordering::AcqRel);
            let Some(run) = runs.get(k) else { return };
            let run = &blocks[run.clone()];
            let len = run.len() * bs as usize;
            let buf = match &mut buf {
                Some(b) if b.len() >= len => b,
                b => b.insert(AlignedBuf::zeroed(len)),
            };
            // Blocks that failed their checksum are not written back (a dirty one is lost now:
            // the backing store keeps its older copy, which reads never return).
            let result = read_slots(e, run, &mut buf[..len]).and_then(|good| {
                for part in good_stretches(&good) {
                    let bytes = &buf[part.start * bs as usize..part.end * bs as usize];
                    e.backing
                        .write_at(bytes, run[part.start].lba * bs, false)
                        .inspect_err(|err| e.backing_failed(BackingOp::Write, err))?;
                    Stats::add(&e.stats.backing_writes, 1);
                    Stats::add(&e.stats.backing_write_bytes, bytes.len() as u64);
                    Stats::add(&e.stats.cleaner_writes, 1);
                }
                Ok(())
            });
            match result {
                Ok(()) => {
                    done[k].store(true, Ordering::Release);
                }
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
    // What was written: everything unless cancelled (then the runs finished before the stop).
    let mut written = Vec::with_capacity(blocks.len());
    let mut written_generations = Vec::with_capacity(blocks.len());
    for (run, done) in runs.iter().zip(&done) {
        if done.load(Ordering::Acquire) {
            written.extend_from_slice(&blocks[run.clone()]);
            written_generations.extend_from_slice(&generations[run.clone()]);
        }
    }
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
}

/// Reads the blocks of `run` (slots anywhere) into `buf`, one device read per stretch of
/// consecutive slots, and checks each against its checksum (see `integrity`). The segments are
/// pinned while they are read. Returns, per block, whether it holds good data: a block that
/// failed (dropped, lost, or moved on meanwhile) must not be written back or copied.
pub(crate) fn read_slots(e: &Engine, run: &[DirtyBlock], buf: &mut [u8]) -> io::Result<Vec<bool>> {
    let bs = e.geo.block_size as usize;
    let mut good = Vec::with_capacity(run.len());
    let mut i = 0;
    while i < run.len() {
        let mut j = i + 1;
        while j < run.len() && run[j].slot == run[j - 1].slot + 1 {
            j += 1;
        }
        let (segs, crcs) = {
            let st = e.state.read();
            let mut v: Vec<u32> = run[i..j].iter().map(|b| e.geo.segment_of(b.slot)).collect();
            v.dedup();
            for &s in &v {
                st.segs.reader_enter(s);
            }
            let crcs: Vec<u32> = run[i..j].iter().map(|b| st.crcs[b.slot as usize]).collect();
            (v, crcs)
        };
        let part = &mut buf[i * bs..j * bs];
        let result = e.cache.read_at(part, e.geo.slot_offset(run[i].slot));
        if result.is_ok() {
            for ((block, b), crc) in part.chunks_mut(bs).zip(&run[i..j]).zip(crcs) {
                good.push(
                    integrity::intact(block, crc)
                        || integrity::bad_block(e, b.lba, b.slot, crc, block) == Verdict::Repaired,
                );
            }
        }
        {
            let st = e.state.read();
            for &s in &segs {
                st.segs.reader_exit(s);
            }
        }
        result.inspect_err(|_| Stats::add(&e.stats.cache_errors, 1))?;
        Stats::add(&e.stats.cache_reads, 1);
        Stats::add(&e.stats.cache_read_bytes, ((j - i) * bs) as u64);
        i = j;
    }
    Ok(good)
}

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

//! Reads through the cache: hits from the cache device, misses from the backing store, then
//! promoted by an asynchronous PROMOTE record as the request's plan says (see `plan`).

use std::io;
use std::sync::atomic::Ordering;

use flashtier_io::{check_range, AlignedBuf};
use smallvec::SmallVec;

use crate::health::BackingOp;
use crate::integrity::{self, IntegrityError, Verdict};
use crate::layout::batch::Kind;
use crate::log::Record;
use crate::policy::PromotionPolicy;
use crate::range_lock::Hold;
use crate::stats::Stats;

use super::plan::{Promote, ReadPlan};
use super::Cache;

/// The first lost block of `[first, first + n)`, if any.
pub(super) fn first_lost(st: &crate::state::State, first: u64, n: u64) -> Option<u64> {
    if !st.lost.overlaps(first, n) {
        return None;
    }
    (first..first + n).find(|&lba| st.lost.overlaps(lba, 1))
}

/// A hit found under the state lock: touches its slot for the policy, takes the checksum it was
/// written with, and pins its segment (once per segment run) until the read of it is done.
pub(super) fn pin_hit<const C: usize, const P: usize>(
    e: &crate::engine::Engine,
    st: &crate::state::State,
    slot: u32,
    now: u32,
    crcs: &mut SmallVec<[u32; C]>,
    pinned: &mut SmallVec<[u32; P]>,
) {
    st.index.touch(slot);
    crcs.push(st.crcs[slot as usize]);
    let seg = e.geo.segment_of(slot);
    if pinned.last() != Some(&seg) {
        st.segs.reader_enter(seg);
        st.segs.note_access(seg, now);
        pinned.push(seg);
    }
}

/// How far a pass over a read's blocks got.
pub(super) enum Pass {
    Done,
    /// A miss met a write of its blocks landing on the backing store (`Backing::ranges`): wait
    /// for it with no segment pinned, then read again.
    Busy {
        lba: u64,
        n: u64,
    },
}

/// Promotion data waiting for the log beyond this is dropped rather than queued.
const MAX_QUEUED_PROMOTION: u64 = 64 << 20;

impl Cache {
    /// A client read; `prefetch` promotes every miss.
    pub(super) fn read(&self, buf: &mut [u8], offset: u64, prefetch: bool) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, false)?;
        let e = &*self.e;
        Stats::add(&e.stats.reads, 1);
        let promote = match self.plan_read(offset, buf.len() as u64, prefetch) {
            ReadPlan::Backing => return self.pass_through_read(buf, offset),
            ReadPlan::Cached(promote) => promote,
        };
        let tail = self.uncached_tail();
        if offset + buf.len() as u64 > tail {
            let (cached, rest) = buf.split_at_mut((tail - offset) as usize);
            self.pass_through_read(rest, tail)?;
            return self.read_at_cached(cached, offset, promote);
        }
        self.read_at_cached(buf, offset, promote)
    }

    pub(super) fn read_at_cached(
        &self,
        buf: &mut [u8],
        offset: u64,
        promote: Promote,
    ) -> io::Result<()> {
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

    /// Reads whole blocks `[first, first + count)` into `out`.
    pub(super) fn read_blocks(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        promote: Promote,
    ) -> io::Result<()> {
        loop {
            match self.read_blocks_once(first, count, out, promote)? {
                Pass::Done => return Ok(()),
                // With no segment pinned, wait for the write, then look again: a write-through
                // write maps its blocks before it writes the backing store, so they are hits now.
                Pass::Busy { lba, n } => {
                    Stats::add(&self.e.stats.read_miss_waits, 1);
                    drop(self.e.backing.ranges.lock(lba, n, Hold::Reading));
                }
            }
        }
    }

    /// One try at [`Cache::read_blocks`]: [`Pass::Busy`] if a miss met a write of its blocks
    /// landing on the backing store.
    fn read_blocks_once(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        promote: Promote,
    ) -> io::Result<Pass> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        // Before the lookup: a write the lookup does not see is stamped after this, and a miss's
        // promotion is dropped (see `guards`).
        let since = e.guards.now();
        // Runs of hits (consecutive slots) and misses, found under one short read lock; the
        // segments holding hits are pinned until their reads are done.
        enum Run {
            Hit { slot: u32, n: u64 },
            Miss { n: u64 },
        }
        // Inline up to a 128 KiB read of 4 KiB blocks in a few runs and segments: a read hit
        // allocates nothing.
        let mut runs: SmallVec<[(u64, Run); 8]> = SmallVec::new();
        let mut pinned: SmallVec<[u32; 4]> = SmallVec::new();
        // The checksum each hit's slot was written with, in order.
        let mut crcs: SmallVec<[u32; 32]> = SmallVec::new();
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
                        pin_hit(e, &st, slot, now, &mut crcs, &mut pinned);
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
        let mut result = Ok(Pass::Done);
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
                Run::Miss { .. } => self.read_miss(first + at, n as u64, buf, promote, since),
            };
            if !matches!(r, Ok(Pass::Done)) {
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
    pub(super) fn check_hits(
        &self,
        lba: u64,
        slot: u32,
        crcs: &[u32],
        buf: &mut [u8],
        promote: Promote,
    ) -> io::Result<Pass> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        for (i, (block, &crc)) in buf.chunks_mut(bs).zip(crcs).enumerate() {
            if integrity::intact(block, crc) {
                continue;
            }
            let (lba, slot) = (lba + i as u64, slot + i as u32);
            match integrity::bad_block(e, lba, slot, crc, block) {
                Verdict::Repaired => {}
                Verdict::Dropped | Verdict::Moved => {
                    // The caller's segments are still pinned: a busy block is waited for there.
                    match self.read_blocks_once(lba, 1, block, promote)? {
                        Pass::Done => {}
                        busy => return Ok(busy),
                    }
                }
                Verdict::Lost => {
                    Stats::add(&e.stats.lost_reads, 1);
                    return Err(IntegrityError::Lost { lba }.into());
                }
            }
        }
        Ok(Pass::Done)
    }

    /// Reads blocks from the backing store and queues the promotion of those `promote` allows;
    /// `since`: the guard clock before the lookup that found them unmapped. Never waits (the
    /// caller pins segments, see `read_blocks`): [`Pass::Busy`] if a write of these blocks is
    /// landing on the backing store, whose read could see it half done.
    pub(super) fn read_miss(
        &self,
        lba: u64,
        n: u64,
        buf: &mut [u8],
        promote: Promote,
        since: u64,
    ) -> io::Result<Pass> {
        let e = &*self.e;
        let bs = self.block_size();
        {
            let Some(_reading) = e.backing.ranges.try_lock(lba, n, Hold::Reading) else {
                return Ok(Pass::Busy { lba, n });
            };
            let _fg = e.backing.foreground.begin();
            e.backing
                .dev
                .read_at(buf, lba * bs)
                .inspect_err(|err| e.backing_failed(BackingOp::Read, err))?;
        }
        e.backing.health.read_succeeded();
        Stats::add(&e.stats.backing_reads, 1);
        Stats::add(&e.stats.backing_read_bytes, buf.len() as u64);
        Stats::add(&e.stats.read_miss_blocks, n);
        let ghost_hits = (lba..lba + n).map(|b| e.history.ghost.read_missed(b)).sum();
        Stats::add(&e.stats.ghost_hit_blocks, ghost_hits);
        self.promote_missed(lba, buf, promote, since);
        Ok(Pass::Done)
    }

    /// Queues the promotion of the blocks from `lba` in `buf`, read from the backing store after
    /// guard clock `since`, that `promote` allows.
    fn promote_missed(&self, lba: u64, buf: &[u8], promote: Promote, since: u64) {
        let e = &*self.e;
        let bs = self.block_size();
        let n = buf.len() as u64 / bs;
        let policy = match promote {
            Promote::Never => return,
            Promote::Sequential => {
                Stats::add(&e.stats.bypassed_read_blocks, n);
                return;
            }
            Promote::All => PromotionPolicy::Always,
            Promote::Admitted => e.tunables.promotion(),
        };
        let (now, window) = (e.now_secs(), e.tunables.promotion_window_secs());
        if !policy.filters(e.history.evicting(now, window)) {
            self.queue_promotion(lba, buf, since);
            return;
        }
        // n-hit: promote the runs of blocks that reached their nth recent miss.
        let (table, nhit) = (e.history.misses(), e.tunables.promotion_nhit());
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
    }

    /// Queues PROMOTE records for `data` (whole blocks from `lba`), read from the backing store
    /// after guard clock `since`; drops what does not fit the promotion queue.
    pub(super) fn queue_promotion(&self, lba: u64, data: &[u8], since: u64) {
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
                Stats::add(&e.stats.promotions_shed_blocks, n - done);
                break;
            }
            let mut buf = e.log.buffer(bytes as usize);
            let from = (done * bs) as usize;
            buf.copy_from_slice(&data[from..from + bytes as usize]);
            let mut rec = Record::new(Kind::Promote, lba + done, k as u32, Some(buf));
            rec.promote_since = Some(since);
            e.log.append_async(rec, false);
            done += k;
        }
    }
}

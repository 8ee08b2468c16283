//! A batch of client reads served together when every block of each is cached: one lookup under
//! the state lock for the whole batch, then one batch of cache-device reads (`BlockDev::read_batch`,
//! io_uring on a file), so the thread that took the requests off the connection sleeps once for
//! all of them instead of once per read (issue 11 item 5: the O_DIRECT `pread` per read hit was
//! two thirds of the server's CPU per read, most of it the sleep and the wake-up).
//!
//! Only whole hits are taken: a read with a miss, a lost block, an unaligned edge or blocks in
//! more than one run of slots is left to the caller (`result` stays `None`) and named to its
//! `leave` right after the lookup, before any hit is read: it reads them with `read_at`, on
//! other threads, so a miss and the batch's hits never wait for each other. Nothing a left read's own `read_at` does is done here first: its
//! plan (the read stream's observation) and its counters are left to that call.
//!
//! A taken read is served exactly as `read.rs` serves it: counted as a read, planned (the stream
//! observed, once), its blocks touched for the policy and its segments pinned under the state
//! lock, read, checked against the checksums they were written with (`check_hits`), then
//! unpinned. A segment stays pinned until every read of the batch is read and checked, as long as
//! the batch's slowest device read, not across anything the caller does with the data (the NBD
//! server answers its client after this returns).

use flashtier_io::BatchRead;
use smallvec::SmallVec;

use crate::stats::Stats;

use super::plan::{Promote, ReadPlan};
use super::read::{first_lost, pin_hit, Pass};
use super::Cache;

/// A read of the batch found whole in the cache.
struct Taken {
    /// Its place in the caller's batch.
    at: usize,
    first: u64,
    /// The first of its consecutive slots.
    slot: u32,
    /// Where its blocks' checksums start in the batch's list.
    crc_from: usize,
    promote: Promote,
}

/// Reads (and block checksums) a batch keeps inline: the NBD layer's batches (at most 8 reads,
/// of at most 16 KiB after the first) allocate nothing unless the first read is large.
const INLINE: usize = 32;

impl Cache {
    /// Serves the reads of `reads` that are whole hits (see the module documentation); the
    /// others are left `None`, and named to `leave` before any is read.
    pub(super) fn read_batch_hits(
        &self,
        reads: &mut [BatchRead<'_>],
        leave: &mut dyn FnMut(&[usize]),
    ) {
        let e = &*self.e;
        let bs = self.block_size();
        if !self.mode().caches_reads() {
            let all: SmallVec<[usize; INLINE]> = (0..reads.len()).collect();
            leave(&all);
            return;
        }
        let tail = self.uncached_tail();
        let mut taken: SmallVec<[Taken; INLINE]> = SmallVec::new();
        let mut crcs: SmallVec<[u32; INLINE]> = SmallVec::new();
        let mut pinned: SmallVec<[u32; INLINE]> = SmallVec::new();
        {
            let st = e.state.read();
            let now = e.now_secs();
            for (at, r) in reads.iter().enumerate() {
                let len = r.buf.len() as u64;
                let whole_blocks = len > 0 && r.offset.is_multiple_of(bs) && len.is_multiple_of(bs);
                // Out of range too: left to `read_at`, which refuses it.
                let beyond = r.offset.checked_add(len).is_none_or(|end| end > tail);
                if r.result.is_some() || !whole_blocks || beyond {
                    continue;
                }
                let (first, count) = (r.offset / bs, len / bs);
                if first_lost(&st, first, count).is_some() {
                    continue;
                }
                // One run of consecutive slots, every block mapped; nothing is touched or pinned
                // before the whole read is known to hit.
                let Some(slot) = st.index.get(first) else {
                    continue;
                };
                let one_run = (1..count).all(|i| st.index.get(first + i) == Some(slot + i as u32));
                if !one_run {
                    continue;
                }
                let crc_from = crcs.len();
                for i in 0..count as u32 {
                    pin_hit(e, &st, slot + i, now, &mut crcs, &mut pinned);
                }
                taken.push(Taken {
                    at,
                    first,
                    slot,
                    crc_from,
                    promote: Promote::Never,
                });
            }
        }
        // The misses may be read elsewhere while the hits are read here.
        let mut left: SmallVec<[usize; INLINE]> = SmallVec::new();
        let mut next = taken.iter().peekable();
        for (at, r) in reads.iter().enumerate() {
            if next.peek().is_some_and(|t| t.at == at) {
                next.next();
            } else if r.result.is_none() {
                left.push(at);
            }
        }
        if !left.is_empty() {
            leave(&left);
        }
        if taken.is_empty() {
            return;
        }
        for t in &mut taken {
            let r = &reads[t.at];
            Stats::add(&e.stats.reads, 1);
            Stats::add(&e.stats.batched_reads, 1);
            // Planned as its own read would be (the stream observed once); a mode switched
            // meanwhile leaves it served from what is cached, as a read already past its lookup.
            t.promote = match self.plan_read(r.offset, r.buf.len() as u64, false) {
                ReadPlan::Cached(promote) => promote,
                ReadPlan::Backing => Promote::Never,
            };
        }
        let mut results: SmallVec<[Option<std::io::Result<()>>; INLINE]> = SmallVec::new();
        {
            let mut device: SmallVec<[BatchRead<'_>; INLINE]> = SmallVec::new();
            let mut next = taken.iter().peekable();
            for (at, r) in reads.iter_mut().enumerate() {
                if next.peek().is_some_and(|t| t.at == at) {
                    let t = next.next().expect("peeked");
                    device.push(BatchRead::new(&mut *r.buf, e.geo.slot_offset(t.slot)));
                }
            }
            // What it leaves (it does not batch) is read below, on this thread.
            e.cache.read_batch(&mut device, &mut |_| {});
            for d in &mut device {
                // The cache device left it (no io_uring here): read it on this thread.
                let result = match d.result.take() {
                    Some(result) => result,
                    None => e.cache.read_at(d.buf, d.offset),
                };
                if result.is_err() {
                    Stats::add(&e.stats.cache_errors, 1);
                }
                Stats::add(&e.stats.cache_reads, 1);
                Stats::add(&e.stats.cache_read_bytes, d.buf.len() as u64);
                results.push(Some(result));
            }
        }
        let mut hits = 0;
        // A block that failed its check and whose read again met a write landing on the backing
        // store: read whole again once nothing is pinned (as `read_blocks` does).
        let mut again: SmallVec<[usize; 4]> = SmallVec::new();
        for (t, result) in taken.iter().zip(&mut results) {
            let r = &mut reads[t.at];
            let count = r.buf.len() / bs as usize;
            let crcs = &crcs[t.crc_from..t.crc_from + count];
            let checked = result
                .take()
                .expect("one result per taken read")
                .and_then(|()| self.check_hits(t.first, t.slot, crcs, r.buf, t.promote));
            r.result = match checked {
                Ok(Pass::Done) => {
                    hits += count as u64;
                    Some(Ok(()))
                }
                Ok(Pass::Busy { .. }) => {
                    again.push(t.at);
                    None
                }
                Err(err) => Some(Err(err)),
            };
        }
        {
            let st = e.state.read();
            for seg in pinned {
                st.segs.reader_exit(seg);
            }
        }
        Stats::add(&e.stats.read_hit_blocks, hits);
        for at in again {
            let t = taken.iter().find(|t| t.at == at).expect("taken");
            let r = &mut reads[at];
            let count = r.buf.len() as u64 / bs;
            r.result = Some(self.read_blocks(t.first, count, r.buf, t.promote));
        }
    }

    /// How many reads [`Cache::read_batch_hits`] serves together: as many as the cache device
    /// reads at once, while the mode caches reads.
    pub(super) fn read_batch_limit(&self) -> usize {
        if self.mode().caches_reads() {
            self.e.cache.read_batch_max()
        } else {
            1
        }
    }
}

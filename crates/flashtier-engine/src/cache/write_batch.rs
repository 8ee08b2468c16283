//! A batch of client write-back writes logged together: their records go to the log writer in
//! one group (one batch on the cache device when they fit one), and the thread that took them
//! off the connection waits once for all of them (issue 11 item 5). One by one, each write cost
//! its thread a wake-up for the connection, a wait for the log (a sleep and a wake-up) and a reply
//! of its own.
//!
//! Only writes that `write_back` would serve as they are and that wait for nothing but the log
//! are taken: whole blocks within the cached part of the volume, at most the atomic size (one
//! record each), in write-back mode without a write cutoff (a cutoff observes the write stream,
//! which the caller's `write_at` does for a write left), and whose blocks no read-modify-write
//! holds (`write_ranges`, tried without waiting: this thread holds the batch's other ranges, and
//! a thread that holds a range never waits for one, `range_lock`'s rule). Everything else is left
//! (`result` stays `None`) for the caller's `write_at`. A taken write is served exactly as through
//! `write_at`: counted, planned under `writes_gate`, its blocks held shared in `write_ranges` until
//! its record is applied, logged dirty and acknowledged once written (no sync: none has FUA).

use std::io;

use smallvec::SmallVec;

use flashtier_io::BatchWrite;

use crate::log::MAX_GROUP;
use crate::range_lock::{Hold, RangeGuard};
use crate::stats::Stats;

use super::plan::WritePlan;
use super::Cache;

impl Cache {
    /// Most writes `write_batch_back` takes at once: in write-back mode without a write cutoff,
    /// a log group; else 1 (it takes none).
    pub(super) fn write_batch_limit(&self) -> usize {
        if self.batches_writes() {
            MAX_GROUP
        } else {
            1
        }
    }

    fn batches_writes(&self) -> bool {
        self.plan_write(false) == WritePlan::WriteBack
            && self.e.tunables.sequential_cutoff_write_bytes().is_none()
    }

    /// Logs the writes of `writes` that are plain write-back writes (see the module
    /// documentation) together; the others are left `None`.
    pub(super) fn write_batch_back(&self, writes: &mut [BatchWrite<'_>]) {
        for group in writes.chunks_mut(MAX_GROUP) {
            self.write_group(group);
        }
    }

    fn write_group(&self, writes: &mut [BatchWrite<'_>]) {
        let e = &*self.e;
        let bs = self.block_size();
        let max_blocks = (e.atomic_bytes as u64 / bs).max(1);
        let _gate = e.writes_gate.read();
        if !self.batches_writes() {
            return;
        }
        let tail = self.uncached_tail();
        // Each taken write's place in `writes`, and the hold on its blocks until it is applied.
        let mut taken: SmallVec<[(usize, RangeGuard<'_>); MAX_GROUP]> = SmallVec::new();
        for (at, w) in writes.iter().enumerate() {
            let len = w.buf.len() as u64;
            let whole_blocks = len > 0 && w.offset.is_multiple_of(bs) && len.is_multiple_of(bs);
            let cached = w.offset.checked_add(len).is_some_and(|end| end <= tail);
            if w.result.is_some() || !whole_blocks || !cached || len / bs > max_blocks {
                continue;
            }
            let Some(guard) = e
                .write_ranges
                .try_lock(w.offset / bs, len / bs, Hold::Shared)
            else {
                continue;
            };
            taken.push((at, guard));
        }
        if taken.is_empty() {
            return;
        }
        let span = |w: &BatchWrite<'_>| (w.offset / bs, w.buf.len() as u64 / bs);
        self.count_write_hits(taken.iter().map(|&(at, _)| span(&writes[at])));
        let blocks: u64 = taken.iter().map(|&(at, _)| span(&writes[at]).1).sum();
        let records = taken.iter().map(|&(at, _)| {
            let w = &writes[at];
            self.write_record(w.offset / bs, w.buf, true)
        });
        let mut results: SmallVec<[_; MAX_GROUP]> = SmallVec::new();
        e.log.append_group(records, &mut results);
        Stats::add(&e.stats.writes, taken.len() as u64);
        Stats::add(&e.stats.batched_writes, taken.len() as u64);
        Stats::add(&e.stats.write_blocks, blocks);
        for ((at, _guard), result) in taken.into_iter().zip(results) {
            writes[at].result = Some(result.map(drop).map_err(io::Error::from));
        }
    }
}

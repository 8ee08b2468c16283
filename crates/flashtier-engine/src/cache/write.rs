//! What every cached write goes through before its mode's handler: the uncached tail, the
//! write's blocks held in `Engine::write_ranges`, a read-modify-write for partial blocks, and the
//! dispatch on the request's plan. Also the records every mode writes (WRITE, INVALIDATE).

use std::io;

use flashtier_io::AlignedBuf;
use smallvec::SmallVec;

use crate::cleaner;
use crate::layout::batch::Kind;
use crate::log::Record;
use crate::policy::Mode;
use crate::range_lock::{Hold, RangeGuard};
use crate::state::DirtyBlock;
use crate::stats::Stats;

use super::plan::{Promote, WritePlan};
use super::write_around::Payload;
use super::Cache;

/// The records `log_blocks` wrote: each one's first block, the slot it landed in, and its
/// length. Inline for up to four records (a write of four times the atomic size), so a client
/// write needs no allocation for it.
pub(super) type Logged = SmallVec<[(u64, Option<u32>, u32); 4]>;

/// How a write holds its blocks in `Engine::write_ranges` (shared by whole-block writes,
/// exclusive for partial ones).
pub(super) enum RmwHeld<'a> {
    /// Exclusively, by the caller, for the whole write (a read-modify-write).
    ByCaller,
    /// Exclusively, until the write's INVALIDATE is applied.
    Exclusive(RangeGuard<'a>),
    Shared {
        _guard: RangeGuard<'a>,
    },
}

impl<'a> RmwHeld<'a> {
    pub(super) fn downgrade(self) -> RmwHeld<'a> {
        match self {
            RmwHeld::Exclusive(mut g) => {
                g.downgrade();
                RmwHeld::Shared { _guard: g }
            }
            held => held,
        }
    }
}

impl Cache {
    /// A client write; `past_cutoff`: it continued a sequential stream past the write cutoff.
    pub(super) fn write(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        past_cutoff: bool,
    ) -> io::Result<()> {
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

    pub(super) fn write_at_cached(
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
        let plan = self.plan_write(past_cutoff);
        if offset.is_multiple_of(bs) && end.is_multiple_of(bs) {
            if let WritePlan::PastCutoff(mode) = plan {
                // Exclusive only where `write_past_cutoff` needs it (see there).
                let exclusive = mode == Mode::WriteBack;
                let hold = if exclusive {
                    Hold::Exclusive
                } else {
                    Hold::Shared
                };
                let guard = ranges.lock(first, last - first, hold);
                let held = if exclusive {
                    RmwHeld::Exclusive(guard)
                } else {
                    RmwHeld::Shared { _guard: guard }
                };
                return self.write_past_cutoff(mode, first, Payload::Data(buf), fua, held);
            }
            let _shared = ranges.lock(first, last - first, Hold::Shared);
            return self.write_planned(plan, first, buf, fua);
        }
        // A partial block: read what surrounds the write, patch, write whole blocks, excluding
        // every other writer of these blocks so nothing lands between the read and the write.
        let _exclusive = ranges.lock(first, last - first, Hold::Exclusive);
        let mut data = AlignedBuf::zeroed(((last - first) * bs) as usize);
        let tail_at = ((last - 1 - first) * bs) as usize;
        if !offset.is_multiple_of(bs) {
            self.read_edge(first, &mut data[..bs as usize])?;
        }
        if !end.is_multiple_of(bs) && (last - 1 > first || offset.is_multiple_of(bs)) {
            self.read_edge(last - 1, &mut data[tail_at..tail_at + bs as usize])?;
        }
        let skip = (offset - first * bs) as usize;
        data[skip..skip + buf.len()].copy_from_slice(buf);
        let written = match plan {
            WritePlan::PastCutoff(mode) => {
                self.write_past_cutoff(mode, first, Payload::Data(&data), fua, RmwHeld::ByCaller)
            }
            plan => self.write_planned(plan, first, &data, fua),
        };
        if written.is_ok() && !end.is_multiple_of(bs) {
            // The block the next write of an appending writer starts in.
            let e = &*self.e;
            self.partials
                .remember(&e.state, &e.geo, last - 1, &data[tail_at..]);
        }
        written
    }

    /// One edge block of a partial write: from `partial_blocks` when it remembers what the block
    /// holds, else read through the cache (never promoted).
    fn read_edge(&self, lba: u64, out: &mut [u8]) -> io::Result<()> {
        let e = &*self.e;
        if self.partials.fill(&e.state, &e.geo, lba, out) {
            Stats::add(&e.stats.partial_write_blocks_from_memory, 1);
            return Ok(());
        }
        self.read_blocks(lba, 1, out, Promote::Never)
    }

    /// Whole-block writes, as `plan` says (one of a mode's own; see `write_past_cutoff` for the
    /// other).
    pub(super) fn write_planned(
        &self,
        plan: WritePlan,
        lba: u64,
        data: &[u8],
        fua: bool,
    ) -> io::Result<()> {
        let n = data.len() as u64 / self.block_size();
        match plan {
            WritePlan::WriteBack => self.write_back(lba, data, fua),
            WritePlan::WriteThrough => {
                let _turn = self.e.guards.write_through_lock(lba, n);
                self.write_through(lba, data, fua)
            }
            WritePlan::Around => {
                self.write_around_runs(lba, Payload::Data(data), &[(0, n)], fua, || ())
            }
            WritePlan::PastCutoff(mode) => {
                unreachable!("a write past the cutoff in {mode} goes to write_past_cutoff")
            }
        }
    }

    /// Writes whole blocks `[lba, lba + n)` from `data` into the cache as WRITE records.
    pub(super) fn log_blocks(&self, lba: u64, data: &[u8], dirty: bool) -> io::Result<Logged> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        let n = (data.len() / bs) as u64;
        let max = (e.atomic_bytes as usize / bs).max(1) as u64;
        self.count_write_hits(std::iter::once((lba, n)));
        let mut records = Logged::new();
        let mut done = 0;
        while done < n {
            let k = (n - done).min(max);
            let from = done as usize * bs;
            let rec = self.write_record(lba + done, &data[from..from + k as usize * bs], dirty);
            let appended = e.log.append(rec, false)?;
            records.push((lba + done, appended.slot, k as u32));
            done += k;
        }
        Stats::add(&e.stats.write_blocks, n);
        Ok(records)
    }

    /// Counts the blocks of the writes `(first block, blocks)` that replace a cached version,
    /// under one hold of the state lock.
    pub(super) fn count_write_hits(&self, writes: impl Iterator<Item = (u64, u64)>) {
        let e = &*self.e;
        let st = e.state.read();
        let hits: usize = writes
            .map(|(lba, n)| {
                (lba..lba + n)
                    .filter(|&b| st.index.get(b).is_some())
                    .count()
            })
            .sum();
        Stats::add(&e.stats.write_hit_blocks, hits as u64);
    }

    /// A WRITE record of the whole blocks `data` from `lba` (at most the atomic size), its data
    /// copied into a buffer from the log's pool.
    pub(super) fn write_record(&self, lba: u64, data: &[u8], dirty: bool) -> Record {
        let mut buf = self.e.log.buffer(data.len());
        buf.copy_from_slice(data);
        let blocks = (data.len() as u64 / self.block_size()) as u32;
        Record::new(Kind::Write, lba, blocks, Some(buf)).dirty(dirty)
    }

    /// Durably unmaps `[lba, lba + n)` so the backing store may be written there.
    pub(super) fn invalidate(&self, lba: u64, n: u64) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.append_invalidate(lba, n)?;
        Ok(self.e.log.sync_vouched(false)?)
    }

    /// Unmaps `[lba, lba + n)` (not yet durably: sync before writing the backing store there).
    pub(super) fn append_invalidate(&self, lba: u64, n: u64) -> io::Result<()> {
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

    /// The blocks `log_blocks` wrote, with their segments' generations (for `mark_clean`).
    pub(super) fn written_blocks(&self, records: &Logged) -> (Vec<DirtyBlock>, Vec<u64>) {
        let blocks: Vec<DirtyBlock> = records
            .iter()
            .filter_map(|&(lba, slot, n)| Some((lba, slot?, n)))
            .flat_map(|(lba, slot, n)| {
                (0..n).map(move |i| DirtyBlock {
                    lba: lba + i as u64,
                    slot: slot + i,
                })
            })
            .collect();
        let generations = cleaner::generations_of(&self.e, &self.e.state.read(), &blocks);
        (blocks, generations)
    }
}

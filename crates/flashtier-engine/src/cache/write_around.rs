//! Write-around (and pass-through's writes): an INVALIDATE record for the range is synced, then
//! the backing store is written. Also a write-back or write-through write past the sequential
//! write cutoff, which goes around the cache except for its blocks dirty there, and write-zeroes,
//! planned as such a write whose data the backing store makes itself (`Payload::Zeroes`).
//!
//! The rule behind the order: before the backing store is written, every record that could map
//! the blocks being written must be durably superseded, or a crash could bring back a cached copy
//! older than what the backing store holds.

use std::io;

use flashtier_io::{AlignedBuf, ZeroOpts};

use crate::cleaner;
use crate::guards::BusyRange;
use crate::policy::Mode;
use crate::stats::Stats;

use super::plan::WritePlan;
use super::write::RmwHeld;
use super::Cache;

/// What a write around the cache puts in its blocks.
#[derive(Clone, Copy)]
pub(super) enum Payload<'a> {
    /// Whole blocks of data, from the write's first block on.
    Data(&'a [u8]),
    /// Zeroes in `blocks` blocks: the backing store gets a WRITE_ZEROES of its own, and blocks
    /// that take a cached path get zero blocks written.
    Zeroes { blocks: u64, opts: ZeroOpts },
}

/// `(first, count)` blocks of a write, `first` relative to its first block.
type Run = (u64, u64);

/// Zero blocks written through a cached path at a time (1 MiB of 4 KiB blocks).
const ZERO_PIECE_BLOCKS: u64 = 256;

impl Payload<'_> {
    fn blocks(&self, bs: u64) -> u64 {
        match self {
            Payload::Data(data) => data.len() as u64 / bs,
            Payload::Zeroes { blocks, .. } => *blocks,
        }
    }

    /// Calls `f(at, data)` over blocks `[first, first + n)` of the payload (`at` relative to its
    /// start), in pieces: zeroes a bounded buffer at a time.
    fn each_piece(
        &self,
        bs: u64,
        first: u64,
        n: u64,
        mut f: impl FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        match self {
            Payload::Data(data) => f(
                first,
                &data[(first * bs) as usize..((first + n) * bs) as usize],
            ),
            Payload::Zeroes { .. } => {
                let zeroes = AlignedBuf::zeroed((n.min(ZERO_PIECE_BLOCKS) * bs) as usize);
                let mut at = first;
                while at < first + n {
                    let k = (first + n - at).min(ZERO_PIECE_BLOCKS);
                    f(at, &zeroes[..(k * bs) as usize])?;
                    at += k;
                }
                Ok(())
            }
        }
    }
}

impl Cache {
    /// Writes runs of whole blocks around the cache: invalidates them durably, then writes them
    /// to the backing store. `runs` are `(first, count)` blocks of `payload`, which starts at
    /// block `lba`. `invalidated` runs once the INVALIDATEs are applied, before they are synced;
    /// what it returns is kept until the backing writes are done.
    ///
    /// The blocks are held in `Backing::ranges` from the INVALIDATEs on, not just for the backing
    /// writes: a write-back write that lands in the cache on these blocks after the INVALIDATE is
    /// newer than this one, and a cleaning pass must not write it back and mark it clean before
    /// this write reaches the backing store under it. (Not before the INVALIDATEs: appending may
    /// wait for reclaim, which may wait for a cleaning pass of these blocks. The sync below is a
    /// system request for the same reason.)
    pub(super) fn write_around_runs<T>(
        &self,
        lba: u64,
        payload: Payload<'_>,
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
        let held = self.hold_for_backing(lba * bs, payload.blocks(bs) * bs);
        let _kept = invalidated();
        // As a system request: a client sync waits while client records wait for log space, and
        // the reclaim they wait for may need a cleaning pass, which waits for these blocks.
        e.log.sync_vouched(true)?;
        for (&(first, n), busy) in runs.iter().zip(&mut busy) {
            let offset = (lba + first) * bs;
            match payload {
                Payload::Data(data) => {
                    Stats::add(&e.stats.write_blocks, n);
                    let part = &data[(first * bs) as usize..((first + n) * bs) as usize];
                    self.backing_write_held(&held, part, offset, fua, Some(busy))?;
                }
                Payload::Zeroes { opts, .. } => {
                    self.backing_zeroes_held(&held, offset, n * bs, opts, Some(busy))?;
                }
            }
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
    /// partial-block write still cannot read these blocks before the backing store has them).
    /// Write-through writes take the blocks' turn lock, held here until the backing writes are
    /// done, which also keeps the two in log order on the backing store.
    pub(super) fn write_past_cutoff(
        &self,
        mode: Mode,
        lba: u64,
        payload: Payload<'_>,
        fua: bool,
        held: RmwHeld<'_>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let n = payload.blocks(bs);
        let turn = (mode == Mode::WriteThrough).then(|| e.guards.write_through_lock(lba, n));
        let (cached, around) = self.dirty_and_other_runs(lba, n);
        if around.is_empty() {
            drop(turn);
            let _held = held.downgrade();
            let plan = WritePlan::of_mode(mode);
            return payload.each_piece(bs, 0, n, |at, part| {
                self.write_planned(plan, lba + at, part, fua)
            });
        }
        for &(first, k) in &cached {
            payload.each_piece(bs, first, k, |at, part| {
                if turn.is_some() {
                    self.write_through(lba + at, part, fua)
                } else {
                    // Made durable (FUA) by the sync before the backing writes below.
                    self.log_blocks(lba + at, part, true).map(drop)
                }
            })?;
        }
        if let Payload::Data(_) = payload {
            Stats::add(
                &e.stats.bypassed_write_blocks,
                around.iter().map(|&(_, k)| k).sum(),
            );
        }
        self.write_around_runs(lba, payload, &around, fua, move || (turn, held.downgrade()))
    }

    /// Runs `(first, count)` of blocks `[lba, lba + n)` (`first` relative to `lba`): those dirty
    /// in the cache, and the others. Without looking at every block of a range larger than
    /// what is cached (a write-zeroes may cover the whole device).
    fn dirty_and_other_runs(&self, lba: u64, n: u64) -> (Vec<Run>, Vec<Run>) {
        let e = &*self.e;
        let mut dirty: Vec<u64> = {
            let st = e.state.read();
            cleaner::dirty_in_range(&st, e.geo.slot_count(), lba, n)
                .into_iter()
                .map(|b| b.lba - lba)
                .collect()
        };
        dirty.sort_unstable();
        let (mut cached, mut around): (Vec<Run>, Vec<Run>) = (vec![], vec![]);
        let mut next = 0;
        for d in dirty {
            if d > next {
                around.push((next, d - next));
            }
            match cached.last_mut() {
                Some((first, k)) if *first + *k == d => *k += 1,
                _ => cached.push((d, 1)),
            }
            next = d + 1;
        }
        if next < n {
            around.push((next, n - next));
        }
        (cached, around)
    }
}

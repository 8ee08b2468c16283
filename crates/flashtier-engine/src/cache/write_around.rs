//! Write-around (and pass-through's writes): an INVALIDATE record for the range is synced, then
//! the backing store is written. Also a write-back or write-through write past the sequential
//! write cutoff, which goes around the cache except for its blocks dirty there.
//!
//! The rule behind the order: before the backing store is written, every record that could map
//! the blocks being written must be durably superseded, or a crash could bring back a cached copy
//! older than what the backing store holds.

use std::io;

use crate::cleaner;
use crate::guards::BusyRange;
use crate::policy::Mode;
use crate::stats::Stats;

use super::plan::WritePlan;
use super::write::RmwHeld;
use super::Cache;

impl Cache {
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
    pub(super) fn write_around_runs<T>(
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
        let held = self.hold_for_backing(lba * bs, data.len() as u64);
        let _kept = invalidated();
        // As a system request: a client sync waits while client records wait for log space, and
        // the reclaim they wait for may need a cleaning pass, which waits for these blocks.
        e.log.sync_vouched(true)?;
        for (&(first, n), busy) in runs.iter().zip(&mut busy) {
            Stats::add(&e.stats.write_blocks, n);
            let part = &data[(first * bs) as usize..((first + n) * bs) as usize];
            self.backing_write_held(&held, part, (lba + first) * bs, fua, Some(busy))?;
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
    pub(super) fn write_past_cutoff(
        &self,
        mode: Mode,
        lba: u64,
        data: &[u8],
        fua: bool,
        held: RmwHeld<'_>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size() as usize;
        let n = (data.len() / bs) as u64;
        let turn = (mode == Mode::WriteThrough).then(|| e.guards.write_through_lock(lba, n));
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
            return self.write_planned(WritePlan::of_mode(mode), lba, data, fua);
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
}

//! The backing store, directly: pass-through reads and the uncached tail, and the backing writes
//! of every mode that writes there (write-through, write-around, pass-through), each holding its
//! blocks in `Backing::ranges` so that no cleaning pass lands an older version over it,
//! and no read of the backing store sees one of them half landed.

use std::io;
use std::sync::atomic::Ordering;

use flashtier_io::ZeroOpts;

use crate::guards::BusyRange;
use crate::health::BackingOp;
use crate::integrity::IntegrityError;
use crate::range_lock::{Hold, RangeGuard};
use crate::stats::Stats;

use super::read::first_lost;
use super::Cache;

impl Cache {
    /// A read of the backing store only (the plan's `ReadPlan::Backing`, or a read's part past
    /// the last whole cache block): refused for a lost block, whose backing copy is older than
    /// what was lost.
    pub(super) fn pass_through_read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let end = offset + buf.len() as u64;
        let lost = first_lost(&e.state.read(), offset / bs, end.div_ceil(bs) - offset / bs);
        if let Some(lba) = lost {
            Stats::add(&e.stats.lost_reads, 1);
            return Err(IntegrityError::Lost { lba }.into());
        }
        Stats::add(&e.stats.backing_reads, 1);
        Stats::add(&e.stats.backing_read_bytes, buf.len() as u64);
        self.backing_read(buf, offset)
    }

    /// Reads the backing store directly (pass-through, the uncached tail), never while a write
    /// of the same blocks is landing there (see `range_lock`): the caller pins no segment, so
    /// it may wait for one.
    pub(super) fn backing_read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let first = offset / bs;
        let end = (offset + buf.len() as u64).div_ceil(bs);
        let _reading = e.backing.ranges.lock(first, end - first, Hold::Reading);
        let _fg = e.backing.foreground.begin();
        e.backing
            .dev
            .read_at(buf, offset)
            .inspect_err(|err| e.backing_failed(BackingOp::Read, err))?;
        e.backing.health.read_succeeded();
        Ok(())
    }

    /// Writes the backing store directly. `busy` (the blocks' guard, if they are cacheable)
    /// learns whether the data is durable there yet.
    pub(super) fn backing_write(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let held = self.hold_for_backing(offset, buf.len() as u64);
        self.backing_write_held(&held, buf, offset, fua, busy)
    }

    /// Holds the blocks under `offset..offset + len` in `Backing::ranges` (shared): no cleaning
    /// pass writes an older version of them back meanwhile.
    pub(super) fn hold_for_backing(&self, offset: u64, len: u64) -> RangeGuard<'_> {
        let bs = self.block_size();
        let first = offset / bs;
        self.e
            .backing
            .ranges
            .lock(first, (offset + len).div_ceil(bs) - first, Hold::Shared)
    }

    /// [`Cache::backing_write`] for a caller that holds the blocks already.
    pub(super) fn backing_write_held(
        &self,
        _held: &RangeGuard<'_>,
        buf: &[u8],
        offset: u64,
        fua: bool,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let written = {
            let _fg = e.backing.foreground.begin();
            e.backing.dev.write_at(buf, offset, fua)
        };
        self.backing_written(written, fua, busy)?;
        Stats::add(&e.stats.backing_writes, 1);
        Stats::add(&e.stats.backing_write_bytes, buf.len() as u64);
        Ok(())
    }

    /// Zeroes `len` bytes at `offset` on the backing store (WRITE_ZEROES) for a caller that
    /// holds the blocks already; `busy` as for [`Cache::backing_write_held`].
    pub(super) fn backing_zeroes_held(
        &self,
        _held: &RangeGuard<'_>,
        offset: u64,
        len: u64,
        opts: ZeroOpts,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let e = &*self.e;
        let written = {
            let _fg = e.backing.foreground.begin();
            e.backing.dev.write_zeroes(offset, len, opts)
        };
        self.backing_written(written, opts.fua, busy)
    }

    /// After a write (or WRITE_ZEROES) to the backing store: its failure recorded, or its
    /// success, and without FUA, that the backing store holds unflushed writes.
    fn backing_written(
        &self,
        written: io::Result<()>,
        fua: bool,
        busy: Option<&mut BusyRange<'_>>,
    ) -> io::Result<()> {
        let e = &*self.e;
        written.inspect_err(|err| e.backing_failed(BackingOp::Write, err))?;
        e.backing.health.write_succeeded();
        if !fua {
            e.backing.unflushed.store(true, Ordering::Release);
            if let Some(busy) = busy {
                busy.written_unflushed();
            }
        }
        Ok(())
    }
}

//! Trim and write-zeroes: requests that carry no data.
//!
//! **Trim** drops the whole blocks inside its range from the cache (an INVALIDATE, synced), then
//! trims the backing store's exact range; trimmed bytes may read as anything afterwards, so
//! dirty blocks among them may simply go.
//!
//! **Write-zeroes** zeroes its partial edge blocks as ordinary writes, and the whole blocks
//! between them as a write past the sequential cutoff would be written (`write_around`): in
//! write-back and write-through, blocks dirty in the cache are zeroed there, through the mode's
//! own path, and the rest are invalidated and zeroed on the backing store by a WRITE_ZEROES of
//! its own (no zero data sent). A dirty block must not be invalidated before the backing store
//! durably holds what replaces it: a crash would bring back the backing store's older copy over
//! a write that may have been flushed. (Before, a write-zeroes wrote those blocks back first, by
//! running a cleaning pass on the client's thread; and as it held no write range, a write of a
//! block in the range could make it dirty between that pass and the INVALIDATE.) Like any write,
//! it holds `writes_gate`, so the mode it was planned in stays until it is done, and its blocks
//! in `write_ranges` as a write past the cutoff does.

use std::io;
use std::sync::atomic::Ordering;

use flashtier_io::ZeroOpts;

use crate::health::BackingOp;
use crate::policy::Mode;
use crate::range_lock::Hold;

use super::plan::WritePlan;
use super::write::RmwHeld;
use super::write_around::Payload;
use super::Cache;

impl Cache {
    /// Trims `len` bytes at `offset` (checked by the caller).
    pub(super) fn trim_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        // Only whole blocks inside the range are dropped from the cache; the backing store gets
        // the exact range.
        let first = offset.div_ceil(bs);
        let last = ((offset + len) / bs).min(e.cached_blocks).max(first);
        let mut busy = e.guards.busy(first, last - first);
        self.invalidate(first, last - first)?;
        let _held = self.hold_for_backing(offset, len);
        e.backing.unflushed.store(true, Ordering::Release);
        busy.written_unflushed();
        let _fg = e.backing.foreground.begin();
        e.backing
            .dev
            .trim(offset, len)
            .inspect_err(|err| e.backing_failed(BackingOp::Trim, err))
    }

    /// Zeroes `len` bytes at `offset` (checked by the caller).
    pub(super) fn zero_range(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let end = offset + len;
        let first = offset.div_ceil(bs).min(e.cached_blocks);
        let last = (end / bs).min(e.cached_blocks).max(first);
        // Partial blocks at the edges are zeroed as ordinary writes. They are not part of a
        // write stream: the whole blocks between them go around the cache anyway.
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
            self.zero_blocks(first, last - first, opts)?;
        }
        Ok(())
    }

    /// Zeroes whole cached blocks `[first, first + n)` (see the module's essay).
    fn zero_blocks(&self, first: u64, n: u64, opts: ZeroOpts) -> io::Result<()> {
        let e = &*self.e;
        let payload = Payload::Zeroes { blocks: n, opts };
        let _gate = e.writes_gate.read();
        match self.plan_write(true) {
            WritePlan::PastCutoff(mode) => {
                // Exclusive only where `write_past_cutoff` needs it, as for a write.
                let held = if mode == Mode::WriteBack {
                    RmwHeld::Exclusive(e.write_ranges.lock(first, n, Hold::Exclusive))
                } else {
                    RmwHeld::Shared {
                        _guard: e.write_ranges.lock(first, n, Hold::Shared),
                    }
                };
                self.write_past_cutoff(mode, first, payload, opts.fua, held)
            }
            _ => {
                let _held = e.write_ranges.lock(first, n, Hold::Shared);
                self.write_around_runs(first, payload, &[(0, n)], opts.fua, || ())
            }
        }
    }
}

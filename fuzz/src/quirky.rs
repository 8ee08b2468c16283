//! A `MemDev` with the quirks real devices have and `MemDev` lacks, so the server's handling of
//! them is fuzzed too: a fragmented allocation map, a bad region where I/O fails with EIO, and
//! fast zeroing that only works on aligned ranges. Everything is a fixed function of the offset,
//! so the transmission target's model knows exactly what to expect. (The map is fiction: it says
//! nothing about what the device holds, and the server only relays it.)

use std::io;
use std::ops::Range;
use std::sync::Arc;

use flashtier_io::{check_range, BlockDev, DevInfo, Extent, ZeroOpts};
use flashtier_testkit::MemDev;
use flashtier_nbd::wire::{errno, state};

use crate::DEV_SIZE;

/// I/O touching this range fails with EIO.
pub const BAD: Range<u64> = (DEV_SIZE as u64 - 64 * 1024)..(DEV_SIZE as u64 - 60 * 1024);
/// The allocation map changes every this many bytes.
pub const GRANULE: u64 = 512;
/// Fast zeroing needs offset and length aligned to this.
pub const FAST_ZERO_ALIGN: u64 = 4096;

/// `base:allocation` flags of the granule holding `offset`.
pub fn flags_at(offset: u64) -> u32 {
    let g = offset / GRANULE;
    match g % 5 {
        0 | 1 => 0,
        2 => state::HOLE | state::ZERO,
        3 => state::ZERO,
        _ => {
            if g.is_multiple_of(2) {
                0
            } else {
                state::HOLE | state::ZERO
            }
        }
    }
}

/// Whether `[offset, offset + len)` overlaps the bad region.
pub fn touches_bad(offset: u64, len: u64) -> bool {
    len > 0 && offset < BAD.end && offset.saturating_add(len) > BAD.start
}

pub struct Quirky {
    inner: Arc<MemDev>,
    info: DevInfo,
}

impl Quirky {
    pub fn new(inner: Arc<MemDev>) -> Quirky {
        let info = DevInfo {
            can_extents: true,
            ..inner.info().clone()
        };
        Quirky { inner, info }
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if touches_bad(offset, len) {
            // NBD's error values are Linux's errno values.
            return Err(io::Error::from_raw_os_error(errno::EIO as i32));
        }
        Ok(())
    }
}

impl BlockDev for Quirky {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        format!("quirky {}", self.inner.describe())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        self.inner.write_at(buf, offset, fua)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        self.inner.trim(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.check(offset, len)?;
        if opts.fast_only && !(offset | len).is_multiple_of(FAST_ZERO_ALIGN) {
            return Err(io::ErrorKind::Unsupported.into());
        }
        self.inner.write_zeroes(offset, len, opts)
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)
    }

    /// One extent per granule (not merged), as many as allowed.
    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        let end = offset + len;
        let mut pos = offset;
        let mut n = 0;
        while pos < end && n < max_extents.max(1) {
            let next = ((pos / GRANULE + 1) * GRANULE).min(end);
            let flags = flags_at(pos);
            out.push(Extent {
                len: next - pos,
                hole: flags & state::HOLE != 0,
                zero: flags & state::ZERO != 0,
            });
            pos = next;
            n += 1;
        }
        if n == 0 {
            out.push(Extent::data(len));
        }
        Ok(())
    }
}

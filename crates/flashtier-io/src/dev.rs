//! The `BlockDev` trait: what every storage layer in flashtier looks like to the one above it.

use std::io;

/// What a device can do, fixed when it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevInfo {
    /// Size in bytes.
    pub size: u64,
    /// Writes, trims and zeroing fail with `EPERM`.
    pub read_only: bool,
    /// The smallest unit the device reads and writes without a read-modify-write (a power of two).
    /// Requests need not be aligned to it, but aligned ones are cheaper.
    pub min_block: u32,
    /// The device keeps `flush` meaningful: it has a volatile cache that `flush` makes durable.
    pub can_flush: bool,
    /// `write_at(.., fua = true)` is cheaper than a write followed by `flush`.
    pub native_fua: bool,
    /// `trim` can actually release space (otherwise it is accepted and ignored).
    pub can_trim: bool,
    /// `write_zeroes` is supported without writing zero buffers in every case.
    pub can_fast_zero: bool,
    /// `extents` reports real allocation (otherwise everything is reported as data).
    pub can_extents: bool,
    /// The medium seeks (spinning disk), so callers may prefer sequential access.
    pub rotational: bool,
}

impl DevInfo {
    /// Defaults for a plain read-write device of `size` bytes with nothing special about it.
    pub fn basic(size: u64) -> Self {
        DevInfo {
            size,
            read_only: false,
            min_block: 1,
            can_flush: true,
            native_fua: false,
            can_trim: false,
            can_fast_zero: false,
            can_extents: false,
            rotational: false,
        }
    }
}

/// Options for [`BlockDev::write_zeroes`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroOpts {
    /// The range may be deallocated (punched) as long as it reads back as zeroes.
    pub may_trim: bool,
    /// Fail with `ENOTSUP` instead of falling back to writing zero buffers, so the caller can
    /// choose a cheaper strategy (the NBD `FAST_ZERO` flag).
    pub fast_only: bool,
    /// Durable before returning (the NBD `FUA` flag).
    pub fua: bool,
}

/// One run of the allocation map, as reported by [`BlockDev::extents`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length of the run in bytes.
    pub len: u64,
    /// Not allocated on the medium.
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

impl Extent {
    /// A run of allocated data (neither a hole nor known zeroes).
    pub const fn data(len: u64) -> Self {
        Extent {
            len,
            hole: false,
            zero: false,
        }
    }
}

/// One read of a [`BlockDev::read_batch`].
#[derive(Debug)]
pub struct BatchRead<'a> {
    /// Filled from `offset`; a short read is an error, as for `read_at`.
    pub buf: &'a mut [u8],
    /// Where the read starts on the device.
    pub offset: u64,
    /// Set by the device when it served this read; `None`: left to the caller.
    pub result: Option<io::Result<()>>,
}

impl<'a> BatchRead<'a> {
    /// A read of `buf.len()` bytes at `offset`, not served yet.
    pub fn new(buf: &'a mut [u8], offset: u64) -> Self {
        BatchRead {
            buf,
            offset,
            result: None,
        }
    }
}

/// One write of a [`BlockDev::write_batch`].
#[derive(Debug)]
pub struct BatchWrite<'a> {
    /// Written at `offset`.
    pub buf: &'a [u8],
    /// Where the write starts on the device.
    pub offset: u64,
    /// Set by the device when it wrote this one; `None`: left to the caller.
    pub result: Option<io::Result<()>>,
}

impl<'a> BatchWrite<'a> {
    /// A write of `buf` at `offset`, not done yet.
    pub fn new(buf: &'a [u8], offset: u64) -> Self {
        BatchWrite {
            buf,
            offset,
            result: None,
        }
    }
}

/// A block device: a fixed-size array of bytes with durable writes on demand.
///
/// Implementations must be safe to call from many threads at once; overlapping concurrent writes
/// may land in either order (as on a disk). Callers keep requests within `info().size`; devices
/// still reject out-of-range requests with `EINVAL`/`ENOSPC` rather than trusting them.
///
/// Errors are `std::io::Error` so the errno survives all the way to the NBD reply.
pub trait BlockDev: Send + Sync {
    /// Its size, whether it is read-only, and what it can do.
    fn info(&self) -> &DevInfo;

    /// One line for logs and `--help` output, e.g. `file /var/lib/x.img (O_DIRECT)`.
    fn describe(&self) -> String;

    /// Fills `buf` from `offset`. Short reads are an error.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Most reads [`BlockDev::read_batch`] serves together to advantage (a device that submits
    /// them at once, e.g. through io_uring); 1, the default: it does not, and a caller holding
    /// several reads should call `read_at` for each, from as many threads as it wants them
    /// concurrent.
    fn read_batch_max(&self) -> usize {
        1
    }

    /// Serves the batch's reads together, as many as it can: each one served gets its `result`,
    /// the others are left `None` for the caller to read with `read_at` (the default serves
    /// none). A device may leave a read when serving it would wait for something slower or
    /// faster than the batch's other reads (a cache miss, bound for the backing store), and
    /// tells `leave` the places of the reads it leaves as soon as it knows (a cache: before it
    /// reads anything), so that the caller can have them read elsewhere meanwhile; each read
    /// left is named once.
    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        for i in 0..reads.len() {
            leave(&[i]);
        }
    }

    /// Writes all of `buf` at `offset`. With `fua`, the data is durable when this returns.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;

    /// Most writes [`BlockDev::write_batch`] takes together to advantage (a cache that appends
    /// them to its log as one batch and waits once); 1, the default: it does not, and a caller
    /// holding several writes should call `write_at` for each.
    fn write_batch_max(&self) -> usize {
        1
    }

    /// Writes the batch's writes together (none with FUA: each is done as `write_at(.., false)`
    /// would do it), as many as it can: each one written gets its `result`, the others are left
    /// `None` for the caller to write with `write_at` (the default writes none). A device takes
    /// only writes that cost the others nothing to wait for (a cache: whole blocks it logs;
    /// not one that reads what surrounds it, or writes to a slower store), so the caller should
    /// offer small writes aligned to `info().min_block`. Overlapping writes of one batch land
    /// in either order, as concurrent `write_at`s may.
    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        let _ = writes;
    }

    /// Writes the concatenation of `bufs` at `offset`, as one request where the device can (a
    /// log writer hands over a header and the data of many records without copying them
    /// together). Like `write_at`, it is not atomic: a crash may keep any part of it.
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut at = offset;
        for buf in bufs {
            self.write_at(buf, at, false)?;
            at += buf.len() as u64;
        }
        Ok(())
    }

    /// Makes every write that completed before this call durable.
    fn flush(&self) -> io::Result<()>;

    /// Hints that the range is no longer needed; its contents become unspecified.
    fn trim(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Makes the range read as zeroes.
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()>;

    /// Hints that the range will be read soon.
    fn prefetch(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    /// Appends the allocation map of `[offset, offset + len)` to `out`. It may stop early (the sum
    /// of lengths is at most `len` and at least one extent is reported), and must not report more
    /// than `max_extents` entries.
    fn extents(
        &self,
        _offset: u64,
        len: u64,
        _max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        out.push(Extent::data(len));
        Ok(())
    }
}

/// Checks that `[offset, offset + len)` lies inside a device of `size` bytes. Writes beyond the
/// end are `ENOSPC`, everything else `EINVAL`, as the NBD spec asks.
pub fn check_range(size: u64, offset: u64, len: u64, is_write: bool) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::from_raw_os_error(if is_write {
            libc::ENOSPC
        } else {
            libc::EINVAL
        })),
    }
}

/// Fills the range with zero buffers: the fallback when a device has no cheaper way to zero.
pub fn write_zero_buffers(dev: &dyn BlockDev, offset: u64, len: u64, fua: bool) -> io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let zeroes = crate::AlignedBuf::zeroed(CHUNK.min(len) as usize);
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done) as usize;
        dev.write_at(&zeroes[..n], offset + done, false)?;
        done += n as u64;
    }
    if fua {
        dev.flush()?;
    }
    Ok(())
}

/// Reads the blocks of `buf` (at `offset`, `block` bytes each) marked in `missing` from `dev`,
/// one request per run of them: what a memory tier does with the blocks it could not answer.
pub fn read_runs(
    dev: &dyn BlockDev,
    buf: &mut [u8],
    offset: u64,
    block: usize,
    missing: &[bool],
) -> io::Result<()> {
    let n = missing.len();
    let mut i = 0;
    while i < n {
        if !missing[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < n && missing[i] {
            i += 1;
        }
        dev.read_at(
            &mut buf[start * block..i * block],
            offset + (start * block) as u64,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_checks_use_the_specs_errno() {
        assert!(check_range(100, 0, 100, false).is_ok());
        assert!(check_range(100, 100, 0, true).is_ok());
        let e = check_range(100, 50, 51, true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let e = check_range(100, 50, 51, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        let e = check_range(100, u64::MAX, 2, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    }
}

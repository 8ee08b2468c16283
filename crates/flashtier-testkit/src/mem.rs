//! A device in RAM: for tests, fuzzing and examples, where a file would only add noise.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

use flashtier_io::{check_range, BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts};

/// A zero-filled device held in a `Vec`, trimming and zeroing quickly; writes are durable on
/// return (flush does nothing).
pub struct MemDev {
    info: DevInfo,
    data: RwLock<Vec<u8>>,
    /// Serves `read_batch` and `write_batch` (see [`MemDev::batching`]).
    batching: AtomicBool,
    batches: AtomicU64,
    batched_reads: AtomicU64,
    batched_writes: AtomicU64,
}

/// Most reads a batching [`MemDev`] serves in one `read_batch`, as a file's io_uring ring.
const MEM_READ_BATCH: usize = 32;
/// Most writes a batching [`MemDev`] takes in one `write_batch`, as a cache in write-back mode.
const MEM_WRITE_BATCH: usize = 8;

impl MemDev {
    /// A device of `size` bytes, all zero.
    pub fn new(size: usize) -> MemDev {
        MemDev {
            info: DevInfo {
                can_trim: true,
                can_fast_zero: true,
                ..DevInfo::basic(size as u64)
            },
            data: RwLock::new(vec![0; size]),
            batching: AtomicBool::new(false),
            batches: AtomicU64::new(0),
            batched_reads: AtomicU64::new(0),
            batched_writes: AtomicU64::new(0),
        }
    }

    /// The same device serving whole batches of reads (`read_batch`, up to [`MEM_READ_BATCH`]),
    /// as a file with io_uring does, and of writes (`write_batch`, up to [`MEM_WRITE_BATCH`], in
    /// order), as a write-back cache does, so that callers take their batched paths; it counts
    /// them.
    pub fn batching(self) -> MemDev {
        self.batching.store(true, Ordering::Relaxed);
        self
    }

    /// The `read_batch` calls served so far, and the reads in them.
    pub fn batches(&self) -> (u64, u64) {
        (
            self.batches.load(Ordering::Relaxed),
            self.batched_reads.load(Ordering::Relaxed),
        )
    }

    /// The writes taken in `write_batch` calls so far.
    pub fn batched_writes(&self) -> u64 {
        self.batched_writes.load(Ordering::Relaxed)
    }

    /// The same device refusing writes (`EPERM`), as a read-only export or disk would.
    pub fn read_only(mut self) -> MemDev {
        self.info.read_only = true;
        self
    }

    /// A copy of the whole contents.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.info.read_only {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        check_range(self.info.size, offset, len, true)?;
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        data[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

impl BlockDev for MemDev {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        format!("memory ({} bytes)", self.info.size)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, false)?;
        let data = self.data.read().unwrap_or_else(|e| e.into_inner());
        buf.copy_from_slice(&data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn read_batch_max(&self) -> usize {
        if self.batching.load(Ordering::Relaxed) {
            MEM_READ_BATCH
        } else {
            1
        }
    }

    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        if !self.batching.load(Ordering::Relaxed) {
            (0..reads.len()).for_each(|i| leave(&[i]));
            return;
        }
        self.batches.fetch_add(1, Ordering::Relaxed);
        for r in reads {
            self.batched_reads.fetch_add(1, Ordering::Relaxed);
            r.result = Some(self.read_at(r.buf, r.offset));
        }
    }

    fn write_batch_max(&self) -> usize {
        if self.batching.load(Ordering::Relaxed) {
            MEM_WRITE_BATCH
        } else {
            1
        }
    }

    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        if !self.batching.load(Ordering::Relaxed) {
            return;
        }
        for w in writes {
            self.batched_writes.fetch_add(1, Ordering::Relaxed);
            w.result = Some(self.write_at(w.buf, w.offset, false));
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        self.check_writable()?;
        check_range(self.info.size, offset, buf.len() as u64, true)?;
        let mut data = self.data.write().unwrap_or_else(|e| e.into_inner());
        data[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _opts: ZeroOpts) -> io::Result<()> {
        self.zero(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        _max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        out.push(Extent::data(len));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_a_device() {
        let dev = MemDev::new(8192);
        dev.write_at(b"abc", 10, false).unwrap();
        let mut b = [0u8; 3];
        dev.read_at(&mut b, 10).unwrap();
        assert_eq!(&b, b"abc");
        dev.write_zeroes(0, 4096, ZeroOpts::default()).unwrap();
        dev.read_at(&mut b, 10).unwrap();
        assert_eq!(b, [0, 0, 0]);
        assert_eq!(
            dev.write_at(b"x", 8192, false).unwrap_err().raw_os_error(),
            Some(libc::ENOSPC)
        );
        let ro = MemDev::new(10).read_only();
        assert_eq!(
            ro.write_at(b"x", 0, false).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
    }

    #[test]
    fn a_batching_device_takes_writes_in_order_and_fails_each_alone() {
        let plain = MemDev::new(8192);
        let mut w = [BatchWrite::new(b"abc", 0)];
        plain.write_batch(&mut w);
        assert!(w[0].result.is_none(), "a plain device leaves every write");
        assert_eq!(plain.write_batch_max(), 1);

        let dev = MemDev::new(8192).batching();
        let mut w = [
            BatchWrite::new(b"abc", 0),
            BatchWrite::new(b"x", 8192),
            BatchWrite::new(b"de", 1),
        ];
        dev.write_batch(&mut w);
        assert!(w[0].result.as_ref().unwrap().is_ok());
        assert_eq!(
            w[1].result
                .as_ref()
                .unwrap()
                .as_ref()
                .unwrap_err()
                .raw_os_error(),
            Some(libc::ENOSPC)
        );
        assert!(w[2].result.as_ref().unwrap().is_ok());
        let mut b = [0u8; 3];
        dev.read_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"ade", "written in the batch's order");
        assert_eq!(dev.batched_writes(), 3);
    }
}

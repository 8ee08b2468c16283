//! A device that behaves like a slow disk: one request at a time, each taking a fixed latency.
//! Used by `flashtier demo` and tests to show what a cache in front of slow storage does,
//! without needing an external slow device.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::dev::{BlockDev, DevInfo, Extent, ZeroOpts};

/// A device that serves one request at a time from `inner`, each after a fixed delay.
pub struct SlowDev {
    inner: Arc<dyn BlockDev>,
    latency: Duration,
    /// Serialises requests, like a single disk head.
    head: Mutex<()>,
}

impl SlowDev {
    /// Wraps `inner` so that every request takes `latency` more.
    pub fn new(inner: Arc<dyn BlockDev>, latency: Duration) -> SlowDev {
        SlowDev {
            inner,
            latency,
            head: Mutex::new(()),
        }
    }

    fn seek<T>(&self, op: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let _head = self.head.lock().unwrap_or_else(|e| e.into_inner());
        std::thread::sleep(self.latency);
        op()
    }
}

impl BlockDev for SlowDev {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }

    fn describe(&self) -> String {
        format!(
            "{} (slowed to {:?} per request)",
            self.inner.describe(),
            self.latency
        )
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.seek(|| self.inner.read_at(buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.seek(|| self.inner.write_at(buf, offset, fua))
    }

    fn flush(&self) -> io::Result<()> {
        self.seek(|| self.inner.flush())
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.seek(|| self.inner.trim(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.seek(|| self.inner.write_zeroes(offset, len, opts))
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.inner.extents(offset, len, max_extents, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{create_sparse_file, FileDev, FileOptions};
    use std::time::Instant;

    #[test]
    fn requests_take_their_latency_one_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.img");
        create_sparse_file(&path, 1 << 20).unwrap();
        let file = FileDev::open(&path, FileOptions::default()).unwrap();
        let dev = Arc::new(SlowDev::new(Arc::new(file), Duration::from_millis(5)));
        let start = Instant::now();
        std::thread::scope(|s| {
            for i in 0..4u64 {
                let dev = dev.clone();
                s.spawn(move || dev.write_at(&[1u8; 512], i * 512, false).unwrap());
            }
        });
        assert!(start.elapsed() >= Duration::from_millis(20));
        let mut b = [0u8; 512];
        dev.read_at(&mut b, 1024).unwrap();
        assert_eq!(b, [1u8; 512]);
    }
}

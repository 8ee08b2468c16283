//! [`Switchable`]: the exported device, which can be swapped at runtime between the cache and
//! the backing store (`flashtier detach` / `attach`) without disconnecting clients.
//!
//! Each request holds a shared lock for its whole duration; a swap takes it exclusively, so it
//! waits for every request in flight through the old device and no request starts on the old
//! device after the swap returns. That is what lets detach release the cache right after the
//! swap: nothing can still be reading its slots.

use std::io;
use std::sync::Arc;

use flashtier_io::{BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts};
use parking_lot::RwLock;

/// A device that forwards each request to whichever device it holds now (the cache, or the
/// backing store while none is attached), so detach and attach never disconnect a client.
pub struct Switchable {
    current: RwLock<Arc<dyn BlockDev>>,
    /// Fixed at start: clients negotiated with it. Size and read-only never change (the cache
    /// and its backing store agree on them); the rest are hints.
    info: DevInfo,
}

impl Switchable {
    /// Starts serving `dev`; its geometry (size, read-only, hints) is what clients see for good.
    pub fn new(dev: Arc<dyn BlockDev>) -> Switchable {
        Switchable {
            info: dev.info().clone(),
            current: RwLock::new(dev),
        }
    }

    /// Serves `dev` from now on, once the requests in flight on the previous device are done;
    /// returns the previous device.
    pub fn switch_to(&self, dev: Arc<dyn BlockDev>) -> Arc<dyn BlockDev> {
        debug_assert_eq!(dev.info().size, self.info.size);
        let mut current = self.current.write();
        std::mem::replace(&mut *current, dev)
    }

    /// The device served now.
    pub fn current(&self) -> Arc<dyn BlockDev> {
        self.current.read().clone()
    }
}

impl BlockDev for Switchable {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        self.current.read().describe()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.current.read().read_at(buf, offset)
    }

    fn read_batch_max(&self) -> usize {
        self.current.read().read_batch_max()
    }

    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        self.current.read().read_batch(reads, leave)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.current.read().write_at(buf, offset, fua)
    }

    fn write_batch_max(&self) -> usize {
        self.current.read().write_batch_max()
    }

    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        self.current.read().write_batch(writes)
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        self.current.read().write_vectored_at(bufs, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.current.read().flush()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.current.read().trim(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.current.read().write_zeroes(offset, len, opts)
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.current.read().prefetch(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.current.read().extents(offset, len, max_extents, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashtier_testkit::MemDev;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A device whose reads wait until the test lets them go.
    struct Parked {
        inner: MemDev,
        entered: mpsc::SyncSender<()>,
        release: parking_lot::Mutex<mpsc::Receiver<()>>,
    }

    impl BlockDev for Parked {
        fn info(&self) -> &DevInfo {
            self.inner.info()
        }
        fn describe(&self) -> String {
            "parked".into()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.entered.send(()).unwrap();
            self.release.lock().recv().unwrap();
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            self.inner.write_at(buf, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn trim(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, o: u64, l: u64, z: ZeroOpts) -> io::Result<()> {
            self.inner.write_zeroes(o, l, z)
        }
    }

    #[test]
    fn a_switch_waits_for_requests_in_flight_on_the_old_device() {
        let (entered_tx, entered) = mpsc::sync_channel(1);
        let (release, release_rx) = mpsc::channel();
        let old = Arc::new(Parked {
            inner: MemDev::new(1 << 20),
            entered: entered_tx,
            release: parking_lot::Mutex::new(release_rx),
        });
        old.write_at(&[1u8; 4096], 0, false).unwrap();
        let new = Arc::new(MemDev::new(1 << 20));
        new.write_at(&[2u8; 4096], 0, false).unwrap();
        let sw = Arc::new(Switchable::new(old));
        let reader = {
            let sw = sw.clone();
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                sw.read_at(&mut b, 0).unwrap();
                b[0]
            })
        };
        entered.recv().unwrap();
        let (done_tx, done) = mpsc::channel();
        let switcher = {
            let sw = sw.clone();
            std::thread::spawn(move || {
                sw.switch_to(new);
                done_tx.send(()).unwrap();
            })
        };
        assert!(
            done.recv_timeout(Duration::from_millis(200)).is_err(),
            "switched while a request was in flight on the old device"
        );
        release.send(()).unwrap();
        assert_eq!(reader.join().unwrap(), 1);
        done.recv().unwrap();
        switcher.join().unwrap();
        let mut b = [0u8; 4096];
        sw.read_at(&mut b, 0).unwrap();
        assert_eq!(b[0], 2);
    }
}

//! A device wrapper that injects I/O errors, for testing how the layers above handle a failing
//! disk.
//!
//! [`FaultDev`] forwards every request to an inner device unless one of its [`Fault`] rules says
//! the request fails, in which case it returns `EIO` (`io::Error::from_raw_os_error(libc::EIO)`).
//! Rules can be added and removed at any time through `&self`, so a test can arm a fault while
//! the code under test is running.
//!
//! Counting:
//! - **Write-like operations** are `write_at`, `write_vectored_at` (one per call, however many
//!   pieces it has), `trim` and `write_zeroes`, numbered from 1 over the device's life, failed ones
//!   included. A FUA write or zeroing counts as a write, not as a flush.
//! - **Flushes** are `flush` calls, numbered the same way.
//! - Reads (`read_at`) are counted too; `prefetch`, `extents`, `info` and `describe` are not.
//!
//! A failed write **does not reach the inner device**: the inner device holds exactly the writes
//! that returned `Ok` (plus, with concurrent requests, any that were already past the check when
//! a rule was armed — as on real hardware). The exception is [`WriteFailure::Torn`]: then the write
//! that *causes* a failure (the one a one-shot rule or a trigger hits) lands in part — the first
//! half, rounded down to whole 512-byte sectors — before `EIO` is returned, like a write cut short
//! by a surprise shutdown. Writes refused because the device is already dead, or by a persistent
//! rule after its first hit, or by [`Fault::FailWritesIn`], never land.
//!
//! A **dead** device ([`Fault::DieAtWrite`], [`Fault::DieAtFlush`], [`FaultDev::kill`]) fails
//! every request — reads, writes, flushes, trims, zeroing, prefetch, extents — until
//! [`FaultDev::clear`].

use std::fmt;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use flashtier_io::{BlockDev, DevInfo, Extent, ZeroOpts};

/// One fault rule. Numbers are 1-based positions in the device's life-long count of write-like
/// operations or flushes (see the [module docs](self)); use [`FaultDev::writes_seen`] or the
/// `fail_next_*` helpers to arm a fault relative to now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The `n`th write-like operation fails (once).
    FailWrite(u64),
    /// Every write-like operation from the `n`th on fails: the device can no longer write, but
    /// still reads and flushes.
    FailWritesFrom(u64),
    /// The `n`th flush fails (once).
    FailFlush(u64),
    /// Every flush from the `n`th on fails.
    FailFlushesFrom(u64),
    /// Reads overlapping `[offset, offset + len)` fail (a medium error).
    FailReads {
        /// First byte of the failing range.
        offset: u64,
        /// Length of the failing range, in bytes.
        len: u64,
    },
    /// Write-like operations overlapping `[offset, offset + len)` fail and never land.
    FailWritesIn {
        /// First byte of the failing range.
        offset: u64,
        /// Length of the failing range, in bytes.
        len: u64,
    },
    /// The first write-like operation numbered `n` or later fails and kills the device: it and
    /// every later request of any kind fail.
    DieAtWrite(u64),
    /// The first flush numbered `n` or later fails and kills the device.
    DieAtFlush(u64),
}

/// What a write that a rule fails leaves on the inner device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WriteFailure {
    /// Nothing: the inner device never sees the write.
    #[default]
    Clean,
    /// The write that causes a failure writes its first half (rounded down to 512-byte sectors,
    /// so a write under 1 KiB lands nothing) to the inner device, then fails.
    Torn,
}

/// Granularity of a torn write's landed prefix.
const TORN_UNIT: u64 = 512;

#[derive(Default)]
struct State {
    faults: Vec<Fault>,
    mode: WriteFailure,
    dead: bool,
    writes: u64,
    flushes: u64,
    reads: u64,
    injected: u64,
}

/// The decision for one request.
enum Verdict {
    Pass,
    Fail,
    /// Fail, after writing this many bytes from the start of the request.
    Tear(u64),
}

fn overlaps(a_off: u64, a_len: u64, b_off: u64, b_len: u64) -> bool {
    a_len > 0
        && b_len > 0
        && a_off < b_off.saturating_add(b_len)
        && b_off < a_off.saturating_add(a_len)
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

/// Wraps a device and fails its requests on demand; see the [module docs](self).
///
/// `D` can be a concrete device (`FaultDev<CrashDev>`, keeping typed access to it through
/// [`inner`](Self::inner)) or `dyn BlockDev` (the default).
pub struct FaultDev<D: BlockDev + ?Sized = dyn BlockDev> {
    inner: Arc<D>,
    state: Mutex<State>,
}

impl<D: BlockDev + ?Sized> FaultDev<D> {
    /// Wraps `inner` with no faults armed.
    pub fn new(inner: Arc<D>) -> Self {
        FaultDev {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    /// Builder form of [`add`](Self::add).
    pub fn with(self, fault: Fault) -> Self {
        self.add(fault);
        self
    }

    /// The wrapped device (to inspect or crash it; writing to it directly bypasses the faults).
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Arms a rule.
    pub fn add(&self, fault: Fault) {
        self.lock().faults.push(fault);
    }

    /// The armed rules.
    pub fn faults(&self) -> Vec<Fault> {
        self.lock().faults.clone()
    }

    /// Removes every rule and brings a dead device back to life (counters are kept).
    pub fn clear(&self) {
        let mut state = self.lock();
        state.faults.clear();
        state.dead = false;
    }

    /// Sets what a failed write leaves behind (`Clean` by default).
    pub fn set_write_failure(&self, mode: WriteFailure) {
        self.lock().mode = mode;
    }

    /// Fails the next write-like operation, once.
    pub fn fail_next_write(&self) {
        let mut state = self.lock();
        let n = state.writes + 1;
        state.faults.push(Fault::FailWrite(n));
    }

    /// Fails the next flush, once.
    pub fn fail_next_flush(&self) {
        let mut state = self.lock();
        let n = state.flushes + 1;
        state.faults.push(Fault::FailFlush(n));
    }

    /// Kills the device after `k` more write-like operations succeed: the next one after them
    /// fails (torn, in `Torn` mode) and so does everything after it.
    pub fn die_after_writes(&self, k: u64) {
        let mut state = self.lock();
        let n = state.writes + k + 1;
        state.faults.push(Fault::DieAtWrite(n));
    }

    /// Kills the device now: every request fails until [`clear`](Self::clear).
    pub fn kill(&self) {
        self.lock().dead = true;
    }

    /// Whether the device is dead (a `DieAt*` rule fired, or [`kill`](Self::kill)): every request
    /// fails until [`clear`](Self::clear).
    pub fn is_dead(&self) -> bool {
        self.lock().dead
    }

    /// Write-like operations seen so far, failed ones included.
    pub fn writes_seen(&self) -> u64 {
        self.lock().writes
    }

    /// Flushes seen so far, failed ones included.
    pub fn flushes_seen(&self) -> u64 {
        self.lock().flushes
    }

    /// Reads seen so far, failed ones included.
    pub fn reads_seen(&self) -> u64 {
        self.lock().reads
    }

    /// Requests failed by this wrapper so far (errors of the inner device not included).
    pub fn faults_injected(&self) -> u64 {
        self.lock().injected
    }

    fn judge_write(&self, offset: u64, len: u64) -> Verdict {
        let mut state = self.lock();
        state.writes += 1;
        let n = state.writes;
        if state.dead {
            state.injected += 1;
            return Verdict::Fail;
        }
        let (mut fail, mut cause) = (false, false);
        let mut die = false;
        for fault in &state.faults {
            match *fault {
                Fault::FailWrite(k) if n == k => (fail, cause) = (true, true),
                Fault::FailWritesFrom(k) if n >= k => {
                    fail = true;
                    cause |= n == k;
                }
                Fault::FailWritesIn { offset: o, len: l } if overlaps(offset, len, o, l) => {
                    fail = true
                }
                Fault::DieAtWrite(k) if n >= k => (fail, cause, die) = (true, true, true),
                _ => {}
            }
        }
        if die {
            state.dead = true;
        }
        if !fail {
            return Verdict::Pass;
        }
        state.injected += 1;
        if cause && state.mode == WriteFailure::Torn {
            Verdict::Tear(len / 2 / TORN_UNIT * TORN_UNIT)
        } else {
            Verdict::Fail
        }
    }

    fn judge_flush(&self) -> bool {
        let mut state = self.lock();
        state.flushes += 1;
        let n = state.flushes;
        let (mut fail, mut die) = (state.dead, false);
        for fault in &state.faults {
            match *fault {
                Fault::FailFlush(k) if n == k => fail = true,
                Fault::FailFlushesFrom(k) if n >= k => fail = true,
                Fault::DieAtFlush(k) if n >= k => (fail, die) = (true, true),
                _ => {}
            }
        }
        state.dead |= die;
        if fail {
            state.injected += 1;
        }
        !fail
    }

    fn judge_read(&self, offset: u64, len: u64) -> bool {
        let mut state = self.lock();
        state.reads += 1;
        let fail = state.dead
            || state.faults.iter().any(|f| {
                matches!(*f, Fault::FailReads { offset: o, len: l } if overlaps(offset, len, o, l))
            });
        if fail {
            state.injected += 1;
        }
        !fail
    }

    fn check_alive(&self) -> io::Result<()> {
        let mut state = self.lock();
        if state.dead {
            state.injected += 1;
            return Err(eio());
        }
        Ok(())
    }
}

impl<D: BlockDev + ?Sized> fmt::Debug for FaultDev<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("FaultDev")
            .field("inner", &self.inner.describe())
            .field("faults", &state.faults)
            .field("mode", &state.mode)
            .field("dead", &state.dead)
            .field("writes", &state.writes)
            .field("flushes", &state.flushes)
            .field("reads", &state.reads)
            .field("injected", &state.injected)
            .finish()
    }
}

impl<D: BlockDev + ?Sized> BlockDev for FaultDev<D> {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }

    fn describe(&self) -> String {
        format!("fault injection over {}", self.inner.describe())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if !self.judge_read(offset, buf.len() as u64) {
            return Err(eio());
        }
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        match self.judge_write(offset, buf.len() as u64) {
            Verdict::Pass => self.inner.write_at(buf, offset, fua),
            Verdict::Fail => Err(eio()),
            Verdict::Tear(n) => {
                if n > 0 {
                    self.inner.write_at(&buf[..n as usize], offset, fua)?;
                }
                Err(eio())
            }
        }
    }

    /// One write-like operation per call; a torn one writes the first half of the concatenation.
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        match self.judge_write(offset, len) {
            Verdict::Pass => self.inner.write_vectored_at(bufs, offset),
            Verdict::Fail => Err(eio()),
            Verdict::Tear(mut n) => {
                let mut head: Vec<&[u8]> = Vec::new();
                for b in bufs {
                    if n == 0 {
                        break;
                    }
                    let take = (b.len() as u64).min(n);
                    head.push(&b[..take as usize]);
                    n -= take;
                }
                if !head.is_empty() {
                    self.inner.write_vectored_at(&head, offset)?;
                }
                Err(eio())
            }
        }
    }

    fn flush(&self) -> io::Result<()> {
        if !self.judge_flush() {
            return Err(eio());
        }
        self.inner.flush()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.judge_write(offset, len) {
            Verdict::Pass => self.inner.trim(offset, len),
            Verdict::Fail => Err(eio()),
            Verdict::Tear(n) => {
                if n > 0 {
                    self.inner.trim(offset, n)?;
                }
                Err(eio())
            }
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        match self.judge_write(offset, len) {
            Verdict::Pass => self.inner.write_zeroes(offset, len, opts),
            Verdict::Fail => Err(eio()),
            Verdict::Tear(n) => {
                if n > 0 {
                    self.inner.write_zeroes(offset, n, opts)?;
                }
                Err(eio())
            }
        }
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_alive()?;
        self.inner.prefetch(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.check_alive()?;
        self.inner.extents(offset, len, max_extents, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDev;
    use crate::{CrashDev, CrashPolicy};

    fn mem(size: usize) -> FaultDev<MemDev> {
        FaultDev::new(Arc::new(MemDev::new(size)))
    }

    fn is_eio(r: io::Result<()>) -> bool {
        matches!(r, Err(e) if e.raw_os_error() == Some(libc::EIO))
    }

    #[test]
    fn passes_everything_through_without_faults() {
        let dev = mem(8192);
        assert_eq!(dev.info(), dev.inner().info());
        assert!(dev.describe().starts_with("fault injection over memory"));
        dev.write_at(b"abc", 10, true).unwrap();
        dev.write_vectored_at(&[b"de", b"f"], 13).unwrap();
        dev.flush().unwrap();
        let mut b = [0u8; 6];
        dev.read_at(&mut b, 10).unwrap();
        assert_eq!(&b, b"abcdef");
        dev.trim(0, 512).unwrap();
        dev.write_zeroes(512, 512, ZeroOpts::default()).unwrap();
        dev.prefetch(0, 10).unwrap();
        let mut out = Vec::new();
        dev.extents(0, 8192, 4, &mut out).unwrap();
        assert_eq!(
            (dev.writes_seen(), dev.flushes_seen(), dev.reads_seen()),
            (4, 1, 1)
        );
        assert_eq!(dev.faults_injected(), 0);
        // Inner errors come through unchanged and are not counted as injected.
        let e = dev.write_at(b"x", 8192, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(dev.faults_injected(), 0);
        assert!(format!("{dev:?}").contains("FaultDev"));
    }

    #[test]
    fn the_nth_write_fails_once_and_never_lands() {
        let dev = mem(8192).with(Fault::FailWrite(3));
        dev.write_at(&[1; 512], 0, false).unwrap();
        dev.trim(512, 512).unwrap();
        let before = dev.inner().snapshot();
        assert!(is_eio(dev.write_at(&[3; 2048], 1024, false)));
        assert_eq!(dev.inner().snapshot(), before);
        dev.write_at(&[4; 512], 1024, false).unwrap();
        assert_eq!((dev.writes_seen(), dev.faults_injected()), (4, 1));
        // Flushes and reads are unaffected.
        dev.flush().unwrap();
        let mut b = [0u8; 1];
        dev.read_at(&mut b, 1024).unwrap();
        assert_eq!(b[0], 4);
    }

    #[test]
    fn every_write_kind_counts() {
        let dev = mem(8192).with(Fault::FailWritesFrom(1));
        assert!(is_eio(dev.write_at(b"x", 0, false)));
        assert!(is_eio(dev.write_at(b"x", 0, true)));
        assert!(is_eio(dev.write_vectored_at(&[b"a", b"b"], 0)));
        assert!(is_eio(dev.trim(0, 512)));
        assert!(is_eio(dev.write_zeroes(0, 512, ZeroOpts::default())));
        assert_eq!(
            (dev.writes_seen(), dev.flushes_seen(), dev.faults_injected()),
            (5, 0, 5)
        );
        // A device that cannot write still reads and flushes.
        dev.flush().unwrap();
        let mut b = [0u8; 1];
        dev.read_at(&mut b, 0).unwrap();
        assert!(!dev.is_dead());
        assert_eq!(dev.inner().snapshot(), vec![0; 8192]);
    }

    #[test]
    fn writes_fail_from_the_nth_on() {
        let dev = mem(4096).with(Fault::FailWritesFrom(2));
        dev.write_at(b"a", 0, false).unwrap();
        for _ in 0..5 {
            assert!(is_eio(dev.write_at(b"b", 1, false)));
        }
        assert_eq!(dev.faults_injected(), 5);
        dev.clear();
        dev.write_at(b"c", 2, false).unwrap();
        assert_eq!(&dev.inner().snapshot()[..3], b"a\0c");
    }

    #[test]
    fn flush_faults() {
        let dev = mem(4096).with(Fault::FailFlush(2));
        dev.flush().unwrap();
        assert!(is_eio(dev.flush()));
        dev.flush().unwrap();
        dev.add(Fault::FailFlushesFrom(5));
        dev.flush().unwrap();
        assert!(is_eio(dev.flush()));
        assert!(is_eio(dev.flush()));
        dev.write_at(b"x", 0, false).unwrap();
        assert_eq!(
            (dev.flushes_seen(), dev.writes_seen(), dev.faults_injected()),
            (6, 1, 3)
        );
        dev.fail_next_flush();
        assert_eq!(dev.faults().last(), Some(&Fault::FailFlush(7)));
    }

    #[test]
    fn reads_fail_in_a_range() {
        let dev = mem(8192).with(Fault::FailReads {
            offset: 4096,
            len: 512,
        });
        let mut b = [0u8; 512];
        dev.read_at(&mut b, 0).unwrap();
        dev.read_at(&mut b, 3584).unwrap(); // ends right where the bad range starts
        dev.read_at(&mut b, 4608).unwrap(); // starts right where it ends
        assert!(is_eio(dev.read_at(&mut b, 4000)));
        assert!(is_eio(dev.read_at(&mut b, 4500)));
        let mut big = vec![0u8; 8192];
        assert!(is_eio(dev.read_at(&mut big, 0)));
        dev.read_at(&mut [], 4096).unwrap(); // empty reads touch nothing
        assert_eq!((dev.reads_seen(), dev.faults_injected()), (7, 3));
        // Writes there are fine.
        dev.write_at(&b[..], 4096, false).unwrap();
    }

    #[test]
    fn writes_fail_in_a_range_without_landing() {
        let dev = mem(8192).with(Fault::FailWritesIn {
            offset: 1024,
            len: 1024,
        });
        dev.set_write_failure(WriteFailure::Torn); // a bad region never tears
        dev.write_at(&[1; 1024], 0, false).unwrap();
        assert!(is_eio(dev.write_at(&[2; 2048], 512, false)));
        assert!(is_eio(dev.write_zeroes(2047, 1, ZeroOpts::default())));
        dev.write_at(&[3; 1024], 2048, false).unwrap();
        let img = dev.inner().snapshot();
        assert_eq!(&img[..1024], &[1; 1024]);
        assert_eq!(&img[1024..2048], &[0; 1024]);
        assert_eq!(&img[2048..3072], &[3; 1024]);
    }

    #[test]
    fn a_dead_device_fails_everything_until_cleared() {
        let dev = mem(4096).with(Fault::DieAtWrite(2));
        dev.write_at(b"a", 0, false).unwrap();
        assert!(!dev.is_dead());
        assert!(is_eio(dev.write_at(b"b", 1, false)));
        assert!(dev.is_dead());
        let mut b = [0u8; 1];
        assert!(is_eio(dev.read_at(&mut b, 0)));
        assert!(is_eio(dev.flush()));
        assert!(is_eio(dev.trim(0, 1)));
        assert!(is_eio(dev.write_zeroes(0, 1, ZeroOpts::default())));
        assert!(is_eio(dev.prefetch(0, 1)));
        assert!(is_eio(dev.extents(0, 1, 1, &mut Vec::new())));
        assert_eq!(dev.faults_injected(), 7);
        assert_eq!(&dev.inner().snapshot()[..2], b"a\0");
        dev.clear();
        assert!(!dev.is_dead());
        dev.read_at(&mut b, 0).unwrap();
        dev.write_at(b"c", 1, false).unwrap();

        let dev = mem(4096).with(Fault::DieAtFlush(1));
        dev.write_at(b"a", 0, false).unwrap();
        assert!(is_eio(dev.flush()));
        assert!(dev.is_dead());
        assert!(is_eio(dev.write_at(b"a", 0, false)));

        let dev = mem(4096);
        dev.kill();
        assert!(is_eio(dev.write_at(b"a", 0, false)));
        assert_eq!(dev.inner().snapshot(), vec![0; 4096]);
    }

    #[test]
    fn a_late_trigger_fires_on_the_next_write() {
        let dev = mem(4096);
        for _ in 0..5 {
            dev.write_at(b"a", 0, false).unwrap();
        }
        dev.add(Fault::DieAtWrite(2));
        assert!(is_eio(dev.write_at(b"b", 0, false)));
        assert!(dev.is_dead());
    }

    #[test]
    fn relative_arming_helpers() {
        let dev = mem(4096);
        dev.write_at(b"a", 0, false).unwrap();
        dev.fail_next_write();
        assert!(is_eio(dev.write_at(b"b", 0, false)));
        dev.write_at(b"c", 0, false).unwrap();
        dev.die_after_writes(2);
        dev.write_at(b"d", 0, false).unwrap();
        dev.write_at(b"e", 0, false).unwrap();
        assert!(is_eio(dev.write_at(b"f", 0, false)));
        assert!(dev.is_dead());
        assert_eq!(dev.inner().snapshot()[0], b'e');
    }

    #[test]
    fn torn_failures_land_the_first_half_of_the_causing_write_only() {
        let dev = mem(1 << 16).with(Fault::FailWritesFrom(1));
        dev.set_write_failure(WriteFailure::Torn);
        assert!(is_eio(dev.write_at(&[1; 4096], 0, false)));
        assert!(is_eio(dev.write_at(&[2; 4096], 8192, false))); // already failing: clean
        let img = dev.inner().snapshot();
        assert_eq!(&img[..2048], &[1; 2048]);
        assert_eq!(&img[2048..4096], &[0; 2048]);
        assert_eq!(&img[8192..12288], &[0; 4096]);

        // Rounded down to whole sectors: 3000 bytes -> 1024 land; under 1 KiB nothing.
        let dev = mem(1 << 16);
        dev.set_write_failure(WriteFailure::Torn);
        dev.fail_next_write();
        assert!(is_eio(dev.write_at(&[5; 3000], 0, false)));
        dev.fail_next_write();
        assert!(is_eio(dev.write_at(&[6; 1000], 4096, false)));
        let img = dev.inner().snapshot();
        assert_eq!(&img[..1024], &[5; 1024]);
        assert_eq!(img[1024], 0);
        assert_eq!(img[4096], 0);

        // Zeroing and trimming tear the same way.
        let dev = FaultDev::new(Arc::new(CrashDev::from_image(vec![9; 8192])));
        dev.set_write_failure(WriteFailure::Torn);
        dev.fail_next_write();
        assert!(is_eio(dev.write_zeroes(0, 4096, ZeroOpts::default())));
        dev.fail_next_write();
        assert!(is_eio(dev.trim(4096, 2048)));
        let view = dev.inner().view();
        assert_eq!(&view[..2048], &[0; 2048]);
        assert_eq!(&view[2048..4096], &[9; 2048]);
        assert_eq!(&view[4096..5120], &[0; 1024]);
        assert_eq!(&view[5120..], &[9; 3072]);

        // A device dying mid-write: the write that kills it is torn, later ones are not.
        let dev = mem(1 << 16).with(Fault::DieAtWrite(1));
        dev.set_write_failure(WriteFailure::Torn);
        assert!(is_eio(dev.write_at(&[7; 2048], 0, false)));
        assert!(is_eio(dev.write_at(&[8; 2048], 4096, false)));
        let img = dev.inner().snapshot();
        assert_eq!(&img[..1024], &[7; 1024]);
        assert_eq!(&img[1024..2048], &[0; 1024]);
        assert_eq!(&img[4096..6144], &[0; 2048]);
    }

    #[test]
    fn vectored_writes_count_once_and_tear_across_pieces() {
        let dev = mem(1 << 16);
        dev.write_vectored_at(&[&[1; 512], &[2; 512], &[3; 512]], 0)
            .unwrap();
        assert_eq!(dev.writes_seen(), 1);
        dev.set_write_failure(WriteFailure::Torn);
        dev.fail_next_write();
        assert!(is_eio(
            dev.write_vectored_at(&[&[4; 1000], &[5; 1000], &[6; 2096]], 4096)
        ));
        assert_eq!(dev.writes_seen(), 2);
        let img = dev.inner().snapshot();
        assert_eq!(&img[4096..5096], &[4; 1000]);
        assert_eq!(&img[5096..6096], &[5; 1000]);
        assert_eq!(&img[6096..6144], &[6; 48]); // 2048 bytes in all
        assert_eq!(img[6144], 0);
    }

    #[test]
    fn arming_from_another_thread_mid_run() {
        let dev: Arc<FaultDev> = Arc::new(FaultDev::new(Arc::new(MemDev::new(1 << 20))));
        let worker = {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let mut ok = 0u64;
                for i in 0..u64::MAX {
                    if dev.write_at(&[1; 512], (i % 2048) * 512, false).is_err() {
                        return ok;
                    }
                    ok += 1;
                }
                ok
            })
        };
        while dev.writes_seen() < 100 {
            std::thread::yield_now();
        }
        dev.add(Fault::FailWritesFrom(0));
        let ok = worker.join().unwrap();
        assert_eq!(dev.writes_seen(), ok + 1);
        assert_eq!(dev.faults_injected(), 1);
    }

    #[test]
    fn over_a_crash_dev_the_failed_write_is_not_there_after_power_loss() {
        let crash = Arc::new(CrashDev::new(1 << 16));
        let dev = FaultDev::new(crash.clone()).with(Fault::DieAtWrite(3));
        dev.write_at(&[1; 512], 0, false).unwrap();
        dev.flush().unwrap();
        dev.write_at(&[2; 512], 512, true).unwrap();
        assert!(is_eio(dev.write_at(&[3; 512], 1024, false)));
        assert!(is_eio(dev.flush()));
        assert_eq!(crash.writes_issued(), 2);
        for seed in 0..10 {
            let img = crash.crash(seed, CrashPolicy::random()).view();
            assert_eq!(&img[..512], &[1; 512]);
            assert_eq!(&img[512..1024], &[2; 512]);
            assert_eq!(&img[1024..1536], &[0; 512]);
        }
    }
}

//! A RAM device with a volatile write cache, so a test can cut the power at any instant.
//!
//! [`CrashDev`] models a disk the way the durability contract talks about one:
//!
//! - There is a **durable image** (what survives power loss) and an **ordered log** of the writes
//!   issued since the last completed `flush`. Reads see the latest view: the durable image with
//!   every logged write applied in order, as a disk's cache would serve them.
//! - `flush` makes every logged write durable and empties the log.
//! - A **FUA** write (`write_at(.., fua = true)`, `write_zeroes` with `opts.fua`) is durable on
//!   return, but only that write: it is logged with a `durable` flag and the writes issued before
//!   it stay volatile. (When the log is empty it goes straight into the durable image.)
//! - `trim` and `write_zeroes` are writes of zeroes: after a power loss they may or may not have
//!   happened, like any other unflushed write. (Only their length is stored.)
//! - [`CrashDev::crash`] computes what a power loss *now* could leave: the durable image, then the
//!   log in order, applying every durable write whole and each volatile write kept whole, dropped
//!   or torn (a random subset of its sectors lands), as [`CrashPolicy`] says, and deterministic for
//!   a given seed. Per sector, the latest write that was kept wins, so a kept earlier write never
//!   undoes a later FUA write, and a FUA write's data is present unless a later kept write
//!   overwrote it. The result is a new `CrashDev` with that image and an empty log: the device as
//!   it comes back after the power is restored.
//!
//! Tearing is per sector ([`CrashPolicy::sector`], 512 bytes unless set): sectors are aligned to
//! the device, each one of a write lands whole or not at all, so a write that fits in one aligned
//! sector is never torn, and a longer or unaligned one may be.
//!
//! A vectored write is one request of many pieces; each piece is logged as a separate write and
//! so may be kept, dropped or torn independently (`write_vectored_at` is not atomic).
//!
//! The whole state sits behind one mutex: every call is atomic with respect to `crash`, which
//! therefore sees the state between two calls, as a power loss between two completions would.
//! [`CrashDev::cut_power`] also makes the device fail every later request with `EIO`, so threads
//! still running against it stop changing it (and see what a dead disk answers).

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::sync::{Mutex, MutexGuard};

use flashtier_io::{check_range, BlockDev, DevInfo, Extent, ZeroOpts};

/// The default tearing unit: a 512-byte sector.
pub const SECTOR: u32 = 512;

/// What a power loss does to each volatile (unflushed, non-FUA) write: kept whole with
/// probability `keep`, torn with probability `tear`, dropped otherwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrashPolicy {
    /// Probability that a volatile write lands whole.
    pub keep: f64,
    /// Probability that a volatile write is torn: a random subset of its sectors lands. A write of
    /// two or more sectors torn this way always keeps some sectors and loses others; a write
    /// within one sector is kept or dropped, at even odds.
    pub tear: f64,
    /// Tearing unit in bytes, aligned to the device (a power of two; 512 by default). Use the
    /// device's atomic write unit, e.g. 4096 to model a disk that never tears a 4 KiB block.
    pub sector: u32,
}

impl CrashPolicy {
    /// Keeps each volatile write with probability `keep`, tears it with probability `tear`,
    /// drops it otherwise. Panics unless both are in `[0, 1]` and `keep + tear <= 1`.
    pub fn new(keep: f64, tear: f64) -> CrashPolicy {
        let policy = CrashPolicy {
            keep,
            tear,
            sector: SECTOR,
        };
        policy.validate();
        policy
    }

    /// Every volatile write is lost: the crash image is [`CrashDev::snapshot_durable`].
    pub const fn drop_all() -> CrashPolicy {
        CrashPolicy {
            keep: 0.0,
            tear: 0.0,
            sector: SECTOR,
        }
    }

    /// Every volatile write lands: the crash image is [`CrashDev::view`].
    pub const fn keep_all() -> CrashPolicy {
        CrashPolicy {
            keep: 1.0,
            tear: 0.0,
            sector: SECTOR,
        }
    }

    /// Every volatile write is torn (the harshest policy for multi-sector writes).
    pub const fn tear_all() -> CrashPolicy {
        CrashPolicy {
            keep: 0.0,
            tear: 1.0,
            sector: SECTOR,
        }
    }

    /// Keep, tear and drop with a third of the probability each.
    pub const fn random() -> CrashPolicy {
        CrashPolicy {
            keep: 1.0 / 3.0,
            tear: 1.0 / 3.0,
            sector: SECTOR,
        }
    }

    /// The same policy with another tearing unit (a power of two).
    pub fn with_sector(mut self, sector: u32) -> CrashPolicy {
        self.sector = sector;
        self.validate();
        self
    }

    fn validate(&self) {
        assert!(
            (0.0..=1.0).contains(&self.keep)
                && (0.0..=1.0).contains(&self.tear)
                && self.keep + self.tear <= 1.0 + 1e-9,
            "invalid crash policy {self:?}: keep and tear are probabilities summing to at most 1"
        );
        assert!(
            self.sector.is_power_of_two(),
            "invalid crash policy {self:?}: the sector size must be a power of two"
        );
    }
}

impl Default for CrashPolicy {
    fn default() -> Self {
        CrashPolicy::random()
    }
}

/// A write in the log: the bytes written, or a run of zeroes (trim, write_zeroes).
enum Data {
    Bytes(Box<[u8]>),
    Zeroes(u64),
}

struct Write {
    offset: u64,
    data: Data,
    /// FUA: durable since it completed, whatever happens to the writes around it.
    durable: bool,
}

impl Write {
    fn len(&self) -> u64 {
        match &self.data {
            Data::Bytes(b) => b.len() as u64,
            Data::Zeroes(n) => *n,
        }
    }

    fn end(&self) -> u64 {
        self.offset + self.len()
    }

    /// Applies the part of the write within `[from, to)` (absolute device offsets, inside the
    /// write) to `image`.
    fn apply_range(&self, image: &mut [u8], from: u64, to: u64) {
        debug_assert!(self.offset <= from && from <= to && to <= self.end());
        let dst = &mut image[from as usize..to as usize];
        match &self.data {
            Data::Bytes(b) => {
                let at = (from - self.offset) as usize;
                dst.copy_from_slice(&b[at..at + dst.len()]);
            }
            Data::Zeroes(_) => dst.fill(0),
        }
    }

    fn apply(&self, image: &mut [u8]) {
        self.apply_range(image, self.offset, self.end());
    }
}

struct State {
    /// What survives a power loss, ignoring the log.
    durable: Vec<u8>,
    /// `durable` with every logged write applied: what reads return.
    view: Vec<u8>,
    /// Writes since the last flush, in completion order. Its first entry is never durable
    /// (a durable write issued with an empty log goes straight into `durable`).
    log: VecDeque<Write>,
    /// Entries of `log` that are not durable.
    volatile: usize,
    writes_issued: u64,
    flushes: u64,
    powered_off: bool,
}

impl State {
    fn push(&mut self, write: Write) {
        if write.len() == 0 {
            return;
        }
        write.apply(&mut self.view);
        if write.durable && self.log.is_empty() {
            write.apply(&mut self.durable);
        } else {
            if !write.durable {
                self.volatile += 1;
            }
            self.log.push_back(write);
        }
    }

    /// The image a power loss now could leave, with `fate` deciding each volatile write.
    fn image(&self, mut fate: impl FnMut(&Write) -> Fate) -> Vec<u8> {
        let mut image = self.durable.clone();
        for w in &self.log {
            if w.durable {
                w.apply(&mut image);
                continue;
            }
            match fate(w) {
                Fate::Keep => w.apply(&mut image),
                Fate::Drop => {}
                Fate::Torn(sectors) => {
                    for (from, to) in sectors {
                        w.apply_range(&mut image, from, to);
                    }
                }
            }
        }
        image
    }
}

enum Fate {
    Keep,
    Drop,
    /// The byte ranges that land.
    Torn(Vec<(u64, u64)>),
}

/// A small deterministic PRNG (splitmix64): crash images must be reproducible from a seed.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Splits `[offset, end)` at multiples of `sector`.
fn sectors(offset: u64, end: u64, sector: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = offset;
    while at < end {
        let next = ((at / sector) + 1) * sector;
        let to = next.min(end);
        out.push((at, to));
        at = to;
    }
    out
}

/// Draws the fate of one volatile write.
fn draw(rng: &mut SplitMix64, policy: &CrashPolicy, w: &Write) -> Fate {
    let r = rng.unit();
    if r < policy.keep {
        return Fate::Keep;
    }
    if r >= policy.keep + policy.tear {
        return Fate::Drop;
    }
    let pieces = sectors(w.offset, w.end(), policy.sector as u64);
    let mut land: Vec<bool> = pieces.iter().map(|_| rng.next_u64() & 1 == 1).collect();
    if land.len() >= 2 && (land.iter().all(|&l| l) || land.iter().all(|&l| !l)) {
        // A tear keeps some sectors and loses others: flip one so it really is partial.
        let i = rng.below(land.len());
        land[i] = !land[i];
    }
    Fate::Torn(
        pieces
            .into_iter()
            .zip(land)
            .filter_map(|(piece, l)| l.then_some(piece))
            .collect(),
    )
}

/// A RAM device with a volatile write cache that can lose power; see the [module docs](self).
pub struct CrashDev {
    info: DevInfo,
    state: Mutex<State>,
}

impl CrashDev {
    /// A zero-filled device of `size` bytes, everything durable.
    pub fn new(size: usize) -> CrashDev {
        CrashDev::from_image(vec![0; size])
    }

    /// A device whose durable contents are `image` (and nothing is pending).
    pub fn from_image(image: Vec<u8>) -> CrashDev {
        CrashDev {
            info: DevInfo {
                min_block: SECTOR,
                can_flush: true,
                native_fua: true,
                can_trim: true,
                can_fast_zero: true,
                ..DevInfo::basic(image.len() as u64)
            },
            state: Mutex::new(State {
                view: image.clone(),
                durable: image,
                log: VecDeque::new(),
                volatile: 0,
                writes_issued: 0,
                flushes: 0,
                powered_off: false,
            }),
        }
    }

    /// The same device, refusing writes, trims and zeroing with `EPERM`.
    pub fn read_only(mut self) -> CrashDev {
        self.info.read_only = true;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The contents a power loss now is guaranteed to leave: the durable image plus every FUA
    /// write since the last flush, none of the volatile writes (= `crash` with `drop_all`).
    pub fn snapshot_durable(&self) -> Vec<u8> {
        self.lock().image(|_| Fate::Drop)
    }

    /// The contents reads return now (= `crash` with `keep_all`).
    pub fn view(&self) -> Vec<u8> {
        self.lock().view.clone()
    }

    /// Writes that a power loss now could lose: neither flushed nor FUA. A vectored write counts
    /// once per non-empty piece; empty writes are not logged.
    pub fn pending_writes(&self) -> usize {
        self.lock().volatile
    }

    /// Write-like calls accepted so far: `write_at`, `write_vectored_at` (one per call), `trim`,
    /// `write_zeroes`. Calls rejected (range, read-only, powered off) are not counted.
    pub fn writes_issued(&self) -> u64 {
        self.lock().writes_issued
    }

    /// Completed `flush` calls.
    pub fn flushes(&self) -> u64 {
        self.lock().flushes
    }

    /// The image a power loss now could leave, drawn from `policy` with `seed` (the same seed,
    /// policy and log always give the same image).
    pub fn crash_image(&self, seed: u64, policy: CrashPolicy) -> Vec<u8> {
        policy.validate();
        let mut rng = SplitMix64(seed);
        self.lock().image(|w| draw(&mut rng, &policy, w))
    }

    /// The device as it comes back after a power loss now: a new `CrashDev` (same size and
    /// read-only flag, fresh counters, nothing pending, powered on) whose contents are
    /// [`crash_image`](Self::crash_image). This device is unaffected and keeps running.
    pub fn crash(&self, seed: u64, policy: CrashPolicy) -> CrashDev {
        self.successor(self.crash_image(seed, policy))
    }

    /// Like [`crash`](Self::crash), but the power loss happens on this device too: atomically with
    /// taking the image, this device starts failing every request with `EIO` (see
    /// [`power_off`](Self::power_off)), so threads still using it cannot change it any more.
    pub fn cut_power(&self, seed: u64, policy: CrashPolicy) -> CrashDev {
        policy.validate();
        let mut rng = SplitMix64(seed);
        let image = {
            let mut state = self.lock();
            state.powered_off = true;
            state.image(|w| draw(&mut rng, &policy, w))
        };
        self.successor(image)
    }

    /// A power loss that keeps exactly the first `n` volatile writes (whole) and drops the rest;
    /// FUA writes are kept as always. For enumerating every prefix of the log: `n` from 0 to
    /// `pending_writes()`.
    pub fn crash_prefix(&self, n: usize) -> CrashDev {
        let mut seen = 0;
        let image = self.lock().image(|_| {
            seen += 1;
            if seen <= n {
                Fate::Keep
            } else {
                Fate::Drop
            }
        });
        self.successor(image)
    }

    /// From now on every request (reads included) fails with `EIO`; the state is frozen and the
    /// inspection methods (`view`, `crash`, ...) keep working.
    pub fn power_off(&self) {
        self.lock().powered_off = true;
    }

    /// Whether the power was cut ([`power_off`](Self::power_off), [`cut_power`](Self::cut_power)):
    /// requests fail, inspection still works.
    pub fn is_powered_off(&self) -> bool {
        self.lock().powered_off
    }

    fn successor(&self, image: Vec<u8>) -> CrashDev {
        let dev = CrashDev::from_image(image);
        if self.info.read_only {
            dev.read_only()
        } else {
            dev
        }
    }

    /// Locks the state for a write of `len` bytes at `offset`, after the checks every write does.
    fn lock_for_write(&self, offset: u64, len: u64) -> io::Result<MutexGuard<'_, State>> {
        if self.info.read_only {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        check_range(self.info.size, offset, len, true)?;
        let mut state = self.lock();
        if state.powered_off {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        state.writes_issued += 1;
        Ok(state)
    }

    fn zero(&self, offset: u64, len: u64, durable: bool) -> io::Result<()> {
        let mut state = self.lock_for_write(offset, len)?;
        state.push(Write {
            offset,
            data: Data::Zeroes(len),
            durable,
        });
        Ok(())
    }

    fn check_powered(&self) -> io::Result<MutexGuard<'_, State>> {
        let state = self.lock();
        if state.powered_off {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(state)
    }
}

impl fmt::Debug for CrashDev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("CrashDev")
            .field("size", &self.info.size)
            .field("logged", &state.log.len())
            .field("volatile", &state.volatile)
            .field("writes_issued", &state.writes_issued)
            .field("flushes", &state.flushes)
            .field("powered_off", &state.powered_off)
            .finish()
    }
}

impl BlockDev for CrashDev {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        format!("crash-test memory ({} bytes)", self.info.size)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.info.size, offset, buf.len() as u64, false)?;
        let state = self.check_powered()?;
        buf.copy_from_slice(&state.view[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let mut state = self.lock_for_write(offset, buf.len() as u64)?;
        state.push(Write {
            offset,
            data: Data::Bytes(buf.into()),
            durable: fua,
        });
        Ok(())
    }

    /// Checks the whole range first, then logs each piece as a separate volatile write.
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let total = bufs
            .iter()
            .try_fold(0u64, |n, b| n.checked_add(b.len() as u64))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut state = self.lock_for_write(offset, total)?;
        let mut at = offset;
        for buf in bufs {
            state.push(Write {
                offset: at,
                data: Data::Bytes((*buf).into()),
                durable: false,
            });
            at += buf.len() as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let mut state = self.check_powered()?;
        let state = &mut *state;
        for w in state.log.drain(..) {
            w.apply(&mut state.durable);
        }
        state.volatile = 0;
        state.flushes += 1;
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero(offset, len, false)
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.zero(offset, len, opts.fua)
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        self.check_powered().map(drop)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        _max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range(self.info.size, offset, len, false)?;
        drop(self.check_powered()?);
        out.push(Extent::data(len));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn read(dev: &CrashDev, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        dev.read_at(&mut buf, offset).unwrap();
        buf
    }

    #[test]
    fn is_send_sync_and_describes_itself() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CrashDev>();
        let dev = CrashDev::new(4096);
        let info = dev.info();
        assert_eq!(info.size, 4096);
        assert_eq!(info.min_block, 512);
        assert!(info.can_flush && info.native_fua && info.can_trim && info.can_fast_zero);
        assert!(!info.read_only);
        assert!(dev.describe().contains("4096"));
        assert!(format!("{dev:?}").contains("CrashDev"));
    }

    #[test]
    fn reads_see_the_latest_view_and_flush_makes_it_durable() {
        let dev = CrashDev::new(8192);
        dev.write_at(b"hello", 100, false).unwrap();
        dev.write_at(b"J", 100, false).unwrap();
        assert_eq!(read(&dev, 100, 5), b"Jello");
        assert_eq!(dev.pending_writes(), 2);
        assert_eq!(dev.writes_issued(), 2);
        assert_eq!(&dev.snapshot_durable()[100..105], &[0; 5]);
        assert_eq!(&dev.view()[100..105], b"Jello");

        let lost = dev.crash(1, CrashPolicy::drop_all());
        assert_eq!(read(&lost, 100, 5), [0; 5]);
        let kept = dev.crash(1, CrashPolicy::keep_all());
        assert_eq!(read(&kept, 100, 5), b"Jello");

        dev.flush().unwrap();
        assert_eq!(dev.flushes(), 1);
        assert_eq!(dev.pending_writes(), 0);
        assert_eq!(dev.snapshot_durable(), dev.view());
        for seed in 0..20 {
            let after = dev.crash(seed, CrashPolicy::random());
            assert_eq!(read(&after, 100, 5), b"Jello");
        }
    }

    #[test]
    fn fua_is_durable_alone_and_never_undone_by_earlier_writes() {
        let dev = CrashDev::new(8192);
        dev.write_at(&[b'a'; 1024], 0, false).unwrap(); // volatile, sectors 0-1
        dev.write_at(&[b'b'; 512], 512, true).unwrap(); // FUA over sector 1
        dev.write_at(&[b'c'; 512], 2048, false).unwrap(); // volatile, later
        assert_eq!(dev.pending_writes(), 2);
        let durable = dev.snapshot_durable();
        assert_eq!(&durable[..512], &[0; 512]);
        assert_eq!(&durable[512..1024], &[b'b'; 512]);
        assert_eq!(&durable[2048..2560], &[0; 512]);
        for policy in [
            CrashPolicy::drop_all(),
            CrashPolicy::keep_all(),
            CrashPolicy::tear_all(),
            CrashPolicy::random(),
        ] {
            for seed in 0..50 {
                let img = dev.crash_image(seed, policy);
                assert_eq!(&img[512..1024], &[b'b'; 512], "{policy:?} seed {seed}");
                assert!(img[..512] == [0; 512] || img[..512] == [b'a'; 512]);
            }
        }
        // A later volatile write over FUA data may or may not win.
        dev.write_at(&[b'd'; 512], 512, false).unwrap();
        assert_eq!(
            &dev.crash_image(0, CrashPolicy::keep_all())[512..1024],
            &[b'd'; 512]
        );
        assert_eq!(
            &dev.crash_image(0, CrashPolicy::drop_all())[512..1024],
            &[b'b'; 512]
        );
    }

    #[test]
    fn fua_with_nothing_pending_goes_straight_to_the_durable_image() {
        let dev = CrashDev::new(4096);
        dev.write_at(b"x", 0, true).unwrap();
        dev.write_zeroes(
            1024,
            512,
            ZeroOpts {
                fua: true,
                ..ZeroOpts::default()
            },
        )
        .unwrap();
        assert_eq!(dev.pending_writes(), 0);
        assert_eq!(dev.lock().log.len(), 0);
        assert_eq!(dev.crash_image(3, CrashPolicy::drop_all())[0], b'x');
    }

    #[test]
    fn trim_and_zeroes_are_volatile_zero_writes() {
        let dev = CrashDev::from_image(vec![0xff; 4096]);
        dev.trim(0, 512).unwrap();
        dev.write_zeroes(512, 512, ZeroOpts::default()).unwrap();
        dev.write_zeroes(
            1024,
            512,
            ZeroOpts {
                fua: true,
                ..ZeroOpts::default()
            },
        )
        .unwrap();
        assert_eq!(dev.writes_issued(), 3);
        assert_eq!(dev.pending_writes(), 2);
        assert_eq!(read(&dev, 0, 1536), vec![0; 1536]);
        let img = dev.crash_image(0, CrashPolicy::drop_all());
        assert_eq!(&img[..1024], &[0xff; 1024]);
        assert_eq!(&img[1024..1536], &[0; 512]);
        assert_eq!(&img[1536..], &[0xff; 2560]);
        assert_eq!(dev.crash_image(0, CrashPolicy::keep_all()), dev.view());
    }

    #[test]
    fn keep_all_and_drop_all_are_exact() {
        let dev = CrashDev::new(1 << 16);
        dev.write_at(&[1; 5000], 10, false).unwrap();
        dev.flush().unwrap();
        dev.write_at(&[2; 3000], 4000, false).unwrap();
        dev.write_at(&[3; 100], 4100, true).unwrap();
        dev.trim(9000, 700).unwrap();
        dev.write_vectored_at(&[&[4; 600], &[5; 900]], 20000)
            .unwrap();
        let before = dev.snapshot_durable();
        let all = dev.crash(42, CrashPolicy::keep_all());
        assert_eq!(all.view(), dev.view());
        assert_eq!(all.snapshot_durable(), dev.view());
        assert_eq!(all.pending_writes(), 0);
        assert_eq!(all.writes_issued(), 0);
        let none = dev.crash(42, CrashPolicy::drop_all());
        assert_eq!(none.view(), before);
        assert_eq!(none.pending_writes(), 0);
        // The original is untouched by crashing it.
        assert_eq!(dev.pending_writes(), 4);
    }

    #[test]
    fn tearing_keeps_some_sectors_whole_and_drops_others() {
        let dev = CrashDev::new(1 << 16);
        dev.write_at(&[7; 8 * 512], 4096, false).unwrap();
        let mut partial = 0;
        for seed in 0..20 {
            let img = dev.crash_image(seed, CrashPolicy::tear_all());
            let landed: Vec<bool> = (0..8)
                .map(|s| {
                    let sector = &img[4096 + s * 512..4096 + (s + 1) * 512];
                    assert!(
                        sector == [7; 512] || sector == [0; 512],
                        "sector torn inside"
                    );
                    sector[0] == 7
                })
                .collect();
            // tear_all always tears a multi-sector write for real.
            assert!(landed.iter().any(|&l| l) && landed.iter().any(|&l| !l));
            // ... and not just as a prefix.
            if landed.windows(2).any(|w| !w[0] && w[1]) {
                partial += 1;
            }
        }
        assert!(partial > 0, "tears should not all be prefixes");
    }

    #[test]
    fn random_policy_tears_some_write() {
        let dev = CrashDev::new(1 << 16);
        for i in 0..16u64 {
            dev.write_at(&[i as u8 + 1; 2048], i * 4096, false).unwrap();
        }
        let mut torn = false;
        for seed in 0..10 {
            let img = dev.crash_image(seed, CrashPolicy::random());
            for i in 0..16usize {
                let w = &img[i * 4096..i * 4096 + 2048];
                let n = w.iter().filter(|&&b| b != 0).count();
                assert_eq!(n % 512, 0);
                torn |= n != 0 && n != 2048;
            }
        }
        assert!(torn);
    }

    #[test]
    fn sector_size_is_the_tearing_unit_and_aligned_to_the_device() {
        let dev = CrashDev::new(1 << 16);
        dev.write_at(&[9; 4096], 4096, false).unwrap(); // one aligned 4K block
        dev.write_at(&[8; 4096], 10240, false).unwrap(); // straddles two 4K blocks
        let policy = CrashPolicy::tear_all().with_sector(4096);
        let mut straddle_torn = false;
        for seed in 0..20 {
            let img = dev.crash_image(seed, policy);
            let b = &img[4096..8192];
            assert!(b == [9; 4096] || b == [0; 4096]);
            let (lo, hi) = (&img[10240..12288], &img[12288..14336]);
            assert!(lo == [8; 2048] || lo == [0; 2048]);
            assert!(hi == [8; 2048] || hi == [0; 2048]);
            straddle_torn |= lo != hi;
        }
        assert!(straddle_torn);
    }

    #[test]
    fn crashes_are_deterministic_per_seed() {
        let dev = CrashDev::new(1 << 16);
        for i in 0..32u64 {
            dev.write_at(&[i as u8 + 1; 1536], i * 2000, false).unwrap();
        }
        let a = dev.crash_image(12345, CrashPolicy::random());
        let b = dev.crash_image(12345, CrashPolicy::random());
        assert_eq!(a, b);
        let distinct: std::collections::HashSet<Vec<u8>> = (0..8)
            .map(|s| dev.crash_image(s, CrashPolicy::random()))
            .collect();
        assert!(distinct.len() > 1);
    }

    #[test]
    fn vectored_pieces_are_separate_writes() {
        let dev = CrashDev::new(1 << 16);
        dev.write_vectored_at(&[&[1; 512], &[], &[2; 512], &[3; 512]], 0)
            .unwrap();
        assert_eq!(dev.writes_issued(), 1);
        assert_eq!(dev.pending_writes(), 3);
        assert_eq!(read(&dev, 0, 1536)[512..1024], [2; 512]);
        assert_eq!(
            dev.crash_prefix(2).view()[..1536],
            {
                let mut v = vec![1; 512];
                v.extend([2; 512]);
                v.extend([0; 512]);
                v
            }[..]
        );
        // A vectored write beyond the end is refused whole.
        let e = dev
            .write_vectored_at(&[&[1; 512], &[2; 512]], (1 << 16) - 512)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(dev.pending_writes(), 3);
    }

    #[test]
    fn crash_prefix_keeps_exactly_a_prefix() {
        let dev = CrashDev::new(4096);
        dev.write_at(b"a", 0, false).unwrap();
        dev.write_at(b"F", 1, true).unwrap();
        dev.write_at(b"b", 2, false).unwrap();
        dev.write_at(b"c", 0, false).unwrap();
        assert_eq!(dev.pending_writes(), 3);
        let got: Vec<Vec<u8>> = (0..=3)
            .map(|n| dev.crash_prefix(n).view()[..3].to_vec())
            .collect();
        assert_eq!(got, [b"\0F\0", b"aF\0", b"aFb", b"cFb"]);
    }

    #[test]
    fn range_checks_and_read_only() {
        let dev = CrashDev::new(4096);
        let e = dev.write_at(b"x", 4096, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let e = dev
            .write_zeroes(4000, 100, ZeroOpts::default())
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let e = dev.trim(u64::MAX, 2).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        let mut b = [0u8; 2];
        let e = dev.read_at(&mut b, 4095).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        let mut out = Vec::new();
        assert!(dev.extents(4000, 200, 8, &mut out).is_err());
        dev.extents(0, 4096, 8, &mut out).unwrap();
        assert_eq!(out, [Extent::data(4096)]);
        assert_eq!(dev.writes_issued(), 0);
        // Empty writes are accepted and counted, but log nothing.
        dev.write_at(b"", 4096, false).unwrap();
        assert_eq!(dev.writes_issued(), 1);
        assert_eq!(dev.pending_writes(), 0);

        let ro = CrashDev::new(4096).read_only();
        assert!(ro.info().read_only);
        for e in [
            ro.write_at(b"x", 0, false).unwrap_err(),
            ro.trim(0, 1).unwrap_err(),
            ro.write_zeroes(0, 1, ZeroOpts::default()).unwrap_err(),
        ] {
            assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        }
        ro.flush().unwrap();
        assert!(ro.crash(0, CrashPolicy::random()).info().read_only);
    }

    #[test]
    fn cutting_the_power_freezes_the_device() {
        let dev = CrashDev::new(4096);
        dev.write_at(b"abc", 0, false).unwrap();
        let after = dev.cut_power(0, CrashPolicy::keep_all());
        assert!(dev.is_powered_off());
        assert!(!after.is_powered_off());
        let mut b = [0u8; 3];
        for e in [
            dev.read_at(&mut b, 0).unwrap_err(),
            dev.write_at(b"x", 0, false).unwrap_err(),
            dev.flush().unwrap_err(),
            dev.trim(0, 1).unwrap_err(),
            dev.write_zeroes(0, 1, ZeroOpts::default()).unwrap_err(),
            dev.prefetch(0, 1).unwrap_err(),
        ] {
            assert_eq!(e.raw_os_error(), Some(libc::EIO));
        }
        assert_eq!(&dev.view()[..3], b"abc");
        assert_eq!(dev.pending_writes(), 1);
        assert_eq!(read(&after, 0, 3), b"abc");
        after.write_at(b"z", 0, false).unwrap();
        after.flush().unwrap();
    }

    #[test]
    fn crash_while_other_threads_write() {
        let dev = Arc::new(CrashDev::new(1 << 20));
        let writers: Vec<_> = (0..4u8)
            .map(|t| {
                let dev = dev.clone();
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    loop {
                        let off = (t as u64 * 65536 + (i % 64) * 1024) % (1 << 20);
                        match dev.write_at(&[t + 1; 1024], off, i % 7 == 3) {
                            Ok(()) => {}
                            Err(e) => {
                                assert_eq!(e.raw_os_error(), Some(libc::EIO));
                                return;
                            }
                        }
                        if i % 13 == 5 && dev.flush().is_err() {
                            return;
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let after = dev.cut_power(7, CrashPolicy::random());
        for w in writers {
            w.join().unwrap();
        }
        // Every 1 KiB-aligned region holds whole sectors of one writer's byte or zeroes.
        let img = after.view();
        for s in img.chunks(512) {
            assert!(s.iter().all(|&b| b == s[0]));
        }
        assert_eq!(
            dev.crash_image(9, CrashPolicy::drop_all()),
            dev.snapshot_durable()
        );
    }

    // ---- property test ----

    #[derive(Debug, Clone)]
    enum Op {
        Write {
            offset: u64,
            len: u64,
            byte: u8,
            fua: bool,
        },
        Vectored {
            offset: u64,
            lens: Vec<u64>,
            byte: u8,
        },
        Zeroes {
            offset: u64,
            len: u64,
            fua: bool,
        },
        Trim {
            offset: u64,
            len: u64,
        },
        Flush,
    }

    const SIZE: u64 = 16 * 512;

    fn op() -> impl Strategy<Value = Op> {
        let range = (0..SIZE).prop_flat_map(|o| (Just(o), 0..=(SIZE - o).min(3000)));
        prop_oneof![
            6 => (range.clone(), any::<u8>(), any::<bool>()).prop_map(|((offset, len), byte, fua)| {
                Op::Write { offset, len, byte, fua }
            }),
            1 => (0..SIZE / 2, proptest::collection::vec(0..1000u64, 1..4), any::<u8>())
                .prop_map(|(offset, lens, byte)| Op::Vectored { offset, lens, byte }),
            1 => (range.clone(), any::<bool>())
                .prop_map(|((offset, len), fua)| Op::Zeroes { offset, len, fua }),
            1 => range.prop_map(|(offset, len)| Op::Trim { offset, len }),
            2 => Just(Op::Flush),
        ]
    }

    /// An independent model: the image at the last flush and every write since, in order.
    #[derive(Default)]
    struct Model {
        base: Vec<u8>,
        log: Vec<(u64, Vec<u8>, bool)>,
    }

    impl Model {
        fn apply(image: &mut [u8], (off, data, _): &(u64, Vec<u8>, bool)) {
            image[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }

        fn view(&self) -> Vec<u8> {
            let mut v = self.base.clone();
            self.log.iter().for_each(|w| Self::apply(&mut v, w));
            v
        }

        fn durable(&self) -> Vec<u8> {
            let mut v = self.base.clone();
            self.log
                .iter()
                .filter(|w| w.2)
                .for_each(|w| Self::apply(&mut v, w));
            v
        }

        /// Whether `image` is what some choice of "each volatile write keeps or loses each of its
        /// sectors" gives, with durable writes always kept and the latest kept write winning.
        /// Per sector, walking the log backwards: a write whose bytes match everywhere they are
        /// not yet explained by a later kept write is kept (keeping it only removes constraints
        /// on earlier writes), a durable write must match, and what no write explains must be
        /// the base image.
        fn explains(&self, image: &[u8]) -> Result<(), String> {
            for s in (0..image.len()).step_by(512) {
                let end = (s + 512).min(image.len());
                let mut explained = vec![false; end - s];
                for (i, (off, data, durable)) in self.log.iter().enumerate().rev() {
                    let (wo, we) = (*off as usize, *off as usize + data.len());
                    let (from, to) = (wo.max(s), we.min(end));
                    if from >= to {
                        continue;
                    }
                    let matches = (from..to).all(|b| explained[b - s] || image[b] == data[b - wo]);
                    if matches {
                        (from..to).for_each(|b| explained[b - s] = true);
                    } else if *durable {
                        return Err(format!("sector at {s}: durable write #{i} lost"));
                    }
                }
                if let Some(b) = (s..end).find(|&b| !explained[b - s] && image[b] != self.base[b]) {
                    return Err(format!("byte {b} is neither written nor durable"));
                }
            }
            Ok(())
        }
    }

    #[test]
    fn the_checker_rejects_impossible_images() {
        let model = Model {
            base: vec![0; 1024],
            log: vec![
                (0, vec![1; 512], false),
                (0, vec![2; 100], true),
                (600, vec![3; 10], false),
            ],
        };
        let mut good = vec![0; 1024];
        good[..100].fill(2);
        assert!(model.explains(&good).is_ok());
        good[100..512].fill(1);
        assert!(model.explains(&good).is_ok());
        let mut lost_fua = good.clone();
        lost_fua[..100].fill(1);
        assert!(model.explains(&lost_fua).is_err());
        let mut torn_in_sector = good.clone();
        torn_in_sector[100..300].fill(0);
        assert!(model.explains(&torn_in_sector).is_err());
        let mut garbage = good;
        garbage[900] = 9;
        assert!(model.explains(&garbage).is_err());
    }

    proptest! {
        #[test]
        fn crash_images_are_consistent(
            ops in proptest::collection::vec(op(), 0..40),
            seed in any::<u64>(),
            keep in 0.0..=1.0f64,
            tear_share in 0.0..=1.0f64,
        ) {
            let dev = CrashDev::new(SIZE as usize);
            let mut model = Model { base: vec![0; SIZE as usize], log: Vec::new() };
            let mut issued = 0;
            for op in &ops {
                issued += 1;
                match op {
                    Op::Write { offset, len, byte, fua } => {
                        let data = vec![*byte; *len as usize];
                        dev.write_at(&data, *offset, *fua).unwrap();
                        model.log.push((*offset, data, *fua));
                    }
                    Op::Vectored { offset, lens, byte } => {
                        let bufs: Vec<Vec<u8>> = lens
                            .iter()
                            .enumerate()
                            .map(|(i, &n)| vec![byte.wrapping_add(i as u8); n as usize])
                            .collect();
                        let refs: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
                        dev.write_vectored_at(&refs, *offset).unwrap();
                        let mut at = *offset;
                        for b in bufs {
                            at += b.len() as u64;
                            model.log.push((at - b.len() as u64, b, false));
                        }
                    }
                    Op::Zeroes { offset, len, fua } => {
                        let opts = ZeroOpts { fua: *fua, ..ZeroOpts::default() };
                        dev.write_zeroes(*offset, *len, opts).unwrap();
                        model.log.push((*offset, vec![0; *len as usize], *fua));
                    }
                    Op::Trim { offset, len } => {
                        dev.trim(*offset, *len).unwrap();
                        model.log.push((*offset, vec![0; *len as usize], false));
                    }
                    Op::Flush => {
                        issued -= 1;
                        dev.flush().unwrap();
                        model.base = model.view();
                        model.log.clear();
                    }
                }
            }
            prop_assert_eq!(dev.writes_issued(), issued);
            prop_assert_eq!(dev.view(), model.view());
            prop_assert_eq!(dev.snapshot_durable(), model.durable());
            prop_assert_eq!(dev.crash_image(seed, CrashPolicy::keep_all()), model.view());
            prop_assert_eq!(dev.crash_image(seed, CrashPolicy::drop_all()), model.durable());
            let volatile = model.log.iter().filter(|w| !w.2 && !w.1.is_empty()).count();
            prop_assert_eq!(dev.pending_writes(), volatile);

            let policy = CrashPolicy::new(keep, (1.0 - keep) * tear_share);
            for p in [policy, CrashPolicy::random(), CrashPolicy::tear_all()] {
                let after = dev.crash(seed, p);
                let image = after.view();
                prop_assert_eq!(&image, &after.snapshot_durable());
                prop_assert_eq!(after.pending_writes(), 0);
                prop_assert_eq!(&image, &dev.crash_image(seed, p));
                if let Err(e) = model.explains(&image) {
                    return Err(TestCaseError::fail(format!("{p:?}: {e}")));
                }
            }
            for n in 0..=volatile {
                let image = dev.crash_prefix(n).view();
                if let Err(e) = model.explains(&image) {
                    return Err(TestCaseError::fail(format!("prefix {n}: {e}")));
                }
            }
        }
    }
}

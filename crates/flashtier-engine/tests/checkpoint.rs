//! Checkpoints are written in the background: while one is being written to the cache device,
//! client writes and FLUSHes go on. (The log writer used to encode and write them itself, and
//! every client write waited: up to 310 ms on a 1 TiB cache.)
//!
//! The cache device here parks the first write to the checkpoint area until the test lets it
//! go, a checkpoint write that takes as long as the test wants; writes and a FLUSH must complete
//! meanwhile, and everything must be there after the checkpoint finished and the cache reopened.
//! Its syncs take `SYNC_TIME`, and the checkpoint counters must have timed both.

mod common;

use std::io;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use flashtier_engine::{read_superblock, Mode};
use flashtier_io::{BlockDev, DevInfo, ZeroOpts};
use flashtier_testkit::CrashDev;

#[derive(Default)]
struct Parking {
    armed: bool,
    parked: bool,
    released: bool,
}

/// How long every sync of the cache device takes here.
const SYNC_TIME: Duration = Duration::from_millis(1);

/// Forwards to `inner` (each sync taking `SYNC_TIME`), but once armed, the first write overlapping `area` waits (before it
/// reaches `inner`) until released.
struct SlowCheckpoints {
    inner: Arc<dyn BlockDev>,
    area: (u64, u64),
    st: Mutex<Parking>,
    cv: Condvar,
}

impl SlowCheckpoints {
    fn arm(&self) {
        self.st.lock().unwrap().armed = true;
    }

    /// Waits until a checkpoint write is parked; false after `limit`.
    fn wait_parked(&self, limit: Duration) -> bool {
        let st = self.st.lock().unwrap();
        let (st, _) = self
            .cv
            .wait_timeout_while(st, limit, |s| !s.parked)
            .unwrap();
        st.parked
    }

    fn release(&self) {
        self.st.lock().unwrap().released = true;
        self.cv.notify_all();
    }

    fn gate(&self, offset: u64, len: u64) {
        if offset + len <= self.area.0 || offset >= self.area.1 {
            return;
        }
        let mut st = self.st.lock().unwrap();
        if !st.armed || st.parked {
            return;
        }
        st.parked = true;
        self.cv.notify_all();
        let _st = self.cv.wait_while(st, |s| !s.released).unwrap();
    }
}

impl BlockDev for SlowCheckpoints {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        format!("slow checkpoints over {}", self.inner.describe())
    }
    fn read_at(&self, b: &mut [u8], o: u64) -> io::Result<()> {
        self.inner.read_at(b, o)
    }
    fn write_at(&self, b: &[u8], o: u64, f: bool) -> io::Result<()> {
        self.gate(o, b.len() as u64);
        self.inner.write_at(b, o, f)
    }
    fn write_vectored_at(&self, b: &[&[u8]], o: u64) -> io::Result<()> {
        self.gate(o, b.iter().map(|x| x.len() as u64).sum());
        self.inner.write_vectored_at(b, o)
    }
    fn flush(&self) -> io::Result<()> {
        std::thread::sleep(SYNC_TIME);
        self.inner.flush()
    }
    fn trim(&self, o: u64, l: u64) -> io::Result<()> {
        self.inner.trim(o, l)
    }
    fn write_zeroes(&self, o: u64, l: u64, z: ZeroOpts) -> io::Result<()> {
        self.inner.write_zeroes(o, l, z)
    }
}

/// Runs `f` on another thread; `None` if it has not returned after `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

#[test]
fn writes_and_flushes_go_on_while_a_checkpoint_is_written() {
    let backing_size = 1u64 << 20;
    let cdev = Arc::new(CrashDev::new(2 << 20));
    let bdev = Arc::new(CrashDev::from_image(vec![0; backing_size as usize]));
    format_small(&*cdev, backing_size, Mode::WriteBack);
    let g = read_superblock(&*cdev).unwrap().geometry;
    let slow = Arc::new(SlowCheckpoints {
        inner: cdev.clone(),
        area: (g.checkpoint_offset, g.data_offset),
        st: Mutex::default(),
        cv: Condvar::new(),
    });
    let c = Arc::new(open(slow.clone(), bdev.clone(), None).unwrap());
    let blocks = backing_size / BS;
    let mut expected = vec![0u8; backing_size as usize];
    slow.arm();
    // An eighth of the cache written makes a checkpoint due.
    let mut seed = 0;
    let limit = Duration::from_secs(20);
    // Writes block `seed % blocks` with `seed`'s pattern, failing if it waits for a checkpoint.
    let mut write_next = |seed: &mut u64| {
        let data = pattern(*seed, BS as usize);
        let lba = *seed % blocks;
        let cc = c.clone();
        let done = within(limit, move || cc.write_at(&data, lba * BS, false));
        if done.is_none() {
            slow.release();
            panic!("a write waited for the checkpoint being written");
        }
        done.unwrap().unwrap();
        expected[(lba * BS) as usize..((lba + 1) * BS) as usize]
            .copy_from_slice(&pattern(*seed, BS as usize));
        *seed += 1;
    };
    while !slow.wait_parked(Duration::ZERO) {
        assert!(seed < 100_000, "no checkpoint was written");
        write_next(&mut seed);
    }
    let parked_at = std::time::Instant::now();
    let checkpoints = c.stats().checkpoints;
    // The checkpoint write is parked: writes and a FLUSH must not wait for it.
    for _ in 0..64 {
        write_next(&mut seed);
    }
    let cc = c.clone();
    let flushed = within(limit, move || cc.flush());
    if flushed.is_none() {
        slow.release();
        panic!("a FLUSH waited for the checkpoint being written");
    }
    flushed.unwrap().unwrap();
    assert_eq!(
        c.stats().checkpoints,
        checkpoints,
        "the checkpoint counted before it was written"
    );
    let parked_for = parked_at.elapsed();
    slow.release();
    let deadline = std::time::Instant::now() + limit;
    while c.stats().checkpoints == checkpoints {
        assert!(
            std::time::Instant::now() < deadline,
            "the checkpoint did not finish"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Timed: the image's write (at least while it was parked), and two syncs per checkpoint.
    let s = c.stats();
    assert!(
        s.checkpoint_write_us >= parked_for.as_micros() as u64,
        "checkpoint writes timed at {} µs, but one was parked for {parked_for:?}",
        s.checkpoint_write_us
    );
    let sync_us = SYNC_TIME.as_micros() as u64;
    assert!(
        s.checkpoint_sync_us >= 2 * sync_us * s.checkpoints,
        "{} checkpoints' syncs timed at {} µs, each sync taking {sync_us} µs",
        s.checkpoints,
        s.checkpoint_sync_us
    );
    assert!(read_all(&*c).unwrap() == expected);
    // A crash after a FLUSH (no clean close): recovery starts from the background checkpoint
    // and replays what was written during and after it. The cache device's image first: the
    // cleaner makes the backing store durable before it marks anything clean.
    c.flush().unwrap();
    let cache_image = cdev.snapshot_durable();
    let backing_image = bdev.snapshot_durable();
    let c = open(
        Arc::new(CrashDev::from_image(cache_image)),
        Arc::new(CrashDev::from_image(backing_image)),
        None,
    )
    .unwrap();
    assert!(
        read_all(&c).unwrap() == expected,
        "data lost across a crash"
    );
    c.close().unwrap();
}

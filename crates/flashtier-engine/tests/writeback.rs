//! The background cleaner (`writeback`) and the drain every cleaning pass shares.
//!
//! - Controller: above the target it writes back, down toward the target, and stops at it;
//!   nothing happens below the target, nor with every policy off below the high watermark;
//!   above the high watermark it drains to the low one and stops there.
//! - Max age writes back the blocks older than the age, not the younger ones; the idle delay
//!   drains while the backing store is idle, not while client I/O keeps reaching it.
//! - A block rewritten while its write-back is parked in flight stays dirty, its newer data is
//!   read back, and a later pass writes that back.
//! - The drain: writes sorted by address and coalesced up to `writeback_max_io_kib`, several in
//!   flight (a device wrapper records sizes and concurrency); one in flight when so set.
//! - Clients first: while client reads keep the backing store busy, background write-back runs
//!   one write at a time (and still progresses); in parallel once they stop.
//! - The rate cap holds (bytes written over a measured interval), and writes at a rate are
//!   spread over each second rather than sent in one burst; a pass that must run now (a full
//!   write-back) does not wait for a paced one's schedule.
//! - A failing backing store: the cleaner retries with backoff, counts retries, keeps the dirty
//!   data, and drains once the store works again.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use flashtier_engine::{Cache, Mode, ReclaimPolicy};
use flashtier_io::{BlockDev, DevInfo, Extent, ZeroOpts};
use flashtier_testkit::{FaultDev, MemDev};

const MIB: u64 = 1 << 20;
/// The backing store: 64 MiB.
const BACKING: u64 = 64 * MIB;

/// Records the backing store's writes: each one's range, and the most in flight at once.
/// Each write takes `delay`, so concurrent writes overlap observably.
struct Recorder {
    inner: Arc<dyn BlockDev>,
    delay: Duration,
    /// Milliseconds each read takes (0 at first): slow client reads keep the backing store busy.
    read_delay_ms: AtomicU64,
    writes: Mutex<Vec<(u64, u64)>>,
    /// When each write started.
    starts: Mutex<Vec<Instant>>,
    inflight: AtomicU64,
    max_inflight: AtomicU64,
}

impl Recorder {
    fn new(inner: Arc<dyn BlockDev>, delay: Duration) -> Arc<Recorder> {
        Arc::new(Recorder {
            inner,
            delay,
            read_delay_ms: AtomicU64::new(0),
            writes: Mutex::new(Vec::new()),
            starts: Mutex::new(Vec::new()),
            inflight: AtomicU64::new(0),
            max_inflight: AtomicU64::new(0),
        })
    }
    fn take(&self) -> Vec<(u64, u64)> {
        self.max_inflight.store(0, Ordering::SeqCst);
        std::mem::take(&mut self.writes.lock().unwrap())
    }
}

impl BlockDev for Recorder {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        "recorder".into()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::thread::sleep(Duration::from_millis(
            self.read_delay_ms.load(Ordering::SeqCst),
        ));
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> std::io::Result<()> {
        self.starts.lock().unwrap().push(Instant::now());
        let now = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_inflight.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        let r = self.inner.write_at(buf, offset, fua);
        self.writes.lock().unwrap().push((offset, buf.len() as u64));
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        r
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len, opts)
    }
    fn prefetch(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.prefetch(offset, len)
    }
    fn extents(&self, o: u64, l: u64, m: usize, out: &mut Vec<Extent>) -> std::io::Result<()> {
        self.inner.extents(o, l, m, out)
    }
}

/// A write-back cache of `cache_mib` MiB (256 KiB segments) over `backing`, every background
/// policy off (each test turns on what it tests).
fn cache_over(backing: Arc<dyn BlockDev>, cache_mib: u64) -> Arc<Cache> {
    let cdev = Arc::new(MemDev::new((cache_mib * MIB) as usize));
    format_cache(
        &*cdev,
        BACKING,
        256 << 10,
        Mode::WriteBack,
        ReclaimPolicy::Fifo,
    )
    .unwrap();
    let c = Arc::new(open(cdev, backing, None).unwrap());
    set(&c, "writeback_controller", "off");
    c
}

fn set(c: &Cache, name: &str, value: &str) {
    c.set_param(name, value).unwrap();
}

fn capacity(c: &Cache) -> u64 {
    c.status().capacity_blocks
}

fn dirty(c: &Cache) -> u64 {
    c.status().dirty_blocks
}

/// Writes blocks `[first, first + n)` (data `pattern(seed + lba)`) in 32-block writes.
fn write_blocks(c: &Cache, first: u64, n: u64, seed: u64) {
    let mut lba = first;
    while lba < first + n {
        let k = (first + n - lba).min(32);
        let mut data = Vec::with_capacity((k * BS) as usize);
        for b in lba..lba + k {
            data.extend_from_slice(&pattern(seed + b, BS as usize));
        }
        c.write_at(&data, lba * BS, false).unwrap();
        lba += k;
    }
}

fn expect_block(c: &Cache, lba: u64, seed: u64) {
    let mut buf = vec![0u8; BS as usize];
    c.read_at(&mut buf, lba * BS).unwrap();
    assert!(buf == pattern(seed + lba, BS as usize), "block {lba} wrong");
}

/// Polls `cond` every 10 ms for up to `secs`; whether it became true.
fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Dirty blocks stay exactly as they are for `ms` milliseconds.
fn stays_dirty(c: &Cache, ms: u64) -> bool {
    let before = dirty(c);
    let deadline = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < deadline {
        if dirty(c) != before {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
fn nothing_is_written_back_below_the_high_watermark_with_every_policy_off() {
    let c = cache_over(Arc::new(MemDev::new(BACKING as usize)), 16);
    let n = capacity(&c) * 45 / 100;
    write_blocks(&c, 0, n, 1);
    assert_eq!(dirty(&c), n);
    assert!(stays_dirty(&c, 600));
    assert_eq!(c.stats().background_cleaned_blocks, 0);
    assert_eq!(c.status().writeback.state, "idle");
}

#[test]
fn above_the_high_watermark_it_drains_to_the_low_one_and_stops() {
    let c = cache_over(Arc::new(MemDev::new(BACKING as usize)), 16);
    let cap = capacity(&c);
    write_blocks(&c, 0, cap * 45 / 100, 1);
    set(&c, "writeback_dirty_low_pct", "20");
    set(&c, "writeback_dirty_high_pct", "40");
    let low = cap * 20 / 100;
    assert!(eventually(20, || dirty(&c) <= low), "{:?}", c.status());
    // It stops at the low watermark (passes are cut to what is above it).
    assert!(stays_dirty(&c, 500));
    let d = dirty(&c);
    assert!(d + 8 >= low && d <= low, "dirty {d}, low {low}");
    assert_eq!(c.status().writeback.state, "idle");
    for lba in [0, cap * 45 / 100 - 1] {
        expect_block(&c, lba, 1);
    }
}

#[test]
fn the_controller_drains_toward_the_target_and_stops_there() {
    let c = cache_over(Arc::new(MemDev::new(BACKING as usize)), 16);
    let cap = capacity(&c);
    let start = cap * 45 / 100;
    write_blocks(&c, 0, start, 1);
    set(&c, "writeback_dirty_target_pct", "10");
    set(&c, "writeback_controller", "pi");
    // An excess of 35% drains at roughly excess / 10 s at first.
    let target = cap / 10;
    assert!(
        eventually(20, || dirty(&c) <= start - (start - target) / 10),
        "{:?}",
        c.status()
    );
    let st = c.status();
    assert_eq!(st.writeback.target_blocks, target);
    assert!(st.writeback.state == "controller", "{st:?}");
    assert!(st.writeback.rate_bytes_per_sec > 0, "{st:?}");
    // Below the target: nothing more.
    set(&c, "writeback_dirty_target_pct", "100");
    std::thread::sleep(Duration::from_millis(300));
    assert!(stays_dirty(&c, 1200), "{:?}", c.status());
    assert_eq!(c.status().writeback.rate_bytes_per_sec, 0);
    // A target just under the dirty level: reached, not overshot by more than a small pass.
    let now = dirty(&c);
    let pct = now * 100 / cap - 1;
    let target = cap * pct / 100;
    set(&c, "writeback_dirty_target_pct", &pct.to_string());
    assert!(eventually(20, || dirty(&c) <= target), "{:?}", c.status());
    std::thread::sleep(Duration::from_millis(1500));
    let d = dirty(&c);
    assert!(
        d <= target && d + 64 >= target,
        "dirty {d}, target {target}"
    );
    for lba in [0, start / 2, start - 1] {
        expect_block(&c, lba, 1);
    }
}

#[test]
fn max_age_writes_back_the_old_blocks_only() {
    let bdev = Arc::new(MemDev::new(BACKING as usize));
    let c = cache_over(bdev.clone(), 16);
    // Old: blocks 0..64 and 200; young (a second later): 64..96 (next to the old ones) and 300.
    write_blocks(&c, 0, 64, 1);
    write_blocks(&c, 200, 1, 1);
    set(&c, "writeback_max_age_secs", "2");
    std::thread::sleep(Duration::from_millis(1100));
    write_blocks(&c, 64, 32, 1);
    write_blocks(&c, 300, 1, 1);
    assert!(eventually(10, || dirty(&c) == 33), "{:?}", c.status());
    let backing = bdev.snapshot();
    let on_backing = |lba: u64| {
        backing[(lba * BS) as usize..((lba + 1) * BS) as usize] == pattern(1 + lba, BS as usize)[..]
    };
    assert!(on_backing(0) && on_backing(63) && on_backing(200));
    assert!(!on_backing(64) && !on_backing(95) && !on_backing(300));
    // The young ones follow once old enough.
    assert!(eventually(10, || dirty(&c) == 0), "{:?}", c.status());
    assert!(c.stats().background_cleaned_blocks >= 97);
}

#[test]
fn idle_delay_waits_for_the_backing_store_to_be_idle() {
    let bdev = Arc::new(MemDev::new(BACKING as usize));
    let c = cache_over(bdev, 16);
    write_blocks(&c, 0, 128, 1);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let reader = {
        let (c, stop, reads) = (c.clone(), stop.clone(), reads.clone());
        std::thread::spawn(move || {
            // Read misses, each from a block never read before: client I/O at the backing store.
            let mut lba = 4096;
            let mut buf = vec![0u8; BS as usize];
            while !stop.load(Ordering::Acquire) {
                c.read_at(&mut buf, lba * BS).unwrap();
                reads.fetch_add(1, Ordering::Release);
                lba += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    assert!(eventually(5, || reads.load(Ordering::Acquire) > 0));
    set(&c, "writeback_idle_delay_ms", "400");
    assert!(
        stays_dirty(&c, 1500),
        "written back while clients used the backing store"
    );
    stop.store(true, Ordering::Release);
    reader.join().unwrap();
    assert!(eventually(10, || dirty(&c) == 0), "{:?}", c.status());
    expect_block(&c, 127, 1);
}

/// The cleaner's write of block 5 is parked; meanwhile block 5 is rewritten (to a new slot).
/// The pass then marks the old slot's version clean, not the block: it stays dirty with the new
/// data, and the next pass writes the new data back.
#[test]
fn a_block_rewritten_while_its_write_back_is_in_flight_stays_dirty() {
    let bdev = Arc::new(MemDev::new(BACKING as usize));
    let first = Gate::new(bdev.clone());
    let second = Gate::new(first.clone());
    let c = cache_over(second.clone(), 16);
    write_blocks(&c, 5, 1, 1);
    first.park_next_write_at(5 * BS);
    set(&c, "writeback_idle_delay_ms", "1");
    let parked = {
        let first = first.clone();
        with_timeout(30, move || first.wait_parked())
    };
    assert!(parked.is_some(), "the cleaner never wrote block 5");
    write_blocks(&c, 5, 1, 1000);
    second.park_next_write_at(5 * BS);
    first.release();
    // The next write of block 5 belongs to the next pass: the first one is done by then.
    let parked = {
        let second = second.clone();
        with_timeout(30, move || second.wait_parked())
    };
    assert!(
        parked.is_some(),
        "the rewritten block was never written back"
    );
    assert_eq!(dirty(&c), 1, "the rewritten block was marked clean");
    let backing = bdev.snapshot();
    assert!(backing[(5 * BS) as usize..(6 * BS) as usize] == pattern(1 + 5, BS as usize)[..]);
    expect_block(&c, 5, 1000);
    second.release();
    assert!(eventually(10, || dirty(&c) == 0), "{:?}", c.status());
    let backing = bdev.snapshot();
    assert!(backing[(5 * BS) as usize..(6 * BS) as usize] == pattern(1000 + 5, BS as usize)[..]);
}

/// 256 consecutive blocks written one at a time in shuffled order (so their cache slots are in
/// no order at all) go back as sixteen 64 KiB writes, several in flight.
#[test]
fn the_drain_is_sorted_coalesced_and_parallel() {
    let rec = Recorder::new(
        Arc::new(MemDev::new(BACKING as usize)),
        Duration::from_millis(20),
    );
    let c = cache_over(rec.clone(), 16);
    set(&c, "writeback_max_io_kib", "64");
    set(&c, "writeback_max_inflight", "4");
    let mut order: Vec<u64> = (1000..1256).collect();
    let mut rng = Rng::new(5);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for &lba in &order {
        write_blocks(&c, lba, 1, 1);
    }
    rec.take();
    assert_eq!(c.write_back_all().unwrap(), 256);
    let most = rec.max_inflight.load(Ordering::SeqCst);
    let mut writes = rec.take();
    writes.sort_unstable();
    let want: Vec<(u64, u64)> = (0..16).map(|i| ((1000 + i * 16) * BS, 16 * BS)).collect();
    assert_eq!(writes, want);
    assert!(
        (2..=4).contains(&most),
        "{most} writes in flight at most (4 allowed)"
    );
    assert_eq!(c.stats().cleaner_writes, 16);

    // One in flight when so set.
    for &lba in &order {
        write_blocks(&c, lba, 1, 7);
    }
    set(&c, "writeback_max_inflight", "1");
    rec.take();
    assert_eq!(c.write_back_all().unwrap(), 256);
    assert_eq!(rec.max_inflight.load(Ordering::SeqCst), 1);
    assert_eq!(rec.take().len(), 16);
    expect_block(&c, 1100, 7);
}

/// While client reads keep the backing store busy, a background pass (here: max age) writes one
/// run at a time, and still makes progress; once the clients stop, its writes go in parallel.
#[test]
fn clients_at_the_backing_store_keep_priority_over_background_write_back() {
    let rec = Recorder::new(
        Arc::new(MemDev::new(BACKING as usize)),
        Duration::from_millis(20),
    );
    let c = cache_over(rec.clone(), 16);
    set(&c, "writeback_max_io_kib", "64");
    set(&c, "writeback_max_inflight", "4");
    // 64 runs of 16 blocks, apart from each other: 64 writes of 64 KiB.
    for run in 0..64 {
        write_blocks(&c, run * 32, 16, 1);
    }
    rec.read_delay_ms.store(30, Ordering::SeqCst);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..4u64)
        .map(|t| {
            let (c, stop) = (c.clone(), stop.clone());
            std::thread::spawn(move || {
                // Misses, each from a block never read before; four threads, so one is nearly
                // always at the backing store.
                let mut lba = 8192 + t * 1000;
                let mut buf = vec![0u8; BS as usize];
                while !stop.load(Ordering::Acquire) {
                    c.read_at(&mut buf, lba * BS).unwrap();
                    lba += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    rec.take();
    set(&c, "writeback_max_age_secs", "1");
    let progressed = eventually(20, || rec.writes.lock().unwrap().len() >= 8);
    let busy_most = rec.max_inflight.load(Ordering::SeqCst);
    stop.store(true, Ordering::Release);
    for r in readers {
        r.join().unwrap();
    }
    assert!(progressed, "no background write-back under client load");
    assert_eq!(
        busy_most, 1,
        "background write-back ran {busy_most} writes at once while clients used the backing store"
    );
    rec.read_delay_ms.store(0, Ordering::SeqCst);
    rec.take();
    assert!(eventually(20, || dirty(&c) == 0), "{:?}", c.status());
    let idle_most = rec.max_inflight.load(Ordering::SeqCst);
    assert!(
        idle_most >= 2,
        "background write-back stayed at {idle_most} write in flight without client load"
    );
    expect_block(&c, 63 * 32 + 15, 1);
}

#[test]
fn the_rate_cap_holds() {
    let c = cache_over(Arc::new(MemDev::new(BACKING as usize)), 32);
    write_blocks(&c, 0, 6 * MIB / BS, 1);
    set(&c, "writeback_rate_max_kib", "1024");
    let before = c.stats().backing_write_bytes;
    let t0 = Instant::now();
    // Idle: full speed, but capped.
    set(&c, "writeback_idle_delay_ms", "1");
    std::thread::sleep(Duration::from_secs(2));
    let written = c.stats().backing_write_bytes - before;
    let secs = t0.elapsed().as_secs_f64();
    assert!(written > 0, "nothing written back");
    // A second's worth may go at once (the bucket), then 1 MiB/s.
    let bound = (MIB as f64 * (secs + 1.0)) as u64;
    assert!(
        written <= bound,
        "{written} bytes in {secs:.2} s over a 1 MiB/s cap"
    );
    // Without the cap the rest goes at once.
    set(&c, "writeback_rate_max_kib", "0");
    assert!(eventually(10, || dirty(&c) == 0), "{:?}", c.status());
}

/// At a rate, a pass's writes are spread over the second it was sized for. Before: a second's
/// worth went out at once, every second, and clients' latency saw-toothed with it.
#[test]
fn write_back_at_a_rate_is_paced_not_bursty() {
    let rec = Recorder::new(Arc::new(MemDev::new(BACKING as usize)), Duration::ZERO);
    let c = cache_over(rec.clone(), 32);
    write_blocks(&c, 0, 4 * MIB / BS, 1);
    // 512 KiB/s in 64 KiB writes: 8 writes a second, in passes of up to a second's worth.
    set(&c, "writeback_max_io_kib", "64");
    set(&c, "writeback_max_inflight", "8");
    set(&c, "writeback_rate_max_kib", "512");
    rec.starts.lock().unwrap().clear();
    set(&c, "writeback_idle_delay_ms", "1");
    std::thread::sleep(Duration::from_millis(2500));
    set(&c, "writeback_idle_delay_ms", "0");
    let starts = rec.starts.lock().unwrap().clone();
    assert!(starts.len() >= 12, "{} writes in 2.5 s", starts.len());
    // Unpaced, all 8 writes of a second start within a few milliseconds of each other; paced,
    // 125 ms apart. No 200 ms window holds more than 3 (2 due, one of slack).
    let most = starts
        .iter()
        .map(|&t| {
            starts
                .iter()
                .filter(|&&u| u >= t && u < t + Duration::from_millis(200))
                .count()
        })
        .max()
        .unwrap();
    assert!(most <= 3, "{most} writes within 200 ms at 8 a second");
}

/// A pass that must run now (a full write-back, as a flush command or a mode switch makes) does
/// not wait for the paced background pass ahead of it to keep its schedule.
#[test]
fn a_full_write_back_does_not_wait_for_a_paced_pass() {
    let rec = Recorder::new(Arc::new(MemDev::new(BACKING as usize)), Duration::ZERO);
    let c = cache_over(rec.clone(), 32);
    write_blocks(&c, 0, MIB / BS, 1);
    // 64 KiB/s in 4 KiB writes: a pass of 16 writes over a second.
    set(&c, "writeback_max_io_kib", "4");
    set(&c, "writeback_max_inflight", "16");
    set(&c, "writeback_rate_max_kib", "64");
    rec.starts.lock().unwrap().clear();
    set(&c, "writeback_idle_delay_ms", "1");
    assert!(
        eventually(5, || !rec.starts.lock().unwrap().is_empty()),
        "no paced pass started"
    );
    let t0 = Instant::now();
    c.write_back_all().unwrap();
    let took = t0.elapsed();
    assert_eq!(dirty(&c), 0);
    assert!(
        took < Duration::from_millis(500),
        "the full write-back took {took:?} behind a paced pass of a second"
    );
}

#[test]
fn a_failing_backing_store_is_retried_and_nothing_is_dropped() {
    let bdev = Arc::new(FaultDev::new(
        Arc::new(MemDev::new(BACKING as usize)) as Arc<dyn BlockDev>
    ));
    let c = cache_over(bdev.clone(), 16);
    write_blocks(&c, 0, 64, 1);
    bdev.add(flashtier_testkit::Fault::FailWritesFrom(
        bdev.writes_seen() + 1,
    ));
    set(&c, "writeback_idle_delay_ms", "1");
    assert!(
        eventually(10, || c.stats().writeback_retries >= 2),
        "{:?}",
        c.stats()
    );
    let st = c.status();
    assert_eq!(st.dirty_blocks, 64, "{st:?}");
    assert!(st.backing_degraded.is_some(), "{st:?}");
    expect_block(&c, 63, 1);
    bdev.clear();
    assert!(eventually(15, || dirty(&c) == 0), "{:?}", c.status());
    // The pass marks its blocks clean, then reports the store healthy: polled, not read once
    // (read at once, it failed about once in a dozen runs).
    assert!(
        eventually(5, || c.status().backing_degraded.is_none()),
        "{:?}",
        c.status()
    );
}

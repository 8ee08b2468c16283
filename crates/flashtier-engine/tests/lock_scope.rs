//! Writers wait only for writers of the same blocks.
//!
//! A write of part of a block reads the rest of the block first (from the backing store when it
//! is not cached: a seek on a slow disk) and must not let another write of that block land in
//! between. Before, one lock for the whole cache did that, so one 512-byte write stalled every
//! writer for the length of its read.
//!
//! A cleaning pass must not land an older version of a block on the backing store after a write
//! that went straight there. Before, a pass held one lock for its whole length, so a flush
//! writing back one block stalled every write-through write, write around the cache and trim.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flashtier_engine::{Cache, Mode};
use flashtier_io::{BlockDev, DevInfo, Extent, SlowDev, ZeroOpts};
use flashtier_testkit::MemDev;

/// Each backing request takes this long, one at a time.
const SEEK: Duration = Duration::from_millis(300);
const BACKING: u64 = 16 << 20;

/// A write-back cache over a backing store that takes [`SEEK`] per request; nothing written
/// back behind the test's back. Returns it with the backing store's memory.
fn slow_cache() -> (Arc<Cache>, Arc<MemDev>) {
    let cache_dev = Arc::new(MemDev::new(8 << 20));
    let inner = Arc::new(MemDev::new(BACKING as usize));
    let backing = Arc::new(SlowDev::new(inner.clone() as Arc<dyn BlockDev>, SEEK));
    format_small(&*cache_dev, BACKING, Mode::WriteBack);
    let c = open(cache_dev, backing, None).unwrap();
    c.set_param("writeback_controller", "off").unwrap();
    (Arc::new(c), inner)
}

/// Starts a 512-byte write into block `lba` (not cached: its read-modify-write reads the slow
/// backing store), and waits until it is surely reading.
fn partial_write_reading(c: &Arc<Cache>, lba: u64) -> std::thread::JoinHandle<()> {
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.write_at(&[0xab; 512], lba * BS + 1024, false).unwrap());
    std::thread::sleep(SEEK / 6);
    t
}

#[test]
fn a_partial_write_does_not_stall_writes_of_other_blocks() {
    let (c, _) = slow_cache();
    // Block 9 is cached, so a partial write of it reads the cache, not the backing store.
    c.write_at(&pattern(9, BS as usize), 9 * BS, false).unwrap();
    let reading = partial_write_reading(&c, 5);

    let started = Instant::now();
    c.write_at(&pattern(7, BS as usize), 7 * BS, false).unwrap();
    let whole = started.elapsed();
    let started = Instant::now();
    c.write_at(&[0xcd; 512], 9 * BS, false).unwrap();
    let partial = started.elapsed();
    reading.join().unwrap();
    assert!(
        whole < SEEK / 2 && partial < SEEK / 2,
        "writes of other blocks waited for a read-modify-write of block 5 ({SEEK:?} read): \
         whole block {whole:?}, partial {partial:?}"
    );
    c.flush().unwrap();
}

/// A whole-block write of the block a read-modify-write is patching waits for it: the patch
/// must not write back the older content it read over the newer write.
#[test]
fn a_write_of_the_same_block_waits_for_the_read_modify_write() {
    let (c, _) = slow_cache();
    let reading = partial_write_reading(&c, 5);
    let newer = pattern(55, BS as usize);
    c.write_at(&newer, 5 * BS, false).unwrap();
    reading.join().unwrap();
    let mut got = vec![0u8; BS as usize];
    c.read_at(&mut got, 5 * BS).unwrap();
    // The partial write came first (it was reading), so the whole-block write, which waited,
    // overwrote it.
    assert!(
        got == newer,
        "block 5 lost the whole-block write that raced with its read-modify-write"
    );
}

/// A backing store whose next `slow_writes` writes to one range take [`SEEK`] each (a remapped
/// sector, or a busy zone of a shingled disk); everything else at memory speed, in parallel.
struct SlowRange {
    inner: Arc<MemDev>,
    slow: std::ops::Range<u64>,
    slow_writes: std::sync::atomic::AtomicU32,
}

impl SlowRange {
    fn new(inner: Arc<MemDev>, slow: std::ops::Range<u64>, slow_writes: u32) -> SlowRange {
        SlowRange {
            inner,
            slow,
            slow_writes: slow_writes.into(),
        }
    }

    fn delay(&self, offset: u64, len: u64) {
        use std::sync::atomic::Ordering::SeqCst;
        if offset < self.slow.end
            && self.slow.start < offset + len
            && self
                .slow_writes
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            std::thread::sleep(SEEK);
        }
    }
}

impl BlockDev for SlowRange {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        "memory, slow to write one range".into()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> std::io::Result<()> {
        self.delay(offset, buf.len() as u64);
        self.inner.write_at(buf, offset, fua)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.delay(offset, len);
        self.inner.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> std::io::Result<()> {
        self.delay(offset, len);
        self.inner.write_zeroes(offset, len, opts)
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> std::io::Result<()> {
        self.inner.extents(offset, len, max, out)
    }
}

/// While a flush writes back block 3 (slow), a write-through write of block 8, a write around
/// the cache of block 9 and a trim of block 10 go straight to the backing store without waiting
/// for it; and the flush still writes block 3 back.
#[test]
fn a_cleaning_pass_does_not_stall_writes_around_it_to_other_blocks() {
    let cache_dev = Arc::new(MemDev::new(8 << 20));
    let inner = Arc::new(MemDev::new(BACKING as usize));
    let backing = Arc::new(SlowRange::new(inner.clone(), 3 * BS..4 * BS, u32::MAX));
    format_small(&*cache_dev, BACKING, Mode::WriteThrough);
    let c = Arc::new(open(cache_dev, backing, None).unwrap());
    // A write-through write stays dirty until a FLUSH makes the backing store's copy durable:
    // a cleaning pass writes it back again.
    c.write_at(&pattern(3, BS as usize), 3 * BS, false).unwrap();
    assert_eq!(c.status().dirty_blocks, 1);
    let c2 = c.clone();
    let flushing = std::thread::spawn(move || {
        let started = Instant::now();
        c2.write_back_all().unwrap();
        started.elapsed()
    });
    std::thread::sleep(SEEK / 6); // the pass is writing block 3 back
    let took = |f: &dyn Fn()| {
        let started = Instant::now();
        f();
        started.elapsed()
    };
    let through = took(&|| c.write_at(&pattern(8, BS as usize), 8 * BS, false).unwrap());
    let trim = took(&|| c.trim(10 * BS, BS).unwrap());
    let pass = flushing.join().unwrap();
    assert!(
        pass >= SEEK,
        "the pass did not write block 3 back ({pass:?})"
    );
    assert!(
        through < SEEK / 2 && trim < SEEK / 2,
        "writes straight to the backing store waited for a pass writing back block 3 ({SEEK:?} \
         per write there): write-through {through:?}, trim {trim:?}"
    );
    assert_eq!(
        c.status().dirty_blocks,
        1,
        "block 8 stays dirty until a FLUSH"
    );
    c.flush().unwrap();
    for (lba, want) in [(3, pattern(3, BS as usize)), (8, pattern(8, BS as usize))] {
        let mut b = vec![0u8; BS as usize];
        inner.read_at(&mut b, lba * BS).unwrap();
        assert!(b == want, "block {lba} is not on the backing store");
    }
    c.close().unwrap();
}

/// A write-through write of the block a pass is writing back waits for it, so the older version
/// the pass read never lands over the newer one (here the pass's backing write is slow and the
/// newer one fast: without the wait the older would land last).
#[test]
fn a_write_through_write_of_a_block_being_written_back_lands_after_it() {
    let cache_dev = Arc::new(MemDev::new(8 << 20));
    let inner = Arc::new(MemDev::new(BACKING as usize));
    let backing = Arc::new(SlowRange::new(inner.clone(), 3 * BS..4 * BS, 0));
    format_small(&*cache_dev, BACKING, Mode::WriteThrough);
    let c = Arc::new(open(cache_dev, backing.clone() as Arc<dyn BlockDev>, None).unwrap());
    let (older, newer) = (pattern(3, BS as usize), pattern(33, BS as usize));
    c.write_at(&older, 3 * BS, false).unwrap();
    backing
        .slow_writes
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let c2 = c.clone();
    let flushing = std::thread::spawn(move || c2.write_back_all().unwrap());
    std::thread::sleep(SEEK / 6); // the pass is writing the older version back
                                  // With FUA, so the newer version is clean at once and no later pass writes it back again.
    c.write_at(&newer, 3 * BS, true).unwrap();
    flushing.join().unwrap();
    c.flush().unwrap();
    let mut b = vec![0u8; BS as usize];
    inner.read_at(&mut b, 3 * BS).unwrap();
    assert!(
        b == newer,
        "the pass landed the older version over the newer write-through write"
    );
    c.read_at(&mut b, 3 * BS).unwrap();
    assert!(b == newer);
    c.close().unwrap();
}

//! Writers wait only for writers of the same blocks.
//!
//! A write of part of a block reads the rest of the block first (from the backing store when it
//! is not cached: a seek on a slow disk) and must not let another write of that block land in
//! between. Before, one lock for the whole cache did that, so one 512-byte write stalled every
//! writer for the length of its read.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flashtier_engine::{Cache, Mode};
use flashtier_io::{BlockDev, SlowDev};
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

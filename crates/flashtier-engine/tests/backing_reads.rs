//! A read of the backing store never overlaps a write of the same blocks to it.
//!
//! Neither a file's page cache nor a block device promises that a read overlapping a write sees
//! each block whole, old or new. The kill -9 crash test found a read miss in write-through mode
//! that returned a block whose first bytes were a racing write's and whose rest was older: the
//! read had looked the block up before the write mapped it, then read the backing store while
//! the write was landing there. These tests park one side at the backing store and check that
//! the other waits for it, whichever came first.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flashtier_engine::{Cache, Mode};
use flashtier_io::BlockDev;
use flashtier_testkit::MemDev;

const BACKING: u64 = 16 << 20;
const LBA: u64 = 5;
/// How long the side that must wait is watched (it would get through in well under a
/// millisecond without the lock).
const WATCH: Duration = Duration::from_millis(300);

/// A cache in `mode` over a gated backing store whose block [`LBA`] holds `old`.
fn setup(mode: Mode, old: &[u8]) -> (Arc<Cache>, Arc<Gate>, Arc<MemDev>) {
    let cache_dev = Arc::new(MemDev::new(8 << 20));
    let inner = Arc::new(MemDev::new(BACKING as usize));
    inner.write_at(old, LBA * BS, false).unwrap();
    let gate = Gate::new(inner.clone());
    format_small(&*cache_dev, BACKING, mode);
    let c = open(cache_dev, gate.clone(), None).unwrap();
    c.set_param("writeback_controller", "off").unwrap();
    (Arc::new(c), gate, inner)
}

fn backing_block(inner: &MemDev) -> Vec<u8> {
    let mut b = vec![0u8; BS as usize];
    inner.read_at(&mut b, LBA * BS).unwrap();
    b
}

fn spawn_read(c: &Arc<Cache>) -> std::thread::JoinHandle<Vec<u8>> {
    let c = c.clone();
    std::thread::spawn(move || {
        let mut b = vec![0u8; BS as usize];
        c.read_at(&mut b, LBA * BS).unwrap();
        b
    })
}

fn spawn_write(c: &Arc<Cache>, data: &[u8]) -> std::thread::JoinHandle<()> {
    let (c, data) = (c.clone(), data.to_vec());
    std::thread::spawn(move || c.write_at(&data, LBA * BS, false).unwrap())
}

fn wait_parked(gate: &Arc<Gate>, what: &str) {
    let gate = gate.clone();
    assert!(
        with_timeout(30, move || gate.wait_parked()).is_some(),
        "{what} never reached the backing store"
    );
}

/// A write that starts while a read of its block is at the backing store (a miss, or a
/// pass-through read) waits for that read before it writes there: the read returns the old
/// block whole. In every mode whose writes go to the backing store.
#[test]
fn a_backing_write_waits_for_a_read_of_its_blocks_in_flight() {
    for mode in [Mode::WriteThrough, Mode::WriteAround, Mode::PassThrough] {
        write_waits_for_read(mode);
    }
}

fn write_waits_for_read(mode: Mode) {
    let (old, new) = (pattern(1, BS as usize), pattern(2, BS as usize));
    let (c, gate, inner) = setup(mode, &old);
    gate.park_next_read_at(LBA * BS);
    let reader = spawn_read(&c);
    wait_parked(&gate, "the read miss");

    let writer = spawn_write(&c, &new);
    let until = Instant::now() + WATCH;
    while Instant::now() < until {
        assert!(
            backing_block(&inner) == old,
            "{mode:?}: the write landed on the backing store under a read of the same block"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !writer.is_finished(),
        "{mode:?}: the write did not wait for the read"
    );

    gate.release();
    assert!(
        reader.join().unwrap() == old,
        "{mode:?}: the read saw the write"
    );
    writer.join().unwrap();
    assert!(backing_block(&inner) == new);
    let mut b = vec![0u8; BS as usize];
    c.read_at(&mut b, LBA * BS).unwrap();
    assert!(b == new);
}

/// A read miss that finds a write of its block landing on the backing store waits for it (with
/// nothing pinned), then reads again and returns the new block whole.
#[test]
fn a_read_miss_waits_for_a_write_of_its_blocks_landing_on_the_backing_store() {
    let (old, new) = (pattern(3, BS as usize), pattern(4, BS as usize));
    let (c, gate, inner) = setup(Mode::WriteAround, &old);
    gate.park_next_write_at(LBA * BS);
    let writer = spawn_write(&c, &new);
    wait_parked(&gate, "the write-around write");

    let reader = spawn_read(&c);
    let until = Instant::now() + WATCH;
    while Instant::now() < until {
        assert!(
            !reader.is_finished(),
            "the read went to the backing store under a write of the same block"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(c.stats().read_miss_waits >= 1, "{:?}", c.stats());

    gate.release();
    writer.join().unwrap();
    assert!(
        reader.join().unwrap() == new,
        "the read returned the old block"
    );
    assert!(backing_block(&inner) == new);
}

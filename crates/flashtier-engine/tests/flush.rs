//! The manual flush (`Cache::write_back_all_cancellable`, behind `flashtier flush`): it writes
//! every dirty block back and leaves the backing store durable; cancelled mid-way, it stops
//! between backing writes, flushes the backing store, and marks clean only what it wrote.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use flashtier_engine::Mode;
use flashtier_io::BlockDev;
use flashtier_testkit::CrashDev;

/// Blocks written (8 runs of one block, far apart: each is its own backing write).
const LBAS: [u64; 8] = [0, 10, 20, 30, 40, 50, 60, 70];

/// A write-back cache over a gated backing store with `LBAS` dirty; returns the expected image.
fn dirty_setup() -> (
    Arc<CrashDev>,
    Arc<Gate>,
    Arc<flashtier_engine::Cache>,
    Vec<u8>,
) {
    let cdev = Arc::new(CrashDev::new(2 << 20));
    let original = pattern(7, 1 << 20);
    let bdev = Arc::new(CrashDev::from_image(original.clone()));
    let gate = Gate::new(bdev.clone());
    format_small(&*cdev, 1 << 20, Mode::WriteBack);
    let c = Arc::new(open(cdev, gate.clone(), None).unwrap());
    let mut expected = original;
    for (i, &lba) in LBAS.iter().enumerate() {
        let data = pattern(100 + i as u64, BS as usize);
        c.write_at(&data, lba * BS, false).unwrap();
        expected[(lba * BS) as usize..((lba + 1) * BS) as usize].copy_from_slice(&data);
    }
    assert_eq!(c.status().dirty_blocks, LBAS.len() as u64);
    (bdev, gate, c, expected)
}

fn block(image: &[u8], lba: u64) -> &[u8] {
    &image[(lba * BS) as usize..((lba + 1) * BS) as usize]
}

#[test]
fn flush_writes_everything_back_and_the_backing_is_durable() {
    let (bdev, _gate, c, expected) = dirty_setup();
    let never = AtomicBool::new(false);
    assert_eq!(c.write_back_all_cancellable(&never).unwrap(), 8);
    assert_eq!(c.status().dirty_blocks, 0);
    assert!(
        bdev.snapshot_durable() == expected,
        "backing store not durable"
    );
    assert!(read_all(&*c).unwrap() == expected);
    // Nothing dirty: a second flush writes nothing and succeeds.
    assert_eq!(c.write_back_all_cancellable(&never).unwrap(), 0);
}

/// Cancel while the pass's second backing write is parked: that write and the first complete,
/// the pass stops, flushes the backing store and marks only those two clean; the other six stay
/// dirty, still read correctly, and a later flush writes them back.
#[test]
fn cancelled_flush_marks_clean_only_what_it_wrote_durably() {
    let (bdev, gate, c, expected) = dirty_setup();
    // One write in flight, so "the write in flight" is exactly the parked one (with more, the
    // writes running beside it would finish and be marked clean too).
    c.set_param("writeback_max_inflight", "1").unwrap();
    let cancel = Arc::new(AtomicBool::new(false));
    gate.park_next_write_at(LBAS[1] * BS);
    let pass = {
        let (c, cancel) = (c.clone(), cancel.clone());
        std::thread::spawn(move || c.write_back_all_cancellable(&cancel))
    };
    let parked = {
        let gate = gate.clone();
        with_timeout(30, move || gate.wait_parked())
    };
    assert!(parked.is_some(), "the pass never reached its second write");
    cancel.store(true, Ordering::Release);
    gate.release();
    let written = with_timeout(30, move || pass.join().unwrap())
        .expect("the cancelled pass hung")
        .unwrap();
    assert_eq!(written, 2, "stops after the write in flight");
    assert_eq!(c.status().dirty_blocks, 6);
    let durable = bdev.snapshot_durable();
    for &lba in &LBAS[..2] {
        assert!(
            block(&durable, lba) == block(&expected, lba),
            "block {lba} marked clean but not durable on the backing store"
        );
    }
    for &lba in &LBAS[2..] {
        assert!(
            block(&durable, lba) != block(&expected, lba),
            "block {lba} was written back after the cancel"
        );
    }
    // Dirty or clean, every block reads back its latest data.
    assert!(read_all(&*c).unwrap() == expected);

    // A later flush finishes the job.
    let again = AtomicBool::new(false);
    assert_eq!(c.write_back_all_cancellable(&again).unwrap(), 6);
    assert_eq!(c.status().dirty_blocks, 0);
    assert!(bdev.snapshot_durable() == expected);
}

/// A cancel before the pass starts writes nothing and leaves everything dirty.
#[test]
fn flush_cancelled_before_it_starts_writes_nothing() {
    let (bdev, _gate, c, expected) = dirty_setup();
    let before = bdev.snapshot_durable();
    assert_eq!(
        c.write_back_all_cancellable(&AtomicBool::new(true))
            .unwrap(),
        0
    );
    assert_eq!(c.status().dirty_blocks, 8);
    assert!(bdev.snapshot_durable() == before);
    assert!(read_all(&*c).unwrap() == expected);
}

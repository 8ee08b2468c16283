//! Releasing a cache (`Cache::release`, behind `flashtier detach`): refused while dirty blocks
//! remain (nothing changes), otherwise the cache closes and its device is left holding an empty
//! cache for the same backing store, so nothing it cached can be served again.

mod common;

use std::sync::Arc;

use common::*;
use flashtier_engine::{read_superblock, Mode, ReleaseError};
use flashtier_io::BlockDev;
use flashtier_testkit::CrashDev;

const BACKING: u64 = 1 << 20;

/// A write-back cache with 16 dirty blocks written over random backing data; returns the
/// expected image.
fn dirty_cache() -> (
    Arc<CrashDev>,
    Arc<CrashDev>,
    flashtier_engine::Cache,
    Vec<u8>,
) {
    let cdev = Arc::new(CrashDev::new(2 << 20));
    let mut expected = pattern(3, BACKING as usize);
    let bdev = Arc::new(CrashDev::from_image(expected.clone()));
    format_small(&*cdev, BACKING, Mode::WriteBack);
    let c = open(cdev.clone(), bdev.clone(), None).unwrap();
    for i in 0..16u64 {
        let data = pattern(50 + i, BS as usize);
        let at = i * 7 * BS;
        c.write_at(&data, at, false).unwrap();
        expected[at as usize..(at + BS) as usize].copy_from_slice(&data);
    }
    // Read some of the backing store too: clean cached blocks, stale once it changes.
    let mut buf = vec![0u8; 64 << 10];
    c.read_at(&mut buf, 512 << 10).unwrap();
    assert_eq!(c.status().dirty_blocks, 16);
    (cdev, bdev, c, expected)
}

#[test]
fn release_after_write_back_leaves_an_empty_cache_and_a_complete_backing_store() {
    let (cdev, bdev, c, expected) = dirty_cache();
    let uuid = read_superblock(&*cdev).unwrap().uuid;
    c.set_mode(Mode::PassThrough).unwrap();
    assert_eq!(c.status().dirty_blocks, 0);
    assert!(c.status().cached_blocks > 0, "clean blocks stay cached");
    let released = c.release(false).unwrap();
    assert_eq!(released.discarded_blocks, 0);
    assert_ne!(released.superblock.uuid, uuid, "a new cache");
    assert!(
        bdev.snapshot_durable() == expected,
        "the backing store lacks written data, or it is not durable"
    );
    // A late read does not use the old index (the next cache may reuse its slots): it goes to
    // the backing store.
    let mut buf = vec![0u8; BS as usize];
    c.read_at(&mut buf, 0).unwrap();
    assert!(buf == expected[..BS as usize]);
    drop(c);

    // Reopened (as a restart or an attach would): empty, for the same backing store.
    let sb = read_superblock(&*released.device).unwrap();
    assert_eq!(sb.uuid, released.superblock.uuid);
    assert_eq!(sb.backing, ident(BACKING));
    // The backing store changes while nothing caches it.
    let changed = pattern(99, BS as usize);
    bdev.write_at(&changed, 0, false).unwrap();
    let mut expected = expected;
    expected[..BS as usize].copy_from_slice(&changed);
    let c = open(released.device, bdev, None).unwrap();
    let st = c.status();
    assert_eq!((st.cached_blocks, st.dirty_blocks), (0, 0));
    assert_eq!(c.report().cached_blocks, 0);
    assert!(
        read_all(&c).unwrap() == expected,
        "stale data after release"
    );
    c.close().unwrap();
}

#[test]
fn release_with_dirty_blocks_is_refused_unless_discarding() {
    let (cdev, bdev, c, expected) = dirty_cache();
    let original = pattern(3, BACKING as usize);
    let e = c.release(false).err().expect("refused");
    assert!(
        matches!(
            e,
            ReleaseError::Dirty {
                dirty_blocks: 16,
                block_size: 4096
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("16 dirty blocks"), "{e}");
    // Nothing changed: the cache keeps serving, dirty data included, and keeps it across a
    // restart.
    assert_eq!(c.status().dirty_blocks, 16);
    assert_eq!(c.mode(), Mode::WriteBack);
    assert!(read_all(&c).unwrap() == expected);
    c.write_at(&expected[..BS as usize], 0, false).unwrap();
    c.close().unwrap();
    let c = open(cdev.clone(), bdev.clone(), None).unwrap();
    assert!(c.status().dirty_blocks >= 16);
    assert!(read_all(&c).unwrap() == expected);

    // Discarding: the dirty blocks are gone, the backing store keeps its old contents.
    let released = c.release(true).unwrap();
    assert!(released.discarded_blocks >= 16);
    drop(c);
    assert!(bdev.snapshot_durable() == original);
    let c = open(released.device, bdev, None).unwrap();
    assert_eq!(c.status().cached_blocks, 0);
    assert!(read_all(&c).unwrap() == original);
    c.close().unwrap();
}

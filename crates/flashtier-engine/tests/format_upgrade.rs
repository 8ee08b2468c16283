//! Format version 3 added only the FREE record, so a version-2 cache (whose log holds none)
//! opens as it is and keeps its data; opening writes a version-3 superblock, which a flashtier
//! that reads only version 2 refuses. A version this build does not know is refused.

mod common;

use std::sync::Arc;

use common::*;
use flashtier_engine::internals::{checkpoint, superblock, FORMAT_VERSION};
use flashtier_engine::{Cache, EngineError, FormatError, Geometry, Mode};
use flashtier_io::BlockDev;
use flashtier_testkit::MemDev;

const BACKING: u64 = 4 << 20;

/// Rewrites the version field of a structure of `len` bytes at `offset` (checksum at its end,
/// over everything before it), if it starts with `magic`.
fn set_version(dev: &dyn BlockDev, offset: u64, len: usize, magic: &[u8], version: u32) {
    let mut b = vec![0u8; len];
    dev.read_at(&mut b, offset).unwrap();
    if &b[..magic.len()] != magic {
        return;
    }
    b[8..12].copy_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&b[..len - 4]);
    b[len - 4..].copy_from_slice(&crc.to_le_bytes());
    dev.write_at(&b, offset, false).unwrap();
}

/// Both superblock copies and both checkpoint headers as `version` wrote them.
fn write_as_version(dev: &dyn BlockDev, version: u32) {
    let geo = geometry(dev);
    for copy in 0..2 {
        set_version(
            dev,
            copy * superblock::LEN as u64,
            superblock::LEN,
            superblock::MAGIC,
            version,
        );
    }
    for slot in 0..2 {
        set_version(
            dev,
            geo.checkpoint_slot_offset(slot),
            checkpoint::HEADER_LEN,
            checkpoint::MAGIC,
            version,
        );
    }
}

/// The device's geometry, which no version changed (read from a copy of the superblock with
/// its version set back, as this build may refuse the device's).
fn geometry(dev: &dyn BlockDev) -> Geometry {
    let mut b = vec![0u8; superblock::LEN];
    dev.read_at(&mut b, 0).unwrap();
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&b[..superblock::LEN - 4]);
    b[superblock::LEN - 4..].copy_from_slice(&crc.to_le_bytes());
    superblock::Superblock::decode(&b).unwrap().geometry
}

fn check_read(c: &Cache, off: u64, want: &[u8]) {
    let mut got = vec![0u8; want.len()];
    c.read_at(&mut got, off).unwrap();
    assert!(got == want, "data read back differs at {off}");
}

fn versions(dev: &dyn BlockDev) -> [u32; 2] {
    let mut b = vec![0u8; 2 * superblock::LEN];
    dev.read_at(&mut b, 0).unwrap();
    [0, superblock::LEN].map(|at| u32::from_le_bytes(b[at + 8..at + 12].try_into().unwrap()))
}

#[test]
fn a_version_2_cache_opens_and_is_upgraded() {
    let cdev: Arc<dyn BlockDev> = Arc::new(MemDev::new(2 << 20));
    let bdev: Arc<dyn BlockDev> = Arc::new(MemDev::new(BACKING as usize));
    format_small(&*cdev, BACKING, Mode::WriteBack);
    let data = pattern(3, 256 << 10);
    let c = open(cdev.clone(), bdev.clone(), None).unwrap();
    c.write_at(&data, 64 << 10, false).unwrap();
    c.close().unwrap();
    write_as_version(&*cdev, 2);
    assert_eq!(versions(&*cdev), [2, 2]);

    let c = open(cdev.clone(), bdev.clone(), None).unwrap();
    assert!(
        c.status().dirty_blocks > 0,
        "the data is still in the cache"
    );
    check_read(&c, 64 << 10, &data);
    assert!(
        versions(&*cdev).contains(&FORMAT_VERSION),
        "opening wrote a version-{FORMAT_VERSION} superblock: {:?}",
        versions(&*cdev)
    );
    // Reclaim may now log FREE records: overwrite the whole cache a few times.
    for i in 0..12u64 {
        let round = pattern(10 + i, 512 << 10);
        c.write_at(&round, (i % 4) * (512 << 10), false).unwrap();
    }
    c.close().unwrap();
    let c = open(cdev.clone(), bdev, None).unwrap();
    let last: Vec<u8> = (8..12u64)
        .flat_map(|i| pattern(10 + i, 512 << 10))
        .collect();
    check_read(&c, 0, &last);
    c.close().unwrap();
}

#[test]
fn an_unknown_version_is_refused() {
    let cdev: Arc<dyn BlockDev> = Arc::new(MemDev::new(2 << 20));
    let bdev: Arc<dyn BlockDev> = Arc::new(MemDev::new(BACKING as usize));
    format_small(&*cdev, BACKING, Mode::WriteBack);
    for version in [1, FORMAT_VERSION + 1] {
        write_as_version(&*cdev, version);
        match open(cdev.clone(), bdev.clone(), None) {
            Err(EngineError::Format(FormatError::UnsupportedVersion(v))) => {
                assert_eq!(v, version)
            }
            Err(e) => panic!("version {version}: {e}"),
            Ok(_) => panic!("version {version} opened"),
        }
    }
}

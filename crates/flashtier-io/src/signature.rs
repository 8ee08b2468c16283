//! Recognising what a device already holds, so `format` does not destroy it by mistake: a
//! filesystem, a partition table, a volume manager's label.
//!
//! A handful of magic numbers at fixed offsets of the first 68 KiB, as `blkid`/`wipefs` find
//! them (the integration tests check each against `blkid -p` on the real tools' output). Its
//! own probe rather than libblkid: no C library to link and no bindings to keep, a table anyone
//! can review, and the question is only "is something here", not a full identification. What it
//! does not know is not refused: `format` also refuses anything holding a flashtier cache, and
//! `--force` is the override for the rest.

use std::io;

use crate::{AlignedBuf, BlockDev};

/// Bytes read from the start of a device: enough for btrfs's superblock at 64 KiB.
pub const PROBE_LEN: usize = 68 << 10;

/// A recognised signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// What it is, for a person: "an ext2/3/4 filesystem".
    pub what: &'static str,
    /// Short name, as blkid's TYPE/PTTYPE says it.
    pub name: &'static str,
    /// Where the magic is.
    pub offset: usize,
}

/// (name, description, offset, magic). Order: most specific first (a filesystem's boot sector
/// also carries the DOS 0x55AA mark).
const TABLE: &[(&str, &str, usize, &[u8])] = &[
    ("xfs", "an XFS filesystem", 0, b"XFSB"),
    ("btrfs", "a btrfs filesystem", 0x10040, b"_BHRfS_M"),
    ("ext4", "an ext2/3/4 filesystem", 0x438, &[0x53, 0xef]),
    (
        "f2fs",
        "an F2FS filesystem",
        0x400,
        &[0x10, 0x20, 0xf5, 0xf2],
    ),
    ("LVM2_member", "an LVM physical volume", 0x218, b"LVM2 001"),
    ("LVM2_member", "an LVM physical volume", 0x018, b"LVM2 001"),
    ("LVM2_member", "an LVM physical volume", 0x418, b"LVM2 001"),
    ("LVM2_member", "an LVM physical volume", 0x618, b"LVM2 001"),
    ("crypto_LUKS", "a LUKS encrypted volume", 0, b"LUKS\xba\xbe"),
    (
        "linux_raid_member",
        "an md RAID member (1.1)",
        0,
        &[0xfc, 0x4e, 0x2b, 0xa9],
    ),
    (
        "linux_raid_member",
        "an md RAID member (1.2)",
        0x1000,
        &[0xfc, 0x4e, 0x2b, 0xa9],
    ),
    (
        "bcache",
        "a bcache device",
        0x1018,
        &[
            0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba,
            0x6d, 0x81,
        ],
    ),
    ("swap", "a swap area", 0xff6, b"SWAPSPACE2"),
    ("swap", "a swap area", 0xff6, b"SWAP-SPACE"),
    ("iso9660", "an ISO 9660 filesystem", 0x8001, b"CD001"),
    ("squashfs", "a squashfs filesystem", 0, b"hsqs"),
    ("ntfs", "an NTFS filesystem", 3, b"NTFS    "),
    ("vfat", "a FAT filesystem", 0x52, b"FAT32   "),
    ("vfat", "a FAT filesystem", 0x36, b"FAT16   "),
    ("vfat", "a FAT filesystem", 0x36, b"FAT12   "),
    ("qcow2", "a qcow2 disk image", 0, b"QFI\xfb"),
    ("gpt", "a GPT partition table", 0x200, b"EFI PART"),
    ("gpt", "a GPT partition table", 0x1000, b"EFI PART"),
    (
        "dos",
        "a DOS (MBR) partition table or boot sector",
        0x1fe,
        &[0x55, 0xaa],
    ),
];

/// The signatures found in `head` (the first bytes of a device, up to [`PROBE_LEN`]).
pub fn find(head: &[u8]) -> Vec<Signature> {
    let mut found: Vec<Signature> = Vec::new();
    for &(name, what, offset, magic) in TABLE {
        if head.get(offset..offset + magic.len()) == Some(magic)
            && !found.iter().any(|s| s.name == name)
        {
            found.push(Signature { what, name, offset });
        }
    }
    // A GPT disk carries a protective MBR: one finding, not two. A filesystem's boot sector
    // (FAT, NTFS) carries the 0x55AA mark too.
    if found.iter().any(|s| s.name != "dos") {
        found.retain(|s| s.name != "dos");
    }
    found
}

/// Reads the start of `dev` and returns what it holds.
pub fn probe(dev: &dyn BlockDev) -> io::Result<Vec<Signature>> {
    let size = dev.info().size;
    let len = (PROBE_LEN as u64).min(size) as usize;
    let mut buf = AlignedBuf::zeroed(len);
    dev.read_at(&mut buf[..len], 0)?;
    Ok(find(&buf[..len]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(offset: usize, magic: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; PROBE_LEN];
        b[offset..offset + magic.len()].copy_from_slice(magic);
        b
    }

    #[test]
    fn each_signature_is_found_where_it_lives() {
        for &(name, _, offset, magic) in TABLE {
            let found = find(&with(offset, magic));
            assert_eq!(found.len(), 1, "{name} at {offset:#x}: {found:?}");
            assert_eq!(found[0].name, name);
        }
        assert!(find(&vec![0u8; PROBE_LEN]).is_empty());
        assert!(
            find(&[0u8; 100]).is_empty(),
            "a short device is probed as far as it goes"
        );
    }

    #[test]
    fn a_protective_mbr_or_a_boot_sector_is_not_a_second_finding() {
        let mut b = with(0x200, b"EFI PART");
        b[0x1fe] = 0x55;
        b[0x1ff] = 0xaa;
        let found = find(&b);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].name, "gpt");
    }
}

//! Who a file or block device is, beyond its path: what a cache records about its backing store
//! so that another disk at the same path (or the same disk at another path) is told apart, and
//! whether two paths overlap (`format --cache` onto the backing store itself).
//!
//! A fingerprint is a list of fields (`key=value`), each either *required* (a different value
//! means another disk) or *informational* (shown, and updated, when it changes). What legitimately
//! changes decides which is which:
//!
//! - **Regular file**: `ino` and `btime` (birth time, `statx(STATX_BTIME)`, nanoseconds) are
//!   required. Together they name one file of a filesystem: a file created in place of another
//!   (even one that reuses the freed inode number, which ext4 does readily) has a new birth time;
//!   a renamed or moved-within-the-filesystem file keeps both. `dev` is informational: device
//!   numbers change across reboots (btrfs subvolumes and NFS get anonymous numbers, device-mapper
//!   and md minors follow activation order). Where the filesystem reports no birth time, `dev`
//!   becomes required instead, since inode numbers alone are reused. `offset` is 0.
//! - **Loop device**: the identity of the file behind it (as above) and its `offset`: a loop
//!   device presents that file's bytes, so it *is* that file for a cache (`kind=file` either
//!   way; serving `b.img` or `/dev/loop3` over it is the same backing store). The loop device's
//!   own name is informational (`losetup -f` picks whatever number is free).
//! - **Other block devices**: the disk's `wwid` and/or `serial` from sysfs, a device-mapper
//!   `dm_uuid` (LVM volumes), and for a partition its `partition` number and `start` sector. The
//!   `/dev` name and device number are informational (`/dev/sdb` may be `/dev/sdc` after a
//!   reboot). A device that reports none of these is identified by its `path` (required).
//! - **NBD**: built by the caller from the URI (`kind=nbd`, `server`, `export`; all required);
//!   nothing on the wire identifies an export better.
//!
//! The size is compared separately by the engine.

use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// One fact about a backing store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityField {
    /// What the fact is (`kind`, `ino`, `btime`, `dev`, ...).
    pub key: String,
    /// Its value, as text.
    pub value: String,
    /// A different value means a different backing store; otherwise the field is only shown
    /// (and updated) when it changes.
    pub required: bool,
}

impl IdentityField {
    /// A fact that tells this backing store from others.
    pub fn required(key: &str, value: impl Into<String>) -> IdentityField {
        IdentityField {
            key: key.into(),
            value: value.into(),
            required: true,
        }
    }

    /// A fact only shown to people (it may change without the store changing).
    pub fn info(key: &str, value: impl Into<String>) -> IdentityField {
        IdentityField {
            key: key.into(),
            value: value.into(),
            required: false,
        }
    }
}

/// The fingerprint of the file or block device at `path` (see the module comment).
pub fn fingerprint(path: &Path) -> io::Result<Vec<IdentityField>> {
    let meta = std::fs::metadata(path)?;
    if meta.file_type().is_block_device() {
        let rdev = meta.rdev();
        if let Some(lo) = loop_backing(rdev)? {
            let mut fields = file_fields(&lo.file, lo.offset);
            fields.push(IdentityField::info("loop", path.to_string_lossy()));
            return Ok(fields);
        }
        return Ok(block_fields(path, rdev));
    }
    if meta.is_file() {
        let stx = FileStat::of(path)?;
        let mut fields = file_fields(&stx, 0);
        fields.push(IdentityField::info(
            "path",
            std::fs::canonicalize(path)?.to_string_lossy(),
        ));
        return Ok(fields);
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is neither a regular file nor a block device",
            path.display()
        ),
    ))
}

/// What a regular file is, for fingerprints and overlap checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStat {
    dev: u64,
    ino: u64,
    /// Birth time (seconds, nanoseconds), if the filesystem reports it.
    btime: Option<(i64, u32)>,
}

impl FileStat {
    fn of(path: &Path) -> io::Result<FileStat> {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: statx writes into the zeroed struct we pass; the path is NUL-terminated.
        let stx = unsafe {
            let mut stx: libc::statx = std::mem::zeroed();
            let r = libc::statx(
                libc::AT_FDCWD,
                c.as_ptr(),
                0,
                libc::STATX_INO | libc::STATX_BTIME,
                &mut stx,
            );
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            stx
        };
        let btime = (stx.stx_mask & libc::STATX_BTIME != 0)
            .then_some((stx.stx_btime.tv_sec, stx.stx_btime.tv_nsec));
        Ok(FileStat {
            dev: libc::makedev(stx.stx_dev_major, stx.stx_dev_minor),
            ino: stx.stx_ino,
            btime,
        })
    }
}

fn devno(dev: u64) -> String {
    format!("{}:{}", libc::major(dev), libc::minor(dev))
}

fn file_fields(f: &FileStat, offset: u64) -> Vec<IdentityField> {
    let mut fields = vec![
        IdentityField::required("kind", "file"),
        IdentityField::required("ino", f.ino.to_string()),
    ];
    match f.btime {
        Some((s, ns)) => {
            fields.push(IdentityField::required("btime", format!("{s}.{ns:09}")));
            fields.push(IdentityField::info("dev", devno(f.dev)));
        }
        // Without a birth time, an inode number reused by a new file would pass: the device
        // number has to match then, reboots notwithstanding.
        None => fields.push(IdentityField::required("dev", devno(f.dev))),
    }
    fields.push(IdentityField::required("offset", offset.to_string()));
    fields
}

fn block_fields(path: &Path, rdev: u64) -> Vec<IdentityField> {
    let mut fields = vec![IdentityField::required("kind", "block")];
    let dir = crate::sysfs::dev_dir(rdev);
    let partition = dir
        .as_ref()
        .and_then(|d| crate::sysfs::read(d.join("partition")));
    // A partition is identified by its disk's identity and its place on it.
    let disk = match (&dir, &partition) {
        (Some(d), Some(_)) => d.parent().map(Path::to_path_buf),
        _ => dir.clone(),
    };
    let mut strong = false;
    if let Some(disk) = &disk {
        let sources: [(&str, &[&str]); 3] = [
            ("wwid", &["wwid", "device/wwid"]),
            ("serial", &["serial", "device/serial"]),
            ("dm_uuid", &["dm/uuid"]),
        ];
        for (key, candidates) in sources {
            if let Some(v) = candidates
                .iter()
                .find_map(|c| crate::sysfs::read(disk.join(c)))
            {
                fields.push(IdentityField::required(key, v));
                strong = true;
            }
        }
    }
    if let (Some(d), Some(p)) = (&dir, partition) {
        fields.push(IdentityField::required("partition", p));
        if let Some(start) = crate::sysfs::read(d.join("start")) {
            fields.push(IdentityField::required("start", start));
        }
    }
    let name = std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .to_string_lossy()
        .into_owned();
    fields.push(if strong {
        IdentityField::info("path", name)
    } else {
        IdentityField::required("path", name)
    });
    fields.push(IdentityField::info("devno", devno(rdev)));
    fields
}

/// A loop device's backing file and where in it the device starts.
struct LoopBacking {
    file: FileStat,
    offset: u64,
}

/// `struct loop_info64` of `<linux/loop.h>` (stable ABI; not in the libc crate).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;

/// The kernel's `new_encode_dev` as `loop_info64.lo_device` carries it, back to a `dev_t`.
fn kernel_decode_dev(dev: u64) -> u64 {
    let major = ((dev & 0xfff00) >> 8) as u32;
    let minor = ((dev & 0xff) | ((dev >> 12) & 0xfff00)) as u32;
    libc::makedev(major, minor)
}

/// The backing file of loop device `rdev`, or None if it is not a loop device. The file is
/// named by `loop/backing_file` in sysfs, and checked against the inode the loop driver holds:
/// a path that now names another file (or none: "(deleted)") yields no birth time, so the
/// fingerprint cannot match one that had it.
fn loop_backing(rdev: u64) -> io::Result<Option<LoopBacking>> {
    let Some(dir) = crate::sysfs::dev_dir(rdev) else {
        return Ok(None);
    };
    let Some(name) = crate::sysfs::read(dir.join("loop/backing_file")) else {
        return Ok(None);
    };
    let dev_path = format!("/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev));
    let dev = File::open(&dev_path).or_else(|_| {
        let base = dir.file_name().unwrap_or_default().to_owned();
        File::open(Path::new("/dev").join(base))
    })?;
    // SAFETY: LOOP_GET_STATUS64 fills the loop_info64 we pass.
    let info = unsafe {
        let mut info: LoopInfo64 = std::mem::zeroed();
        if libc::ioctl(dev.as_raw_fd(), LOOP_GET_STATUS64 as _, &mut info) != 0 {
            return Err(io::Error::last_os_error());
        }
        info
    };
    let held = FileStat {
        dev: kernel_decode_dev(info.lo_device),
        ino: info.lo_inode,
        btime: None,
    };
    let file = match FileStat::of(Path::new(&name)) {
        Ok(f) if f.dev == held.dev && f.ino == held.ino => f,
        _ => held,
    };
    Ok(Some(LoopBacking {
        file,
        offset: info.lo_offset,
    }))
}

/// What holds the bytes of a path: the path's own object first, then what it is built on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    File { dev: u64, ino: u64 },
    Block(u64),
}

/// The objects a path's bytes live on: itself, then (for a block device) its whole disk if it
/// is a partition, the devices it is built on (device-mapper, md: sysfs `slaves`), and the file
/// behind a loop device.
fn stack(path: &Path) -> io::Result<Vec<Node>> {
    let meta = std::fs::metadata(path)?;
    if !meta.file_type().is_block_device() {
        return Ok(vec![Node::File {
            dev: meta.dev(),
            ino: meta.ino(),
        }]);
    }
    let mut out = Vec::new();
    let mut todo = vec![meta.rdev()];
    while let Some(rdev) = todo.pop() {
        if out.contains(&Node::Block(rdev)) || out.len() > 64 {
            continue;
        }
        out.push(Node::Block(rdev));
        if let Ok(Some(lo)) = loop_backing(rdev) {
            out.push(Node::File {
                dev: lo.file.dev,
                ino: lo.file.ino,
            });
        }
        let Some(dir) = crate::sysfs::dev_dir(rdev) else {
            continue;
        };
        let mut below: Vec<PathBuf> = Vec::new();
        if dir.join("partition").exists() {
            below.extend(dir.parent().map(Path::to_path_buf));
        }
        if let Ok(slaves) = std::fs::read_dir(dir.join("slaves")) {
            below.extend(
                slaves
                    .flatten()
                    .filter_map(|e| e.path().canonicalize().ok()),
            );
        }
        for d in below {
            if let Some((maj, min)) = crate::sysfs::read(d.join("dev")).and_then(|s| {
                let (a, b) = s.split_once(':')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            }) {
                todo.push(libc::makedev(maj, min));
            }
        }
    }
    Ok(out)
}

/// Whether writing to `a` may overwrite `b` or the other way round: the same file (by any
/// path or hard link), the same device, a disk and one of its partitions, a device and the
/// device-mapper or md device built on it, a loop device and its file, two loop devices over
/// one file. Two partitions of one disk, or two volumes of one volume group, do not overlap.
pub fn overlaps(a: &Path, b: &Path) -> io::Result<bool> {
    let (sa, sb) = (stack(a)?, stack(b)?);
    let shares_file = sa
        .iter()
        .any(|n| matches!(n, Node::File { .. }) && sb.contains(n));
    Ok(sb.contains(&sa[0]) || sa.contains(&sb[0]) || shares_file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(fields: &'a [IdentityField], key: &str) -> Option<&'a IdentityField> {
        fields.iter().find(|f| f.key == key)
    }

    #[test]
    fn a_file_is_its_inode_and_birth_time_and_a_replacement_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let first = fingerprint(&path).unwrap();
        assert_eq!(get(&first, "kind").unwrap().value, "file");
        assert!(get(&first, "ino").unwrap().required);
        assert_eq!(get(&first, "offset").unwrap().value, "0");
        // Same file, another name: the required fields stay.
        let moved = dir.path().join("moved.img");
        std::fs::rename(&path, &moved).unwrap();
        let again = fingerprint(&moved).unwrap();
        let required = |f: &[IdentityField]| -> Vec<IdentityField> {
            f.iter().filter(|f| f.required).cloned().collect()
        };
        assert_eq!(required(&first), required(&again));
        assert_ne!(get(&first, "path"), get(&again, "path"));
        // A new file where the old one was (ext4 may hand out the same inode number).
        std::fs::remove_file(&moved).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let other = fingerprint(&path).unwrap();
        assert_ne!(required(&first), required(&other));
    }

    #[test]
    fn without_a_birth_time_the_device_number_is_required() {
        let f = FileStat {
            dev: libc::makedev(8, 1),
            ino: 12,
            btime: None,
        };
        let fields = file_fields(&f, 0);
        assert_eq!(
            get(&fields, "dev").unwrap(),
            &IdentityField::required("dev", "8:1")
        );
        let with = file_fields(
            &FileStat {
                btime: Some((1, 2)),
                ..f
            },
            4096,
        );
        assert_eq!(
            get(&with, "dev").unwrap(),
            &IdentityField::info("dev", "8:1")
        );
        assert_eq!(get(&with, "btime").unwrap().value, "1.000000002");
        assert_eq!(get(&with, "offset").unwrap().value, "4096");
    }

    #[test]
    fn kernel_device_numbers_decode() {
        // new_encode_dev(MKDEV(259, 70000)).
        let (major, minor) = (259u64, 70000u64);
        let enc = (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12);
        assert_eq!(kernel_decode_dev(enc), libc::makedev(259, 70000));
    }

    #[test]
    fn the_same_file_by_another_path_overlaps_and_another_file_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, link, sym) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("hard"),
            dir.path().join("sym"),
        );
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        std::fs::hard_link(&a, &link).unwrap();
        std::os::unix::fs::symlink(&a, &sym).unwrap();
        assert!(overlaps(&a, &a).unwrap());
        assert!(overlaps(&a, &link).unwrap());
        assert!(overlaps(&sym, &a).unwrap());
        assert!(!overlaps(&a, &b).unwrap());
    }
}

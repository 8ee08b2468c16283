//! What the kernel says of a block device in sysfs (`/sys/dev/block/MAJ:MIN`): shared by the
//! identity fingerprint, `FileDev`'s rotational flag and `flashtier probe`'s device report.

use std::path::{Path, PathBuf};

/// `/sys/dev/block/MAJ:MIN` for device number `devno`, resolved (so `..` of a partition is its
/// disk). None when the kernel has no such block device (a file on tmpfs, FUSE or NFS has a
/// `st_dev` that is not one).
pub fn dev_dir(devno: u64) -> Option<PathBuf> {
    std::fs::canonicalize(format!(
        "/sys/dev/block/{}:{}",
        libc::major(devno),
        libc::minor(devno)
    ))
    .ok()
}

/// The whole disk holding `devno`: its own directory, or its parent's for a partition (whose
/// `queue/` and `device/` attributes are the disk's).
pub fn disk_dir(devno: u64) -> Option<PathBuf> {
    let dir = dev_dir(devno)?;
    if read(dir.join("partition")).is_some() {
        return dir.parent().map(Path::to_path_buf);
    }
    Some(dir)
}

/// An attribute's value, trimmed; None when it is absent, unreadable or empty.
pub fn read(path: impl AsRef<Path>) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

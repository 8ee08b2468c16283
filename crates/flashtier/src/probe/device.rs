//! What the device says of itself, from sysfs: the block device itself, or for a file the one
//! its filesystem lives on (`st_dev`), and for a partition its disk's `queue/` and `device/`.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use flashtier_io::sysfs;

/// Device names whose storage is RAM: a fast flush there is genuine, not a dropped one.
const RAM_DEVICES: &[&str] = &["ram", "zram", "pmem", "nullb", "brd"];

/// Everything is optional: a file on tmpfs, FUSE or NFS has no block device behind it, and
/// not every driver fills every attribute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFacts {
    /// Kernel name of the disk, e.g. `nvme0n1`, `vda`, `loop3`.
    pub name: Option<String>,
    pub model: Option<String>,
    pub rotational: Option<bool>,
    /// `queue/write_cache`: "write back" (a volatile cache that FLUSH empties) or "write
    /// through".
    pub write_cache: Option<String>,
    pub fua: Option<bool>,
    /// 0: no discard.
    pub discard_max_bytes: Option<u64>,
    /// A RAM disk (zram, brd, pmem, null_blk).
    pub ram_backed: bool,
}

impl DeviceFacts {
    pub fn volatile_write_cache(&self) -> bool {
        self.write_cache.as_deref() == Some("write back")
    }
}

/// The facts for `path` (a file or a block device). Never fails: what cannot be read is None.
pub fn facts(path: &Path) -> DeviceFacts {
    let Ok(meta) = std::fs::metadata(path) else {
        return DeviceFacts::default();
    };
    let devno = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let Some(disk) = sysfs::disk_dir(devno) else {
        // A filesystem without a block device (tmpfs, FUSE, NFS): nothing to report.
        return DeviceFacts::default();
    };
    let read = |attr: &str| sysfs::read(disk.join(attr));
    let name = disk.file_name().map(|n| n.to_string_lossy().into_owned());
    let ram_backed = name
        .as_deref()
        .is_some_and(|n| RAM_DEVICES.iter().any(|r| n.starts_with(r)));
    DeviceFacts {
        model: read("device/model").or_else(|| read("device/name")),
        rotational: read("queue/rotational").map(|v| v == "1"),
        write_cache: read("queue/write_cache"),
        fua: read("queue/fua").map(|v| v == "1"),
        discard_max_bytes: read("queue/discard_max_bytes").and_then(|v| v.parse().ok()),
        ram_backed,
        name,
    }
}

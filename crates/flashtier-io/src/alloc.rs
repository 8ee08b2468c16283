//! Reserving a file's space up front: a cache file must not run out of room while it holds the
//! only copy of acknowledged writes, so `format` allocates all of it before writing anything
//! (a sparse file on a filesystem smaller than it fails later, in the middle of the log).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Creates `path` (which must not exist) as a file of `size` bytes with every byte allocated.
/// Refuses with `ENOSPC` (removing the file again) when the filesystem cannot hold it.
pub fn create_allocated_file(path: &Path, size: u64) -> io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    allocate(&file, size).inspect_err(|_| {
        drop(std::fs::remove_file(path));
    })
}

/// Allocates every block of an existing regular file's first `size` bytes (holes are filled
/// with zeroes, data is left alone). Fails with `ENOSPC` when the space is not there; what was
/// allocated by then stays allocated.
pub fn allocate_existing(path: &Path, size: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    allocate(&file, size)
}

fn allocate(file: &File, size: u64) -> io::Result<()> {
    if size == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // posix_fallocate rather than fallocate: where the filesystem cannot preallocate, glibc
    // writes the blocks instead, so the space is reserved either way.
    // SAFETY: plain syscall wrapper on an fd we own; it returns the error number.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Bytes a file's blocks take on its filesystem (less than its size when it is sparse).
pub fn allocated_bytes(path: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata(path)?.blocks() * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_created_file_is_fully_allocated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        create_allocated_file(&path, 8 << 20).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 << 20);
        assert!(allocated_bytes(&path).unwrap() >= 8 << 20);
        // create_new: an existing file is never truncated.
        let e = create_allocated_file(&path, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
    }

    #[test]
    fn allocating_a_sparse_file_keeps_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let f = File::create(&path).unwrap();
        f.set_len(4 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"keep", 1 << 20).unwrap();
        drop(f);
        allocate_existing(&path, 4 << 20).unwrap();
        assert!(allocated_bytes(&path).unwrap() >= 4 << 20);
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[1 << 20..(1 << 20) + 4], b"keep");
        assert_eq!(data.len(), 4 << 20);
    }
}

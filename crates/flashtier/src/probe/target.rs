//! What the probe may write: a scratch file it creates (and removes), or, with `--destructive`,
//! the existing file or block device the user named. Everything else is refused before a byte
//! is written.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use flashtier_io::{signature, AlignedBuf};

use crate::units::fmt_bytes;

/// The smallest target worth probing: the sequential write wants 16 MiB to run on before the
/// random tests spread over it.
pub const MIN_SIZE: u64 = 16 << 20;

/// Bytes read at each end of a block device to decide whether it holds data: partition tables
/// and most filesystems mark the start, GPT's backup and md/LVM metadata the end.
const DATA_CHECK_LEN: usize = 1 << 20;

/// The file or device under test.
pub struct Target {
    pub path: PathBuf,
    pub size: u64,
    pub kind: Kind,
    /// For a block device: the descriptor opened with O_EXCL, held for the whole probe so the
    /// device cannot be mounted or claimed meanwhile (and is refused if it already is).
    _claim: Option<File>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Created by the probe, removed when the target is dropped (errors and Ctrl-C included).
    Scratch,
    /// An existing regular file (`--destructive`).
    File,
    BlockDevice,
}

impl Kind {
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Scratch => "scratch file",
            Kind::File => "existing file",
            Kind::BlockDevice => "block device",
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if self.kind == Kind::Scratch {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!("cannot remove scratch file {}: {e}", self.path.display());
            }
        }
    }
}

/// Resolves PATH as `flashtier probe` takes it: a directory (a scratch file of `size` in it), a
/// path that does not exist (created as the scratch file), or an existing regular file or block
/// device, which is refused when it holds data unless `destructive`.
pub fn open(path: &Path, size: u64, destructive: bool) -> anyhow::Result<Target> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return create_scratch(path.to_path_buf(), size)
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!("cannot stat {}", path.display())))
        }
    };
    if meta.is_dir() {
        return scratch_in(path, size);
    }
    if meta.file_type().is_block_device() {
        return block_device(path, destructive, true);
    }
    if !meta.is_file() {
        bail!(
            "{} is neither a directory, a regular file nor a block device",
            path.display()
        );
    }
    if !destructive {
        bail!(
            "{} is an existing file of {}: probing it would overwrite its data. Give a directory \
             (a scratch file is created there and removed afterwards) or a path that does not \
             exist, or pass --destructive to overwrite it",
            path.display(),
            fmt_bytes(meta.len())
        );
    }
    check_size(path, meta.len())?;
    Ok(Target {
        path: path.to_path_buf(),
        size: meta.len(),
        kind: Kind::File,
        _claim: None,
    })
}

/// A scratch file of `size` with an unpredictable name in `dir`.
pub fn scratch_in(dir: &Path, size: u64) -> anyhow::Result<Target> {
    let mut last = None;
    for _ in 0..8 {
        let name = format!(".flashtier-probe-{:016x}", random_u64());
        match create_scratch(dir.join(name), size) {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried at least once"))
}

/// A block device the caller has already checked and claimed (`format`, which holds it with
/// O_EXCL and is about to overwrite it): no data check and no claim of its own.
pub fn claimed_device(path: &Path) -> anyhow::Result<Target> {
    block_device(path, true, false)
}

fn create_scratch(path: PathBuf, size: u64) -> anyhow::Result<Target> {
    check_size(&path, size)?;
    // create_new (O_EXCL): never a file or link someone else put there; allocated in full, so
    // a filesystem without the room says so now rather than in the middle of a test.
    match flashtier_io::create_allocated_file(&path, size) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => bail!(
            "the filesystem holding {} has less than {} free: pass a smaller --size (nothing was \
             left behind)",
            path.display(),
            fmt_bytes(size)
        ),
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("cannot create scratch file {}", path.display())))
        }
    }
    tracing::debug!("scratch file {}", path.display());
    Ok(Target {
        path,
        size,
        kind: Kind::Scratch,
        _claim: None,
    })
}

fn block_device(path: &Path, destructive: bool, claim: bool) -> anyhow::Result<Target> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true);
    if claim {
        // A mounted device, or one another program holds exclusively, fails with EBUSY: never
        // probed, not even with --destructive.
        opts.custom_flags(libc::O_EXCL);
    }
    let mut file = opts
        .open(path)
        .with_context(|| format!("cannot open {} (mounted or in use?)", path.display()))?;
    let size = file
        .seek(SeekFrom::End(0))
        .with_context(|| format!("cannot size {}", path.display()))?;
    check_size(path, size)?;
    if !destructive {
        if let Some(what) =
            holds_data(&file, size).with_context(|| format!("cannot read {}", path.display()))?
        {
            bail!(
                "{} holds {what}: probing it would destroy it. Pass --destructive to overwrite it \
                 anyway, or probe a directory on a filesystem instead",
                path.display()
            );
        }
    }
    Ok(Target {
        path: path.to_path_buf(),
        size,
        kind: Kind::BlockDevice,
        _claim: claim.then_some(file),
    })
}

/// What the device holds, if anything: a known signature, else any non-zero byte in its first
/// or last MiB.
fn holds_data(file: &File, size: u64) -> std::io::Result<Option<String>> {
    let len = (DATA_CHECK_LEN as u64).min(size) as usize;
    let mut buf = AlignedBuf::zeroed(len);
    file.read_exact_at(&mut buf, 0)?;
    if let Some(sig) = signature::find(&buf).first() {
        return Ok(Some(format!(
            "{} (`{}` signature at byte {})",
            sig.what, sig.name, sig.offset
        )));
    }
    if buf.iter().any(|&b| b != 0) {
        return Ok(Some("data (non-zero bytes in its first MiB)".into()));
    }
    file.read_exact_at(&mut buf, size - len as u64)?;
    if buf.iter().any(|&b| b != 0) {
        return Ok(Some("data (non-zero bytes in its last MiB)".into()));
    }
    Ok(None)
}

fn check_size(path: &Path, size: u64) -> anyhow::Result<()> {
    if size < MIN_SIZE {
        bail!(
            "{} is {}: the probe needs at least {}",
            path.display(),
            fmt_bytes(size),
            fmt_bytes(MIN_SIZE)
        );
    }
    Ok(())
}

pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom fills at most b.len() bytes of the buffer we own.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // Only uniqueness matters here (the file is created O_EXCL): fall back to the clock.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return t.as_nanos() as u64 ^ (std::process::id() as u64) << 32;
    }
    u64::from_ne_bytes(b)
}

//! `flashtier format`: write a new, empty cache onto a file or device for one backing store.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use anyhow::{bail, Context};
use clap::Args;
use flashtier_engine::{
    format, read_superblock, BackingIdentity, EngineError, FormatError, FormatOptions, Mode,
    ReclaimPolicy, DEFAULT_BLOCK_SIZE,
};
use flashtier_io::{signature, write_zero_buffers, AlignedBuf, BlockDev, ZeroOpts};

use crate::backing::{
    backing_identity, open_backing, open_cache_device, refuse_backing_as_cache, BackingOptions,
};
use crate::units::{fmt_bytes, parse_size};

#[derive(Args, Debug)]
pub struct FormatArgs {
    /// Cache file or block device (an SSD). A file that does not exist is created with --size.
    #[arg(long, value_name = "FILE|DEVICE")]
    pub cache: String,

    /// The backing store this cache will serve: a file, a block device, or an NBD URI. The cache
    /// remembers it and refuses to attach to anything else.
    #[arg(long, value_name = "PATH|NBD-URI")]
    pub backing: String,

    /// Size of the cache file to create (e.g. 8G). Only for a cache file that does not exist yet.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,

    /// Cache block size: the unit of caching (a power of two from 4096 to 65536).
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE, value_parser = parse_block_size)]
    pub block_size: u32,

    /// Segment size: the unit of log allocation and reclaim (a multiple of the block size, at
    /// least 16 blocks; 4M suits most SSDs).
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub segment_size: u64,

    /// Mode the cache starts in when `serve` is not given --mode.
    #[arg(long, default_value_t = Mode::WriteBack)]
    pub mode: Mode,

    /// Which segments reclaim empties first: lru (least recently read; recently read blocks are
    /// kept) or fifo (oldest).
    #[arg(long, default_value_t = ReclaimPolicy::Lru)]
    pub reclaim: ReclaimPolicy,

    /// Overwrite what the device holds: an existing flashtier cache (anything it held that was
    /// not written back to its backing store is lost), a filesystem, a partition table, a
    /// volume label. Without it, format refuses each of these, naming what it found. It never
    /// formats the backing store itself.
    #[arg(long)]
    pub force: bool,

    /// Skip the quick probe (about 2 s) of the cache device before formatting: fdatasync
    /// latency, random and sequential writes, as `flashtier probe` measures them, with a
    /// warning when the device looks unfit for a write-back cache (never an error). A cache
    /// file is probed through a scratch file in its directory, a block device directly.
    #[arg(long)]
    pub no_probe: bool,

    /// For a cache file: skip writing zeroes over all of it. By default format writes every
    /// block of a cache file once (one sequential pass), because a block the file system holds
    /// allocated but unwritten (a new file, or a zeroed range) costs on its first write: the
    /// file system records the block as written, and the next FLUSH commits its journal for it.
    /// Skipped, format is quicker (the pass took 0.35 s per GiB on the disk it was measured
    /// on), but until the log has written the whole file once, writes and FLUSHes are slower
    /// (measured on ext4, 4K write + FLUSH at QD1 on a new cache: FLUSH p50 151 µs instead of
    /// 66 µs). A block device is never written over: it is zeroed by discarding.
    #[arg(long)]
    pub no_prewrite: bool,
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let n = parse_size(s)?;
    if !n.is_power_of_two() || !(4096..=65536).contains(&n) {
        return Err("must be a power of two from 4096 to 65536".into());
    }
    Ok(n as u32)
}

pub fn run(args: FormatArgs) -> anyhow::Result<()> {
    let segment_size = u32::try_from(args.segment_size)
        .ok()
        .filter(|s| *s <= 1 << 30)
        .context("--segment-size must be at most 1G")?;
    let path = Path::new(&args.cache);
    let exists = path.exists();
    match (exists, args.size) {
        (false, None) => bail!(
            "{} does not exist: pass --size to create a cache file of that size",
            args.cache
        ),
        (true, Some(_)) => bail!(
            "{} already exists: --size only applies when creating a new cache file",
            args.cache
        ),
        _ => {}
    }
    let backing = open_backing(
        &args.backing,
        BackingOptions {
            direct: false,
            read_only: true,
        },
    )?;
    let identity = backing_identity(&args.backing, backing.info().size)?;
    drop(backing);
    let Some(size) = args.size else {
        // Never, not even with --force: no setup works with the cache on its own backing store.
        refuse_backing_as_cache(&args.cache, &args.backing)?;
        return format_device(&args, segment_size, identity, true);
    };
    // A geometry that cannot fit is refused before anything is created.
    flashtier_engine::Geometry::compute(size, args.block_size, segment_size)?;
    create_cache_file(path, size)?;
    let formatted = format_device(&args, segment_size, identity, false);
    if formatted.is_err() {
        drop(std::fs::remove_file(path));
    }
    formatted
}

/// Formats the cache device; `existed`: it held something before (checked, then allocated if
/// it is a file).
fn format_device(
    args: &FormatArgs,
    segment_size: u32,
    identity: BackingIdentity,
    existed: bool,
) -> anyhow::Result<()> {
    let dev = open_cache_device(&args.cache)?;
    if existed && !args.force {
        refuse_to_destroy(&args.cache, &*dev)?;
    }
    if !args.no_probe {
        quick_probe(&args.cache);
    }
    if existed && std::fs::metadata(&args.cache)?.is_file() {
        allocate_cache_file(Path::new(&args.cache), dev.info().size)?;
    }
    clear_device(&*dev, &args.cache, !args.no_prewrite)?;

    let sb = format(
        &*dev,
        identity,
        FormatOptions {
            block_size: args.block_size,
            segment_size,
            mode: args.mode,
            reclaim: args.reclaim,
        },
    )
    .with_context(|| format!("cannot format {}", args.cache))?;
    let g = sb.geometry;
    let data = g.segment_count as u64 * g.segment_size as u64;
    let blocks = g.slot_count() as u64;
    println!(
        "flashtier: formatted {} ({}) as a cache for {} ({})",
        args.cache,
        fmt_bytes(dev.info().size),
        sb.backing.name,
        fmt_bytes(sb.backing.size)
    );
    println!(
        "flashtier: {} segments of {}, {} blocks of {} ({} of cache space), mode {}, reclaim {}",
        g.segment_count,
        fmt_bytes(g.segment_size as u64),
        blocks,
        fmt_bytes(g.block_size as u64),
        fmt_bytes(data),
        sb.default_mode,
        sb.reclaim
    );
    println!(
        "flashtier: the index will need about {} of RAM when the cache is full",
        fmt_bytes(blocks * 13)
    );
    Ok(())
}

/// Probes the cache device and warns when it looks unfit; a probe that cannot run is reported
/// and skipped: it never stops a format.
fn quick_probe(cache: &str) {
    let block = std::fs::metadata(cache).is_ok_and(|m| m.file_type().is_block_device());
    match crate::probe::quick(Path::new(cache), block) {
        Ok(v) if v.level == crate::probe::Level::Ok => {}
        Ok(v) => {
            eprintln!(
                "flashtier: warning: {cache} looks {} for a write-back cache device ({}); \
                 `flashtier probe` measures it in full:",
                if v.level == crate::probe::Level::Unfit {
                    "unfit"
                } else {
                    "poor"
                },
                v.level.as_str()
            );
            for r in &v.reasons {
                eprintln!("flashtier: warning:   - {r}");
            }
        }
        Err(e) => eprintln!(
            "flashtier: warning: the quick probe of {cache} did not run: {}",
            crate::error_chain(&e)
        ),
    }
}

/// Clears what the device held, so that nothing of it is mistaken for part of the new cache
/// or for what the device was before: another tool's signatures (blkid, mount and udev look
/// at the start and the end), an earlier cache's batch headers (the dirty-data scan would
/// count them if this cache's superblocks were ever lost). The ends are written; the rest of a
/// cache file is written with zeroes when `prewrite` (see `--no-prewrite`: a file zeroed with
/// `FALLOC_FL_ZERO_RANGE`, or just allocated, has unwritten blocks, and each first write to
/// one costs the file system a journal commit at the next FLUSH), else zeroed with
/// `FALLOC_FL_ZERO_RANGE`, which keeps it allocated; a block device's by a zeroing discard
/// where it has one, else it is left as it is.
fn clear_device(dev: &dyn BlockDev, name: &str, prewrite: bool) -> anyhow::Result<()> {
    let size = dev.info().size;
    let len = (signature::PROBE_LEN as u64).min(size);
    let zeroes = AlignedBuf::zeroed(len as usize);
    let tail = (size - len) / 4096 * 4096;
    for at in [0, tail] {
        dev.write_at(&zeroes[..len.min(size - at) as usize], at, false)
            .with_context(|| format!("cannot clear {name}"))?;
    }
    let block = std::fs::metadata(name).is_ok_and(|m| !m.is_file());
    if prewrite && !block {
        if tail > len {
            eprintln!(
                "flashtier: writing zeroes over {name} once ({}), so that the cache's first \
                 writes do not allocate blocks on the file system (--no-prewrite skips this)",
                fmt_bytes(size)
            );
            write_zero_buffers(dev, len, tail - len, true)
                .with_context(|| format!("cannot write zeroes over {name}"))?;
        }
        return Ok(());
    }
    let zeroed = dev.write_zeroes(
        0,
        size,
        ZeroOpts {
            may_trim: block,
            fast_only: true,
            fua: false,
        },
    );
    if let Err(e) = zeroed.or_else(|_| if block { dev.trim(0, size) } else { Ok(()) }) {
        tracing::debug!("{name} not zeroed ahead of the format: {e}");
    }
    Ok(())
}

/// Creates the cache file with all its space allocated: a sparse cache on a filesystem that
/// cannot hold it would fail later, while it holds acknowledged writes.
fn create_cache_file(path: &Path, size: u64) -> anyhow::Result<()> {
    match flashtier_io::create_allocated_file(path, size) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => bail!(
            "cannot create a {} cache file {}: its filesystem has only {} free (nothing was \
             created)",
            fmt_bytes(size),
            path.display(),
            free_space(path).map_or_else(|| "less".into(), fmt_bytes)
        ),
        Err(e) => {
            Err(anyhow::Error::new(e)
                .context(format!("cannot create cache file {}", path.display())))
        }
    }
}

/// Allocates an existing (perhaps sparse) cache file's every block before anything is written.
fn allocate_cache_file(path: &Path, size: u64) -> anyhow::Result<()> {
    let missing = size.saturating_sub(flashtier_io::allocated_bytes(path)?);
    match flashtier_io::allocate_existing(path, size) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => bail!(
            "{} is sparse and its filesystem cannot hold it: {} more are needed, {} are free \
             (nothing was formatted)",
            path.display(),
            fmt_bytes(missing),
            free_space(path).map_or_else(|| "less".into(), fmt_bytes)
        ),
        Err(e) => {
            Err(anyhow::Error::new(e)
                .context(format!("cannot allocate cache file {}", path.display())))
        }
    }
}

/// Bytes available to us on the filesystem holding `path` (or its directory).
fn free_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let dir = if path.exists() {
        path.to_path_buf()
    } else {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct we pass; the path is NUL-terminated.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut st) == 0).then(|| st.f_bavail * st.f_frsize)
    }
}

/// Refuses (without --force) a device holding anything `format` would destroy: a flashtier
/// cache (damaged or not, of any version), a filesystem, a partition table or volume label, or
/// the log of a cache whose superblocks are gone that still holds dirty data.
fn refuse_to_destroy(name: &str, dev: &dyn BlockDev) -> anyhow::Result<()> {
    let damaged = match read_superblock(dev) {
        Ok(sb) => bail!(
            "{name} already holds a flashtier cache for '{}' ({}); blocks not yet written back to \
             that backing store would be lost. To keep them, first run `flashtier serve --cache \
             {name} --backing {} --mode passthrough` (which writes them back), then format with \
             --force",
            sb.backing.name,
            fmt_bytes(sb.backing.size),
            sb.backing.name
        ),
        Err(EngineError::Format(FormatError::UnsupportedVersion(v))) => bail!(
            "{name} holds a flashtier cache of format version {v}, written by another flashtier \
             version; use that version to write its data back, or pass --force to overwrite it"
        ),
        Err(EngineError::Format(FormatError::Corrupt(why))) => Some(why),
        Err(EngineError::Format(FormatError::NotACache)) => None,
        Err(e) => return Err(anyhow::Error::new(e).context(format!("cannot read {name}"))),
    };
    if damaged.is_none() {
        let found = signature::probe(dev).with_context(|| format!("cannot read {name}"))?;
        if let Some(sig) = found.first() {
            bail!(
                "{name} holds {} (`{}` signature at byte {}); formatting it would destroy it. \
                 Pass --force to overwrite it anyway",
                sig.what,
                sig.name,
                sig.offset
            );
        }
    }
    let size = dev.info().size;
    if size >= 1 << 30 {
        tracing::info!(
            "reading {name} ({}) for the log of an earlier cache (--force skips this)",
            fmt_bytes(size)
        );
    }
    let mut next_report = 10;
    let scan = flashtier_engine::scan(dev, |done, total| {
        if total >= 1 << 30 && done * 100 >= next_report * total {
            tracing::info!("{next_report}% read");
            next_report += 10;
        }
    })
    .with_context(|| format!("cannot read {name}"))?;
    let traces = if scan.found_dirty() {
        format!(
            "its log still holds dirty data: up to {} blocks in {} batch records and {} in its \
             last checkpoint, which may be the only copy of writes its backing store never \
             received",
            scan.dirty_log_blocks, scan.batches, scan.dirty_checkpoint_blocks
        )
    } else {
        String::new()
    };
    match (damaged, traces.is_empty()) {
        (Some(why), true) => {
            bail!("{name} holds a damaged flashtier cache ({why}); pass --force to overwrite it")
        }
        (Some(why), false) => bail!(
            "{name} holds a damaged flashtier cache ({why}) and {traces}; pass --force to \
             overwrite it"
        ),
        (None, false) => bail!(
            "{name} holds the remains of a flashtier cache whose superblocks are gone, and \
             {traces}; pass --force to overwrite it"
        ),
        (None, true) => Ok(()),
    }
}

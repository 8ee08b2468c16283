//! `flashtier format`: write a new, empty cache onto a file or device for one backing store.

use std::path::Path;

use anyhow::{bail, Context};
use clap::Args;
use flashtier_engine::{
    format, read_superblock, EngineError, FormatError, FormatOptions, Mode, ReclaimPolicy,
    DEFAULT_BLOCK_SIZE,
};

use crate::backing::{backing_identity, open_backing, open_cache_device, BackingOptions};
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

    /// Overwrite an existing flashtier cache. Anything it held that was not written back to its
    /// backing store is lost.
    #[arg(long)]
    pub force: bool,
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
    match (path.exists(), args.size) {
        (false, Some(size)) => {
            flashtier_io::create_sparse_file(path, size)
                .with_context(|| format!("cannot create cache file {}", args.cache))?;
        }
        (false, None) => bail!(
            "{} does not exist: pass --size to create a cache file of that size",
            args.cache
        ),
        (true, Some(_)) => bail!(
            "{} already exists: --size only applies when creating a new cache file",
            args.cache
        ),
        (true, None) => {}
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
    let dev = open_cache_device(&args.cache)?;

    match read_superblock(&*dev) {
        Ok(sb) if !args.force => bail!(
            "{} already holds a flashtier cache for '{}' ({}); blocks not yet written back to \
             that backing store would be lost. To keep them, first run `flashtier serve --cache \
             {} --backing {} --mode passthrough` (which writes them back), then format with \
             --force",
            args.cache,
            sb.backing.name,
            fmt_bytes(sb.backing.size),
            args.cache,
            sb.backing.name
        ),
        Err(EngineError::Format(FormatError::UnsupportedVersion(v))) if !args.force => bail!(
            "{} holds a flashtier cache of format version {v}, written by another flashtier \
             version; use that version to write its data back, or pass --force to overwrite it",
            args.cache
        ),
        Err(EngineError::Format(FormatError::Corrupt(why))) if !args.force => bail!(
            "{} holds a damaged flashtier cache ({why}); pass --force to overwrite it",
            args.cache
        ),
        _ => {}
    }

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

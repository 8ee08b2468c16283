//! Opening the backing store named on the command line: a file, a block device, or an NBD URI.

use std::sync::Arc;

use anyhow::Context;
use flashtier_io::{BlockDev, FileDev, FileOptions};
use flashtier_nbd::{NbdClient, NbdUri};

#[derive(Debug, Clone, Copy, Default)]
pub struct BackingOptions {
    /// O_DIRECT for files and block devices.
    pub direct: bool,
    pub read_only: bool,
}

pub fn open_backing(spec: &str, opts: BackingOptions) -> anyhow::Result<Arc<dyn BlockDev>> {
    if NbdUri::is_uri(spec) {
        if opts.direct {
            tracing::warn!("--direct has no effect on an NBD backing store");
        }
        let client = NbdClient::connect(spec)
            .with_context(|| format!("cannot open NBD backing store {spec}"))?;
        return Ok(Arc::new(client));
    }
    let dev = FileDev::open(
        spec,
        FileOptions {
            direct: opts.direct,
            read_only: opts.read_only,
        },
    )
    .with_context(|| format!("cannot open backing store {spec}"))?;
    Ok(Arc::new(dev))
}

/// What a cache records about the backing store it serves: its size and a stable name (the
/// canonical path of a file or device, or the NBD URI as given).
pub fn backing_identity(
    spec: &str,
    size: u64,
) -> anyhow::Result<flashtier_engine::BackingIdentity> {
    let name = if NbdUri::is_uri(spec) {
        spec.to_string()
    } else {
        std::fs::canonicalize(spec)
            .with_context(|| format!("cannot resolve backing store path {spec}"))?
            .to_string_lossy()
            .into_owned()
    };
    Ok(flashtier_engine::BackingIdentity { size, name })
}

/// Opens a cache file or device with O_DIRECT: the cache decides what is durable, not the page
/// cache. Filesystems without O_DIRECT (tmpfs) fall back to buffered I/O with a warning; syncs
/// still make data durable, but the page cache then holds a second copy of everything.
pub fn open_cache_device(path: &str) -> anyhow::Result<Arc<dyn BlockDev>> {
    let opts = FileOptions {
        direct: true,
        read_only: false,
    };
    match FileDev::open(path, opts) {
        Ok(dev) => Ok(Arc::new(dev)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(
                path,
                "O_DIRECT is not supported here; using buffered I/O for the cache"
            );
            let dev = FileDev::open(path, FileOptions::default())
                .with_context(|| format!("cannot open cache device {path}"))?;
            Ok(Arc::new(dev))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot open cache device {path}"))),
    }
}

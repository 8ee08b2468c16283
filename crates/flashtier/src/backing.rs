//! Opening the backing store named on the command line: a file, a block device, or an NBD URI.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use flashtier_engine::IdentityField;
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

/// What a cache records about the backing store it serves: its size, a name for people (the
/// canonical path of a file or device, or the NBD URI as given), and the fingerprint that tells
/// it from other stores (`flashtier_io::identity`; for NBD the server and the export name,
/// all NBD has to offer).
pub fn backing_identity(
    spec: &str,
    size: u64,
) -> anyhow::Result<flashtier_engine::BackingIdentity> {
    if NbdUri::is_uri(spec) {
        let uri = NbdUri::parse(spec)?;
        return Ok(flashtier_engine::BackingIdentity {
            size,
            name: spec.to_string(),
            fingerprint: vec![
                IdentityField::required("kind", "nbd"),
                IdentityField::required("server", uri.addr.to_string()),
                IdentityField::required("export", uri.export),
            ],
        });
    }
    let path = Path::new(spec);
    let name = std::fs::canonicalize(path)
        .with_context(|| format!("cannot resolve backing store path {spec}"))?
        .to_string_lossy()
        .into_owned();
    let fingerprint = flashtier_io::identity::fingerprint(path)
        .with_context(|| format!("cannot identify backing store {spec}"))?;
    Ok(flashtier_engine::BackingIdentity {
        size,
        name,
        fingerprint,
    })
}

/// Refuses a cache path that is, or overlaps, the backing store (the same file by any name, a
/// loop device over it, a partition of it...): formatting it would destroy the backing store.
pub fn refuse_backing_as_cache(cache: &str, backing: &str) -> anyhow::Result<()> {
    if NbdUri::is_uri(backing) {
        return Ok(());
    }
    let (c, b) = (Path::new(cache), Path::new(backing));
    if !c.exists() {
        return Ok(());
    }
    if flashtier_io::identity::overlaps(c, b)
        .with_context(|| format!("cannot tell whether {cache} overlaps {backing}"))?
    {
        anyhow::bail!(
            "{cache} is the backing store itself ({backing}), or shares its storage: making it \
             the cache would destroy the backing store's data"
        );
    }
    Ok(())
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

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

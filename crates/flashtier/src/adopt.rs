//! `serve --accept-new-backing [--discard-dirty]`: a cache whose backing store was replaced on
//! purpose starts over, empty, for the new one. The engine refuses while the cache holds the
//! old store's dirty data; `--discard-dirty` drops it after a warning and a typed confirmation
//! (or `--yes-discard-dirty-data`), as `detach --force` does.

use anyhow::Context;
use flashtier_engine::{adopt, BackingIdentity};
use flashtier_io::BlockDev;

use crate::units::fmt_bytes;

pub struct AdoptOptions {
    pub discard_dirty: bool,
    pub yes_discard_dirty_data: bool,
}

/// Formats the cache on `dev` empty for `identity` if it belongs to another backing store;
/// nothing happens if it belongs to this one.
pub fn adopt_new_backing(
    dev: &dyn BlockDev,
    path: &str,
    identity: &BackingIdentity,
    opts: &AdoptOptions,
) -> anyhow::Result<()> {
    let Some(m) =
        adopt::inspect(dev, identity).with_context(|| format!("cannot use cache {path}"))?
    else {
        tracing::info!("--accept-new-backing: the cache belongs to this backing store already");
        return Ok(());
    };
    let differences: Vec<String> = m.differences.iter().map(ToString::to_string).collect();
    let old = &m.superblock.backing.name;
    let dirty = m.dirty_blocks != Some(0);
    if dirty && opts.discard_dirty {
        let amount = match (m.dirty_blocks, m.dirty_bytes()) {
            (Some(n), Some(bytes)) => format!("{} ({n} blocks)", fmt_bytes(bytes)),
            _ => "an unknown amount of data (the cache does not recover)".into(),
        };
        eprintln!(
            "flashtier: WARNING: --discard-dirty DISCARDS the cache's dirty data: {amount} that \
             clients wrote to the old backing store '{old}' but that store never received will \
             be LOST. Without --discard-dirty, serve the old store with this cache and run \
             `flashtier flush` first."
        );
        if !opts.yes_discard_dirty_data {
            crate::confirm::typed(
                "discard",
                "discard dirty data and use the new backing store",
                "Pass --yes-discard-dirty-data to confirm, or write the data back to the old \
                 backing store first (serve it with this cache, then `flashtier flush`)",
            )?;
        }
    }
    adopt::adopt(dev, identity, opts.discard_dirty)
        .with_context(|| format!("cannot use cache {path} for a new backing store"))?;
    tracing::warn!(
        old_backing = %old,
        new_backing = %identity.name,
        cached_blocks = m.cached_blocks,
        discarded_dirty_blocks = if dirty { m.dirty_blocks } else { Some(0) },
        "accepted a new backing store ({}); the cache starts empty",
        differences.join("; ")
    );
    Ok(())
}

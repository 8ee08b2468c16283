//! Giving a cache a new backing store on purpose (`serve --accept-new-backing`): the old one
//! was replaced (a new disk, a restored or copied image) and the operator says so.
//!
//! Nothing the cache holds is valid for the new store: its clean blocks are copies of the old
//! store's data, its dirty blocks are writes the old store never received. So adopting a store
//! formats the device empty for it (the same geometry, mode and reclaim policy, a new uuid),
//! and is refused while the cache holds dirty data, unless the caller discards it: those writes
//! then exist nowhere. How much is dirty comes from a read-only recovery of the cache; a cache
//! that does not recover counts as holding an unknown amount.

use flashtier_io::BlockDev;

use crate::engine::{self, FormatOptions};
use crate::layout::superblock::{BackingIdentity, FieldDiff, Superblock};
use crate::{recover, EngineError};

/// How a cache relates to a backing store it does not belong to.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The cache's superblock (whose backing store it belongs to).
    pub superblock: Superblock,
    /// What differs, expected vs found.
    pub differences: Vec<FieldDiff>,
    /// Dirty blocks of the old backing store in the cache; None if the cache does not recover.
    pub dirty_blocks: Option<u64>,
    /// Blocks cached in all (clean and dirty); 0 if the cache does not recover.
    pub cached_blocks: u64,
}

impl Mismatch {
    /// Bytes of dirty data the cache holds for the old backing store; None if the cache does not recover.
    pub fn dirty_bytes(&self) -> Option<u64> {
        self.dirty_blocks
            .map(|n| n * self.superblock.geometry.block_size as u64)
    }
}

/// Whether the cache on `dev` belongs to `identity`: None if it does, else what differs and
/// what the cache holds. Reads only.
pub fn inspect(
    dev: &dyn BlockDev,
    identity: &BackingIdentity,
) -> Result<Option<Mismatch>, EngineError> {
    let sb = recover::read_superblock(dev)?;
    let differences = sb.backing.check(identity).mismatches;
    if differences.is_empty() {
        return Ok(None);
    }
    let (dirty_blocks, cached_blocks) = match recover::recover(dev, &sb) {
        Ok(r) => (Some(r.state.segs.total_dirty()), r.state.segs.total_live()),
        Err(e) => {
            tracing::warn!("the cache does not recover, so its dirty data is unknown: {e}");
            (None, 0)
        }
    };
    Ok(Some(Mismatch {
        superblock: sb,
        differences,
        dirty_blocks,
        cached_blocks,
    }))
}

/// Formats the cache on `dev` empty for `identity` if it belongs to another backing store
/// (see the module comment). Refused with [`EngineError::DirtyData`] while it holds dirty data
/// (or may), unless `discard_dirty`. Returns what was replaced, or None if the cache belonged
/// to `identity` already (nothing is written then).
pub fn adopt(
    dev: &dyn BlockDev,
    identity: &BackingIdentity,
    discard_dirty: bool,
) -> Result<Option<Mismatch>, EngineError> {
    let Some(m) = inspect(dev, identity)? else {
        return Ok(None);
    };
    if m.dirty_blocks != Some(0) && !discard_dirty {
        return Err(EngineError::DirtyData {
            backing: m.superblock.backing.name.clone(),
            dirty_blocks: m.dirty_blocks,
            block_size: m.superblock.geometry.block_size,
        });
    }
    let g = m.superblock.geometry;
    engine::format(
        dev,
        identity.clone(),
        FormatOptions {
            block_size: g.block_size,
            segment_size: g.segment_size,
            mode: m.superblock.default_mode,
            reclaim: m.superblock.reclaim,
        },
    )?;
    Ok(Some(m))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flashtier_testkit::MemDev;

    use super::*;
    use crate::layout::superblock::IdentityField;
    use crate::Cache;

    fn ident(ino: &str) -> BackingIdentity {
        BackingIdentity {
            size: 64 << 20,
            name: "/b.img".into(),
            fingerprint: vec![
                IdentityField::required("kind", "file"),
                IdentityField::required("ino", ino),
            ],
        }
    }

    fn cache_with_dirty_block() -> (Arc<dyn BlockDev>, Arc<dyn BlockDev>) {
        let dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(16 << 20));
        let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(64 << 20));
        let opts = FormatOptions {
            segment_size: 1 << 20,
            ..FormatOptions::default()
        };
        engine::format(&*dev, ident("1"), opts).unwrap();
        let c = Cache::open(dev.clone(), backing.clone(), &ident("1"), None).unwrap();
        c.write_at(&[5u8; 4096], 0, false).unwrap();
        c.close().unwrap();
        (dev, backing)
    }

    #[test]
    fn another_store_is_refused_with_what_differs_and_adopted_only_without_dirty_data() {
        let (dev, backing) = cache_with_dirty_block();
        let e = Cache::open(dev.clone(), backing.clone(), &ident("2"), None)
            .err()
            .unwrap();
        let text = e.to_string();
        assert!(text.contains("ino: expected 1, found 2"), "{text}");
        assert!(text.contains("--accept-new-backing"), "{text}");

        assert!(adopt(&*dev, &ident("1"), false).unwrap().is_none());
        let before = read(&*dev);
        let e = adopt(&*dev, &ident("2"), false).unwrap_err();
        assert!(
            matches!(
                e,
                EngineError::DirtyData {
                    dirty_blocks: Some(1),
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            read(&*dev) == before,
            "a refused adoption wrote to the cache"
        );

        let m = adopt(&*dev, &ident("2"), true).unwrap().unwrap();
        assert_eq!(m.dirty_blocks, Some(1));
        let c = Cache::open(dev.clone(), backing, &ident("2"), None).unwrap();
        assert_eq!(
            c.status().cached_blocks,
            0,
            "the old store's blocks survived"
        );
        let mut buf = [1u8; 4096];
        c.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 4096], "the old store's dirty block was served");
        c.close().unwrap();
    }

    #[test]
    fn a_cache_without_dirty_data_is_adopted_empty() {
        let (dev, backing) = cache_with_dirty_block();
        let c = Cache::open(dev.clone(), backing.clone(), &ident("1"), None).unwrap();
        c.write_back_all().unwrap();
        c.close().unwrap();
        let m = adopt(&*dev, &ident("3"), false).unwrap().unwrap();
        assert_eq!(m.dirty_blocks, Some(0));
        assert_eq!(m.differences[0].key, "ino");
        let sb = recover::read_superblock(&*dev).unwrap();
        assert_eq!(sb.backing, ident("3"));
        assert_ne!(sb.uuid, m.superblock.uuid);
    }

    fn read(dev: &dyn BlockDev) -> Vec<u8> {
        let mut b = vec![0u8; dev.info().size as usize];
        dev.read_at(&mut b, 0).unwrap();
        b
    }
}

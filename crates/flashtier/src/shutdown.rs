//! How `flashtier serve` ends: the cache is closed at shutdown and the outcome is told as it is.
//! Only a cache whose device still works gets the final checkpoint; a failed one is reported as
//! not closed cleanly, with its own exit status, so the message and the status never disagree.

use std::sync::Arc;

use flashtier_engine::Cache;

/// Closes `cache` (if one is attached) once the server stopped with `served`, and returns what
/// `serve` reports: a cache that was not closed cleanly comes first (its failed device explains
/// a failed final flush, which it then quotes).
pub fn finish(cache: Option<Arc<Cache>>, served: anyhow::Result<()>) -> anyhow::Result<()> {
    let closed = match cache {
        Some(cache) => close_cache(&cache),
        None => Ok(()),
    };
    match (closed, served) {
        (Ok(()), served) => served,
        (Err(closing), Ok(())) => Err(closing),
        (Err(mut closing), Err(served)) => {
            match closing.downcast_mut::<CacheNotClosed>() {
                Some(not_closed) => not_closed.also = Some(crate::error_chain(&served)),
                None => tracing::error!("{}", crate::error_chain(&served)),
            }
            Err(closing)
        }
    }
}

/// `serve` stopped, but the cache was not closed cleanly: its device failed, while serving or
/// when the final checkpoint was written. What the log on the device holds is recovered at the
/// next start; nothing was written back or dropped. `flashtier serve` exits with
/// [`CacheNotClosed::EXIT_CODE`].
#[derive(Debug)]
pub struct CacheNotClosed {
    why: String,
    dirty_blocks: u64,
    /// The server's own error, a consequence (its final flush fails on a failed cache).
    also: Option<String>,
}

impl CacheNotClosed {
    pub const EXIT_CODE: i32 = 3;
}

impl std::fmt::Display for CacheNotClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped, but the cache was NOT closed cleanly: {}. No final checkpoint was written; \
             its {} dirty blocks stay on the cache device, and the next start recovers what its \
             log holds (check or replace the device first)",
            self.why, self.dirty_blocks
        )?;
        if let Some(also) = &self.also {
            write!(f, ". Also: {also}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CacheNotClosed {}

/// Closes the cache at shutdown (the server has flushed) and says truthfully how it went: only
/// a cache whose device still works gets the final checkpoint that makes the next start
/// near-instant.
fn close_cache(cache: &Cache) -> anyhow::Result<()> {
    let status = cache.status();
    let not_closed = |why: String| CacheNotClosed {
        why,
        dirty_blocks: status.dirty_blocks,
        also: None,
    };
    let closed = cache.close();
    if status.failed {
        // close() skips the checkpoint of a failed log: nothing was written at all.
        return Err(not_closed(
            "its device failed while serving (the errors were logged then)".into(),
        )
        .into());
    }
    match closed {
        // A failed checkpoint fails the log.
        Err(e) if cache.status().failed => {
            Err(not_closed(format!("writing its final checkpoint failed: {e}")).into())
        }
        // The final flush of the backing store, for writes that went around the cache: the
        // cache closed (with its checkpoint), but those writes may not be durable.
        Err(e) => Err(anyhow::Error::new(e).context(
            "the cache closed cleanly, but the final flush of the backing store failed (writes \
             that went around the cache may not be durable there)",
        )),
        Ok(()) => {
            tracing::info!(
                cached_blocks = status.cached_blocks,
                dirty_blocks = status.dirty_blocks,
                "cache closed cleanly"
            );
            Ok(())
        }
    }
}

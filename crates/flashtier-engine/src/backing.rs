//! The backing store, as the engine holds it: the device, whether it is failing, the client I/O
//! at it that background write-back gives way to, the blocks being written to it, and what was
//! written to it around the cache since its last flush.
//!
//! What is here is state and the locks on it; the paths that use them are the cache's (bypass
//! writes, read misses, FLUSH) and the cleaner's (write-back passes).
//!
//! Where `ranges` and `flush_turn` stand among the engine's locks is in ARCHITECTURE.md's one
//! lock-order list.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use flashtier_io::BlockDev;
use parking_lot::Mutex;

use crate::health::BackingHealth;
use crate::range_lock::RangeLock;
use crate::state::DirtyBlock;

pub(crate) struct Backing {
    pub(crate) dev: Arc<dyn BlockDev>,
    /// Whether it is failing (see `health`).
    pub(crate) health: BackingHealth,
    /// Client I/O at it, which background write-back gives way to.
    pub(crate) foreground: Foreground,
    /// The blocks a write straight to the backing store holds (shared) from its INVALIDATE on
    /// until the backing store has it, a read miss holds while it reads them, and a cleaning
    /// pass holds (exclusive) while it writes a run of them back (see `cleaner`).
    pub(crate) ranges: RangeLock,
    /// Written (bypassing the cache) since it was last flushed.
    pub(crate) unflushed: AtomicBool,
    /// FLUSHes take turns for the backing store's flush (see `Cache::flush`).
    pub(crate) flush_turn: Mutex<()>,
    /// Write-through blocks written to it but not yet flushed there, with their segments'
    /// generations; marked clean after the next backing flush.
    pub(crate) unflushed_write_through: Mutex<(Vec<DirtyBlock>, Vec<u64>)>,
}

impl Backing {
    pub(crate) fn new(dev: Arc<dyn BlockDev>) -> Backing {
        Backing {
            dev,
            health: BackingHealth::default(),
            foreground: Foreground::default(),
            ranges: RangeLock::default(),
            unflushed: AtomicBool::new(false),
            flush_turn: Mutex::new(()),
            unflushed_write_through: Mutex::new((Vec::new(), Vec::new())),
        }
    }
}

/// Client I/O to the backing store: how much is in flight, and when the last finished.
pub(crate) struct Foreground {
    inflight: AtomicU32,
    /// Milliseconds since `epoch` when the last request started or finished.
    last_ms: AtomicU64,
    epoch: Instant,
}

impl Default for Foreground {
    fn default() -> Foreground {
        Foreground {
            inflight: AtomicU32::new(0),
            last_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// Held while a client request is at the backing store.
pub(crate) struct ForegroundIo<'a> {
    f: &'a Foreground,
}

impl Drop for ForegroundIo<'_> {
    fn drop(&mut self) {
        self.f.last_ms.store(self.f.now_ms(), Ordering::Release);
        self.f.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Foreground {
    /// Marks a client request to the backing store in flight until the guard drops.
    pub(crate) fn begin(&self) -> ForegroundIo<'_> {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.last_ms.store(self.now_ms(), Ordering::Release);
        ForegroundIo { f: self }
    }

    pub(crate) fn busy(&self) -> bool {
        self.inflight.load(Ordering::Acquire) > 0
    }

    /// Milliseconds since the last client backing I/O (0 while some is in flight).
    pub(crate) fn idle_ms(&self) -> u64 {
        if self.busy() {
            return 0;
        }
        self.now_ms()
            .saturating_sub(self.last_ms.load(Ordering::Acquire))
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

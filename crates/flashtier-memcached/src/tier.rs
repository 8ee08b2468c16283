//! [`MemcachedTier`]: a [`BlockDev`] in front of the backing store that answers reads of clean
//! blocks from a memcached pool.
//!
//! It sits where the backing store is (below the SSD tier, or exported directly when there is
//! none), so everything that reaches the backing store passes through it: read misses of the
//! tier above, its write-backs, writes around it. That is what lets it keep the
//! [`Versions`](crate::versions) record exact without the tiers above knowing of it.
//!
//! The rules, and why no read can return old data (ARCHITECTURE.md has the whole argument):
//! - memcached only ever holds copies of what the store below holds; it is never the only copy,
//!   so losing any value, a server, or the whole pool loses nothing.
//! - Every write, trim and write-zeroes marks its blocks' versions before it reaches the store
//!   below and after (success or not); a value is used only when its tag equals its block's
//!   version now, which no write since the value's data was read can leave unchanged.
//! - Keys name the cache and a generation drawn at start, so a value from before a restart, or
//!   from another host sharing the pool, is never even fetched.
//! - Whatever fails in the pool (a timeout, a dead server, a corrupt value) is a miss: the read
//!   goes to the store below, and the client never sees the error.
//!
//! Modes (`memcached_mode`), WaffleGrid's two:
//! - `inclusive`: blocks read from the store below and blocks written to it are stored, and a
//!   hit leaves the value where it is.
//! - `victim`: only blocks evicted by a faster tier are stored ([`MemcachedTier::offer_victim`]),
//!   and a hit removes the value (the tier above keeps the block). The tier directly above hands
//!   its evictions down: the SSD tier's reclaim ([`MemcachedTier::victim_tags`] before it reads
//!   them, then [`MemcachedTier::offer_tagged`]), or, with no SSD tier, the RAM tier
//!   ([`MemcachedTier::offer_victim`]).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use flashtier_io::{BlockDev, DevInfo, Extent, ZeroOpts};

use crate::client::Pool;
use crate::value::{self, KeySpace};
use crate::versions::{Tag, Versions};

/// The block size of a value: reads and writes are looked up and stored in these units.
pub const BLOCK: usize = 4096;
/// Requests longer than this (1 MiB) go to the store below as they are: a large sequential
/// transfer is not what a memory tier is for, and one multi-get of it would be slow.
pub const MAX_BLOCKS: usize = 256;

/// What the tier stores (the live parameter `memcached_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MemcachedMode {
    /// Blocks read from and written to the store below are stored; hits stay.
    #[default]
    Inclusive,
    /// Blocks evicted by a faster tier are stored; a hit removes the value.
    Victim,
}

/// The values `memcached_mode` takes, for errors and help.
pub const MODES: &str = "inclusive | victim";

impl std::str::FromStr for MemcachedMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "inclusive" => Ok(MemcachedMode::Inclusive),
            "victim" => Ok(MemcachedMode::Victim),
            _ => Err(format!(
                "invalid value '{s}' for memcached_mode: allowed {MODES}"
            )),
        }
    }
}

impl std::fmt::Display for MemcachedMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemcachedMode::Inclusive => "inclusive",
            MemcachedMode::Victim => "victim",
        })
    }
}

/// The tier's own counters (the pool keeps per-server ones).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks looked up in the pool.
    pub lookup_blocks: u64,
    /// Blocks answered from the pool.
    pub hit_blocks: u64,
    /// Blocks read from the store below after a lookup.
    pub miss_blocks: u64,
    /// Values found but older than their block's version (never used).
    pub stale_values: u64,
    /// Values found but corrupt or of another block (never used).
    pub corrupt_values: u64,
    /// Blocks stored in the pool.
    pub stored_blocks: u64,
    /// Stores the pool did not take (a server down, full or failing).
    pub store_failures: u64,
    /// Values removed after a hit (`victim` mode).
    pub removed_blocks: u64,
    /// Requests passed to the store below without a lookup (unaligned, too long, tier off).
    pub bypassed_requests: u64,
}

#[derive(Default)]
struct Counters {
    lookup_blocks: AtomicU64,
    hit_blocks: AtomicU64,
    miss_blocks: AtomicU64,
    stale_values: AtomicU64,
    corrupt_values: AtomicU64,
    stored_blocks: AtomicU64,
    store_failures: AtomicU64,
    removed_blocks: AtomicU64,
    bypassed_requests: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    if n > 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// The memcached tier over a block device.
pub struct MemcachedTier {
    below: Arc<dyn BlockDev>,
    pool: Arc<Pool>,
    keys: KeySpace,
    versions: Versions,
    mode: AtomicU8,
    enabled: AtomicBool,
    counters: Counters,
    /// Evicted blocks offered in `victim` mode, tagged when offered, until shipped.
    victims: Mutex<Vec<(u64, Tag, Vec<u8>)>>,
}

/// The most offered victims waiting to be shipped; past it, offers are dropped (and counted as
/// store failures): a victim not stored only costs a later miss.
const MAX_QUEUED_VICTIMS: usize = 4096;

impl MemcachedTier {
    /// The tier over `below`, storing in `pool` under the keys of cache `namespace` (a hash of
    /// the backing store's identity). Each call draws a new generation.
    pub fn new(
        below: Arc<dyn BlockDev>,
        pool: Arc<Pool>,
        namespace: u64,
        mode: MemcachedMode,
    ) -> io::Result<MemcachedTier> {
        let mut generation = [0u8; 8];
        flashtier_io::sys::fill_random(&mut generation)?;
        let blocks = below.info().size / BLOCK as u64;
        Ok(MemcachedTier {
            keys: KeySpace::new(namespace, u64::from_le_bytes(generation)),
            versions: Versions::new(blocks),
            below,
            pool,
            mode: AtomicU8::new(mode as u8),
            enabled: AtomicBool::new(true),
            counters: Counters::default(),
            victims: Mutex::new(Vec::new()),
        })
    }

    /// The pool, to add and remove servers and read their health and statistics.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The mode in force.
    pub fn mode(&self) -> MemcachedMode {
        match self.mode.load(Ordering::Relaxed) {
            0 => MemcachedMode::Inclusive,
            _ => MemcachedMode::Victim,
        }
    }

    /// Changes the mode; effective from the next request.
    pub fn set_mode(&self, mode: MemcachedMode) {
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    /// Whether reads look in the pool and anything is stored.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns the tier on or off. Off, requests go straight below but writes still mark their
    /// versions, so turning it back on never revives a value a write made old meanwhile.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// The tier's counters.
    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            lookup_blocks: get(&c.lookup_blocks),
            hit_blocks: get(&c.hit_blocks),
            miss_blocks: get(&c.miss_blocks),
            stale_values: get(&c.stale_values),
            corrupt_values: get(&c.corrupt_values),
            stored_blocks: get(&c.stored_blocks),
            store_failures: get(&c.store_failures),
            removed_blocks: get(&c.removed_blocks),
            bypassed_requests: get(&c.bypassed_requests),
        }
    }

    /// Whether offered victims are taken now (`victim` mode, the tier on, servers in the pool).
    pub fn takes_victims(&self) -> bool {
        self.mode() == MemcachedMode::Victim && self.enabled() && !self.pool.is_empty()
    }

    /// Appends to `out` the versions of the blocks of `[offset, offset + len)` now, for a faster
    /// tier to take *before* it reads data it will offer ([`MemcachedTier::offer_tagged`]);
    /// false if the range is not whole blocks or a write to one of them is in flight.
    pub fn victim_tags(&self, offset: u64, len: usize, out: &mut Vec<Tag>) -> bool {
        let b = BLOCK as u64;
        if !offset.is_multiple_of(b) || !len.is_multiple_of(BLOCK) {
            return false;
        }
        let start = out.len();
        for block in offset / b..(offset + len as u64) / b {
            let tag = self.versions.tag(block);
            if !tag.quiet() {
                out.truncate(start);
                return false;
            }
            out.push(tag);
        }
        true
    }

    /// Offers `data`, the content of `[offset, offset + data.len())` that a faster tier evicts,
    /// with the versions [`MemcachedTier::victim_tags`] gave before the data was read, to be
    /// stored in `victim` mode. The caller guarantees that no write of those blocks reached the
    /// store below between taking the versions and reading the data it offers (a write after
    /// that makes the value old). Nothing is sent until [`MemcachedTier::ship_victims`].
    pub fn offer_tagged(&self, offset: u64, tags: &[Tag], data: &[u8]) {
        if !self.takes_victims() || data.len() != tags.len() * BLOCK {
            return;
        }
        let first = offset / BLOCK as u64;
        let mut queue = self.victims.lock();
        for (i, (&tag, piece)) in tags.iter().zip(data.chunks_exact(BLOCK)).enumerate() {
            if queue.len() >= MAX_QUEUED_VICTIMS {
                bump(&self.counters.store_failures, (tags.len() - i) as u64);
                return;
            }
            queue.push((first + i as u64, tag, piece.to_vec()));
        }
    }

    /// Offers `block`, which a faster tier evicts with content `data`, its version taken now.
    ///
    /// The caller guarantees that `data` is what the store below holds for `block` at the time
    /// of the call and that no write to the block can reach this tier during it (the RAM tier
    /// calls this under the lock its writes drop copies under, and only when it sits directly
    /// on this tier).
    pub fn offer_victim(&self, block: u64, data: &[u8]) {
        if !self.takes_victims() {
            return;
        }
        let mut tags = Vec::with_capacity(1);
        if self.victim_tags(block * BLOCK as u64, data.len(), &mut tags) {
            self.offer_tagged(block * BLOCK as u64, &tags, data);
        }
    }

    /// Stores the victims offered so far, in one pipelined batch.
    pub fn ship_victims(&self) {
        let queued = std::mem::take(&mut *self.victims.lock());
        let items: Vec<(u64, Tag, &[u8])> = queued
            .iter()
            .map(|(block, tag, data)| (*block, *tag, data.as_slice()))
            .collect();
        self.store(&items);
    }

    /// The whole blocks of a request, if the pool should see it.
    fn blocks_of(&self, offset: u64, len: usize) -> Option<(u64, usize)> {
        let aligned = offset.is_multiple_of(BLOCK as u64) && len.is_multiple_of(BLOCK) && len > 0;
        let n = len / BLOCK;
        (aligned && n <= MAX_BLOCKS && self.enabled() && !self.pool.is_empty())
            .then_some((offset / BLOCK as u64, n))
    }

    /// Stores `items` (block, tag, data), counting what the pool took.
    fn store(&self, items: &[(u64, Tag, &[u8])]) {
        if items.is_empty() {
            return;
        }
        let mut keys = Vec::with_capacity(items.len());
        let mut values = Vec::with_capacity(items.len());
        for &(block, tag, data) in items {
            let mut k = String::new();
            self.keys.key(block, &mut k);
            keys.push(k);
            let mut v = Vec::with_capacity(value::HEADER + data.len());
            value::encode(&self.keys, block, tag, data, &mut v);
            values.push(v);
        }
        let pairs: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_bytes(), v.as_slice()))
            .collect();
        let stored = self.pool.set_multi(&pairs);
        bump(&self.counters.stored_blocks, stored as u64);
        bump(&self.counters.store_failures, (items.len() - stored) as u64);
    }

    /// A write of `[offset, offset + len)` by `write`, with the versions marked around it;
    /// `data` is what the blocks hold afterwards if it succeeds (None: not known here, as for
    /// a trim, or not worth storing).
    fn write_marked(
        &self,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        write: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        if len == 0 {
            return write();
        }
        let b = BLOCK as u64;
        let first = offset / b;
        let count = (offset + len).div_ceil(b) - first;
        let begun = self.versions.begin(first, count);
        let result = write();
        let store = result.is_ok()
            && self.mode() == MemcachedMode::Inclusive
            && data.is_some()
            && self.blocks_of(offset, len as usize).is_some();
        let mut items = Vec::new();
        self.versions.end(begun, first, count, |block, tag| {
            if let (true, Some(tag), Some(data)) = (store, tag, data) {
                let at = ((block - first) * b) as usize;
                items.push((block, tag, &data[at..at + BLOCK]));
            }
        });
        self.store(&items);
        result
    }
}

impl BlockDev for MemcachedTier {
    fn info(&self) -> &DevInfo {
        self.below.info()
    }

    fn describe(&self) -> String {
        let n = self.pool.len();
        format!(
            "{} with a memcached tier ({n} server{})",
            self.below.describe(),
            if n == 1 { "" } else { "s" }
        )
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some((first, n)) = self.blocks_of(offset, buf.len()) else {
            bump(&self.counters.bypassed_requests, 1);
            return self.below.read_at(buf, offset);
        };
        // Versions first: a value is used only if no write began since this point.
        let tags: Vec<Tag> = (0..n as u64)
            .map(|i| self.versions.tag(first + i))
            .collect();
        let keys: Vec<String> = (0..n as u64)
            .map(|i| {
                let mut k = String::new();
                self.keys.key(first + i, &mut k);
                k
            })
            .collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let values = self.pool.get_multi(&key_refs);
        let mut missing = vec![true; n];
        let (mut stale, mut corrupt) = (0, 0);
        for (i, v) in values.iter().enumerate() {
            let Some(v) = v else { continue };
            match value::decode(&self.keys, v, first + i as u64, BLOCK) {
                Ok((tag, data)) if tag.quiet() && tag == tags[i] => {
                    buf[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(data);
                    missing[i] = false;
                }
                Ok(_) => stale += 1,
                Err(e) => {
                    tracing::debug!(block = first + i as u64, "memcached value not used: {e}");
                    corrupt += 1
                }
            }
        }
        let hits = missing.iter().filter(|m| !**m).count();
        let c = &self.counters;
        bump(&c.lookup_blocks, n as u64);
        bump(&c.hit_blocks, hits as u64);
        bump(&c.miss_blocks, (n - hits) as u64);
        bump(&c.stale_values, stale);
        bump(&c.corrupt_values, corrupt);
        // The misses, one read of the store below per run of them.
        flashtier_io::read_runs(&*self.below, buf, offset, BLOCK, &missing)?;
        if hits > 0 && hits < n && !self.versions.unchanged(first, &tags) {
            // A write began meanwhile: the hits are from before it, the blocks just read may
            // be from after it. One read from below answers consistently.
            self.below.read_at(buf, offset)?;
            return Ok(());
        }
        match self.mode() {
            MemcachedMode::Inclusive => {
                let items: Vec<(u64, Tag, &[u8])> = (0..n)
                    .filter(|&i| missing[i] && tags[i].quiet())
                    .map(|i| (first + i as u64, tags[i], &buf[i * BLOCK..(i + 1) * BLOCK]))
                    .collect();
                self.store(&items);
            }
            MemcachedMode::Victim => {
                // The tier above promotes what it read; the pool's copy would only take room.
                let used: Vec<&[u8]> = (0..n)
                    .filter(|&i| !missing[i])
                    .map(|i| key_refs[i])
                    .collect();
                if !used.is_empty() {
                    bump(&c.removed_blocks, self.pool.delete_multi(&used) as u64);
                }
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.write_marked(offset, buf.len() as u64, Some(buf), || {
            self.below.write_at(buf, offset, fua)
        })
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.write_marked(offset, len, None, || {
            self.below.write_vectored_at(bufs, offset)
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.below.flush()
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_marked(offset, len, None, || self.below.trim(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.write_marked(offset, len, None, || {
            self.below.write_zeroes(offset, len, opts)
        })
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.below.prefetch(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.below.extents(offset, len, max_extents, out)
    }
}

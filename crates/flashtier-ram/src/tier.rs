//! [`RamTier`]: a [`BlockDev`] that answers reads of the hottest blocks from process memory.
//!
//! It sits above the SSD tier (or, with no SSD tier, above the memcached tier or the backing
//! store), so every request a client makes passes through it: that is what keeps its copies
//! current without any tier below knowing of it.
//!
//! The rules, and why no read returns old data:
//! - A copy is only ever of what the device below returned for a read, or of a write the device
//!   below acknowledged; the tier holds clean data only and drops nothing the device below lacks.
//! - Every write (and trim, write-zeroes) marks its blocks in a [`Versions`] record before it
//!   goes below and after, and drops their copies right after marking the start, before the
//!   device below sees it. So once a write is acknowledged no copy older than it remains.
//! - A read miss takes its blocks' tags *before* it reads below, and inserts a block read only
//!   if the tag is still current, under the block's shard lock: a write that began meanwhile
//!   (whose copy-dropping may already be done) makes the insert a no-op.
//! - A write that finds a copy of a block it writes (a hot block) puts its own data back once
//!   the device below acknowledged it and no other write touched the block meanwhile (the
//!   version's end tag), under the same check as a read's insert.
//! - A read that answered some blocks from copies rechecks every block's version at the end;
//!   if a write began meanwhile its answer could mix data from before and after that write (a
//!   torn atomic write), so the read is made again from below.
//! - Batches (`read_batch`, `write_batch`) follow the same rules request by request: a batched
//!   read is answered from copies only if all of its blocks are and the recheck holds (else it
//!   goes below with the others), and each batched write is marked before the batch goes below
//!   and ended after, with no data for one the device below left.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use flashtier_io::versions::{Begun, Tag, Versions};
use flashtier_io::{BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts};
use smallvec::SmallVec;

use crate::store::{RamPolicy, Store, BLOCK};

/// Reads longer than this (1 MiB) go below as they are and are not kept: a large sequential
/// transfer would push the hot blocks out.
pub const MAX_BLOCKS: usize = 256;

/// Where the blocks the tier evicts go (the memcached tier's `victim` mode).
///
/// [`EvictionSink::evicted`] is called with the lock of the evicted block's shard held, and
/// that lock orders the eviction before any write through the tier can reach the device below
/// for the block (a write drops the block's copy under the same lock first). So while the call
/// runs, `data` is what the device below holds for `block` *provided nothing else writes to
/// that device* — which is why `serve` gives the tier a sink only when the tier sits directly on
/// the memcached tier (no SSD tier between them to write back later).
pub trait EvictionSink: Send + Sync {
    /// A block leaves the tier; `data` is its content. Called under a lock: no I/O here, only
    /// note what is needed (the memcached tier takes the block's version now) and queue it.
    fn evicted(&self, block: u64, data: &[u8]);
    /// Called after a request's evictions, outside the tier's locks: send what was queued.
    fn ship(&self);
}

/// The tier's counters and sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RamStats {
    /// Blocks looked up.
    pub lookup_blocks: u64,
    /// Blocks answered from memory.
    pub hit_blocks: u64,
    /// Blocks read from the device below after a lookup.
    pub miss_blocks: u64,
    /// Blocks read below and kept.
    pub inserted_blocks: u64,
    /// Blocks pushed out to make room.
    pub evicted_blocks: u64,
    /// Copies dropped by a write, trim or write-zeroes.
    pub invalidated_blocks: u64,
    /// Copies a write replaced with its own data.
    pub updated_blocks: u64,
    /// Reads made again from below because a write ran through them.
    pub reread_requests: u64,
    /// Reads passed below without a lookup (not whole blocks, or longer than 1 MiB).
    pub bypassed_requests: u64,
    /// What the tier may hold.
    pub capacity_bytes: u64,
    /// What it holds now.
    pub used_bytes: u64,
    /// The memory it allocated: copies, their index and the version record.
    pub memory_bytes: u64,
}

#[derive(Default)]
struct Counters {
    lookup_blocks: AtomicU64,
    hit_blocks: AtomicU64,
    miss_blocks: AtomicU64,
    inserted_blocks: AtomicU64,
    evicted_blocks: AtomicU64,
    invalidated_blocks: AtomicU64,
    updated_blocks: AtomicU64,
    reread_requests: AtomicU64,
    bypassed_requests: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    if n > 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// The RAM tier over a block device.
pub struct RamTier {
    below: Arc<dyn BlockDev>,
    versions: Versions,
    store: Store,
    policy: RamPolicy,
    sink: Option<Arc<dyn EvictionSink>>,
    counters: Counters,
}

impl RamTier {
    /// A tier of `bytes` (rounded down to whole 4 KiB blocks, at least one) over `below`,
    /// evicting in `policy` order and handing evictions to `sink`.
    pub fn new(
        below: Arc<dyn BlockDev>,
        bytes: u64,
        policy: RamPolicy,
        sink: Option<Arc<dyn EvictionSink>>,
    ) -> RamTier {
        let blocks = below.info().size / BLOCK as u64;
        RamTier {
            versions: Versions::new(blocks),
            store: Store::new(bytes / BLOCK as u64),
            below,
            policy,
            sink,
            counters: Counters::default(),
        }
    }

    /// The eviction order.
    pub fn policy(&self) -> RamPolicy {
        self.policy
    }

    /// The tier's counters and sizes.
    pub fn stats(&self) -> RamStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RamStats {
            lookup_blocks: get(&c.lookup_blocks),
            hit_blocks: get(&c.hit_blocks),
            miss_blocks: get(&c.miss_blocks),
            inserted_blocks: get(&c.inserted_blocks),
            evicted_blocks: get(&c.evicted_blocks),
            invalidated_blocks: get(&c.invalidated_blocks),
            updated_blocks: get(&c.updated_blocks),
            reread_requests: get(&c.reread_requests),
            bypassed_requests: get(&c.bypassed_requests),
            capacity_bytes: self.store.capacity() * BLOCK as u64,
            used_bytes: self.store.len() * BLOCK as u64,
            memory_bytes: self.store.memory_bytes() + self.versions.memory_bytes(),
        }
    }

    /// The whole blocks of a read, if the tier should see it.
    fn blocks_of(offset: u64, len: usize) -> Option<(u64, usize)> {
        let aligned = offset.is_multiple_of(BLOCK as u64) && len.is_multiple_of(BLOCK) && len > 0;
        let n = len / BLOCK;
        (aligned && n <= MAX_BLOCKS).then_some((offset / BLOCK as u64, n))
    }

    /// Keeps `data` as `block`'s copy if `tag` is still its version, handing a victim to the
    /// sink; whether it was kept, and whether that evicted a block.
    fn keep(&self, block: u64, tag: Tag, data: &[u8]) -> (bool, bool) {
        let mut shard = self.store.shard(block);
        // Under the shard lock: a write that began after `tag` drops copies under this lock
        // after bumping the version, so it either sees this copy and drops it, or this check
        // sees its bump.
        if !self.versions.current(block, tag) {
            return (false, false);
        }
        let evicted = shard.insert(block, data, |victim, bytes| {
            if let Some(sink) = &self.sink {
                sink.evicted(victim, bytes);
            }
        });
        (true, evicted)
    }

    fn ship_evictions(&self, evicted: u64) {
        bump(&self.counters.evicted_blocks, evicted);
        if let (true, Some(sink)) = (evicted > 0, &self.sink) {
            sink.ship();
        }
    }

    /// A write of `[offset, offset + len)` by `write`, its blocks' versions marked around it and
    /// their copies dropped before it goes below; `data` is what the blocks hold afterwards if it
    /// succeeds (None: not known here, as for a trim).
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
        let marked = self.mark(offset, len);
        let result = write();
        self.unmark(marked, data.filter(|_| result.is_ok()));
        result
    }

    /// Before a write of `[offset, offset + len)` (not empty) goes below: its blocks' versions
    /// marked as written and their copies dropped.
    fn mark(&self, offset: u64, len: u64) -> Marked {
        let b = BLOCK as u64;
        let first = offset / b;
        let count = (offset + len).div_ceil(b) - first;
        let begun = self.versions.begin(first, count);
        let whole = Self::blocks_of(offset, len as usize).is_some();
        let mut held = Vec::new();
        let mut dropped = 0;
        if count > self.store.capacity() {
            // Fewer copies than blocks: look at the copies rather than at each block.
            self.store
                .each_shard(|s| dropped += s.remove_range(first, first + count));
        } else {
            held = (first..first + count)
                .map(|block| self.store.shard(block).remove(block))
                .collect();
            dropped = held.iter().filter(|&&h| h).count() as u64;
        }
        Marked {
            first,
            count,
            begun,
            whole,
            held,
            dropped,
        }
    }

    /// After the write [`RamTier::mark`]ed came back: `written` is what its blocks hold now if
    /// it succeeded and that is known (None: it failed, was not done, or wrote no data here);
    /// a block that had a copy gets it back, with the new data, if no other write touched it
    /// meanwhile.
    fn unmark(&self, m: Marked, written: Option<&[u8]>) {
        let data = written.filter(|_| m.whole && m.dropped > 0);
        let (mut updated, mut evicted) = (0, 0);
        self.versions.end(m.begun, m.first, m.count, |block, tag| {
            let i = (block - m.first) as usize;
            if let (Some(data), Some(tag), Some(true)) = (data, tag, m.held.get(i)) {
                let (kept, ev) = self.keep(block, tag, &data[i * BLOCK..(i + 1) * BLOCK]);
                updated += u64::from(kept);
                evicted += u64::from(ev);
            }
        });
        bump(&self.counters.updated_blocks, updated);
        bump(&self.counters.invalidated_blocks, m.dropped - updated);
        self.ship_evictions(evicted);
    }

    /// Answers `buf` (whole blocks from `first`, `tags` taken for them) from copies if every
    /// block has one and no write touched them meanwhile; false (and `buf` unspecified) if not.
    fn read_copies(&self, buf: &mut [u8], first: u64, tags: &[Tag]) -> bool {
        let all = buf.chunks_exact_mut(BLOCK).enumerate().all(|(i, chunk)| {
            let block = first + i as u64;
            tags[i].quiet() && self.store.shard(block).get(block, self.policy, chunk)
        });
        all && self.versions.unchanged(first, tags)
    }
}

/// A write between [`RamTier::mark`] and [`RamTier::unmark`].
struct Marked {
    first: u64,
    count: u64,
    begun: Begun,
    /// Whole blocks (so its data can replace copies).
    whole: bool,
    /// Per block, whether it had a copy (empty when the copies were looked at instead).
    held: Vec<bool>,
    dropped: u64,
}

/// A read of a batch that the tier passes below, with the versions of its blocks taken before.
struct Passed {
    /// Its place in the caller's batch.
    at: usize,
    /// Its first block and the blocks' tags, when the tier may keep what is read.
    blocks: Option<(u64, SmallVec<[Tag; 4]>)>,
}

impl BlockDev for RamTier {
    fn info(&self) -> &DevInfo {
        self.below.info()
    }

    fn describe(&self) -> String {
        let bytes = self.store.capacity() * BLOCK as u64;
        let size = if bytes.is_multiple_of(1 << 20) {
            format!("{} MiB", bytes >> 20)
        } else {
            format!("{} KiB", bytes >> 10)
        };
        format!("{} with a RAM tier of {size}", self.below.describe())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let Some((first, n)) = Self::blocks_of(offset, buf.len()) else {
            bump(&self.counters.bypassed_requests, 1);
            return self.below.read_at(buf, offset);
        };
        // Versions first: a copy read below is kept only if no write began since this point,
        // and the answer is checked against them at the end.
        // Inline for reads of up to 16 KiB (InnoDB's pages): not two heap allocations a read.
        let tags: SmallVec<[Tag; 4]> = (0..n as u64)
            .map(|i| self.versions.tag(first + i))
            .collect();
        let mut missing: SmallVec<[bool; 4]> = SmallVec::from_elem(true, n);
        let mut hits = 0;
        for (i, chunk) in buf.chunks_exact_mut(BLOCK).enumerate() {
            let block = first + i as u64;
            // A block with a write in flight may still have its copy for an instant; the
            // write's data is what the read should race with, so go below.
            if tags[i].quiet() && self.store.shard(block).get(block, self.policy, chunk) {
                missing[i] = false;
                hits += 1;
            }
        }
        let c = &self.counters;
        bump(&c.lookup_blocks, n as u64);
        bump(&c.hit_blocks, hits as u64);
        bump(&c.miss_blocks, (n - hits) as u64);
        flashtier_io::read_runs(&*self.below, buf, offset, BLOCK, &missing)?;
        if hits > 0 && !self.versions.unchanged(first, &tags) {
            // A write ran through this read: the copies are from before it, and the blocks
            // read below (or copies it put back) may be from after it.
            bump(&c.reread_requests, 1);
            return self.below.read_at(buf, offset);
        }
        let (mut kept, mut evicted) = (0, 0);
        for i in (0..n).filter(|&i| missing[i] && tags[i].quiet()) {
            let (k, e) = self.keep(first + i as u64, tags[i], &buf[i * BLOCK..(i + 1) * BLOCK]);
            kept += u64::from(k);
            evicted += u64::from(e);
        }
        bump(&c.inserted_blocks, kept);
        self.ship_evictions(evicted);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.write_marked(offset, buf.len() as u64, Some(buf), || {
            self.below.write_at(buf, offset, fua)
        })
    }

    fn read_batch_max(&self) -> usize {
        self.below.read_batch_max()
    }

    /// Reads whose every block has a copy are answered here; the others go below as one batch
    /// (what it leaves, the caller reads through [`BlockDev::read_at`] here), and their blocks
    /// are kept as a read miss's are.
    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        if self.below.read_batch_max() < 2 {
            (0..reads.len()).for_each(|i| leave(&[i]));
            return;
        }
        let c = &self.counters;
        let mut passed: SmallVec<[Passed; 8]> = SmallVec::new();
        for (at, r) in reads.iter_mut().enumerate() {
            let Some((first, n)) = Self::blocks_of(r.offset, r.buf.len()) else {
                // Counted once served below: one left goes through `read_at`, which counts it.
                passed.push(Passed { at, blocks: None });
                continue;
            };
            // Versions first, as for `read_at`.
            let tags: SmallVec<[Tag; 4]> = (0..n as u64)
                .map(|i| self.versions.tag(first + i))
                .collect();
            bump(&c.lookup_blocks, n as u64);
            if self.read_copies(r.buf, first, &tags) {
                bump(&c.hit_blocks, n as u64);
                r.result = Some(Ok(()));
            } else {
                passed.push(Passed {
                    at,
                    blocks: Some((first, tags)),
                });
            }
        }
        if passed.is_empty() {
            return;
        }
        // The reads passed below borrow the callers' buffers, given back afterwards.
        let mut below: SmallVec<[BatchRead<'_>; 8]> = passed
            .iter()
            .map(|p| {
                let r = &mut reads[p.at];
                BatchRead::new(std::mem::take(&mut r.buf), r.offset)
            })
            .collect();
        self.below.read_batch(&mut below, &mut |left| {
            let places: SmallVec<[usize; 8]> = left.iter().map(|&j| passed[j].at).collect();
            leave(&places);
        });
        let (mut kept, mut evicted, mut missed, mut bypassed) = (0, 0, 0, 0);
        for (p, b) in passed.iter().zip(below) {
            let r = &mut reads[p.at];
            r.buf = b.buf;
            r.result = b.result;
            bypassed += u64::from(p.blocks.is_none() && r.result.is_some());
            let (Some((first, tags)), Some(Ok(()))) = (&p.blocks, &r.result) else {
                continue;
            };
            missed += tags.len() as u64;
            for (i, &tag) in tags.iter().enumerate().filter(|(_, t)| t.quiet()) {
                let (k, e) = self.keep(first + i as u64, tag, &r.buf[i * BLOCK..(i + 1) * BLOCK]);
                kept += u64::from(k);
                evicted += u64::from(e);
            }
        }
        bump(&c.miss_blocks, missed);
        bump(&c.inserted_blocks, kept);
        bump(&c.bypassed_requests, bypassed);
        self.ship_evictions(evicted);
    }

    fn write_batch_max(&self) -> usize {
        self.below.write_batch_max()
    }

    /// Marks every write's blocks (dropping their copies), hands the batch below, and ends each
    /// mark as `write_at` does; a write left below ends with no data (the caller writes it
    /// through [`BlockDev::write_at`] here).
    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        if self.below.write_batch_max() < 2 {
            return;
        }
        let marks: SmallVec<[Option<Marked>; 8]> = writes
            .iter()
            .map(|w| (!w.buf.is_empty()).then(|| self.mark(w.offset, w.buf.len() as u64)))
            .collect();
        self.below.write_batch(writes);
        for (w, m) in writes.iter().zip(marks) {
            if let Some(m) = m {
                let written = matches!(w.result, Some(Ok(()))).then_some(w.buf);
                self.unmark(m, written);
            }
        }
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

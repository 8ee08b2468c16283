//! The RAM tier over an in-memory device: what it keeps, what writes do to it, what it hands
//! its sink, and a concurrent verifying workload that would see any old or torn read.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use flashtier_io::{BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts};
use flashtier_ram::{EvictionSink, RamPolicy, RamTier};
use flashtier_testkit::stamp::{content, version_of};
use flashtier_testkit::{FaultDev, MemDev};
use parking_lot::Mutex;

const B: usize = 4096;

/// A device that counts the reads reaching it and, when `jitter` is set, pauses a little before
/// and after each request so that requests overlap in every order. It serves batches when the
/// device inside does, leaving every second request of a batch when `picky` is set.
struct Below {
    inner: Arc<dyn BlockDev>,
    reads: AtomicU64,
    jitter: bool,
    picky: bool,
    rng: AtomicU64,
}

impl Below {
    fn new(inner: Arc<dyn BlockDev>, jitter: bool) -> Arc<Below> {
        Arc::new(Below {
            inner,
            reads: AtomicU64::new(0),
            jitter,
            picky: false,
            rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
        })
    }

    fn picky(inner: Arc<dyn BlockDev>) -> Arc<Below> {
        Arc::new(Below {
            inner,
            reads: AtomicU64::new(0),
            jitter: false,
            picky: true,
            rng: AtomicU64::new(1),
        })
    }

    fn pause(&self) {
        if self.jitter {
            let r = self
                .rng
                .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
                .wrapping_mul(0xff51_afd7_ed55_8ccd)
                >> 58;
            match r {
                0..=39 => {}
                40..=59 => thread::yield_now(),
                _ => thread::sleep(Duration::from_micros(r * 10)),
            }
        }
    }

    fn around<T>(&self, f: impl FnOnce() -> T) -> T {
        self.pause();
        let r = f();
        self.pause();
        r
    }
}

impl BlockDev for Below {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        "test device".into()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.around(|| self.inner.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.around(|| self.inner.write_at(buf, offset, fua))
    }
    fn read_batch_max(&self) -> usize {
        self.inner.read_batch_max()
    }
    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        if !self.picky {
            self.reads.fetch_add(reads.len() as u64, Ordering::Relaxed);
            return self.around(|| self.inner.read_batch(reads, leave));
        }
        for (i, r) in reads.iter_mut().enumerate() {
            if i % 2 == 1 {
                leave(&[i]);
            } else {
                self.reads.fetch_add(1, Ordering::Relaxed);
                r.result = Some(self.inner.read_at(r.buf, r.offset));
            }
        }
    }
    fn write_batch_max(&self) -> usize {
        self.inner.write_batch_max()
    }
    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        if !self.picky {
            return self.around(|| self.inner.write_batch(writes));
        }
        for w in writes.iter_mut().step_by(2) {
            w.result = Some(self.inner.write_at(w.buf, w.offset, false));
        }
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.around(|| self.inner.trim(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.around(|| self.inner.write_zeroes(offset, len, opts))
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.inner.extents(offset, len, max_extents, out)
    }
}

fn tier(blocks: u64, ram_blocks: u64) -> (Arc<Below>, RamTier) {
    let below = Below::new(Arc::new(MemDev::new(blocks as usize * B)), false);
    let t = RamTier::new(below.clone(), ram_blocks * B as u64, RamPolicy::Lru, None);
    (below, t)
}

fn read(t: &RamTier, block: u64, n: usize) -> Vec<u8> {
    let mut buf = vec![0; n * B];
    t.read_at(&mut buf, block * B as u64).unwrap();
    buf
}

#[test]
fn a_block_read_once_is_answered_from_memory() {
    let (below, t) = tier(64, 16);
    below
        .inner
        .write_at(&content(3, 7), 3 * B as u64, false)
        .unwrap();
    assert_eq!(version_of(&read(&t, 3, 1), 3), 7);
    let before = below.reads.load(Ordering::Relaxed);
    assert_eq!(version_of(&read(&t, 3, 1), 3), 7);
    assert_eq!(
        below.reads.load(Ordering::Relaxed),
        before,
        "a hit reads nothing below"
    );
    // A run of a hit between misses: one read below per run of misses.
    let before = below.reads.load(Ordering::Relaxed);
    read(&t, 2, 3);
    assert_eq!(below.reads.load(Ordering::Relaxed), before + 2);
    let s = t.stats();
    assert_eq!(
        (s.lookup_blocks, s.hit_blocks, s.miss_blocks),
        (5, 2, 3),
        "{s:?}"
    );
    assert_eq!(
        (s.inserted_blocks, s.used_bytes),
        (3, 3 * B as u64),
        "{s:?}"
    );
    assert_eq!(s.capacity_bytes, 16 * B as u64);
}

#[test]
fn a_write_replaces_a_hot_copy_and_leaves_cold_blocks_out() {
    let (below, t) = tier(64, 16);
    read(&t, 5, 1);
    t.write_at(&content(5, 2), 5 * B as u64, false).unwrap();
    t.write_at(&content(9, 1), 9 * B as u64, false).unwrap();
    let before = below.reads.load(Ordering::Relaxed);
    assert_eq!(
        version_of(&read(&t, 5, 1), 5),
        2,
        "the write's data, from memory"
    );
    assert_eq!(below.reads.load(Ordering::Relaxed), before);
    assert_eq!(version_of(&read(&t, 9, 1), 9), 1);
    assert_eq!(
        below.reads.load(Ordering::Relaxed),
        before + 1,
        "9 was not kept by its write"
    );
    let s = t.stats();
    assert_eq!((s.updated_blocks, s.invalidated_blocks), (1, 0), "{s:?}");
}

#[test]
fn partial_writes_trims_and_zeroes_drop_copies() {
    let (_below, t) = tier(64, 16);
    t.write_at(&content(1, 1), B as u64, false).unwrap();
    for b in 0..4 {
        read(&t, b, 1);
    }
    // 512 bytes into block 1: the copy goes, the next read merges below.
    t.write_at(&[0xAB; 512], B as u64 + 512, false).unwrap();
    let got = read(&t, 1, 1);
    assert_eq!(&got[..512], &content(1, 1)[..512]);
    assert!(got[512..1024].iter().all(|&b| b == 0xAB));
    t.write_at(&content(2, 5), 2 * B as u64, false).unwrap();
    t.trim(2 * B as u64, B as u64).unwrap();
    assert!(read(&t, 2, 1).iter().all(|&b| b == 0), "trimmed");
    t.write_at(&content(3, 5), 3 * B as u64, false).unwrap();
    t.write_zeroes(3 * B as u64, B as u64, ZeroOpts::default())
        .unwrap();
    assert!(read(&t, 3, 1).iter().all(|&b| b == 0), "zeroed");
    // A trim longer than the tier looks at its copies, not at each block.
    for b in 10..26 {
        read(&t, b, 1);
    }
    t.write_at(&content(20, 9), 20 * B as u64, false).unwrap();
    let filled = t.stats().used_bytes;
    assert!(filled > 0);
    t.trim(0, 64 * B as u64).unwrap();
    assert_eq!(t.stats().used_bytes, 0);
    assert!(read(&t, 20, 1).iter().all(|&b| b == 0));
}

#[test]
fn a_failed_write_leaves_no_copy_behind() {
    let dev = Arc::new(FaultDev::new(Arc::new(MemDev::new(64 * B))));
    let t = RamTier::new(dev.clone(), 16 * B as u64, RamPolicy::Lru, None);
    t.write_at(&content(4, 1), 4 * B as u64, false).unwrap();
    read(&t, 4, 1);
    dev.fail_next_write();
    assert!(t.write_at(&content(4, 2), 4 * B as u64, false).is_err());
    // What the device holds is the answer, not the copy, nor the failed write's data.
    assert_eq!(version_of(&read(&t, 4, 1), 4), 1);
    let s = t.stats();
    assert_eq!(
        (s.invalidated_blocks, s.updated_blocks, s.hit_blocks),
        (1, 0, 0),
        "{s:?}"
    );
}

#[test]
fn long_and_unaligned_reads_go_below_and_are_not_kept() {
    let (_below, t) = tier(1024, 512);
    let mut buf = vec![0; 2 << 20];
    t.read_at(&mut buf, 0).unwrap();
    let mut odd = vec![0; 1000];
    t.read_at(&mut odd, 100).unwrap();
    let s = t.stats();
    assert_eq!(
        (s.bypassed_requests, s.lookup_blocks, s.used_bytes),
        (2, 0, 0),
        "{s:?}"
    );
}

#[derive(Default)]
struct Collect {
    evicted: Mutex<Vec<(u64, Vec<u8>)>>,
    shipped: AtomicU64,
}

impl EvictionSink for Collect {
    fn evicted(&self, block: u64, data: &[u8]) {
        self.evicted.lock().push((block, data.to_vec()));
    }
    fn ship(&self) {
        self.shipped.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn evicted_blocks_reach_the_sink_with_their_data() {
    let dev = Arc::new(MemDev::new(64 * B));
    for b in 0..64 {
        dev.write_at(&content(b, 1), b * B as u64, false).unwrap();
    }
    let sink = Arc::new(Collect::default());
    let t = RamTier::new(dev, 8 * B as u64, RamPolicy::Fifo, Some(sink.clone()));
    for b in 0..8 {
        read(&t, b, 1);
    }
    assert!(sink.evicted.lock().is_empty());
    read(&t, 8, 4);
    let got = std::mem::take(&mut *sink.evicted.lock());
    let blocks: Vec<u64> = got.iter().map(|(b, _)| *b).collect();
    assert_eq!(blocks, vec![0, 1, 2, 3], "FIFO: the oldest four");
    for (b, data) in &got {
        assert_eq!(version_of(data, *b), 1);
    }
    assert_eq!(
        sink.shipped.load(Ordering::Relaxed),
        1,
        "one ship per request"
    );
    assert_eq!(t.stats().evicted_blocks, 4);
    // A write dropping a copy is not an eviction.
    t.write_at(&content(9, 2), 9 * B as u64 + 8, false).unwrap();
    assert!(sink.evicted.lock().is_empty());
}

#[test]
fn memory_is_bounded_by_the_size_and_counted() {
    let (_below, t) = tier(1 << 18, 1 << 14); // 1 GiB device, 64 MiB tier
    let s = t.stats();
    assert_eq!(s.capacity_bytes, 64 << 20);
    // The copies, about 1% for their index, and the version record (8 bytes per block).
    assert!(s.memory_bytes >= s.capacity_bytes + (1 << 18) * 8, "{s:?}");
    assert!(
        s.memory_bytes <= s.capacity_bytes * 102 / 100 + (1 << 18) * 8,
        "{s:?}"
    );
}

/// Writers rewrite whole 4-block pages (one writer at a time per page, each write stamped with
/// the page's next version in all four blocks), readers read random runs of pages with no lock,
/// through a device that pauses at random so that every interleaving happens. A read must see,
/// for each page, one version in all its blocks (never torn), no older than the last write
/// acknowledged before the read began and no newer than the last write begun before it ended.
fn batching_tier(below: Arc<Below>, ram_blocks: u64) -> RamTier {
    RamTier::new(below, ram_blocks * B as u64, RamPolicy::Lru, None)
}

/// Serves `reads` (block, blocks) as one batch; the versions read, per read, and which were left.
fn read_batch(t: &RamTier, reads: &[(u64, usize)]) -> (Vec<Vec<u64>>, Vec<usize>) {
    let mut bufs: Vec<Vec<u8>> = reads.iter().map(|&(_, n)| vec![0; n * B]).collect();
    let mut left = Vec::new();
    let mut batch: Vec<BatchRead> = bufs
        .iter_mut()
        .zip(reads)
        .map(|(buf, &(block, _))| BatchRead::new(buf, block * B as u64))
        .collect();
    t.read_batch(&mut batch, &mut |l| left.extend_from_slice(l));
    let served: Vec<bool> = batch.iter().map(|r| r.result.is_some()).collect();
    for r in &batch {
        if let Some(res) = &r.result {
            res.as_ref().unwrap();
        }
    }
    drop(batch);
    let versions = bufs
        .iter()
        .zip(reads)
        .zip(served)
        .map(|((buf, &(block, n)), served)| {
            if !served {
                return Vec::new();
            }
            (0..n)
                .map(|i| version_of(&buf[i * B..(i + 1) * B], block + i as u64))
                .collect()
        })
        .collect();
    (versions, left)
}

#[test]
fn a_batch_of_reads_is_answered_from_memory_where_it_can_and_below_as_one_batch() {
    let below = Below::new(Arc::new(MemDev::new(64 * B).batching()), false);
    for block in 0..8 {
        below
            .inner
            .write_at(&content(block, 1), block * B as u64, false)
            .unwrap();
    }
    let t = batching_tier(below.clone(), 16);
    assert_eq!(t.read_batch_max(), below.read_batch_max());
    let reads = [(0, 1), (2, 2), (6, 1)];
    let (got, left) = read_batch(&t, &reads);
    assert_eq!(got, vec![vec![1], vec![1, 1], vec![1]]);
    assert!(left.is_empty());
    assert_eq!(below.reads.load(Ordering::Relaxed), 3, "one batch below");
    let s = t.stats();
    assert_eq!(
        (
            s.lookup_blocks,
            s.hit_blocks,
            s.miss_blocks,
            s.inserted_blocks
        ),
        (4, 0, 4, 4),
        "{s:?}"
    );
    // Again, with a read not whole blocks beside them: only that one goes below, not kept.
    let mut odd = vec![0u8; 100];
    let mut hits: Vec<Vec<u8>> = vec![vec![0; B], vec![0; 2 * B], vec![0; B]];
    let mut batch: Vec<BatchRead> = hits
        .iter_mut()
        .zip(reads)
        .map(|(buf, (block, _))| BatchRead::new(buf, block * B as u64))
        .collect();
    batch.push(BatchRead::new(&mut odd, 5 * B as u64 + 1));
    t.read_batch(&mut batch, &mut |_| panic!("nothing is left"));
    assert!(batch.iter().all(|r| matches!(r.result, Some(Ok(())))));
    drop(batch);
    assert_eq!(&odd[..], &content(5, 1)[1..101]);
    assert_eq!(version_of(&hits[1][B..], 3), 1);
    assert_eq!(
        below.reads.load(Ordering::Relaxed),
        4,
        "only the odd read went below"
    );
    let s = t.stats();
    assert_eq!(
        (s.hit_blocks, s.bypassed_requests, s.inserted_blocks),
        (4, 1, 4),
        "{s:?}"
    );
}

/// Writes version 1 of blocks 0..4, reads blocks 0 and 1 (so they are in memory), then writes
/// version 2 of blocks `0..blocks` as one batch; per write, whether it was done and succeeded.
fn warm_then_write_batch(t: &RamTier, blocks: u64) -> Vec<Option<bool>> {
    for block in 0..4 {
        t.write_at(&content(block, 1), block * B as u64, false)
            .unwrap();
    }
    read(t, 0, 2);
    let data: Vec<Vec<u8>> = (0..blocks).map(|block| content(block, 2)).collect();
    let mut batch: Vec<BatchWrite> = data
        .iter()
        .zip(0..)
        .map(|(d, block)| BatchWrite::new(d, block * B as u64))
        .collect();
    t.write_batch(&mut batch);
    batch
        .iter()
        .map(|w| w.result.as_ref().map(|r| r.is_ok()))
        .collect()
}

#[test]
fn a_batch_of_writes_replaces_hot_copies_as_writes_one_by_one_do() {
    let below = Below::new(Arc::new(MemDev::new(64 * B).batching()), false);
    let t = batching_tier(below.clone(), 16);
    assert_eq!(t.write_batch_max(), below.write_batch_max());
    let done = warm_then_write_batch(&t, 4);
    assert_eq!(done, vec![Some(true); 4]);
    let reads = below.reads.load(Ordering::Relaxed);
    assert_eq!(version_of(&read(&t, 0, 1), 0), 2);
    assert_eq!(version_of(&read(&t, 1, 1), 1), 2);
    assert_eq!(
        below.reads.load(Ordering::Relaxed),
        reads,
        "the hot blocks' copies hold the batch's data"
    );
    assert_eq!(
        version_of(&read(&t, 2, 1), 2),
        2,
        "a cold block reads below"
    );
    let s = t.stats();
    assert_eq!((s.updated_blocks, s.invalidated_blocks), (2, 0), "{s:?}");
}

/// What the device below leaves, the tier leaves too, without a copy that could be older than
/// the write the caller then makes through it.
#[test]
fn what_the_device_below_leaves_is_left_to_the_caller_without_a_stale_copy() {
    let below = Below::picky(Arc::new(MemDev::new(64 * B).batching()));
    let t = batching_tier(below.clone(), 16);
    let done = warm_then_write_batch(&t, 2);
    assert_eq!(done, vec![Some(true), None], "left below, left here");
    assert_eq!(version_of(&read(&t, 0, 1), 0), 2);
    let reads = below.reads.load(Ordering::Relaxed);
    assert_eq!(version_of(&read(&t, 1, 1), 1), 1, "not written yet");
    assert_eq!(
        below.reads.load(Ordering::Relaxed),
        reads + 1,
        "its copy was dropped"
    );
    t.write_at(&content(1, 2), B as u64, false).unwrap();
    assert_eq!(version_of(&read(&t, 1, 1), 1), 2);

    // Reads: the first is in memory, the other two go below, which leaves its second: the
    // caller's third, named by its place in the caller's batch.
    let (got, left) = read_batch(&t, &[(0, 1), (2, 1), (3, 1)]);
    assert_eq!(left, vec![2]);
    assert_eq!(got, vec![vec![2], vec![1], vec![]]);

    // Reads the tier does not look up count as bypassed once served: the one left is counted
    // by the `read_at` that serves it later.
    let bypassed = t.stats().bypassed_requests;
    let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 100]);
    let mut odd = [
        BatchRead::new(&mut a, 2 * B as u64 + 1),
        BatchRead::new(&mut b, 3 * B as u64 + 1),
    ];
    t.read_batch(&mut odd, &mut |_| {});
    assert!(odd[0].result.is_some() && odd[1].result.is_none());
    assert_eq!(t.stats().bypassed_requests, bypassed + 1);
}

#[test]
fn concurrent_reads_and_writes_never_see_old_or_torn_pages() {
    concurrent_reads_and_writes(false);
}

/// The same through the batched paths: writers hand pages (whole, or as two halves) to
/// `write_batch`, readers read their pages as one `read_batch`.
#[test]
fn concurrent_batches_never_see_old_or_torn_pages() {
    concurrent_reads_and_writes(true);
}

fn concurrent_reads_and_writes(batches: bool) {
    const PAGES: u64 = 48;
    const PAGE: u64 = 4;
    let mem = MemDev::new((PAGES * PAGE) as usize * B);
    let mem = if batches { mem.batching() } else { mem };
    let below = Below::new(Arc::new(mem), true);
    // A quarter of the pages fit: evictions, misses and hits all happen.
    let t = Arc::new(RamTier::new(
        below.clone(),
        PAGES * PAGE / 4 * B as u64,
        RamPolicy::Lru,
        None,
    ));
    let writing: Arc<Vec<Mutex<()>>> = Arc::new((0..PAGES).map(|_| Mutex::new(())).collect());
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..PAGES).map(|_| AtomicU64::new(0)).collect());
    let begun: Arc<Vec<AtomicU64>> = Arc::new((0..PAGES).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let seconds = if std::env::var("FLASHTIER_LONG").as_deref() == Ok("1") {
        40
    } else {
        4
    };
    let rng = |seed: u64| {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    };
    let page_bytes =
        |p: u64, v: u64| -> Vec<u8> { (0..PAGE).flat_map(|i| content(p * PAGE + i, v)).collect() };
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (t, writing, acked, begun, stop) = (
                t.clone(),
                writing.clone(),
                acked.clone(),
                begun.clone(),
                stop.clone(),
            );
            thread::spawn(move || {
                let mut next = rng(0xabc + w);
                while !stop.load(Ordering::Relaxed) {
                    // Hot pages more often, so some stay in memory while being rewritten.
                    let p = (next() % PAGES).min(next() % PAGES);
                    let _one_writer = writing[p as usize].lock();
                    let v = begun[p as usize].load(Ordering::SeqCst) + 1;
                    begun[p as usize].store(v, Ordering::SeqCst);
                    let at = p * PAGE * B as u64;
                    let bytes = page_bytes(p, v);
                    match next() % 8 {
                        // Two halves in one batch (the device below writes them in order).
                        0 | 1 if batches => {
                            let (first, second) = bytes.split_at(2 * B);
                            let mut halves = [
                                BatchWrite::new(first, at),
                                BatchWrite::new(second, at + 2 * B as u64),
                            ];
                            t.write_batch(&mut halves);
                            for w in &halves {
                                assert!(matches!(w.result, Some(Ok(()))), "a batched write failed");
                            }
                        }
                        2 | 3 if batches => {
                            let mut whole = [BatchWrite::new(&bytes, at)];
                            t.write_batch(&mut whole);
                            assert!(matches!(whole[0].result, Some(Ok(()))));
                        }
                        // A part of the page: the rest keeps its blocks, so rewrite it all after.
                        0 => {
                            t.write_at(&bytes[..2 * B], at, false).unwrap();
                            t.write_at(&bytes[2 * B..], at + 2 * B as u64, false)
                                .unwrap();
                        }
                        _ => t.write_at(&bytes, at, next() % 2 == 0).unwrap(),
                    }
                    acked[p as usize].store(v, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..3u64)
        .map(|r| {
            let (t, acked, begun, stop, reads) = (
                t.clone(),
                acked.clone(),
                begun.clone(),
                stop.clone(),
                reads.clone(),
            );
            thread::spawn(move || {
                let mut next = rng(0x5eed + r);
                while !stop.load(Ordering::Relaxed) {
                    let first = (next() % PAGES).min(next() % PAGES);
                    let n = (1 + next() % 3).min(PAGES - first);
                    let floor: Vec<u64> = (first..first + n)
                        .map(|p| acked[p as usize].load(Ordering::SeqCst))
                        .collect();
                    let mut buf = vec![0; (n * PAGE) as usize * B];
                    if batches {
                        let mut reads: Vec<BatchRead> = buf
                            .chunks_mut(PAGE as usize * B)
                            .zip(first..)
                            .map(|(page, p)| BatchRead::new(page, p * PAGE * B as u64))
                            .collect();
                        t.read_batch(&mut reads, &mut |_| panic!("the device takes all"));
                        for r in &reads {
                            assert!(matches!(r.result, Some(Ok(()))), "a batched read failed");
                        }
                    } else {
                        t.read_at(&mut buf, first * PAGE * B as u64).unwrap();
                    }
                    for (i, p) in (first..first + n).enumerate() {
                        let ceiling = begun[p as usize].load(Ordering::SeqCst);
                        let page = &buf[i * (PAGE as usize) * B..][..PAGE as usize * B];
                        let versions: Vec<u64> = (0..PAGE)
                            .map(|k| version_of(&page[k as usize * B..][..B], p * PAGE + k))
                            .collect();
                        let v = versions[0];
                        // A page being written in two halves may show the new first half only
                        // while its write is in flight; a whole-page write never tears.
                        assert!(
                            versions.iter().all(|&x| x == v)
                                || (versions[..2].iter().all(|&x| x == v)
                                    && versions[2..].iter().all(|&x| x + 1 == v)),
                            "page {p} torn: {versions:?}"
                        );
                        assert!(
                            versions[3] >= floor[i],
                            "page {p}: read {versions:?}, but {} was acknowledged before",
                            floor[i]
                        );
                        assert!(
                            v <= ceiling,
                            "page {p}: {v} was never written (last {ceiling})"
                        );
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_secs(seconds));
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    for r in readers {
        r.join().expect("a reader saw old or torn data");
    }
    let s = t.stats();
    eprintln!("{} reads, {s:?}", reads.load(Ordering::Relaxed));
    assert!(
        s.hit_blocks > 0 && s.evicted_blocks > 0 && s.updated_blocks > 0,
        "{s:?}"
    );
    // Quiet now: every page reads back its last version, from memory or not.
    for p in 0..PAGES {
        let buf = read(&t, p * PAGE, PAGE as usize);
        for k in 0..PAGE {
            assert_eq!(
                version_of(&buf[k as usize * B..][..B], p * PAGE + k),
                acked[p as usize].load(Ordering::SeqCst)
            );
        }
    }
}

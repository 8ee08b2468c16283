//! Heap allocations on the hot path: 4 KiB read hits and 4 KiB write-back writes, in steady
//! state, counted with a counting global allocator.
//!
//! Neither path allocates per I/O (issue 11, item 5): a write's data goes into a buffer from the
//! log's pool (`Log::buffer`), which returns there once written; the thread waits on its own
//! reused waiter (`log::Waiter`); the record's checksums, the write's list of records and a
//! read's runs, pinned segments and checksums are inline (`SmallVec`); the log writer rotates
//! its queues and reuses its batch vectors. See ARCHITECTURE.md, "The path of a request,
//! function by function". The test prints the figures (`cargo test -p flashtier-engine --test
//! hot_path_allocations -- --nocapture`).
//!
//! Two counts per path: the calling thread's (what `read_at` / `write_at` allocate themselves,
//! which for a read hit must be zero; a write that finds the log writer idle also writes its own
//! batch, and with it may copy an index chunk a checkpoint still shares), and every thread's (the
//! log writer's batches too, and whatever a background thread does meanwhile). The latter is not exactly zero: what the
//! background does once per second or per checkpoint allocates (a checkpoint's snapshot, a
//! segment's per-second write marks, the list of unsynced slots growing between syncs), about
//! 0.02 per write in 1000 writes here. Its bound fails on anything done per I/O or per batch
//! (a batch is a write here: one writer, one write at a time).

use std::sync::Arc;

use flashtier_engine::{format, BackingIdentity, Cache, FormatOptions, Mode};
use flashtier_io::{BatchRead, BatchWrite, BlockDev};
use flashtier_testkit::alloc_count::{self, Counting};
use flashtier_testkit::MemDev;

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counts() -> (u64, u64) {
    (alloc_count::this_thread(), alloc_count::everywhere())
}

const BS: u64 = 4096;
/// I/Os measured per path.
const N: u64 = 1000;
/// The working set: 1 MiB, far below the write-back controller's 10% dirty target of the 128 MiB
/// cache, so no background write-back runs, and small enough that reclaim never has to.
const WORKING_SET_BLOCKS: u64 = 256;

/// Before the pool, waiters and inline vectors: 3.00 per read hit (calling thread and all
/// threads), 4.00 per write-back write on the calling thread and 8.01 on all threads.
const MAX_READ_HIT_ALLOCS_THIS_THREAD: f64 = 0.0;
const MAX_READ_HIT_ALLOCS_ALL_THREADS: f64 = 0.1;
/// Not zero: a write that finds the log writer idle writes its batch itself (see `log_writer`'s
/// `Rounds`), and with it the writer's occasional allocations (copying an index chunk a
/// checkpoint still shares). Anything per write or per batch would be 1.0.
const MAX_WRITE_ALLOCS_THIS_THREAD: f64 = 0.05;
/// Anything per batch would be 1.0 (one batch per write here); see the module doc for the 0.02.
const MAX_WRITE_ALLOCS_ALL_THREADS: f64 = 0.1;

fn ident(size: u64) -> BackingIdentity {
    BackingIdentity {
        size,
        name: "mem".into(),
        fingerprint: Vec::new(),
    }
}

/// The block of the `i`th I/O: a stride through the working set, so no two consecutive I/Os
/// are sequential (no sequential cutoff) and every block is visited equally.
fn block(i: u64) -> u64 {
    (i * 97) % WORKING_SET_BLOCKS
}

struct Figures {
    this_thread: f64,
    all_threads: f64,
}

fn measure(mut io: impl FnMut(u64)) -> Figures {
    let (mine0, all0) = counts();
    for i in 0..N {
        io(i);
    }
    let (mine1, all1) = counts();
    Figures {
        this_thread: (mine1 - mine0) as f64 / N as f64,
        all_threads: (all1 - all0) as f64 / N as f64,
    }
}

#[test]
fn allocations_per_read_hit_and_per_write_back_write() {
    let backing_size = 256u64 << 20;
    let cache_dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(128 << 20));
    let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(backing_size as usize));
    format(&*cache_dev, ident(backing_size), FormatOptions::default()).unwrap();
    let c = Cache::open(cache_dev, backing, &ident(backing_size), None).unwrap();
    assert_eq!(c.mode(), Mode::WriteBack);

    // Buffers are the caller's (the NBD worker keeps its own between requests): not counted.
    let wbuf = vec![0x5au8; BS as usize];
    let mut rbuf = vec![0u8; BS as usize];

    // Warm up: every block of the working set written (so cached, dirty) and read, twice, so
    // every lazily grown structure has reached its steady size.
    for pass in 0..2 {
        for i in 0..WORKING_SET_BLOCKS * 2 {
            c.write_at(&wbuf, block(i + pass) * BS, false).unwrap();
        }
        for i in 0..WORKING_SET_BLOCKS * 2 {
            c.read_at(&mut rbuf, block(i + pass) * BS).unwrap();
        }
    }

    let s0 = c.stats();
    let reads = measure(|i| c.read_at(&mut rbuf, block(i) * BS).unwrap());
    let s1 = c.stats();
    assert_eq!(
        s1.read_hit_blocks - s0.read_hit_blocks,
        N,
        "every measured read must be a hit"
    );
    assert_eq!(s1.read_miss_blocks, s0.read_miss_blocks);

    // The same reads 16 at a time (`read_batch`, as the NBD server batches pipelined READs);
    // the batch's list is inline, like the server's.
    let mut bufs = vec![vec![0u8; BS as usize]; 16];
    let (mine0, all0) = counts();
    for round in 0..N / 16 {
        let mut batch: smallvec::SmallVec<[BatchRead<'_>; 16]> = bufs
            .iter_mut()
            .enumerate()
            .map(|(k, buf)| BatchRead::new(buf, block(round * 16 + k as u64) * BS))
            .collect();
        c.read_batch(&mut batch, &mut |left| panic!("reads {left:?} left"));
        assert!(batch.iter().all(|r| matches!(r.result, Some(Ok(())))));
    }
    let (mine1, all1) = counts();
    let batched = Figures {
        this_thread: (mine1 - mine0) as f64 / (N / 16 * 16) as f64,
        all_threads: (all1 - all0) as f64 / (N / 16 * 16) as f64,
    };
    let s1b = c.stats();
    assert_eq!(
        s1b.read_hit_blocks - s1.read_hit_blocks,
        N / 16 * 16,
        "every batched read must be a hit"
    );
    assert_eq!(s1b.read_miss_blocks, s0.read_miss_blocks);
    let s1 = s1b;

    let writes = measure(|i| c.write_at(&wbuf, block(i) * BS, false).unwrap());
    let s2 = c.stats();
    assert_eq!(s2.writes - s1.writes, N);

    // The same writes 8 at a time (`write_batch`, as the NBD server batches pipelined WRITEs),
    // after one batch that makes the thread's group waiters (once per thread).
    let write_batch = |round: u64| {
        let mut batch: smallvec::SmallVec<[BatchWrite<'_>; 8]> = (0..8)
            .map(|k| BatchWrite::new(&wbuf, block(round * 8 + k) * BS))
            .collect();
        c.write_batch(&mut batch);
        assert!(batch.iter().all(|w| matches!(w.result, Some(Ok(())))));
    };
    write_batch(N);
    let s2 = c.stats();
    let (mine0, all0) = counts();
    for round in 0..N / 8 {
        write_batch(round);
    }
    let (mine1, all1) = counts();
    let batched_writes = Figures {
        this_thread: (mine1 - mine0) as f64 / (N / 8 * 8) as f64,
        all_threads: (all1 - all0) as f64 / (N / 8 * 8) as f64,
    };
    let s2b = c.stats();
    assert_eq!(s2b.writes - s2.writes, N / 8 * 8);
    let s2 = s2b;

    // The database commit: a write, then a FLUSH (a sync of the cache device).
    let commits = measure(|i| {
        c.write_at(&wbuf, block(i) * BS, false).unwrap();
        c.flush().unwrap();
    });
    let s3 = c.stats();
    assert_eq!(s3.flushes - s2.flushes, N);

    println!("hot path heap allocations per I/O (N = {N}, 4 KiB, steady state; issue 11 item 5):");
    println!(
        "  read hit:          {:.2} on the calling thread, {:.2} on all threads",
        reads.this_thread, reads.all_threads
    );
    println!(
        "  batched read hit:  {:.2} on the calling thread, {:.2} on all threads",
        batched.this_thread, batched.all_threads
    );
    println!(
        "  write-back write:  {:.2} on the calling thread, {:.2} on all threads",
        writes.this_thread, writes.all_threads
    );
    println!(
        "  batched write:     {:.2} on the calling thread, {:.2} on all threads",
        batched_writes.this_thread, batched_writes.all_threads
    );
    println!(
        "  write + flush:     {:.2} on the calling thread, {:.2} on all threads",
        commits.this_thread, commits.all_threads
    );
    c.close().unwrap();

    assert!(
        reads.this_thread <= MAX_READ_HIT_ALLOCS_THIS_THREAD,
        "read hits allocate: {:.2} per I/O on the calling thread (bound {})",
        reads.this_thread,
        MAX_READ_HIT_ALLOCS_THIS_THREAD
    );
    assert!(
        reads.all_threads <= MAX_READ_HIT_ALLOCS_ALL_THREADS,
        "read hits allocate: {:.2} per I/O on all threads (bound {})",
        reads.all_threads,
        MAX_READ_HIT_ALLOCS_ALL_THREADS
    );
    assert!(
        batched.this_thread <= MAX_READ_HIT_ALLOCS_THIS_THREAD,
        "batched read hits allocate: {:.2} per I/O on the calling thread (bound {})",
        batched.this_thread,
        MAX_READ_HIT_ALLOCS_THIS_THREAD
    );
    assert!(
        writes.this_thread <= MAX_WRITE_ALLOCS_THIS_THREAD,
        "write-back writes allocate: {:.2} per I/O on the calling thread (bound {})",
        writes.this_thread,
        MAX_WRITE_ALLOCS_THIS_THREAD
    );
    assert!(
        writes.all_threads <= MAX_WRITE_ALLOCS_ALL_THREADS,
        "write-back writes allocate: {:.2} per I/O on all threads (bound {})",
        writes.all_threads,
        MAX_WRITE_ALLOCS_ALL_THREADS
    );
    assert!(
        batched_writes.this_thread <= MAX_WRITE_ALLOCS_THIS_THREAD,
        "batched write-back writes allocate: {:.2} per I/O on the calling thread (bound {})",
        batched_writes.this_thread,
        MAX_WRITE_ALLOCS_THIS_THREAD
    );
    assert!(
        batched_writes.all_threads <= MAX_WRITE_ALLOCS_ALL_THREADS,
        "batched write-back writes allocate: {:.2} per I/O on all threads (bound {})",
        batched_writes.all_threads,
        MAX_WRITE_ALLOCS_ALL_THREADS
    );
    assert!(
        commits.this_thread <= MAX_WRITE_ALLOCS_THIS_THREAD,
        "write + flush allocates: {:.2} per commit on the calling thread (bound {})",
        commits.this_thread,
        MAX_WRITE_ALLOCS_THIS_THREAD
    );
    assert!(
        commits.all_threads <= MAX_WRITE_ALLOCS_ALL_THREADS,
        "write + flush allocates: {:.2} per commit on all threads (bound {})",
        commits.all_threads,
        MAX_WRITE_ALLOCS_ALL_THREADS
    );
}

//! The live policy parameters change what the cache does, observably, from the next request.
//!
//! - `sequential_cutoff_read_kib`: a sequential read is promoted up to the cutoff and no
//!   further (also with two streams interleaved), everything with the cutoff off; changing it
//!   back and forth takes effect at once; hits are still served from the cache.
//! - `promotion = nhit`: a block is promoted on its nth miss, not before; a read of several
//!   blocks promotes exactly those that reached n; `always` promotes on the first miss again.
//! - `promotion = auto`: every miss is promoted while reclaim has evicted nothing, and once it
//!   evicts, a block needs its nth miss; `promotion_window_secs` after the last eviction, the
//!   first miss promotes again.
//! - `sequential_cutoff_write_kib`: in write-back and write-through, a write stream past the
//!   cutoff reaches the backing store directly (aligned and unaligned writes), replaces cached
//!   copies without leaving a stale one readable, keeps blocks that are dirty in the cache in
//!   the cache, and a power loss after such a write never brings back data older than an
//!   acknowledged write (directed reproducers: a flushed dirty block under the stream, a
//!   write-back write racing the stream's invalidation, and a write-through block awaiting its
//!   backing flush, checked with the crash oracle); such writes keep going while other writers
//!   wait for reclaim of a full cache (a deadlock reproducer).
//! - `reclaim_compact_pct`: a working set under half the cache, overwritten at random until the
//!   log has wrapped several times, is never evicted while compaction is on (every block still
//!   hits, with its newest data); with it off, the same run evicts part of it. A working set of
//!   three quarters of the cache is kept whole at the default threshold (75%) and partly evicted
//!   at 50%.
//! - Ghost hits (a measure, not a parameter): reading a set 1.5x the cache over and over, nearly
//!   every miss is on a block evicted within a cache's worth of evictions and counts; at 4x the
//!   cache, few do.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use flashtier_engine::{Cache, Mode, StatsSnapshot};
use flashtier_io::BlockDev;
use flashtier_testkit::{CrashDev, CrashPolicy, MemDev};

const MIB: u64 = 1 << 20;

/// A 64 MiB cache (1 MiB segments: room for every promotion below) in front of a 64 MiB backing
/// store holding `pattern(1, ..)`.
fn setup(mode: Mode) -> (Arc<MemDev>, Cache) {
    setup_sized(64 << 20, mode)
}

/// [`setup`] with a cache device of `cache_bytes`.
fn setup_sized(cache_bytes: usize, mode: Mode) -> (Arc<MemDev>, Cache) {
    let cdev = Arc::new(MemDev::new(cache_bytes));
    let bdev = Arc::new(MemDev::new(64 << 20));
    bdev.write_at(&pattern(1, 64 << 20), 0, false).unwrap();
    format_cache(
        &*cdev,
        64 << 20,
        1 << 20,
        mode,
        flashtier_engine::ReclaimPolicy::Lru,
    )
    .unwrap();
    let c = open(cdev, bdev.clone(), None).unwrap();
    (bdev, c)
}

/// Waits until `promoted_blocks` reaches `want` (promotions are logged asynchronously, after a
/// linger of up to 20 ms), then a little longer to see that no more arrive.
fn promoted(c: &Cache, want: u64) -> StatsSnapshot {
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.stats().promoted_blocks < want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let s = c.stats();
    assert_eq!(s.promoted_blocks, want, "{s:?}");
    s
}

/// Reads `[from, from + len)` in `req`-byte requests and checks the data.
fn read_seq(c: &Cache, from: u64, len: u64, req: u64) {
    let want = pattern(1, 64 << 20);
    let mut buf = vec![0u8; req as usize];
    let mut at = from;
    while at < from + len {
        c.read_at(&mut buf, at).unwrap();
        assert!(
            buf[..] == want[at as usize..(at + req) as usize],
            "read at {at}"
        );
        at += req;
    }
}

#[test]
fn reads_past_the_read_cutoff_are_not_promoted() {
    let (_bdev, c) = setup(Mode::WriteBack);
    c.set_param("sequential_cutoff_read_kib", "1024").unwrap();
    // 8 MiB in 128 KiB requests: the first 8 requests (1 MiB) are promoted.
    read_seq(&c, 0, 8 * MIB, 128 << 10);
    let s = promoted(&c, 256);
    assert_eq!(s.bypassed_read_blocks, 1792, "{s:?}");
    // Hits are still served from the cache, even past the cutoff.
    c.set_param("sequential_cutoff_read_kib", "64").unwrap();
    read_seq(&c, 0, MIB, 128 << 10);
    let s = c.stats();
    assert_eq!(s.read_hit_blocks, 256, "{s:?}");
    assert_eq!(s.bypassed_read_blocks, 1792, "{s:?}");

    // Off: all of it.
    c.set_param("sequential_cutoff_read_kib", "0").unwrap();
    read_seq(&c, 8 * MIB, 8 * MIB, 128 << 10);
    promoted(&c, 256 + 2048);

    // Back on, with two streams interleaved: each is promoted up to the cutoff.
    c.set_param("sequential_cutoff_read_kib", "1024").unwrap();
    let req = 64 << 10;
    for i in 0..32 {
        read_seq(&c, 16 * MIB + i * req, req, req);
        read_seq(&c, 32 * MIB + i * req, req, req);
    }
    let s = promoted(&c, 256 + 2048 + 2 * 256);
    assert_eq!(s.bypassed_read_blocks, 1792 + 2 * 256, "{s:?}");
    c.close().unwrap();
}

#[test]
fn nhit_promotes_a_block_on_its_nth_miss() {
    let (_bdev, c) = setup(Mode::WriteBack);
    c.set_param("promotion", "nhit").unwrap();
    c.set_param("promotion_nhit", "2").unwrap();
    let block = |b: u64| read_seq(&c, b * BS, BS, BS);

    block(10);
    let s = promoted(&c, 0);
    assert_eq!(s.promotions_skipped_blocks, 1, "{s:?}");
    block(10);
    promoted(&c, 1);
    block(10);
    assert_eq!(c.stats().read_hit_blocks, 1, "{:?}", c.stats());

    // A read of several blocks promotes exactly those on their second miss (44..48).
    read_seq(&c, 40 * BS, 8 * BS, 8 * BS);
    read_seq(&c, 44 * BS, 8 * BS, 8 * BS);
    let s = promoted(&c, 1 + 4);
    assert_eq!(s.promotions_skipped_blocks, 1 + 8 + 4, "{s:?}");
    read_seq(&c, 44 * BS, 4 * BS, 4 * BS);
    assert_eq!(c.stats().read_hit_blocks, 1 + 4, "{:?}", c.stats());

    c.set_param("promotion_nhit", "3").unwrap();
    for _ in 0..2 {
        block(20);
    }
    promoted(&c, 5);
    block(20);
    promoted(&c, 6);

    // Back to always: the first miss promotes.
    c.set_param("promotion", "always").unwrap();
    block(30);
    promoted(&c, 7);
    c.close().unwrap();
}

#[test]
fn auto_counts_misses_only_while_reclaim_evicts() {
    // 8 MiB of cache (1 MiB segments) for 64 MiB of data.
    let (_bdev, c) = setup_sized(8 << 20, Mode::WriteBack);
    c.set_param("promotion", "auto").unwrap();
    c.set_param("sequential_cutoff_read_kib", "0").unwrap();
    let block = |b: u64| read_seq(&c, b * BS, BS, BS);

    // Nothing evicted yet: the first miss promotes.
    block(10);
    let s = promoted(&c, 1);
    assert_eq!(s.promotions_skipped_blocks, 0, "{s:?}");

    // Reading 4x the cache makes reclaim evict.
    read_seq(&c, MIB, 32 * MIB, 64 << 10);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().evicted_blocks == 0 {
        assert!(
            Instant::now() < deadline,
            "nothing evicted: {:?}",
            c.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every miss promoted or counted, then a little longer to see that no more arrive.
    let settled = |c: &Cache| {
        promotions_settled(c);
        std::thread::sleep(Duration::from_millis(100));
        c.stats()
    };
    let before = settled(&c);
    assert!(
        before.promotions_skipped_blocks > 0,
        "once reclaim evicted, misses were counted: {before:?}"
    );

    // Now a block read once is not promoted, and read again it is.
    block(48 * 256);
    let s = settled(&c);
    assert_eq!(
        s.promotions_skipped_blocks,
        before.promotions_skipped_blocks + 1,
        "{s:?}"
    );
    assert_eq!(s.promoted_blocks, before.promoted_blocks, "{s:?}");
    block(48 * 256);
    let s = promoted(&c, before.promoted_blocks + 1);
    assert_eq!(
        s.promotions_skipped_blocks,
        before.promotions_skipped_blocks + 1,
        "{s:?}"
    );

    // A window (1 s) with no eviction: the first miss promotes again.
    c.set_param("promotion_window_secs", "1").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let evicted = c.stats().evicted_blocks;
        std::thread::sleep(Duration::from_millis(2500));
        if c.stats().evicted_blocks == evicted {
            break;
        }
        assert!(Instant::now() < deadline, "reclaim never stopped evicting");
    }
    let before = c.stats();
    block(50 * 256);
    let s = promoted(&c, before.promoted_blocks + 1);
    assert_eq!(
        s.promotions_skipped_blocks, before.promotions_skipped_blocks,
        "{s:?}"
    );
    c.close().unwrap();
}

#[test]
fn prefetch_promotes_whatever_the_policies_say() {
    let (_bdev, c) = setup(Mode::WriteBack);
    c.set_param("sequential_cutoff_read_kib", "64").unwrap();
    c.set_param("promotion", "nhit").unwrap();
    c.prefetch(0, 4 * MIB).unwrap();
    let s = promoted(&c, 1024);
    assert_eq!(
        s.bypassed_read_blocks + s.promotions_skipped_blocks,
        0,
        "{s:?}"
    );
    c.close().unwrap();
}

/// What the backing store holds at `[off, off + len)`.
fn backing(b: &MemDev, off: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    b.read_at(&mut buf, off).unwrap();
    buf
}

fn check_read(c: &Cache, off: u64, want: &[u8]) {
    let mut buf = vec![0u8; want.len()];
    c.read_at(&mut buf, off).unwrap();
    assert!(
        buf == want,
        "read at {off}+{} returned other data",
        want.len()
    );
}

/// Writes `data` at `off` in `req`-byte requests.
fn write_seq(c: &Cache, off: u64, data: &[u8], req: usize) {
    for (i, chunk) in data.chunks(req).enumerate() {
        c.write_at(chunk, off + (i * req) as u64, false).unwrap();
    }
}

fn writes_past_the_cutoff_go_to_the_backing_store(mode: Mode) {
    let (bdev, c) = setup(mode);
    c.set_param("sequential_cutoff_write_kib", "64").unwrap();
    // 256 KiB in 16 KiB writes: the first 64 KiB are cached, the rest goes around.
    let x = pattern(2, 256 << 10);
    write_seq(&c, MIB, &x, 16 << 10);
    let s = c.stats();
    assert_eq!(s.bypassed_write_blocks, 48, "{s:?}");
    assert!(
        backing(&bdev, MIB + (64 << 10), 192 << 10) == x[64 << 10..],
        "the stream past the cutoff is not on the backing store"
    );
    if mode == Mode::WriteBack {
        assert_eq!(c.status().dirty_blocks, 16, "{:?}", c.status());
        assert!(backing(&bdev, MIB, 64 << 10) != x[..64 << 10]);
    }
    check_read(&c, MIB, &x);

    // Unaligned writes (read-modify-write) past the cutoff go around the cache too.
    let y = pattern(3, 100_000);
    write_seq(&c, 4 * MIB + 100, &y, 6000);
    assert!(c.stats().bypassed_write_blocks > 48, "{:?}", c.stats());
    assert!(
        backing(&bdev, 4 * MIB + 100 + 70_000, 30_000) == y[70_000..],
        "unaligned writes past the cutoff are not on the backing store"
    );
    check_read(&c, 4 * MIB + 100, &y);
    if mode == Mode::WriteBack {
        // Logged: the 10 writes up to the cutoff (blocks 0..=14), and block 14 again (the 11th
        // write's first block was dirty, so it stayed in the cache).
        assert_eq!(c.status().dirty_blocks, 16 + 15, "{:?}", c.status());
    }

    // Cached clean copies are replaced, never left readable.
    c.set_param("sequential_cutoff_write_kib", "0").unwrap();
    read_seq(&c, 8 * MIB, 256 << 10, 64 << 10);
    promoted(&c, 64);
    let cached = c.status().cached_blocks;
    c.set_param("sequential_cutoff_write_kib", "16").unwrap();
    let z = pattern(4, 256 << 10);
    write_seq(&c, 8 * MIB, &z, 32 << 10);
    check_read(&c, 8 * MIB, &z);
    assert_eq!(c.status().cached_blocks, cached - 64, "{:?}", c.status());

    // Switching the cutoff off again: the next stream is cached.
    c.set_param("sequential_cutoff_write_kib", "0").unwrap();
    let before = c.stats().bypassed_write_blocks;
    let w = pattern(5, 256 << 10);
    write_seq(&c, 12 * MIB, &w, 16 << 10);
    assert_eq!(c.stats().bypassed_write_blocks, before);
    if mode == Mode::WriteBack {
        assert!(backing(&bdev, 12 * MIB, 256 << 10) != w);
        assert_eq!(c.status().dirty_blocks, 16 + 15 + 64, "{:?}", c.status());
    }
    check_read(&c, 12 * MIB, &w);
    c.close().unwrap();
}

#[test]
fn write_back_writes_past_the_cutoff_go_to_the_backing_store() {
    writes_past_the_cutoff_go_to_the_backing_store(Mode::WriteBack);
}

#[test]
fn write_through_writes_past_the_cutoff_go_to_the_backing_store() {
    writes_past_the_cutoff_go_to_the_backing_store(Mode::WriteThrough);
}

#[test]
fn dirty_blocks_keep_a_write_past_the_cutoff_in_the_cache() {
    let (bdev, c) = setup(Mode::WriteBack);
    let old = pattern(6, 64 << 10);
    c.write_at(&old, 0, false).unwrap();
    c.set_param("sequential_cutoff_write_kib", "4").unwrap();
    let new = pattern(7, 64 << 10);
    c.write_at(&new, 0, false).unwrap();
    assert_eq!(c.stats().bypassed_write_blocks, 0, "{:?}", c.stats());
    check_read(&c, 0, &new);
    assert!(backing(&bdev, 0, 64 << 10) != new);
    // Once written back, the same write goes around the cache.
    c.write_back_all().unwrap();
    c.write_at(&old, 0, false).unwrap();
    assert_eq!(c.stats().bypassed_write_blocks, 16, "{:?}", c.stats());
    check_read(&c, 0, &old);
    assert!(backing(&bdev, 0, 64 << 10) == old);
    // Some blocks dirty: those stay in the cache, the others go around.
    c.set_param("sequential_cutoff_write_kib", "0").unwrap();
    c.write_at(&pattern(8, 4 * BS as usize), 4 * BS, false)
        .unwrap();
    c.set_param("sequential_cutoff_write_kib", "4").unwrap();
    let newer = pattern(9, 64 << 10);
    c.write_at(&newer, 0, false).unwrap();
    assert_eq!(c.stats().bypassed_write_blocks, 16 + 12, "{:?}", c.stats());
    assert_eq!(c.status().dirty_blocks, 4, "{:?}", c.status());
    let on_backing = backing(&bdev, 0, 64 << 10);
    let (bs, cut) = (BS as usize, 8 * BS as usize);
    assert!(on_backing[..4 * bs] == newer[..4 * bs] && on_backing[cut..] == newer[cut..]);
    assert!(
        on_backing[4 * bs..cut] == old[4 * bs..cut],
        "the dirty blocks went around the cache"
    );
    check_read(&c, 0, &newer);
    c.close().unwrap();
}

/// Fresh crash devices on a rail, behind gates, formatted write-back, opened with a 4 KiB write
/// cutoff (so any longer write goes around the cache).
fn crash_setup() -> (Arc<Rail>, Arc<Gate>, Arc<Gate>, Arc<Cache>) {
    let rail = Rail::new();
    let cdev = Arc::new(CrashDev::new(2 << 20));
    let bdev = Arc::new(CrashDev::from_image(pattern(8, 1 << 20)));
    format_small(&*cdev, 1 << 20, Mode::WriteBack);
    let gc = Gate::new(rail.attach(cdev));
    let gb = Gate::new(rail.attach(bdev));
    let c = open(gc.clone(), gb.clone(), None).unwrap();
    c.set_param("sequential_cutoff_write_kib", "4").unwrap();
    (rail, gc, gb, Arc::new(c))
}

fn recovered_block0(rail: &Rail) -> Vec<u8> {
    let mut imgs = rail.crash_images(1, CrashPolicy::drop_all()).into_iter();
    let c: Arc<dyn BlockDev> = Arc::new(CrashDev::from_image(imgs.next().unwrap()));
    let b: Arc<dyn BlockDev> = Arc::new(CrashDev::from_image(imgs.next().unwrap()));
    let c = open(c, b, None).unwrap();
    let mut buf = vec![0u8; BS as usize];
    c.read_at(&mut buf, 0).unwrap();
    buf
}

/// A write past the cutoff over a dirty block whose write was flushed, then a power loss before
/// the backing store flushed anything: the block must read as the flushed write (or the new one),
/// never as what the backing store held before both. Invalidating the dirty block (durably,
/// before the backing write) would bring that back.
#[test]
fn a_write_past_the_cutoff_never_loses_a_flushed_dirty_block() {
    let (rail, _gc, _gb, c) = crash_setup();
    let a = pattern(9, BS as usize);
    c.write_at(&a, 0, false).unwrap();
    c.flush().unwrap();
    let b = pattern(10, 2 * BS as usize);
    c.write_at(&b, 0, false).unwrap();
    let got = recovered_block0(&rail);
    assert!(
        got == a || got == b[..BS as usize],
        "block 0 lost a flushed write: it reads as the backing store's older data"
    );
}

/// A write-back FUA write W of block 0 races a write S past the cutoff over blocks 0 and 1: W's
/// log batch is parked at the cache device while S starts. If S checked block 0 for dirty data
/// before W was applied and invalidated it after, W (acknowledged, durable) would be dropped
/// from the cache before the backing store held S; a power loss then shows block 0 as neither.
#[test]
fn a_write_past_the_cutoff_never_drops_a_racing_write_back_write() {
    let (rail, gc, gb, c) = crash_setup();
    let w = pattern(11, BS as usize);
    let s = pattern(12, 2 * BS as usize);
    gc.park_next_write();
    let writer = {
        let (c, w) = (c.clone(), w.clone());
        std::thread::spawn(move || c.write_at(&w, 0, true))
    };
    gc.wait_parked();
    gb.park_next_write_at(0);
    let stream = {
        let (c, s) = (c.clone(), s.clone());
        std::thread::spawn(move || c.write_at(&s, 0, false))
    };
    std::thread::sleep(Duration::from_millis(100));
    gc.release();
    writer.join().unwrap().unwrap();
    // S either finished (it stayed in the cache) or is parked on its way to the backing store.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !stream.is_finished() && !gb.is_parked() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = recovered_block0(&rail);
    gb.release();
    stream.join().unwrap().unwrap();
    assert!(
        got == w || got == s[..BS as usize],
        "an acknowledged FUA write was lost: block 0 reads as neither it nor the racing write"
    );
    check_read(&c, 0, &s);
}

/// Write-through: a write past the cutoff over a block still awaiting its backing flush (dirty),
/// then a power loss that drops everything volatile. The block's only durable copy is the log
/// record; invalidating it while a later write through the log survives is not a prefix of the
/// history (found by the model test as its first failure with the cutoff: block 3 read as the
/// backing store's data although the write of block 0, logged after the write of block 3,
/// survived).
#[test]
fn a_write_past_the_cutoff_keeps_write_through_blocks_awaiting_their_flush() {
    let rail = Rail::new();
    let initial = pattern(13, 1 << 20);
    let cdev = Arc::new(CrashDev::new(1 << 20));
    let bdev = Arc::new(CrashDev::from_image(initial.clone()));
    format_small(&*cdev, 1 << 20, Mode::WriteThrough);
    let c = open(rail.attach(cdev), rail.attach(bdev), None).unwrap();
    c.set_param("sequential_cutoff_write_kib", "4").unwrap();
    let atomic = c.atomic_write_bytes() as u64;
    let mut model = Model::new(&initial);
    for (i, (off, len)) in [(3 * BS, BS), (0, BS), (BS, 2 * BS + 1)]
        .into_iter()
        .enumerate()
    {
        let data = Arc::new(pattern(20 + i as u64, len as usize));
        let bypassed = c.stats().bypassed_write_blocks;
        c.write_at(&data, off, false).unwrap();
        let mode = if c.stats().bypassed_write_blocks > bypassed {
            Mode::WriteAround
        } else {
            Mode::WriteThrough
        };
        let subs = model.write_subs(
            off,
            len,
            Val::Data { data, at: 0 },
            false,
            mode,
            atomic,
            "w",
        );
        model.apply(subs, true);
    }
    assert!(
        c.stats().bypassed_write_blocks > 0,
        "the last write went around the cache"
    );
    let mut imgs = rail.crash_images(1, CrashPolicy::drop_all()).into_iter();
    drop(c);
    let c: Arc<dyn BlockDev> = Arc::new(CrashDev::from_image(imgs.next().unwrap()));
    let b: Arc<dyn BlockDev> = Arc::new(CrashDev::from_image(imgs.next().unwrap()));
    let c = open(c, b, None).unwrap();
    let recovered = read_all(&c).unwrap();
    if let Err(e) = model.check_crash(&recovered) {
        panic!("{e}\n{}", model.pending_summary());
    }
}

/// Writes past the cutoff keep going while the cache is full of dirty data and other writers
/// wait for reclaim. A write around the cache holds the cleaner's lock from its INVALIDATE to
/// its backing write; if its sync waited behind the records waiting for log space, the cleaning
/// pass that reclaim needs would wait for it, and every writer would hang (found by the
/// power-loss campaign as a hung run; this reproduces it every time on devices sharing a power
/// rail, which serialises their requests).
#[test]
fn writes_past_the_cutoff_make_progress_through_a_full_cache() {
    for seed in 0..3u64 {
        // Devices on a power rail (one request at a time, as in the power-loss campaign).
        let rail = Rail::new();
        let cdev = Arc::new(CrashDev::new(1 << 20));
        let bdev = Arc::new(CrashDev::new(4 << 20));
        format_small(&*cdev, 4 << 20, Mode::WriteBack);
        let c = Arc::new(open(rail.attach(cdev), rail.attach(bdev), None).unwrap());
        c.set_param("sequential_cutoff_write_kib", "16").unwrap();
        let c2 = c.clone();
        let finished = with_timeout(30, move || {
            std::thread::scope(|s| {
                let writers: Vec<_> = (0..4u64)
                    .map(|t| {
                        let c = &c2;
                        s.spawn(move || {
                            let mut r = Rng::new(mix(seed, t));
                            let mut at = t * MIB;
                            for i in 0..300u64 {
                                let n = if t % 2 == 0 {
                                    r.range(1, 28)
                                } else {
                                    r.range(1, 4)
                                };
                                let data = vec![i as u8; (n * BS) as usize];
                                if t % 2 == 0 {
                                    // Sequential, past the cutoff after the first requests.
                                    if at + data.len() as u64 > 4 * MIB {
                                        at = 0;
                                    }
                                    c.write_at(&data, at, false)?;
                                    at += data.len() as u64;
                                } else {
                                    let b = r.below(1024 - n);
                                    c.write_at(&data, b * BS, false)?;
                                }
                                if i % 50 == 49 {
                                    c.flush()?;
                                }
                            }
                            Ok::<(), std::io::Error>(())
                        })
                    })
                    .collect();
                writers
                    .into_iter()
                    .map(|w| w.join().unwrap())
                    .collect::<std::io::Result<Vec<()>>>()
            })
        });
        match finished {
            Some(r) => r.unwrap_or_else(|e| panic!("seed {seed}: a write failed: {e}")),
            None => panic!(
                "seed {seed}: the writers hung (or one panicked) for 30 s: {:?}\n{:?}",
                c.status(),
                c.stats()
            ),
        };
        assert!(c.stats().bypassed_write_blocks > 0, "{:?}", c.stats());
    }
}

/// Write-through (every cached block clean, so evictable), a working set of `set_mib` written
/// once in a 64 MiB cache, then overwritten at random with 4 KiB writes for three times the
/// cache's size: the oldest segments are never wholly garbage, so the policy's victims hold live
/// blocks. The writer lets reclaim stay ahead of it (compaction gives way to eviction once writers
/// wait for space: a single writer to RAM would always outrun it). Returns the counters after
/// reading the whole working set back (checking its data).
fn overwrite_at_random(set_mib: u64, compact_pct: &str) -> StatsSnapshot {
    let (_bdev, c) = setup(Mode::WriteThrough);
    c.set_param("reclaim_compact_pct", compact_pct).unwrap();
    let set = set_mib * MIB;
    let mut want = pattern(2, set as usize);
    write_seq(&c, 0, &want, 64 << 10);
    let mut rng = Rng::new(7);
    for i in 0..3 * 64 * MIB / 4096 {
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.status().free_segments <= 3 {
            assert!(Instant::now() < deadline, "reclaim made no room in 10 s");
            std::thread::sleep(Duration::from_micros(200));
        }
        let at = (rng.below(set / 4096) * 4096) as usize;
        let data = pattern(1000 + i, 4096);
        want[at..at + 4096].copy_from_slice(&data);
        c.write_at(&data, at as u64, false).unwrap();
    }
    let before = c.stats();
    assert!(
        before.reclaimed_segments > 2 * 64,
        "the log did not wrap: {before:?}"
    );
    read_seq_against(&c, &want, 256 << 10);
    let mut s = c.stats();
    s.read_miss_blocks -= before.read_miss_blocks;
    c.close().unwrap();
    s
}

/// Reads `want.len()` bytes from 0 in `req`-byte requests and checks them against `want`.
fn read_seq_against(c: &Cache, want: &[u8], req: usize) {
    for (i, chunk) in want.chunks(req).enumerate() {
        check_read(c, (i * req) as u64, chunk);
    }
}

#[test]
fn compaction_keeps_a_working_set_smaller_than_the_cache() {
    let s = overwrite_at_random(24, "50");
    assert_eq!(s.evicted_blocks, 0, "{s:?}");
    assert_eq!(s.read_miss_blocks, 0, "{s:?}");
    assert!(s.compacted_segments > 0, "{s:?}");
}

/// Reclaim gives the segments it empties back to the log with FREE records (format version 3),
/// at once for a victim sealed before the older checkpoint recovery may use, instead of each
/// waiting for two checkpoints that reclaim asked for (a full index image each). Before, this
/// workload took about two checkpoints per reclaim round.
#[test]
fn reclaimed_segments_are_freed_by_records_not_by_checkpoints() {
    let s = overwrite_at_random(24, "75");
    assert!(
        s.freed_segments * 10 >= s.reclaimed_segments * 9,
        "most emptied segments freed by FREE records: {s:?}"
    );
    assert!(
        s.checkpoints * 4 < s.reclaimed_segments,
        "checkpoints are not what frees segments: {s:?}"
    );
}

/// Three quarters of the cache's capacity in use: random overwrites leave every segment more
/// than half live, so compacting only half-empty segments evicts, and the default threshold
/// (75%) keeps the whole set.
#[test]
fn compaction_at_the_default_keeps_a_working_set_of_three_quarters_of_the_cache() {
    let s = overwrite_at_random(SET_OF_THREE_QUARTERS, "75");
    assert_eq!(s.evicted_blocks, 0, "{s:?}");
    assert_eq!(s.read_miss_blocks, 0, "{s:?}");
    let s = overwrite_at_random(SET_OF_THREE_QUARTERS, "50");
    assert!(s.evicted_blocks > 0, "{s:?}");
    assert!(s.read_miss_blocks > 0, "{s:?}");
}

/// About three quarters of the 64 MiB cache's capacity (its segments minus those reclaim keeps
/// free).
const SET_OF_THREE_QUARTERS: u64 = 44;

#[test]
fn without_compaction_the_policy_evicts_part_of_it() {
    let s = overwrite_at_random(24, "0");
    assert!(s.evicted_blocks > 0, "{s:?}");
    assert!(s.read_miss_blocks > 0, "{s:?}");
    assert_eq!(s.compacted_segments, 0, "{s:?}");
}

/// Waits until every read miss so far was promoted (or counted as not promoted): reads from RAM
/// would otherwise outrun the log writer, and a block whose promotion is still queued misses
/// again without having been evicted.
fn promotions_settled(c: &Cache) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = c.stats();
        if s.promoted_blocks
            + s.promotions_dropped
            + s.promotions_shed_blocks
            + s.promotions_skipped_blocks
            >= s.read_miss_blocks
        {
            return;
        }
        assert!(Instant::now() < deadline, "promotions did not land: {s:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reads `set` bytes of the backing store `passes` times, each pass in a new random order of its
/// 4 KiB blocks, through a 16 MiB write-through cache that promotes every miss (so every block
/// read goes through the cache and out again); returns the counters of the last two passes.
fn cycle_through(set: u64, passes: u64) -> StatsSnapshot {
    let (_bdev, c) = setup_sized(16 << 20, Mode::WriteThrough);
    c.set_param("promotion", "always").unwrap();
    let want = pattern(1, set as usize);
    let mut rng = Rng::new(11);
    let mut blocks: Vec<u64> = (0..set / 4096).collect();
    let mut before = c.stats();
    for pass in 0..passes {
        if pass == passes - 2 {
            before = c.stats();
        }
        for i in (1..blocks.len()).rev() {
            blocks.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for chunk in blocks.chunks(256) {
            for &b in chunk {
                let at = (b * 4096) as usize;
                check_read(&c, at as u64, &want[at..at + 4096]);
            }
            promotions_settled(&c);
        }
    }
    let mut s = c.stats();
    s.read_miss_blocks -= before.read_miss_blocks;
    s.ghost_hit_blocks -= before.ghost_hit_blocks;
    s.evicted_blocks -= before.evicted_blocks;
    c.close().unwrap();
    s
}

#[test]
fn misses_on_blocks_evicted_lately_are_ghost_hits() {
    // 1.5x the cache: what misses was evicted less than a cache's worth of evictions ago.
    let s = cycle_through(24 * MIB, 5);
    assert!(s.evicted_blocks > 0 && s.read_miss_blocks > 1000, "{s:?}");
    assert!(
        s.ghost_hit_blocks * 10 >= s.read_miss_blocks * 6,
        "ghost hits {} of {} misses: {s:?}",
        s.ghost_hit_blocks,
        s.read_miss_blocks
    );
    assert!(s.ghost_hit_blocks <= s.read_miss_blocks, "{s:?}");
}

#[test]
fn misses_a_cache_twice_the_size_would_not_have_hit_are_not_ghost_hits() {
    // 4x the cache: most blocks come back after more than a cache's worth of evictions.
    let s = cycle_through(64 * MIB, 4);
    assert!(s.evicted_blocks > 0 && s.read_miss_blocks > 10_000, "{s:?}");
    assert!(
        s.ghost_hit_blocks * 10 <= s.read_miss_blocks * 2,
        "ghost hits {} of {} misses",
        s.ghost_hit_blocks,
        s.read_miss_blocks
    );
}

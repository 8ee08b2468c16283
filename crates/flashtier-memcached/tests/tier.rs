//! The memcached tier against real memcached servers and a lying stand-in: reads come from the
//! pool once stored, and nothing the pool does (die, restart empty, replay old values, corrupt
//! them, be shared by another tier) makes a read return anything but the newest data.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use flashtier_io::{BlockDev, ZeroOpts};
use flashtier_memcached::{MemcachedMode, MemcachedTier, Pool, PoolOptions};
use flashtier_testkit::memcached::{BlackHole, Memcached, Replayer};
use flashtier_testkit::stamp::{content, version_of};
use flashtier_testkit::MemDev;
use parking_lot::Mutex;

const B: usize = 4096;

/// Generous for a loaded 2-core machine: the tests are about correctness, not speed.
fn options() -> PoolOptions {
    PoolOptions {
        timeout: Duration::from_millis(200),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..PoolOptions::default()
    }
}

fn tier(blocks: usize, servers: &[String], mode: MemcachedMode) -> (Arc<MemDev>, MemcachedTier) {
    let dev = Arc::new(MemDev::new(blocks * B));
    let pool = Arc::new(Pool::new(servers, options()).unwrap());
    let t = MemcachedTier::new(dev.clone(), pool, 7, mode).unwrap();
    (dev, t)
}

fn read_block(t: &MemcachedTier, block: u64) -> Vec<u8> {
    let mut buf = vec![0; B];
    t.read_at(&mut buf, block * B as u64).unwrap();
    buf
}

#[test]
fn a_written_block_is_read_back_from_memcached() {
    let servers = [
        Memcached::start(&["-m", "16"]),
        Memcached::start(&["-m", "16"]),
    ];
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let (dev, t) = tier(256, &addrs, MemcachedMode::Inclusive);
    for b in 0..64 {
        t.write_at(&content(b, 1), b * B as u64, false).unwrap();
    }
    assert_eq!(t.stats().stored_blocks, 64);
    // Another write of the neighbours (the version record is per block: they stay usable).
    for b in (1..64).step_by(2) {
        t.write_at(&content(b, 1), b * B as u64, false).unwrap();
    }
    // Change the device underneath: reads that still return version 1 came from memcached.
    for b in 0..64 {
        dev.write_at(&content(b, 99), b * B as u64, false).unwrap();
    }
    let mut buf = vec![0; 64 * B];
    t.read_at(&mut buf, 0).unwrap();
    for b in 0..64u64 {
        assert_eq!(version_of(&buf[b as usize * B..][..B], b), 1);
    }
    let s = t.stats();
    assert_eq!((s.lookup_blocks, s.hit_blocks), (64, 64), "{s:?}");
    // Both servers hold some: the keys are spread.
    assert!(servers.iter().all(|m| m.stat("curr_items") > 0));
    // A block only read is stored on its miss, then hit.
    read_block(&t, 100);
    read_block(&t, 100);
    let s = t.stats();
    assert_eq!((s.miss_blocks, s.hit_blocks), (1, 65), "{s:?}");
}

#[test]
fn trim_and_zeroes_make_old_values_unusable() {
    let m = Memcached::start(&["-m", "16"]);
    let (_dev, t) = tier(64, &[m.addr()], MemcachedMode::Inclusive);
    t.write_at(&content(3, 1), 3 * B as u64, false).unwrap();
    t.write_at(&content(9, 1), 9 * B as u64, false).unwrap();
    t.write_zeroes(3 * B as u64, B as u64, ZeroOpts::default())
        .unwrap();
    t.trim(9 * B as u64, B as u64).unwrap();
    assert!(read_block(&t, 3).iter().all(|&x| x == 0));
    let nine = read_block(&t, 9);
    assert!(nine.iter().all(|&x| x == 0), "MemDev trims to zeroes");
    assert_eq!(t.stats().hit_blocks, 0);
    assert_eq!(t.stats().stale_values, 2);
}

#[test]
fn old_or_corrupt_values_from_a_lying_server_are_refused() {
    let liar = Replayer::start();
    let (_dev, t) = tier(64, &[liar.addr()], MemcachedMode::Inclusive);
    t.write_at(&content(5, 1), 5 * B as u64, false).unwrap();
    t.write_at(&content(5, 2), 5 * B as u64, false).unwrap();
    assert_eq!(liar.values_set(), 2);
    liar.replay(true);
    assert_eq!(version_of(&read_block(&t, 5), 5), 2);
    assert_eq!(t.stats().stale_values, 1);
    assert_eq!(t.stats().hit_blocks, 0);
    liar.replay(false);
    assert_eq!(version_of(&read_block(&t, 5), 5), 2);
    assert_eq!(t.stats().hit_blocks, 1, "the newest value is used");
    liar.corrupt(true);
    assert_eq!(version_of(&read_block(&t, 5), 5), 2);
    assert_eq!(t.stats().corrupt_values, 1);
}

#[test]
fn another_tier_sharing_the_pool_never_sees_these_values() {
    let m = Memcached::start(&["-m", "16"]);
    let (_a_dev, a) = tier(64, &[m.addr()], MemcachedMode::Inclusive);
    // The same namespace (the worst case: the same backing store's identity), another start.
    let (b_dev, b) = tier(64, &[m.addr()], MemcachedMode::Inclusive);
    a.write_at(&content(1, 1), B as u64, false).unwrap();
    b_dev.write_at(&content(1, 7), B as u64, false).unwrap();
    assert_eq!(version_of(&read_block(&b, 1), 1), 7);
    assert_eq!(b.stats().hit_blocks, 0);
    assert_eq!(b.stats().stale_values + b.stats().corrupt_values, 0);
}

#[test]
fn victim_mode_stores_nothing_itself_and_a_hit_removes_the_value() {
    let m = Memcached::start(&["-m", "16"]);
    let (_dev, t) = tier(64, &[m.addr()], MemcachedMode::Inclusive);
    t.write_at(&content(2, 1), 2 * B as u64, false).unwrap();
    t.set_mode(MemcachedMode::Victim);
    t.write_at(&content(4, 1), 4 * B as u64, false).unwrap();
    read_block(&t, 6);
    assert_eq!(t.stats().stored_blocks, 1, "only the inclusive write");
    assert_eq!(version_of(&read_block(&t, 2), 2), 1);
    let s = t.stats();
    assert_eq!((s.hit_blocks, s.removed_blocks), (1, 1), "{s:?}");
    read_block(&t, 2);
    assert_eq!(t.stats().hit_blocks, 1, "removed after its hit");
}

/// Victims offered by a faster tier are stored only in victim mode, come back once (a hit
/// removes them), and a write after the offer makes the value unusable.
#[test]
fn offered_victims_are_stored_in_victim_mode_and_made_old_by_writes() {
    let m = Memcached::start(&["-m", "16"]);
    let (dev, t) = tier(64, &[m.addr()], MemcachedMode::Inclusive);
    for b in [1u64, 2, 3] {
        dev.write_at(&content(b, 4), b * B as u64, false).unwrap();
    }
    t.offer_victim(1, &content(1, 4));
    t.ship_victims();
    assert_eq!(t.stats().stored_blocks, 0, "inclusive takes no victims");
    t.set_mode(MemcachedMode::Victim);
    t.offer_victim(1, &content(1, 4));
    t.offer_victim(2, &content(2, 4));
    t.ship_victims();
    assert_eq!(t.stats().stored_blocks, 2);
    assert_eq!(version_of(&read_block(&t, 1), 1), 4);
    let s = t.stats();
    assert_eq!((s.hit_blocks, s.removed_blocks), (1, 1), "{s:?}");
    read_block(&t, 1);
    assert_eq!(t.stats().hit_blocks, 1, "removed after its hit");
    // Written after it was offered: the value is old, the write's data is read.
    t.write_at(&content(2, 5), 2 * B as u64, false).unwrap();
    assert_eq!(version_of(&read_block(&t, 2), 2), 5);
    assert_eq!(t.stats().stale_values, 1);
}

#[test]
fn a_dead_or_silent_server_costs_hits_not_errors() {
    let hole = BlackHole::start();
    let hole_addr = hole.addr.clone();
    let mut m = Memcached::start(&["-m", "16"]);
    let (_dev, t) = tier(
        256,
        &[m.addr(), hole_addr.clone()],
        MemcachedMode::Inclusive,
    );
    for b in 0..128 {
        t.write_at(&content(b, 1), b * B as u64, false).unwrap();
    }
    m.kill();
    let start = Instant::now();
    for b in 0..128 {
        assert_eq!(version_of(&read_block(&t, b), b), 1);
    }
    // Each server costs at most one timeout before it is skipped for its backoff.
    assert!(start.elapsed() < Duration::from_secs(10));
    let totals = t.pool().totals();
    assert!(totals.errors + totals.timeouts >= 1, "{totals:?}");
    m.restart();
    // After its backoff the restarted server is used again (alone: the hole would keep the
    // keys it owns missing).
    t.pool().remove_server(&hole_addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        t.write_at(&content(200, 2), 200 * B as u64, false).unwrap();
        let before = t.stats().hit_blocks;
        read_block(&t, 200);
        if t.stats().hit_blocks > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted server never came back"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Threads write and read random runs of blocks through the tier while a chaos thread kills and
/// restarts servers, makes the stand-in replay old values and corrupt them, and a second tier
/// in the same namespace writes other data for the same blocks into the same pool. Each block
/// has a lock held across its read or write and its model update, so every read has exactly one
/// right answer: the version last written.
#[test]
fn a_verifying_workload_never_reads_old_data_whatever_the_pool_does() {
    const BLOCKS: u64 = 512;
    let mut real = [
        Memcached::start(&["-m", "16"]),
        Memcached::start(&["-m", "16"]),
    ];
    let liar = Replayer::start();
    let mut addrs: Vec<String> = real.iter().map(Memcached::addr).collect();
    addrs.push(liar.addr());
    let (_dev, t) = tier(BLOCKS as usize, &addrs, MemcachedMode::Inclusive);
    let t = Arc::new(t);
    let (_other_dev, other) = tier(BLOCKS as usize, &addrs, MemcachedMode::Inclusive);
    let other = Arc::new(other);
    let model: Arc<Vec<Mutex<u64>>> = Arc::new((0..BLOCKS).map(|_| Mutex::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let seconds = if std::env::var("FLASHTIER_LONG").as_deref() == Ok("1") {
        60
    } else {
        6
    };
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let (t, model, stop, reads) = (t.clone(), model.clone(), stop.clone(), reads.clone());
            thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ w;
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                while !stop.load(Ordering::Relaxed) {
                    let first = next() % (BLOCKS - 8);
                    let n = 1 + next() % 8;
                    // Locks in block order: no deadlock between workers.
                    let mut held: Vec<_> = (first..first + n)
                        .map(|b| model[b as usize].lock())
                        .collect();
                    let at = first * B as u64;
                    if next() % 3 == 0 {
                        let mut buf = Vec::with_capacity(n as usize * B);
                        for (i, v) in held.iter_mut().enumerate() {
                            **v += 1;
                            buf.extend_from_slice(&content(first + i as u64, **v));
                        }
                        t.write_at(&buf, at, false).unwrap();
                    } else {
                        let mut buf = vec![0; n as usize * B];
                        t.read_at(&mut buf, at).unwrap();
                        for (i, v) in held.iter().enumerate() {
                            let b = first + i as u64;
                            assert_eq!(version_of(&buf[i * B..][..B], b), **v, "block {b}");
                        }
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let other_writer = {
        let (other, stop) = (other.clone(), stop.clone());
        thread::spawn(move || {
            let mut v = 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                for b in (0..BLOCKS).step_by(3) {
                    v += 1;
                    other.write_at(&content(b, v), b * B as u64, false).unwrap();
                }
            }
        })
    };
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut round = 0u32;
    while Instant::now() < end {
        thread::sleep(Duration::from_millis(300));
        match round % 5 {
            0 => real[0].kill(),
            1 => real[0].restart(),
            2 => liar.replay(true),
            3 => liar.corrupt(true),
            _ => {
                liar.replay(false);
                liar.corrupt(false);
                real[1].restart();
            }
        }
        round += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("a worker saw wrong data");
    }
    other_writer.join().unwrap();
    let s = t.stats();
    eprintln!(
        "{} reads, {s:?}, pool {:?}",
        reads.load(Ordering::Relaxed),
        t.pool().totals()
    );
    assert!(s.hit_blocks > 0, "the pool was never used: {s:?}");
    assert!(
        s.stale_values > 0,
        "the stand-in's old values never reached the tier, so the test proved nothing: {s:?}"
    );
}

use std::sync::Arc;

use flashtier_engine::{format, BackingIdentity, Cache, FormatOptions, Mode};
use flashtier_io::BlockDev;
use flashtier_testkit::MemDev;

fn ident(size: u64) -> BackingIdentity {
    BackingIdentity {
        size,
        name: "mem".into(),
        fingerprint: Vec::new(),
    }
}

/// A 16 MiB cache device, formatted (256 KiB segments) for a 64 MiB backing store; returns
/// both devices.
fn formatted() -> (Arc<dyn BlockDev>, Arc<dyn BlockDev>) {
    let cache_dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(16 << 20));
    let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(64 << 20));
    let opts = FormatOptions {
        segment_size: 256 << 10,
        ..Default::default()
    };
    format(&*cache_dev, ident(64 << 20), opts).unwrap();
    (cache_dev, backing)
}

#[test]
fn write_read_close_reopen_crash_recover() {
    let (cache_dev, backing) = formatted();
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    assert_eq!(c.mode(), Mode::WriteBack);
    let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    c.write_at(&data, 4096 * 10, false).unwrap();
    c.write_at(b"hello", 12345, true).unwrap();
    let mut out = vec![0u8; 65536];
    c.read_at(&mut out, 4096 * 10).unwrap();
    assert_eq!(out, data);
    let st = c.status();
    assert!(st.dirty_blocks >= 16, "{st:?}");
    c.close().unwrap();

    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    assert!(c.report().clean_shutdown);
    let mut out = vec![0u8; 65536];
    c.read_at(&mut out, 4096 * 10).unwrap();
    assert_eq!(out, data);
    let mut h = [0u8; 5];
    c.read_at(&mut h, 12345).unwrap();
    assert_eq!(&h, b"hello");
    c.write_at(&[7u8; 8192], 0, false).unwrap();
    c.flush().unwrap();
    drop(c); // no close: like a crash after the flush

    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    assert!(!c.report().clean_shutdown);
    assert!(c.report().replayed_records >= 1, "{:?}", c.report());
    let mut z = [0u8; 8192];
    c.read_at(&mut z, 0).unwrap();
    assert_eq!(z, [7u8; 8192]);
    // Write everything back: the backing store alone must hold it.
    c.write_back_all().unwrap();
    let mut b = vec![0u8; 65536];
    backing.read_at(&mut b, 4096 * 10).unwrap();
    assert_eq!(b, data);
    c.close().unwrap();
}

#[test]
fn fills_the_cache_and_reclaims() {
    let cache_dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(8 << 20));
    let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(64 << 20));
    let opts = FormatOptions {
        segment_size: 256 << 10,
        ..Default::default()
    };
    format(&*cache_dev, ident(64 << 20), opts).unwrap();
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    // Write 32 MiB through an 8 MiB cache: reclaim must clean and evict.
    for i in 0..(32u64 << 20) / 65536 {
        let buf = vec![(i % 256) as u8; 65536];
        c.write_at(&buf, i * 65536, false).unwrap();
    }
    for i in 0..(32u64 << 20) / 65536 {
        let mut buf = vec![0u8; 65536];
        c.read_at(&mut buf, i * 65536).unwrap();
        assert!(buf.iter().all(|&b| b == (i % 256) as u8), "chunk {i}");
    }
    let s = c.stats();
    assert!(s.reclaimed_segments > 0 && s.cleaned_blocks > 0, "{s:?}");
    c.close().unwrap();
}

#[test]
fn read_misses_are_promoted_and_then_hit() {
    let (cache_dev, backing) = formatted();
    backing.write_at(&[9u8; 65536], 0, false).unwrap();
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    let mut buf = vec![0u8; 65536];
    c.read_at(&mut buf, 0).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while c.stats().promoted_blocks < 16 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = c.stats();
    assert_eq!(s.promoted_blocks, 16, "{s:?}");
    // Device operations are counted as well as bytes: one backing read for the miss, at least
    // one log batch written, and one cache read for the hit.
    assert_eq!((s.backing_reads, s.backing_read_bytes), (1, 65536), "{s:?}");
    assert!(s.cache_writes >= 1 && s.cache_write_bytes >= 65536, "{s:?}");
    c.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 9));
    let s2 = c.stats();
    assert_eq!(s2.read_hit_blocks, 16, "{s2:?}");
    assert_eq!(s2.cache_reads - s.cache_reads, 1, "{s2:?}");
    assert_eq!(s2.backing_reads, 1, "a hit read the backing store: {s2:?}");
    c.close().unwrap();
}

#[test]
fn scan_larger_than_the_cache_after_a_hot_set() {
    let cache_dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(64 << 20));
    let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(256 << 20));
    let opts = FormatOptions {
        segment_size: 1 << 20,
        ..Default::default()
    };
    format(&*cache_dev, ident(256 << 20), opts).unwrap();
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(256 << 20), None).unwrap();
    // Both the hot set (read in order) and the scan must be promoted for the scan to push the
    // hot set through reclaim.
    c.set_param("sequential_cutoff_read_kib", "0").unwrap();
    let mut buf = vec![0u8; 4096];
    for pass in 0..3 {
        for b in 0..4096u64 {
            if pass == 2 {
                c.write_at(&[b as u8; 4096], b * 4096, false).unwrap();
            } else {
                c.read_at(&mut buf, b * 4096).unwrap();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    drop(c);
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(256 << 20), None).unwrap();
    c.set_param("sequential_cutoff_read_kib", "0").unwrap();
    let mut big = vec![0u8; 1 << 20];
    for mib in 0..256u64 {
        if let Err(e) = c.read_at(&mut big, mib << 20) {
            panic!("read {mib}: {e} {:?} {:?}", c.status(), c.stats());
        }
    }
    if let Err(e) = c.write_back_all() {
        panic!("write back: {e} {:?} {:?}", c.status(), c.stats());
    }
    assert_eq!(c.status().dirty_blocks, 0, "{:?}", c.status());
    for b in 0..4096u64 {
        c.read_at(&mut buf, b * 4096).unwrap();
        assert!(buf.iter().all(|&x| x == b as u8), "block {b}");
        backing.read_at(&mut buf, b * 4096).unwrap();
        assert!(buf.iter().all(|&x| x == b as u8), "backing block {b}");
    }
    c.close().unwrap();
}

/// `status` places every slot of the capacity: cached, unwritten (left for the log) or stale
/// (an overwritten block's old copy, a batch header).
#[test]
fn status_splits_the_capacity_into_cached_unwritten_and_stale() {
    let (cache_dev, backing) = formatted();
    let c = Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    let fresh = c.status();
    assert_eq!(
        (
            fresh.cached_blocks,
            fresh.unwritten_blocks,
            fresh.stale_blocks
        ),
        (0, fresh.capacity_blocks, 0),
        "{fresh:?}"
    );
    // One batch of 32 blocks, then 16 of them overwritten one write (one batch) at a time.
    c.write_at(&[1u8; 32 * 4096], 0, false).unwrap();
    for i in 0..16u64 {
        c.write_at(&[2u8; 4096], i * 4096, false).unwrap();
    }
    let st = c.status();
    assert_eq!(st.cached_blocks, 32, "{st:?}");
    assert_eq!(
        st.cached_blocks + st.unwritten_blocks + st.stale_blocks,
        st.capacity_blocks,
        "{st:?}"
    );
    // Stale: the 16 old copies and 17 headers, and at most a few record-less headers (notes).
    assert!((16 + 17..=16 + 17 + 4).contains(&st.stale_blocks), "{st:?}");
    c.close().unwrap();
}

/// What recovery replayed counts towards the next checkpoint: crash after crash, each recovery
/// replays only what was written since the last checkpoint, not an ever longer log.
#[test]
fn replayed_log_counts_towards_the_next_checkpoint() {
    let (cache_dev, backing) = formatted();
    let open = || Cache::open(cache_dev.clone(), backing.clone(), &ident(64 << 20), None).unwrap();
    let slots = open().status().capacity_blocks;
    // Each round writes a tenth of the cache: under the checkpoint threshold (an eighth) alone,
    // over it together with the previous round's replayed log.
    let per_round = slots / 10 / 4;
    let mut replayed = Vec::new();
    for round in 0..3u64 {
        let c = open();
        replayed.push(c.report().replayed_records);
        for i in 0..per_round {
            c.write_at(
                &[round as u8 + 1; 16384],
                (round * per_round + i) * 16384,
                false,
            )
            .unwrap();
        }
        c.flush().unwrap();
        drop(c); // a crash after the flush
    }
    let c = open();
    replayed.push(c.report().replayed_records);
    assert!(
        replayed[2] < per_round && replayed[3] < per_round,
        "replay grows from crash to crash ({per_round} records per round): {replayed:?}"
    );
}

/// A FLUSH that finds the log writer idle syncs on the caller's thread. The note saying how far
/// the log is durable (which lets recovery tell damage to those records from a torn tail) still
/// follows once the log goes quiet: the writer's thread writes it, and FLUSHes that come while
/// it waits to push it back rather than wake it.
#[test]
fn the_log_notes_a_flush_once_it_goes_quiet() {
    let (cache_dev, backing) = formatted();
    let c = Cache::open(cache_dev, backing, &ident(64 << 20), None).unwrap();
    c.set_param("writeback_controller", "off").unwrap();
    let before = c.stats().cache_writes;
    for i in 0..3u8 {
        c.write_at(&[i + 1; 4096], 4096 * i as u64, false).unwrap();
        c.flush().unwrap();
    }
    // One batch per write, then a note after each quiet spell (one, unless this thread was
    // slower between its FLUSHes than the note's delay, 10 ms). Well before the thread's own
    // idle timeout (1 s), which would find the note due without being woken.
    let notes = |c: &Cache| c.stats().cache_writes - before - 3;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(700);
    while notes(&c) == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!((1..=3).contains(&notes(&c)), "{:?}", c.stats());
    c.close().unwrap();
}

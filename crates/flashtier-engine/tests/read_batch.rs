//! `Cache::read_batch`: a batch of client reads serves its whole hits together and leaves every
//! other read (a miss, a partly cached or unaligned read, a lost block) to the caller's
//! `read_at`, having counted and planned nothing for them. What it serves is exactly what
//! `read_at` returns, with the cache device batching its reads or not.

mod common;

use std::sync::Arc;

use common::{format_small, open, pattern, Rng, BS};
use flashtier_engine::Mode;
use flashtier_io::{BatchRead, BlockDev};
use flashtier_testkit::MemDev;

/// `read_batch`, checking that the reads named to `leave` are exactly those left, each once.
fn batch(c: &flashtier_engine::Cache, reads: &mut [BatchRead<'_>]) {
    let mut named = vec![0u32; reads.len()];
    c.read_batch(reads, &mut |left| {
        for &i in left {
            named[i] += 1;
        }
    });
    for (i, r) in reads.iter().enumerate() {
        let want = u32::from(r.result.is_none());
        assert_eq!(named[i], want, "read {i} named {} times to leave", named[i]);
    }
}

const CACHE: usize = 8 << 20;
const BACKING: u64 = 4 << 20;
/// Blocks below this are written through the cache (hits); the rest only on the backing store.
const CACHED: u64 = 256;

/// A write-back cache whose first `CACHED` blocks were written (the data `pattern(block)`), over a
/// backing store holding `pattern(1000 + block)` everywhere.
fn setup(cache_dev: Arc<dyn BlockDev>) -> flashtier_engine::Cache {
    let backing = Arc::new(MemDev::new(BACKING as usize));
    for b in 0..BACKING / BS {
        backing
            .write_at(&pattern(1000 + b, BS as usize), b * BS, false)
            .unwrap();
    }
    format_small(&*cache_dev, BACKING, Mode::WriteBack);
    let c = open(cache_dev, backing, None).unwrap();
    // Four blocks a write: a read within one of them is one run of slots (a batch header may
    // lie between two writes' slots, and a read over two runs is left to `read_at`).
    for group in (0..CACHED).step_by(4) {
        let data: Vec<u8> = (group..group + 4)
            .flat_map(|b| pattern(b, BS as usize))
            .collect();
        c.write_at(&data, group * BS, false).unwrap();
    }
    c
}

/// What `read_at` returns for `[offset, offset + len)`, from the data `setup` wrote.
fn expected(offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let (first, last) = (offset / BS, (offset + len as u64).div_ceil(BS));
    for b in first..last {
        let seed = if b < CACHED { b } else { 1000 + b };
        out.extend(pattern(seed, BS as usize));
    }
    let skip = (offset - first * BS) as usize;
    out[skip..skip + len].to_vec()
}

#[test]
fn a_batch_serves_its_whole_hits_and_leaves_the_rest_untouched() {
    let dev = Arc::new(MemDev::new(CACHE).batching());
    let c = setup(dev.clone());
    assert_eq!(c.read_batch_max(), 32);
    // (offset, len, served): hits, a miss, a read half cached, an unaligned hit.
    let cases: [(u64, usize, bool); 8] = [
        (3 * BS, 4096, true),
        // Out of range, and at an offset whose end overflows: left to `read_at`.
        (BACKING, 4096, false),
        (u64::MAX - 4095, 4096, false),
        (CACHED * BS + 5 * BS, 4096, false),
        (10 * BS, 8192, true),
        ((CACHED - 1) * BS, 8192, false),
        (7 * BS + 512, 1024, false),
        (200 * BS, 16384, true),
    ];
    let mut bufs: Vec<Vec<u8>> = cases.iter().map(|&(_, len, _)| vec![0u8; len]).collect();
    let before = c.stats();
    let mut reads: Vec<BatchRead<'_>> = bufs
        .iter_mut()
        .zip(&cases)
        .map(|(buf, &(offset, _, _))| BatchRead::new(buf, offset))
        .collect();
    batch(&c, &mut reads);
    let served: Vec<bool> = reads.iter().map(|r| r.result.is_some()).collect();
    for r in &reads {
        if let Some(result) = &r.result {
            assert!(result.is_ok(), "{result:?}");
        }
    }
    drop(reads);
    let after = c.stats();
    let want: Vec<bool> = cases.iter().map(|&(_, _, s)| s).collect();
    assert_eq!(served, want);
    for ((buf, &(offset, len, s)), _) in bufs.iter().zip(&cases).zip(&served) {
        if s {
            assert!(
                *buf == expected(offset, len),
                "data of the read at {offset}"
            );
        } else {
            assert!(
                buf.iter().all(|&b| b == 0),
                "a left read's buffer was written"
            );
        }
    }
    // Counted as reads, hits of 1 + 2 + 4 blocks; nothing of the reads left.
    assert_eq!(after.reads - before.reads, 3);
    assert_eq!(after.batched_reads - before.batched_reads, 3);
    assert_eq!(after.read_hit_blocks - before.read_hit_blocks, 7);
    assert_eq!(after.read_miss_blocks, before.read_miss_blocks);
    assert_eq!(after.backing_reads, before.backing_reads);
    // One batch of the three hits on the cache device.
    assert_eq!(dev.batches(), (1, 3));
    // The left reads, read as the caller would: right data (or refused), counted then.
    for (buf, &(offset, len, s)) in bufs.iter_mut().zip(&cases) {
        if !s && offset < BACKING {
            c.read_at(buf, offset).unwrap();
            assert!(
                *buf == expected(offset, len),
                "data of the read at {offset}"
            );
        } else if !s {
            let e = c.read_at(buf, offset).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        }
    }
    assert_eq!(c.stats().reads - before.reads, 6);
    c.close().unwrap();
}

/// Random batches over hits, misses and unaligned reads, on a cache device that batches and one
/// that does not: every read served returns what `read_at` returns, and the reads left return it
/// through `read_at`.
#[test]
fn batches_return_what_read_at_returns() {
    for batching in [true, false] {
        let dev = MemDev::new(CACHE);
        let dev: Arc<dyn BlockDev> = Arc::new(if batching { dev.batching() } else { dev });
        let c = setup(dev);
        let mut rng = Rng::new(0xba7c4 + batching as u64);
        let (mut served, mut left) = (0, 0);
        for _ in 0..200 {
            let n = rng.range(1, 33) as usize;
            let cases: Vec<(u64, usize)> = (0..n)
                .map(|_| {
                    let blocks = rng.range(1, 5);
                    let block = rng.below(2 * CACHED - blocks);
                    if rng.chance(0.2) {
                        (
                            block * BS + rng.below(8) * 512,
                            512 * rng.range(1, 9) as usize,
                        )
                    } else {
                        (block * BS, (blocks * BS) as usize)
                    }
                })
                .collect();
            let mut bufs: Vec<Vec<u8>> = cases.iter().map(|&(_, len)| vec![0u8; len]).collect();
            let mut reads: Vec<BatchRead<'_>> = bufs
                .iter_mut()
                .zip(&cases)
                .map(|(buf, &(offset, _))| BatchRead::new(buf, offset))
                .collect();
            batch(&c, &mut reads);
            let done: Vec<bool> = reads
                .iter()
                .map(|r| {
                    r.result
                        .as_ref()
                        .map(|res| res.as_ref().map_err(|e| e.to_string()).unwrap())
                        .is_some()
                })
                .collect();
            drop(reads);
            for ((buf, &(offset, len)), done) in bufs.iter_mut().zip(&cases).zip(done) {
                if done {
                    served += 1;
                } else {
                    left += 1;
                    c.read_at(buf, offset).unwrap();
                }
                assert!(
                    *buf == expected(offset, len),
                    "data of the read at {offset}+{len}"
                );
            }
        }
        assert!(served > 100 && left > 100, "served {served}, left {left}");
        c.close().unwrap();
    }
}

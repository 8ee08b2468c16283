//! `Cache::write_batch`: a batch of client writes logs its plain write-back writes (whole blocks,
//! within the atomic size) together, in one log batch, and leaves every other write (partial
//! blocks, too large, out of range, a mode that does not log them dirty, a write cutoff) to the
//! caller's `write_at`, having written and counted nothing of it. What it writes reads back as
//! `write_at`'s writes do, before and after a reopen.

mod common;

use std::sync::Arc;

use common::{format_small, open, pattern, Rng, BS};
use flashtier_engine::Mode;
use flashtier_io::{BatchWrite, BlockDev};
use flashtier_testkit::MemDev;

const CACHE: usize = 8 << 20;
const BACKING: u64 = 4 << 20;

/// A write-back cache over a backing store holding `pattern(1000 + block)` everywhere.
fn setup(
    mode: Mode,
) -> (
    Arc<dyn BlockDev>,
    Arc<dyn BlockDev>,
    flashtier_engine::Cache,
) {
    let cache_dev: Arc<dyn BlockDev> = Arc::new(MemDev::new(CACHE));
    let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(BACKING as usize));
    for b in 0..BACKING / BS {
        backing
            .write_at(&pattern(1000 + b, BS as usize), b * BS, false)
            .unwrap();
    }
    format_small(&*cache_dev, BACKING, mode);
    let c = open(cache_dev.clone(), backing.clone(), None).unwrap();
    (cache_dev, backing, c)
}

/// `len` bytes at `offset` of the data `seed` stamps block by block (`pattern(seed + block)`),
/// so that a write's every block is told apart.
fn data(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let (first, last) = (offset / BS, (offset + len as u64).div_ceil(BS));
    let mut out: Vec<u8> = (first..last)
        .flat_map(|b| pattern(seed + b, BS as usize))
        .collect();
    let skip = (offset - first * BS) as usize;
    out.drain(..skip);
    out.truncate(len);
    out
}

fn read(c: &flashtier_engine::Cache, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    c.read_at(&mut buf, offset).unwrap();
    buf
}

#[test]
fn a_batch_logs_its_plain_writes_together_and_leaves_the_rest_untouched() {
    let (cache_dev, backing, c) = setup(Mode::WriteBack);
    assert_eq!(c.write_batch_max(), 8);
    let atomic = c.atomic_write_bytes() as usize;
    // (offset, len, taken): whole blocks, a partial block, one larger than the atomic size,
    // out of range, whole blocks of 16 KiB.
    let cases: [(u64, usize, bool); 6] = [
        (3 * BS, 4096, true),
        (7 * BS + 512, 1024, false),
        (100 * BS, atomic + 4096, false),
        (BACKING, 4096, false),
        (20 * BS, 16384, true),
        (u64::MAX - 4095, 4096, false),
    ];
    let bufs: Vec<Vec<u8>> = cases
        .iter()
        .map(|&(offset, len, _)| data(7, offset.min(BACKING), len))
        .collect();
    // Let the writer finish what opening left it (a note), so the batch is the only one.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = c.stats();
    let mut writes: Vec<BatchWrite<'_>> = bufs
        .iter()
        .zip(&cases)
        .map(|(buf, &(offset, _, _))| BatchWrite::new(buf, offset))
        .collect();
    c.write_batch(&mut writes);
    let after = c.stats();
    for (w, &(offset, _, taken)) in writes.iter().zip(&cases) {
        match &w.result {
            Some(Ok(())) => assert!(taken, "the write at {offset} was taken"),
            // Refused as `write_at` refuses it (the range check comes first there too).
            Some(Err(e)) => {
                assert!(!taken && offset >= BACKING, "the write at {offset}: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            }
            None => assert!(!taken, "the write at {offset} was left"),
        }
    }
    // Counted as two writes of 1 + 4 blocks, logged dirty in one batch of two records.
    assert_eq!(after.writes - before.writes, 2);
    assert_eq!(after.batched_writes - before.batched_writes, 2);
    assert_eq!(after.write_blocks - before.write_blocks, 5);
    assert_eq!(after.batches - before.batches, 1);
    assert_eq!(after.records - before.records, 2);
    assert_eq!(c.status().dirty_blocks, 5);
    // The writes taken read back; nothing of those left was written.
    assert_eq!(read(&c, 3 * BS, 4096), bufs[0]);
    assert_eq!(read(&c, 20 * BS, 16384), bufs[4]);
    assert_eq!(read(&c, 7 * BS, 4096), data(1000, 7 * BS, 4096));
    assert_eq!(
        read(&c, 100 * BS, atomic + 4096),
        data(1000, 100 * BS, atomic + 4096)
    );
    // The left ones, written as the caller would.
    c.write_at(&bufs[1], 7 * BS + 512, false).unwrap();
    c.write_at(&bufs[2], 100 * BS, false).unwrap();
    assert_eq!(read(&c, 7 * BS + 512, 1024), bufs[1]);
    assert_eq!(read(&c, 100 * BS, atomic + 4096), bufs[2]);
    // Logged, so a reopen finds them (dirty: the backing store still holds the old data).
    c.close().unwrap();
    let c = open(cache_dev, backing.clone(), None).unwrap();
    assert_eq!(read(&c, 3 * BS, 4096), bufs[0]);
    assert_eq!(read(&c, 20 * BS, 16384), bufs[4]);
    let mut old = vec![0u8; 4096];
    backing.read_at(&mut old, 3 * BS).unwrap();
    assert_eq!(old, data(1000, 3 * BS, 4096));
    c.close().unwrap();
}

#[test]
fn modes_without_dirty_writes_and_a_write_cutoff_leave_every_write() {
    for mode in [Mode::WriteThrough, Mode::WriteAround, Mode::PassThrough] {
        let (_, _, c) = setup(mode);
        assert_eq!(c.write_batch_max(), 1, "{mode}");
        let buf = data(3, 0, 4096);
        let mut writes = [BatchWrite::new(&buf, 0), BatchWrite::new(&buf, 8 * BS)];
        c.write_batch(&mut writes);
        assert!(writes.iter().all(|w| w.result.is_none()), "{mode}");
        assert_eq!(c.stats().writes, 0, "{mode}");
        c.close().unwrap();
    }
    let (_, _, c) = setup(Mode::WriteBack);
    c.set_param("sequential_cutoff_write_kib", "64").unwrap();
    assert_eq!(c.write_batch_max(), 1);
    let buf = data(3, 0, 4096);
    let mut writes = [BatchWrite::new(&buf, 0)];
    c.write_batch(&mut writes);
    assert!(writes[0].result.is_none());
    assert_eq!(c.stats().writes, 0);
    // With the cutoff off again, it batches again.
    c.set_param("sequential_cutoff_write_kib", "0").unwrap();
    assert_eq!(c.write_batch_max(), 8);
    c.close().unwrap();
}

/// Random batches (and single writes) from several threads over a small region, each thread its
/// own blocks: what each thread reads back of its blocks is its last write there, through the
/// log wrapping (reclaim and cleaning at work) and a reopen.
#[test]
fn batched_writes_read_back_as_written_under_reclaim() {
    let (cache_dev, backing, c) = setup(Mode::WriteBack);
    let c = Arc::new(c);
    const THREADS: u64 = 3;
    const SPAN: u64 = 200;
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut r = Rng::new(0x5eed + t);
                // The seed each of this thread's blocks was last written with.
                let mut last = vec![None::<u64>; SPAN as usize];
                let base = t * SPAN;
                for round in 0..400u64 {
                    let n = r.range(1, 8) as usize;
                    let mut picked: Vec<(u64, usize)> = Vec::new();
                    for _ in 0..n {
                        let len = r.range(1, 4) as usize;
                        let at = r.below(SPAN - len as u64 + 1);
                        if picked
                            .iter()
                            .all(|&(a, l)| at + len as u64 <= a || a + l as u64 <= at)
                        {
                            picked.push((at, len));
                        }
                    }
                    let seed = 10_000 * (t + 1) + round * 64;
                    let bufs: Vec<Vec<u8>> = picked
                        .iter()
                        .map(|&(at, len)| data(seed, (base + at) * BS, len * BS as usize))
                        .collect();
                    let mut writes: Vec<BatchWrite<'_>> = bufs
                        .iter()
                        .zip(&picked)
                        .map(|(buf, &(at, _))| BatchWrite::new(buf, (base + at) * BS))
                        .collect();
                    c.write_batch(&mut writes);
                    for w in &writes {
                        match &w.result {
                            Some(result) => assert!(result.is_ok(), "{result:?}"),
                            None => c.write_at(w.buf, w.offset, false).unwrap(),
                        }
                    }
                    for &(at, len) in &picked {
                        for b in at..at + len as u64 {
                            last[b as usize] = Some(seed);
                        }
                    }
                    if round % 50 == 49 {
                        c.flush().unwrap();
                    }
                }
                last
            })
        })
        .collect();
    let lasts: Vec<Vec<Option<u64>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(c.stats().batches > 0);
    let check = |c: &flashtier_engine::Cache| {
        for (t, last) in lasts.iter().enumerate() {
            for (i, seed) in last.iter().enumerate() {
                let block = t as u64 * SPAN + i as u64;
                let seed = seed.unwrap_or(1000);
                assert_eq!(
                    read(c, block * BS, BS as usize),
                    pattern(seed + block, BS as usize),
                    "block {block}"
                );
            }
        }
    };
    check(&c);
    c.flush().unwrap();
    let c = Arc::try_unwrap(c).ok().expect("the writers are done");
    c.close().unwrap();
    let c = open(cache_dev, backing, None).unwrap();
    check(&c);
    c.close().unwrap();
}

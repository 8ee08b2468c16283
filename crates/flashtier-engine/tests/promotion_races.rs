//! A read miss's promotion never caches data older than what the block holds.
//!
//! A read miss reads the backing store and queues a PROMOTE of what it read; in a cache short of
//! room, the promotion waits for reclaim like any client record. A write of the same block may
//! land meanwhile, be written back by reclaim, and be evicted, leaving the block unmapped again
//! when the promotion is applied: the promotion then maps the older data as clean, and every later
//! read returns it. `guards` drops such promotions by comparing the write's stamp with the clock
//! the read took; this test races a reader against writers in a cache too small for them, and
//! checks at the end that every block reads what its last write wrote.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use flashtier_engine::Mode;
use flashtier_io::BlockDev;
use flashtier_testkit::MemDev;

const HOT: u64 = 256;
const BACKING: u64 = HOT * BS;

/// Before `0672330` the clock was taken after the lookup and the stamp before the WRITE record was
/// applied, so a miss that looked a block up just before a write mapped it passed the check: that
/// code failed this test in 6 runs of 6 (in rounds 0 to 5), and in 3 of 3 runs of 10 two-second
/// rounds.
#[test]
fn a_promotion_racing_writes_never_caches_older_data() {
    for round in 0..8u64 {
        let policy = if round % 2 == 0 { "lru" } else { "fifo" };
        let cdev = Arc::new(MemDev::new(2 << 20));
        let bdev = Arc::new(MemDev::new(BACKING as usize));
        format_small(&*cdev, BACKING, Mode::WriteBack);
        let c = Arc::new(open(cdev, bdev.clone(), None).unwrap());
        // Only reclaim writes back: dirty blocks stay until it needs their room.
        c.set_param("writeback_controller", "off").unwrap();
        c.set_param("reclaim_policy", policy).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (c, stop) = (c.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut r = Rng::new(round);
                while !stop.load(Ordering::Relaxed) {
                    let n = r.range(1, 6);
                    let mut buf = vec![0u8; (n * BS) as usize];
                    c.read_at(&mut buf, r.below(HOT - n + 1) * BS).unwrap();
                }
            })
        };
        // Each writer owns half the blocks, so its own model of them is exact.
        let writers: Vec<_> = [0, HOT / 2]
            .into_iter()
            .enumerate()
            .map(|(t, base)| {
                let (c, stop) = (c.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut r = Rng::new((round << 8) | (t as u64 + 1));
                    let mut model = vec![0u8; (HOT / 2 * BS) as usize];
                    // Every version each block held, oldest first (zeros before the first write).
                    let mut history = vec![vec![vec![0u8; BS as usize]]; (HOT / 2) as usize];
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let n = r.range(1, 6);
                        let at = r.below(HOT / 2 - n + 1);
                        let data =
                            pattern((round << 40) | ((t as u64) << 32) | i, (n * BS) as usize);
                        c.write_at(&data, (base + at) * BS, false).unwrap();
                        c.flush().unwrap();
                        model[(at * BS) as usize..((at + n) * BS) as usize].copy_from_slice(&data);
                        for k in 0..n {
                            history[(at + k) as usize]
                                .push(data[(k * BS) as usize..((k + 1) * BS) as usize].to_vec());
                        }
                        i += 1;
                    }
                    (base, model, history, i)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1000));
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        for w in writers {
            let (base, model, history, writes) = w.join().unwrap();
            let mut got = vec![0u8; model.len()];
            c.read_at(&mut got, base * BS).unwrap();
            // Each stale block: which of its versions it reads, of how many, and which one the
            // backing store holds.
            let version = |b: u64, data: &[u8]| history[b as usize].iter().position(|v| v == data);
            let stale: Vec<_> = (0..HOT / 2)
                .filter(|&b| {
                    let block = (b * BS) as usize..((b + 1) * BS) as usize;
                    got[block.clone()] != model[block]
                })
                .map(|b| {
                    let block = (b * BS) as usize..((b + 1) * BS) as usize;
                    let mut on_backing = vec![0u8; BS as usize];
                    bdev.read_at(&mut on_backing, (base + b) * BS).unwrap();
                    (
                        base + b,
                        version(b, &got[block]),
                        history[b as usize].len() - 1,
                        version(b, &on_backing),
                    )
                })
                .collect();
            assert!(
                stale.is_empty(),
                "round {round} ({policy}): after {writes} writes, blocks read older data than \
                 their last write (block, version read, versions, version on the backing \
                 store): {stale:?} ({:?})",
                c.status()
            );
        }
    }
}

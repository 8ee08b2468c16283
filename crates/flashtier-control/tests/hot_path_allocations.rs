//! Heap allocations of [`Timed`], which every client request passes: timing it, counting it and
//! adding its blocks to the working-set sketch must allocate nothing (atomics only), so that
//! measuring stays always on. Counted with a counting global allocator on the calling thread,
//! over a memory device that allocates nothing itself, as the engine's
//! `tests/hot_path_allocations.rs` counts its read and write paths.

use std::hint::black_box;
use std::sync::Arc;

use flashtier_control::Timed;
use flashtier_io::BlockDev;
use flashtier_testkit::alloc_count::{self, Counting};
use flashtier_testkit::MemDev;

#[global_allocator]
static GLOBAL: Counting = Counting;

fn mine() -> u64 {
    alloc_count::this_thread()
}

#[test]
fn timed_reads_and_writes_allocate_nothing() {
    const DEVICE: u64 = 64 << 20;
    let dev = Timed::new(Arc::new(MemDev::new(DEVICE as usize)));
    let sketch = dev.working_set();
    let mut small = vec![0u8; 4096];
    let mut large = vec![0u8; 1 << 20];
    let run = |small: &mut [u8], large: &mut [u8], rounds: u64| {
        for i in 0..rounds {
            // Scattered, unaligned and large requests: 4 KiB, 100 bytes across a block
            // boundary, 1 MiB (256 blocks), and a vectored write.
            let at = (i * 7919 * 4096) % (DEVICE - (2 << 20));
            dev.read_at(small, at).unwrap();
            dev.write_at(&small[..100], at + 4050, i % 2 == 0).unwrap();
            dev.read_at(large, at).unwrap();
            dev.write_vectored_at(&[&large[..4096], &small[..]], at + 4096)
                .unwrap();
        }
    };
    // The first request of each kind may set things up (nothing known does, but the figure
    // below is for the steady state the issue asks about).
    run(&mut small, &mut large, 10);

    let before = mine();
    run(&mut small, &mut large, 1000);
    let allocations = mine() - before;
    assert_eq!(
        allocations, 0,
        "4,000 requests through Timed allocated {allocations} times"
    );
    assert!(
        sketch.snapshot().blocks() > 1000,
        "the requests reached the working set: {:?}",
        sketch
    );

    // The counter counts: one allocation here is seen.
    let before = mine();
    black_box(Vec::<u8>::with_capacity(black_box(16)));
    assert_eq!(mine() - before, 1, "the counting allocator counts");
}

//! What a record's CRC32C costs on the writer's thread: per-block CRCs (which reads are checked
//! against) plus either `crc32c_combine` of them (how records were checksummed before) or one
//! more hardware pass over the data when there is more than one block (how they are now). The profile under MariaDB with 16 KiB
//! pages put the combine at 19% of the server's CPU (bench/results/oltp_profile.md).
//!
//!   cargo run --release -p flashtier-engine --example record_crc_cost

use std::time::Instant;

fn main() {
    println!("| record | block CRCs + combine | block CRCs + one pass | ratio |");
    println!("|---:|---:|---:|---:|");
    for kib in [4usize, 16, 64, 1024] {
        let data: Vec<u8> = (0..kib * 1024).map(|i| (i * 7 + i / 4096) as u8).collect();
        let n = (2_000_000 / kib).max(200);
        let blocks = |d: &[u8]| -> Vec<u32> { d.chunks(4096).map(crc32c::crc32c).collect() };
        let mut check = 0u32;
        let started = Instant::now();
        for _ in 0..n {
            let b = blocks(&data);
            let crc = b[1..]
                .iter()
                .fold(b[0], |acc, &c| crc32c::crc32c_combine(acc, c, 4096));
            check = check.wrapping_add(crc);
        }
        let combine = started.elapsed().as_nanos() as f64 / n as f64;
        let started = Instant::now();
        for _ in 0..n {
            let b = blocks(&data);
            // A single block's CRC is the record's.
            let crc = if b.len() == 1 {
                b[0]
            } else {
                crc32c::crc32c(&data)
            };
            check = check.wrapping_sub(crc);
        }
        let one_pass = started.elapsed().as_nanos() as f64 / n as f64;
        assert_eq!(check, 0, "both ways give the same CRC");
        println!(
            "| {kib} KiB | {:.1} µs | {:.1} µs | {:.1}× |",
            combine / 1e3,
            one_pass / 1e3,
            combine / one_pass
        );
    }
}

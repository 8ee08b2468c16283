//! The RAM tier end to end: `flashtier serve --ram-cache` above an SSD cache and, with no cache,
//! on the memcached tier feeding its victim mode; fio verifies every byte over NBD, and the
//! counters and the report say what each tier did.

use std::process::{Command, Output};

use flashtier_testkit::memcached::Memcached;

use crate::control::counter;
use crate::harness::{self, path_str, run_any, text, BIN};
use crate::harness::{ctl_ok, format_cache, report, serve};
use crate::memcached::fio_verify;

/// Above a cache: fio writes and verifies, verifies again (from memory), rewrites and verifies;
/// the report shows the tier's size and use, and its memory stays within the size asked for plus
/// its index and version record.
#[test]
fn the_ram_tier_above_an_ssd_cache_verifies_and_reports() {
    harness::require("fio");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 64 << 20);
    let cache = dir.path().join("cache.img");
    format_cache(&cache, &img, "16M");
    let control = dir.path().join("control.sock");
    let server = serve(
        dir.path(),
        &img,
        &control,
        &["--cache", path_str(&cache), "--ram-cache", "8M"],
    );
    // Fits in the RAM tier: the second pass is answered from memory, and the third one's
    // writes replace the copies they find.
    fio_verify(
        &server,
        "ram",
        "6M",
        "--do_verify=1",
        "fio randwrite+verify through the RAM and SSD tiers",
    );
    fio_verify(
        &server,
        "ram",
        "6M",
        "--verify_only",
        "fio verify again through the RAM and SSD tiers",
    );
    fio_verify(
        &server,
        "ram",
        "6M",
        "--do_verify=1",
        "fio rewrites and verifies the blocks in memory",
    );
    let r = report(&control);
    assert!(counter(&r, "ram_hit_blocks") >= 1536, "{}", r["counters"]);
    assert!(counter(&r, "ram_updated_blocks") > 0, "{}", r["counters"]);
    let ram = &r["ram"];
    assert_eq!(ram["capacity_bytes"], 8 << 20, "{ram}");
    let used = ram["used_bytes"].as_u64().unwrap();
    assert!(used > 0 && used <= 8 << 20, "{ram}");
    // 64 MiB of device: 16 Ki blocks of version record.
    let memory = ram["memory_bytes"].as_u64().unwrap();
    assert!(memory <= (8 << 20) * 102 / 100 + (16 << 10) * 8, "{ram}");
    let status = ctl_ok(&control, &["status"]);
    assert!(
        status.contains("lru, ") && status.contains("of 8.00 MiB held"),
        "{status}"
    );
    server.stop();
}

/// With no cache the RAM tier stands on the memcached tier: in victim mode what it evicts goes
/// to memcached and comes back from there (and is removed there) when read again.
#[test]
fn with_no_cache_the_ram_tier_feeds_memcached_victim_mode() {
    harness::require("fio");
    let m = Memcached::start(&["-m", "64"]);
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 64 << 20);
    let control = dir.path().join("control.sock");
    let server = serve(
        dir.path(),
        &img,
        &control,
        &[
            "--ram-cache",
            "4M",
            "--memcached",
            &m.addr(),
            "--memcached-mode",
            "victim",
            "--memcached-timeout-ms",
            "200",
        ],
    );
    assert!(
        !server.log().contains("will store nothing"),
        "{}",
        server.log()
    );
    fio_verify(
        &server,
        "victim",
        "16M",
        "--do_verify=1",
        "fio randwrite+verify through the RAM tier on memcached (victim)",
    );
    fio_verify(
        &server,
        "victim",
        "16M",
        "--verify_only",
        "fio verify again, partly from memcached's victims",
    );
    let r = report(&control);
    let (stored, hits, removed) = (
        counter(&r, "memcached_stored_blocks"),
        counter(&r, "memcached_hit_blocks"),
        counter(&r, "memcached_removed_blocks"),
    );
    assert!(
        stored > 0,
        "no RAM eviction reached memcached: {}",
        r["counters"]
    );
    assert!(hits > 0 && removed > 0, "{}", r["counters"]);
    assert_eq!(counter(&r, "memcached_stale_values"), 0);
    assert_eq!(counter(&r, "memcached_corrupt_values"), 0);
    server.stop();
}

fn refused(args: &[&str]) -> Output {
    run_any(Command::new("timeout").arg("20").arg(BIN).args(args))
}

/// Sizes that are not sizes, or more than the machine's memory, are refused before anything
/// starts.
#[test]
fn serve_refuses_impossible_ram_tiers() {
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 16 << 20);
    let sock = dir.path().join("nbd.sock");
    for (size, says) in [
        ("lots", "a size of 4K or more"),
        ("100T", "more than this machine's memory"),
    ] {
        let out = refused(&[
            "serve",
            "--backing",
            path_str(&img),
            "--listen",
            path_str(&sock),
            "--ram-cache",
            size,
        ]);
        assert!(
            !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(says),
            "--ram-cache {size}:\n{}",
            text(&out)
        );
    }
}

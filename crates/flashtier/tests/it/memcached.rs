//! The memcached tier end to end: `flashtier serve --memcached` with real memcached servers, fio
//! verifying every byte over NBD while servers are killed and restarted, and the tier operated
//! live from the command line (`flashtier memcached`, `set memcached_mode`, `stats`).

use std::path::Path;
use std::time::Duration;

use flashtier_testkit::memcached::Memcached;
use serde_json::Value;

use crate::harness::{
    self, ctl, ctl_ok, format_cache, path_str, report, run_any, serve, text, Server,
};
use crate::tools::{assert_fio_ok, fio_verify_job};

fn counter(socket: &Path, name: &str) -> u64 {
    crate::control::counter(&report(socket), name)
}

/// fio's verifying job `name` of `size` over `server`, `how` = `--do_verify=1` (write, then
/// verify) or `--verify_only` (verify what the same job wrote before); it must pass.
pub(crate) fn fio_verify(server: &Server, name: &str, size: &str, how: &str, what: &str) {
    let uri = format!("--uri={}", server.uri);
    let out = run_any(&mut fio_verify_job(
        name,
        size,
        &["--ioengine=nbd", &uri, how],
    ));
    assert_fio_ok(&out, 1, what);
}

/// How many of the tier's servers `stats --json` reports up.
fn servers_up(socket: &Path) -> usize {
    let report: Value = serde_json::from_str(&ctl_ok(socket, &["stats", "--json"])).unwrap();
    let servers = report["memcached"]["servers"]
        .as_array()
        .unwrap_or_else(|| panic!("no memcached servers in {}", report["memcached"]));
    servers.iter().filter(|s| s["health"] == "up").count()
}

/// Pass-through with a memcached tier (no SSD tier): fio writes and verifies through it while
/// one server dies and comes back; hits come from the pool, nothing reaches the client.
#[test]
fn serve_with_memcached_and_no_cache_verifies_while_a_server_dies_and_returns() {
    harness::require("fio");
    let mut servers = [
        Memcached::start(&["-m", "64"]),
        Memcached::start(&["-m", "64"]),
    ];
    let pool = format!("{},{}", servers[0].addr(), servers[1].addr());
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 64 << 20);
    let control = dir.path().join("control.sock");
    let server = serve(
        dir.path(),
        &img,
        &control,
        &["--memcached", &pool, "--memcached-timeout-ms", "200"],
    );
    fio_verify(
        &server,
        "mc",
        "32M",
        "--do_verify=1",
        "fio randwrite+verify through the memcached tier",
    );
    let hits = counter(&control, "memcached_hit_blocks");
    assert!(hits > 0, "the verify pass read nothing from memcached");
    assert_eq!(counter(&control, "memcached_stale_values"), 0);

    // A server dies: the same verification, now partly from the backing store.
    servers[0].kill();
    fio_verify(
        &server,
        "mc",
        "32M",
        "--verify_only",
        "fio verify with one memcached server dead",
    );
    assert_eq!(servers_up(&control), 1);
    let list = ctl_ok(&control, &["memcached", "list"]);
    assert!(list.contains("down"), "{list}");
    // Back, empty: after its backoff it is used again.
    servers[0].restart();
    harness::wait_until(
        Duration::from_secs(20),
        "the restarted server is up",
        || {
            fio_verify(
                &server,
                "mc",
                "32M",
                "--verify_only",
                "fio verify after the server restarted",
            );
            servers_up(&control) == 2
        },
    );
    server.stop();
}

/// Live operation: add and remove servers, switch the mode through both commands, turn the tier
/// off and on; what `status` and `get` say follows.
#[test]
fn the_memcached_tier_is_operated_live() {
    let a = Memcached::start(&["-m", "16"]);
    let b = Memcached::start(&["-m", "16"]);
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 16 << 20);
    let control = dir.path().join("control.sock");
    let server = serve(dir.path(), &img, &control, &["--memcached", &a.addr()]);
    ctl_ok(&control, &["memcached", "add", &b.addr()]);
    let list = ctl_ok(&control, &["memcached", "list"]);
    assert!(
        list.contains(&a.addr()) && list.contains(&b.addr()),
        "{list}"
    );
    let dup = ctl(&control, &["memcached", "add", &b.addr()]);
    assert!(!dup.status.success(), "adding a server twice must fail");
    ctl_ok(&control, &["memcached", "remove", &a.addr()]);
    assert!(!ctl_ok(&control, &["memcached", "list"]).contains(&a.addr()));
    ctl_ok(&control, &["set", "memcached_mode", "victim"]);
    assert!(ctl_ok(&control, &["get", "memcached_mode"]).contains("victim"));
    ctl_ok(&control, &["memcached", "mode", "inclusive"]);
    assert!(ctl_ok(&control, &["get", "memcached_mode"]).contains("inclusive"));
    let bad = ctl(&control, &["set", "memcached_mode", "lru"]);
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("inclusive | victim"),
        "{}",
        text(&bad)
    );
    ctl_ok(&control, &["memcached", "off"]);
    assert!(ctl_ok(&control, &["status"]).contains("memcached"));
    ctl_ok(&control, &["memcached", "on"]);
    server.stop();
}

/// Victim mode warns at start that it stores nothing yet; a server without the tier says how to
/// get one.
#[test]
fn serve_says_what_victim_mode_does_and_a_server_without_the_tier_refuses() {
    let a = Memcached::start(&["-m", "16"]);
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 16 << 20);
    let control = dir.path().join("control.sock");
    let server = serve(
        dir.path(),
        &img,
        &control,
        &["--memcached", &a.addr(), "--memcached-mode", "victim"],
    );
    assert!(
        server.log().contains("will store nothing"),
        "{}",
        server.log()
    );
    server.stop();
    let plain = serve(dir.path(), &img, &control, &[]);
    let out = ctl(&control, &["memcached", "list"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("--memcached"), "{}", text(&out));
    plain.stop();
}

/// An SSD cache of 16 MiB over a 64 MiB backing store, the memcached tier (one server of
/// 128 MiB) under it in `mode`: the stack of the tests below, kept alive with them.
struct SsdOverMemcached {
    server: Server,
    control: std::path::PathBuf,
    _memcached: Memcached,
    _dir: tempfile::TempDir,
}

fn ssd_over_memcached(mode: &str) -> SsdOverMemcached {
    let memcached = Memcached::start(&["-m", "128"]);
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
        &[
            "--cache",
            path_str(&cache),
            "--memcached",
            &memcached.addr(),
            "--memcached-mode",
            mode,
            "--memcached-timeout-ms",
            "200",
        ],
    );
    SsdOverMemcached {
        server,
        control,
        _memcached: memcached,
        _dir: dir,
    }
}

/// Under the SSD tier: a cache smaller than the data, so its misses and write-backs go through
/// the memcached tier; fio verifies every byte, and the pool served some of the misses.
#[test]
fn under_an_ssd_cache_the_memcached_tier_serves_its_misses() {
    harness::require("fio");
    // Bound whole: the memcached server and the directory live as long as the test.
    let stack = ssd_over_memcached("inclusive");
    let (server, control) = (&stack.server, &stack.control);
    fio_verify(
        server,
        "mc-ssd",
        "48M",
        "--do_verify=1",
        "fio randwrite+verify over the SSD and memcached tiers",
    );
    assert!(counter(control, "memcached_stored_blocks") > 0);
    assert!(
        counter(control, "memcached_hit_blocks") > 0,
        "no SSD miss was served by memcached"
    );
    stack.server.stop();
}

/// Victim mode under an SSD cache smaller than the data: reclaim hands the clean blocks it
/// evicts to memcached, reads that miss the cache come back from there (and leave it), and fio
/// verifies every byte.
#[test]
fn an_ssd_cache_hands_its_evictions_to_memcached_in_victim_mode() {
    harness::require("fio");
    // Bound whole: the memcached server and the directory live as long as the test.
    let stack = ssd_over_memcached("victim");
    let (server, control) = (&stack.server, &stack.control);
    assert!(
        !server.log().contains("will store nothing"),
        "{}",
        server.log()
    );
    fio_verify(
        server,
        "mc-victim",
        "48M",
        "--do_verify=1",
        "fio randwrite+verify over the SSD tier, its evictions in memcached",
    );
    fio_verify(
        server,
        "mc-victim",
        "48M",
        "--verify_only",
        "fio verify again, the SSD tier's misses partly from memcached",
    );
    assert!(
        counter(control, "evicted_blocks") > 0,
        "the cache evicted nothing: the test proves nothing"
    );
    assert!(counter(control, "memcached_stored_blocks") > 0);
    assert!(counter(control, "memcached_hit_blocks") > 0);
    assert!(counter(control, "memcached_removed_blocks") > 0);
    assert_eq!(counter(control, "memcached_corrupt_values"), 0);
    stack.server.stop();
}

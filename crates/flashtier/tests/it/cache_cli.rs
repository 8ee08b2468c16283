//! The cache from the command line: `format` and its refusals, `serve --cache` and its
//! refusals (nothing written when it refuses), the announced atomic write size, a restart that
//! keeps the data, and `demo`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::harness::*;

fn flashtier(args: &[&str]) -> std::process::Output {
    run_any(Command::new(BIN).args(args))
}

fn format_cache(cache: &Path, backing: &Path, extra: &[&str]) -> std::process::Output {
    run_any(format_command(cache, path_str(backing)).args(extra))
}

fn serve_refusal(cache: &Path, backing: &Path, dir: &Path) -> String {
    let socket = dir.join("refused.sock");
    let mut child = Command::new(BIN)
        .args(["serve", "--cache", path_str(cache), "--backing"])
        .args([path_str(backing), "--listen", path_str(&socket)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start flashtier");
    // A serve that does not refuse serves until stopped: a failure, not a test that never ends.
    let refused = wait_or_kill(&mut child, std::time::Duration::from_secs(30));
    let out = child.wait_with_output().expect("serve's output");
    assert!(
        refused.is_some_and(|s| !s.success()),
        "serve accepted what it should refuse:\n{}",
        text(&out)
    );
    assert!(!socket.exists(), "a refused serve left a socket behind");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn format_reports_what_it_created_and_refuses_to_overwrite_a_cache() {
    let dir = Scratch::new();
    let (cache, backing) = (dir.path().join("cache"), dir.path().join("backing"));
    sparse_file(&backing, 64 << 20);
    let out = format_cache(&cache, &backing, &["--size", "32M", "--segment-size", "1M"]);
    assert!(out.status.success(), "format failed:\n{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    for what in [
        "32.00 MiB",
        "64.00 MiB",
        "segments of 1.00 MiB",
        "mode writeback",
    ] {
        assert!(said.contains(what), "format did not say {what:?}:\n{said}");
    }

    let before = std::fs::read(&cache).unwrap();
    let out = format_cache(&cache, &backing, &[]);
    assert!(
        !out.status.success(),
        "format overwrote a cache:\n{}",
        text(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already holds a flashtier cache") && err.contains("--force"),
        "unclear refusal: {err}"
    );
    assert!(
        std::fs::read(&cache).unwrap() == before,
        "a refused format wrote to the cache"
    );

    let out = format_cache(&cache, &backing, &["--force", "--mode", "writethrough"]);
    assert!(
        out.status.success(),
        "format --force failed:\n{}",
        text(&out)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("mode writethrough"));
    assert!(
        std::fs::read(&cache).unwrap() != before,
        "--force did not format"
    );
}

#[test]
fn serve_refuses_a_foreign_damaged_or_newer_cache_and_writes_nothing() {
    let dir = Scratch::new();
    let (cache, backing, other) = (
        dir.path().join("cache"),
        dir.path().join("backing"),
        dir.path().join("other"),
    );
    sparse_file(&backing, 64 << 20);
    sparse_file(&other, 64 << 20);
    let out = format_cache(&cache, &backing, &["--size", "16M", "--segment-size", "1M"]);
    assert!(out.status.success(), "{}", text(&out));
    let pristine = std::fs::read(&cache).unwrap();
    let unchanged = |what: &str, expected: &[u8]| {
        assert!(
            std::fs::read(&cache).unwrap() == expected,
            "serve wrote to the cache although it refused it ({what})"
        );
    };

    let err = serve_refusal(&cache, &other, dir.path());
    assert!(
        err.contains("belongs to backing store") && err.contains(path_str(&backing)),
        "unclear refusal of another backing store: {err}"
    );
    unchanged("other backing store", &pristine);

    // Both superblock copies (4 KiB each at the start) damaged: a checksum mismatch.
    let mut damaged = pristine.clone();
    damaged[200] ^= 0xff;
    damaged[4096 + 200] ^= 0xff;
    std::fs::write(&cache, &damaged).unwrap();
    let err = serve_refusal(&cache, &backing, dir.path());
    assert!(
        err.contains("damaged") || err.contains("checksum"),
        "unclear refusal: {err}"
    );
    unchanged("damaged superblock", &damaged);

    // One copy of a format version this flashtier does not know, as that flashtier would write
    // it (its checksum valid: a version field that fails its checksum is a damaged copy, and
    // the other copy is used).
    let mut newer = pristine.clone();
    newer[8..12].copy_from_slice(&7u32.to_le_bytes());
    let crc = crc32c::crc32c(&newer[..4092]);
    newer[4092..4096].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&cache, &newer).unwrap();
    let err = serve_refusal(&cache, &backing, dir.path());
    assert!(err.contains("format version 7"), "unclear refusal: {err}");
    unchanged("unknown version", &newer);

    // Not a cache at all.
    let zeroes = vec![0u8; pristine.len()];
    std::fs::write(&cache, &zeroes).unwrap();
    let err = serve_refusal(&cache, &backing, dir.path());
    assert!(
        err.contains("not a flashtier cache"),
        "unclear refusal: {err}"
    );
    unchanged("not a cache", &zeroes);

    // One damaged copy is not a refusal: the other copy is used.
    let mut one_torn = pristine.clone();
    one_torn[4096 + 200] ^= 0xff;
    std::fs::write(&cache, &one_torn).unwrap();
    let server = Server::on_socket(
        dir.path(),
        path_str(&backing),
        &["--cache", path_str(&cache)],
    );
    server.stop();
}

/// The announced atomic size, then data written through the cache survives a clean restart
/// (served warm: the log says so) and a kill -9.
#[test]
fn serve_announces_atomic_writes_and_keeps_data_across_restarts() {
    require("nbdcopy");
    let dir = Scratch::new();
    let (cache, backing, data, back) = (
        dir.path().join("cache"),
        dir.path().join("backing"),
        dir.path().join("data"),
        dir.path().join("readback"),
    );
    let size = 32usize << 20;
    random_file(&backing, size, 5);
    random_file(&data, size, 6);
    let out = format_cache(&cache, &backing, &["--size", "64M"]);
    assert!(out.status.success(), "{}", text(&out));

    let socket = dir.path().join("s.sock");
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--cache",
            path_str(&cache),
            "--backing",
            path_str(&backing),
        ])
        .args(["--listen", path_str(&socket)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        let done = line.starts_with("flashtier: listening on ");
        lines.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("writes up to 1.00 MiB atomic")),
        "serve does not state the atomic write size: {lines:?}"
    );

    let server = Server::on_socket(
        dir.path(),
        path_str(&backing),
        &["--cache", path_str(&cache)],
    );
    run(Command::new("nbdcopy").args([path_str(&data), &server.uri]));
    server.stop();

    let server = Server::on_socket(
        dir.path(),
        path_str(&backing),
        &["--cache", path_str(&cache)],
    );
    assert!(
        server.log().contains("after a clean shutdown"),
        "restart after SIGTERM was not clean:\n{}",
        server.log()
    );
    run(Command::new("nbdcopy").args([&server.uri, path_str(&back)]));
    assert!(
        std::fs::read(&back).unwrap() == std::fs::read(&data).unwrap(),
        "data lost across a clean restart"
    );
    // Overwrite half, flush (nbdcopy flushes at the end), then kill -9.
    random_file(&data, size / 2, 7);
    run(Command::new("nbdcopy").args([path_str(&data), &server.uri]));
    let mut server = server;
    server.signal_and_wait(libc::SIGKILL);

    let server = Server::on_socket(
        dir.path(),
        path_str(&backing),
        &["--cache", path_str(&cache)],
    );
    assert!(
        server.log().contains("recovered"),
        "restart after kill -9 did not recover:\n{}",
        server.log()
    );
    std::fs::remove_file(&back).unwrap();
    run(Command::new("nbdcopy").args([&server.uri, path_str(&back)]));
    let got = std::fs::read(&back).unwrap();
    let first_half = std::fs::read(&data).unwrap();
    assert!(
        got[..size / 2] == first_half[..],
        "flushed data lost after kill -9"
    );
    server.stop();
}

#[test]
fn demo_shows_the_cache_working() {
    let out = flashtier(&["demo"]);
    assert!(out.status.success(), "demo failed:\n{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    for what in ["miss", "hit", "absorbed", "restart", "recover"] {
        assert!(
            said.to_lowercase().contains(what),
            "demo output does not mention {what:?}:\n{said}"
        );
    }
}

//! `flashtier detach` and `attach` on a running server, through the real CLI, with clients
//! writing and reading over NBD (qemu-io, nbdcopy): detach writes everything back and serves
//! the backing file directly (clients stay connected), `--force` discards dirty data only once
//! confirmed, commands needing a cache say it is detached, and whatever cache comes back (the
//! released device, another device, after a restart) is empty: data written while detached is
//! read back, never an older cached copy.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

use crate::harness::*;

const MIB: usize = 1 << 20;
/// The backing store's size.
const BACKING: usize = 64 * MIB;

struct Setup {
    dir: Scratch,
    backing: PathBuf,
    cache: PathBuf,
    control: PathBuf,
}

impl Setup {
    /// A 64 MiB backing file of random data and a 96 MiB cache formatted for it.
    fn new() -> Setup {
        let dir = Scratch::new();
        let backing = dir.path().join("backing");
        random_file(&backing, BACKING, 23);
        let s = Setup {
            cache: dir.path().join("cache"),
            control: dir.path().join("control.sock"),
            backing,
            dir,
        };
        s.format(&s.cache, path_str(&s.backing));
        s
    }

    /// Formats a 96 MiB cache file at `cache` for `backing`.
    fn format(&self, cache: &Path, backing: &str) {
        let out =
            run_any(format_command(cache, backing).args(["--size", "96M", "--segment-size", "1M"]));
        assert!(out.status.success(), "format failed:\n{}", text(&out));
    }

    /// `flashtier serve` on the backing file, with `--cache` if `cached`.
    fn serve(&self, cached: bool) -> Server {
        let stats = self.dir.path().join("stats");
        let mut args = vec![
            "--control-socket",
            path_str(&self.control),
            "--stats-file",
            path_str(&stats),
        ];
        if cached {
            args.extend(["--cache", path_str(&self.cache)]);
        }
        Server::on_socket(self.dir.path(), path_str(&self.backing), &args)
    }

    fn ctl(&self, args: &[&str]) -> Output {
        run_any(
            Command::new(BIN)
                .args(args)
                .arg("--control")
                .arg(&self.control),
        )
    }

    /// Runs `flashtier ARGS`, which must succeed; returns its stdout and stderr.
    fn ctl_ok(&self, args: &[&str]) -> (String, String) {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "flashtier {args:?} failed ({}):\n{}",
            out.status,
            text(&out)
        );
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `flashtier ARGS`, which must fail with exit status 1; returns its stderr.
    fn ctl_fails(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "flashtier {args:?} should fail with exit 1:\n{}",
            text(&out)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Runs `flashtier ARGS` on a terminal (through `script`), typing `answer` at it.
    fn ctl_on_tty(&self, args: &[&str], answer: &str) -> Output {
        require("script");
        let cmd = format!(
            "{BIN} {} --control {}",
            args.join(" "),
            path_str(&self.control)
        );
        let mut child = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot run script");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(format!("{answer}\n").as_bytes()).unwrap();
        // script ends with the command; the end of its input is only a ^D on the terminal.
        drop(stdin);
        child.wait_with_output().unwrap()
    }

    fn report(&self) -> Value {
        let (out, _) = self.ctl_ok(&["stats", "--json"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
    }

    fn backing_bytes(&self) -> Vec<u8> {
        std::fs::read(&self.backing).unwrap()
    }

    /// Every byte the export serves, through nbdcopy.
    fn export_bytes(&self, server: &Server) -> Vec<u8> {
        require("nbdcopy");
        let out = self.dir.path().join("export-copy");
        let _ = std::fs::remove_file(&out);
        run(Command::new("nbdcopy").args([&server.uri, path_str(&out)]));
        std::fs::read(&out).unwrap()
    }
}

fn fill(image: &mut [u8], at: usize, len: usize, byte: u8) {
    image[at..at + len].iter_mut().for_each(|b| *b = byte);
}

/// Asserts `got == want` naming the first differing byte (never printing megabytes).
fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: sizes differ");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}

fn cache_state(r: &Value) -> &str {
    r["status"]["cache_state"].as_str().unwrap_or("?")
}

fn status_u64(r: &Value, name: &str) -> u64 {
    r["status"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name} in status: {}", r["status"]))
}

const DETACHED: &str = "the cache is detached; `flashtier attach` brings it back";

#[test]
fn detach_writes_back_and_attach_brings_back_an_empty_cache() {
    let setup = Setup::new();
    let mut expected = setup.backing_bytes();
    let server = setup.serve(true);
    // Dirty blocks, and a range read into the cache (clean blocks).
    qemu_io(
        &server.uri,
        &["write -P 0xa1 0 8M", "write -P 0xa2 20M 64k", "read 32M 2M"],
    );
    fill(&mut expected, 0, 8 * MIB, 0xa1);
    fill(&mut expected, 20 * MIB, 64 << 10, 0xa2);
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached");
    assert!(status_u64(&r, "dirty_blocks") >= 2048, "{r}");
    let writes_before = r["counters"]["writes"].as_u64().unwrap();

    let (out, progress) = setup.ctl_ok(&["detach"]);
    assert!(out.contains("detached"), "{out}");
    assert!(
        progress.contains("detach"),
        "no progress or summary on stderr:\n{progress}"
    );
    let r = setup.report();
    assert_eq!(cache_state(&r), "detached", "{r}");
    assert_eq!(r["status"]["cache"], false);
    assert_eq!(r["job"]["kind"], "detach");
    assert_eq!(r["job"]["done"], true);
    assert!(r["job"]["error"].is_null(), "{r}");
    assert!(
        r["counters"]["writes"].as_u64().unwrap() >= writes_before,
        "counters went back"
    );
    let (status, _) = setup.ctl_ok(&["status"]);
    assert!(
        status.contains("cache") && status.contains("detached"),
        "{status}"
    );
    // The backing file alone holds everything.
    same(
        &setup.backing_bytes(),
        &expected,
        "backing file after detach",
    );

    for args in [
        &["get", "promotion"][..],
        &["set", "promotion", "nhit"],
        &["get", "--all"],
        &["mode", "writethrough"],
        &["flush"],
        &["detach"],
    ] {
        let err = setup.ctl_fails(args);
        assert!(err.contains(DETACHED), "{args:?}: {err}");
    }

    // Served directly: writes reach the backing file, reads are right.
    qemu_io(
        &server.uri,
        &[
            "write -P 0xb1 0 1M",
            "write -P 0xb2 32M 64k",
            "read -P 0xb1 0 1M",
            "read -P 0xa1 1M 7M",
        ],
    );
    fill(&mut expected, 0, MIB, 0xb1);
    fill(&mut expected, 32 * MIB, 64 << 10, 0xb2);
    same(
        &setup.backing_bytes(),
        &expected,
        "backing file while detached",
    );

    // Back: empty, and nothing cached before (dirty or read) comes back stale.
    let (out, _) = setup.ctl_ok(&["attach"]);
    assert!(out.contains("attached"), "{out}");
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached", "{r}");
    assert_eq!(status_u64(&r, "cached_blocks"), 0, "{r}");
    assert_eq!(r["status"]["mode"], "writeback", "{r}");
    let err = setup.ctl_fails(&["attach"]);
    assert!(err.contains("attached already"), "{err}");
    qemu_io(
        &server.uri,
        &[
            "read -P 0xb1 0 1M",
            "read -P 0xb2 32M 64k",
            "read -P 0xa2 20M 64k",
        ],
    );
    same(
        &setup.export_bytes(&server),
        &expected,
        "export after attach",
    );
    // The cache works: writes are dirty in it again.
    qemu_io(&server.uri, &["write -P 0xc1 4M 1M"]);
    fill(&mut expected, 4 * MIB, MIB, 0xc1);
    assert!(status_u64(&setup.report(), "dirty_blocks") >= 256);
    server.stop();

    // A restart opens the attached cache, dirty data included.
    let server = setup.serve(true);
    same(
        &setup.export_bytes(&server),
        &expected,
        "export after restart",
    );
    server.stop();
}

#[test]
fn detach_force_needs_confirmation_and_nothing_stale_survives_a_restart() {
    let setup = Setup::new();
    let original = setup.backing_bytes();
    let mut expected = original.clone();
    let server = setup.serve(true);
    qemu_io(&server.uri, &["write -P 0xc1 0 4M"]);
    let dirty = status_u64(&setup.report(), "dirty_blocks");
    assert_eq!(dirty, 1024);

    // No terminal (stdin is /dev/null) and no --yes-discard-dirty-data: refused, loudly.
    let err = setup.ctl_fails(&["detach", "--force"]);
    assert!(
        err.contains("WARNING") && err.contains("4.00 MiB") && err.contains("LOST"),
        "{err}"
    );
    assert!(err.contains("--yes-discard-dirty-data"), "{err}");
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached");
    assert_eq!(
        status_u64(&r, "dirty_blocks"),
        dirty,
        "refused, yet changed"
    );
    // On a terminal, anything but `discard` refuses too.
    let out = setup.ctl_on_tty(&["detach", "--force"], "yes");
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("type `discard`") && all.contains("not confirmed"),
        "{all}"
    );
    assert_eq!(cache_state(&setup.report()), "attached");

    let out = setup.ctl(&["detach", "--force", "--yes-discard-dirty-data"]);
    assert!(out.status.success(), "{}", text(&out));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stderr.contains("WARNING") && stderr.contains("4.00 MiB"),
        "{stderr}"
    );
    assert!(stdout.contains("1024 dirty blocks discarded"), "{stdout}");
    assert!(
        server.log().contains("discard"),
        "the server logged no warning:\n{}",
        server.log()
    );
    assert_eq!(cache_state(&setup.report()), "detached");
    // Discarded: the backing store never got those writes, and serves its own data.
    same(
        &setup.backing_bytes(),
        &original,
        "backing file after --force",
    );
    qemu_io(&server.uri, &["write -P 0xd1 0 1M"]);
    fill(&mut expected, 0, MIB, 0xd1);
    same(
        &setup.export_bytes(&server),
        &expected,
        "export while detached",
    );

    // Stopped while detached, restarted with the released cache: it is empty.
    server.stop();
    let server = setup.serve(true);
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached");
    assert_eq!(status_u64(&r, "cached_blocks"), 0, "{r}");
    same(
        &setup.export_bytes(&server),
        &expected,
        "export after restart",
    );

    // Another cache device holding a foreign cache is refused unless forced.
    let other_backing = setup.dir.path().join("other-backing");
    sparse_file(&other_backing, 32 << 20);
    let other = setup.dir.path().join("other-cache");
    setup.format(&other, path_str(&other_backing));
    let out = setup.ctl_on_tty(&["detach", "--force"], "discard");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cache_state(&setup.report()), "detached");
    let err = setup.ctl_fails(&["attach", "--cache", path_str(&other)]);
    assert!(
        err.contains("another flashtier cache") && err.contains("--force"),
        "{err}"
    );
    let err = setup.ctl_fails(&["attach", "--cache", path_str(&setup.backing)]);
    assert!(err.contains("backing store itself"), "{err}");
    assert_eq!(cache_state(&setup.report()), "detached");
    setup.ctl_ok(&[
        "attach",
        "--cache",
        path_str(&other),
        "--force",
        "--mode",
        "writethrough",
    ]);
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached");
    assert_eq!(r["status"]["mode"], "writethrough");
    assert_eq!(status_u64(&r, "cached_blocks"), 0);
    qemu_io(&server.uri, &["write -P 0xe1 8M 1M", "read -P 0xd1 0 1M"]);
    fill(&mut expected, 8 * MIB, MIB, 0xe1);
    same(
        &setup.backing_bytes(),
        &expected,
        "write-through backing file",
    );
    server.stop();
}

#[test]
fn a_server_started_without_a_cache_can_attach_one() {
    let setup = Setup::new();
    let mut expected = setup.backing_bytes();
    let server = setup.serve(false);
    let err = setup.ctl_fails(&["get", "promotion"]);
    assert!(err.contains("no cache"), "{err}");
    let err = setup.ctl_fails(&["attach"]);
    assert!(err.contains("--cache PATH"), "{err}");
    qemu_io(&server.uri, &["write -P 0xf1 0 1M"]);
    fill(&mut expected, 0, MIB, 0xf1);

    // A new, never formatted file (relative paths are the CLI's, not the server's).
    let fresh = setup.dir.path().join("fresh-cache");
    sparse_file(&fresh, 64 << 20);
    let out = run_any(
        Command::new(BIN)
            .current_dir(setup.dir.path())
            .args(["attach", "--cache", "fresh-cache", "--control"])
            .arg(&setup.control),
    );
    assert!(out.status.success(), "{}", text(&out));
    let r = setup.report();
    assert_eq!(cache_state(&r), "attached", "{r}");
    assert_eq!(r["status"]["mode"], "writeback");
    assert_eq!(r["status"]["block_size"], 4096, "format defaults");
    assert_eq!(setup.ctl_ok(&["get", "promotion"]).0.trim(), "auto");
    qemu_io(&server.uri, &["write -P 0xf2 1M 1M", "read -P 0xf1 0 1M"]);
    fill(&mut expected, MIB, MIB, 0xf2);
    assert!(status_u64(&setup.report(), "dirty_blocks") >= 256);
    // The engine's counters appear and count from the attach.
    let r = setup.report();
    assert!(r["counters"]["writes"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["windows"]["5min"]["writes"].as_u64().unwrap() >= 1, "{r}");

    setup.ctl_ok(&["detach"]);
    same(
        &setup.backing_bytes(),
        &expected,
        "backing file after detach",
    );
    server.stop();
}

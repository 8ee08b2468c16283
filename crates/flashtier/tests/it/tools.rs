//! Interoperability with real NBD tools: nbdinfo, qemu-img, qemu-io, nbdcopy, fio, nbdfuse.
//!
//! Every test starts its own server on its own scratch directory, drives it with a real client,
//! and checks data where there is data to check: read back through the server and, after a
//! graceful stop, directly in the backing file.

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::harness::{
    self, path_str, qemu_io, run_any, text, wait_or_kill, wait_until, FuseLoop, KillOnDrop, Server,
};

const MIB: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// Deterministic pseudo-random bytes (xorshift64, like `harness::random_file`).
fn random_bytes(size: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut data = vec![0u8; size];
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    data
}

/// Panics (with a useful message) unless `a == b`; names the first differing byte.
fn assert_same_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{what}: length {} instead of {}",
        actual.len(),
        expected.len()
    );
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = (i + 16).min(actual.len());
        panic!(
            "{what}: first difference at byte {i} (0x{i:x}): got {:02x?}, expected {:02x?}",
            &actual[i..end],
            &expected[i..end]
        );
    }
}

/// Panics unless every byte of `data[range]` is `byte`.
fn assert_filled(data: &[u8], start: usize, len: usize, byte: u8, what: &str) {
    let region = &data[start..start + len];
    if let Some(i) = region.iter().position(|&b| b != byte) {
        panic!(
            "{what}: byte at offset {} is 0x{:02x}, expected 0x{byte:02x} throughout {start}..{}",
            start + i,
            region[i],
            start + len
        );
    }
}

/// The value of `"key": value` in nbdinfo's JSON (first occurrence), without quotes.
fn json_field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let needle = format!("\"{key}\"");
    let at = json.find(&needle)? + needle.len();
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest.find([',', '\n', '}', ']']).unwrap_or(rest.len());
    Some(rest[..end].trim().trim_matches('"'))
}

fn json_u64(json: &str, key: &str) -> u64 {
    json_field(json, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("nbdinfo --json has no numeric \"{key}\":\n{json}"))
}

fn json_bool(json: &str, key: &str) -> bool {
    match json_field(json, key) {
        Some("true") => true,
        Some("false") => false,
        other => panic!("nbdinfo --json: \"{key}\" is {other:?}, not a boolean:\n{json}"),
    }
}

fn nbdinfo_json(uri: &str) -> String {
    harness::run_stdout(Command::new("nbdinfo").arg("--json").arg(uri))
}

/// Parses `nbdinfo --map` output into (offset, length, type, description) rows.
fn parse_map(map: &str) -> Vec<(u64, u64, u32, String)> {
    map.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut f = l.split_whitespace();
            let mut num = || -> u64 {
                f.next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("unexpected nbdinfo --map line {l:?}:\n{map}"))
            };
            let (off, len, ty) = (num(), num(), num());
            let desc = f.collect::<Vec<_>>().join(" ");
            (off, len, ty as u32, desc)
        })
        .collect()
}

/// Common fio arguments for a verified random-write job; `extra` selects engine and target.
pub(crate) fn fio_verify_job(name: &str, size: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new("fio");
    cmd.args([
        &format!("--name={name}"),
        "--rw=randwrite",
        "--bsrange=4k-64k",
        &format!("--size={size}"),
        "--iodepth=32",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--randrepeat=1",
        // No verify state files in the working directory.
        "--verify_state_save=0",
    ]);
    cmd.args(extra);
    cmd
}

/// Asserts that fio succeeded with `jobs` jobs, each reporting "err= 0".
pub(crate) fn assert_fio_ok(out: &Output, jobs: usize, what: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ok_jobs = stdout.matches("err= 0").count();
    let verify_errors = text(out).contains("verify:");
    assert!(
        out.status.success() && ok_jobs == jobs && !verify_errors,
        "{what}: fio exited {} with {ok_jobs}/{jobs} jobs at err= 0:\n{}",
        out.status,
        text(out)
    );
}

// ---------------------------------------------------------------------------------------------
// nbdinfo
// ---------------------------------------------------------------------------------------------

#[test]
fn nbdinfo_reports_size_flags_block_sizes_and_contexts() {
    harness::require("nbdinfo");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 96 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let json = nbdinfo_json(&server.uri);
    assert_eq!(json_u64(&json, "export-size"), 96 * MIB as u64, "{json}");
    assert_eq!(
        json_field(&json, "export-name"),
        Some("flashtier"),
        "{json}"
    );
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_cache",
        "can_multi_conn",
        "can_df",
    ] {
        assert!(json_bool(&json, flag), "{flag} should be true:\n{json}");
    }
    assert!(!json_bool(&json, "is_read_only"), "{json}");
    assert_eq!(json_u64(&json, "block_size_minimum"), 512, "{json}");
    assert_eq!(json_u64(&json, "block_size_preferred"), 4096, "{json}");
    assert!(
        json_u64(&json, "block_size_maximum") >= 32 * MIB as u64,
        "maximum block size below 32 MiB:\n{json}"
    );
    assert!(json_bool(&json, "structured"), "{json}");
    let contexts = json
        .split("\"contexts\"")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .unwrap_or_else(|| panic!("no contexts in nbdinfo output:\n{json}"));
    assert!(
        contexts.contains("\"base:allocation\""),
        "base:allocation missing from contexts:\n{json}"
    );

    // --list names the export.
    let list = harness::run_stdout(Command::new("nbdinfo").arg("--list").arg(&server.uri));
    assert!(
        list.contains("export=\"flashtier\""),
        "nbdinfo --list does not show export \"flashtier\":\n{list}"
    );
    server.stop();
}

#[test]
fn nbdinfo_map_reports_data_and_holes() {
    harness::require("nbdinfo");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    let size = 64 * MIB;
    // 1 MiB of data at 0 and at 32 MiB; the rest a hole.
    harness::sparse_file(&img, size as u64);
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        let data = random_bytes(MIB, 7);
        f.write_all_at(&data, 0).unwrap();
        f.write_all_at(&data, 32 * MIB as u64).unwrap();
        f.sync_all().unwrap();
    }
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);
    let map = harness::run_stdout(Command::new("nbdinfo").arg("--map").arg(&server.uri));
    let rows = parse_map(&map);

    // The extents tile the whole export, in order.
    let mut next = 0;
    for &(off, len, _, _) in &rows {
        assert_eq!(off, next, "extents are not contiguous:\n{map}");
        next = off + len;
    }
    assert_eq!(next, size as u64, "extents do not cover the export:\n{map}");

    // Classify every MiB: data (type 0) where written, hole (type bit 0) elsewhere.
    let type_at = |pos: u64| {
        rows.iter()
            .find(|&&(off, len, _, _)| off <= pos && pos < off + len)
            .map(|r| r.2)
            .unwrap()
    };
    for mib in [0u64, 32] {
        let t = type_at(mib * MIB as u64);
        assert_eq!(t & 1, 0, "written MiB {mib} reported as a hole:\n{map}");
    }
    for mib in [2u64, 16, 40, 63] {
        let t = type_at(mib * MIB as u64);
        assert_eq!(
            t & 1,
            1,
            "unwritten MiB {mib} not reported as a hole:\n{map}"
        );
    }
    assert!(map.contains("hole"), "no hole in nbdinfo --map:\n{map}");
    server.stop();
}

// ---------------------------------------------------------------------------------------------
// Listening: TCP and unix socket
// ---------------------------------------------------------------------------------------------

#[test]
fn tcp_listen_on_port_zero_reports_the_real_port() {
    harness::require("nbdinfo");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 8 * MIB as u64);
    let server = Server::start(&["--backing", path_str(&img), "--listen", "127.0.0.1:0"]);

    let port: u16 = server
        .listen
        .strip_prefix("tcp:127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected listen address {:?}", server.listen));
    assert_ne!(port, 0, "server printed port 0 instead of the bound port");
    assert_eq!(
        server.uri,
        format!("nbd://127.0.0.1:{port}/flashtier"),
        "URI does not match the listen address {}",
        server.listen
    );
    assert!(server.socket().is_none());

    let json = nbdinfo_json(&server.uri);
    assert_eq!(json_u64(&json, "export-size"), 8 * MIB as u64, "{json}");
    assert!(!json_bool(&json, "is_read_only"), "{json}");
    // The default (empty) export name reaches the same export.
    let json = nbdinfo_json(&format!("nbd://127.0.0.1:{port}"));
    assert_eq!(json_u64(&json, "export-size"), 8 * MIB as u64, "{json}");
    server.stop();
}

#[test]
fn unix_socket_is_private_and_removed_on_exit() {
    harness::require("nbdinfo");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 4 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);
    let socket = server
        .socket()
        .expect("server should listen on a unix socket");

    let meta = fs::symlink_metadata(&socket).expect("socket file missing");
    assert!(meta.file_type().is_socket(), "{socket:?} is not a socket");
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "socket {socket:?} has mode {:o}, expected 0600",
        meta.permissions().mode() & 0o777
    );
    assert_eq!(
        server.uri,
        format!("nbd+unix:///flashtier?socket={}", socket.display())
    );
    // The socket actually works.
    let json = nbdinfo_json(&server.uri);
    assert_eq!(json_u64(&json, "export-size"), 4 * MIB as u64, "{json}");

    server.stop();
    assert!(
        !socket.exists(),
        "socket {socket:?} left behind after a graceful stop"
    );
}

// ---------------------------------------------------------------------------------------------
// qemu-img and qemu-io
// ---------------------------------------------------------------------------------------------

#[test]
fn qemu_img_info_convert_and_compare() {
    harness::require("qemu-img");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    let size = 48 * MIB;
    harness::sparse_file(&img, size as u64);
    let local = dir.path().join("local.img");
    harness::random_file(&local, size, 42);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let info = harness::run_stdout(Command::new("qemu-img").arg("info").arg(&server.uri));
    assert!(
        info.lines().any(|l| l.trim() == "file format: raw"),
        "qemu-img info does not say raw:\n{info}"
    );
    assert!(
        info.contains(&format!("virtual size: 48 MiB ({size} bytes)")),
        "qemu-img info has the wrong virtual size:\n{info}"
    );

    // Before the copy the export differs from the local file (so compare can tell).
    let before = run_any(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&local)
            .arg(&server.uri),
    );
    assert_eq!(
        before.status.code(),
        Some(1),
        "qemu-img compare should report a difference before the copy:\n{}",
        text(&before)
    );

    harness::run(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&local)
            .arg(&server.uri),
    );
    let cmp = harness::run_stdout(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&local)
            .arg(&server.uri),
    );
    assert!(cmp.contains("Images are identical"), "{cmp}");

    server.stop();
    let cmp = harness::run_stdout(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&local)
            .arg(&img),
    );
    assert!(cmp.contains("Images are identical"), "backing file: {cmp}");
    assert_same_bytes(
        &fs::read(&img).unwrap(),
        &fs::read(&local).unwrap(),
        "backing file after qemu-img convert",
    );
}

/// The qemu-io commands of the pattern test, and a check of their effect on a 8 MiB device.
const QEMU_IO_PATTERN: &[&str] = &[
    "write -P 0xab 0 1M",
    "write -P 0xcd 1M 64k",
    "write -P 0x11 2M 1M",
    // Unaligned, crossing sector boundaries.
    "write -P 0x22 3146241 1000",
    // Write zeroes inside a written range, and a discard.
    "write -z 2560k 128k",
    "write -P 0x33 4M 1M",
    "discard 4M 1M",
    "flush",
    "read -P 0xab 0 1M",
    "read -P 0xcd 1M 64k",
    "read -P 0x11 2M 512k",
    "read -P 0 2560k 128k",
    "read -P 0x11 2688k 384k",
    "read -P 0x22 3146241 1000",
    "read -P 0 3M 513",
    // FUA writes.
    "write -f -P 0x44 5M 4k",
    "read -P 0x44 5M 4k",
];

/// Checks what `QEMU_IO_PATTERN` should have left in the device's bytes.
fn check_qemu_io_pattern(data: &[u8], what: &str) {
    assert_filled(data, 0, MIB, 0xab, what);
    assert_filled(data, MIB, 64 * 1024, 0xcd, what);
    assert_filled(data, MIB + 64 * 1024, MIB - 64 * 1024, 0, what);
    assert_filled(data, 2 * MIB, 512 * 1024, 0x11, what);
    assert_filled(data, 2560 * 1024, 128 * 1024, 0, what);
    assert_filled(data, 2688 * 1024, 384 * 1024, 0x11, what);
    assert_filled(data, 3 * MIB, 513, 0, what);
    assert_filled(data, 3146241, 1000, 0x22, what);
    assert_filled(data, 3146241 + 1000, MIB - 513 - 1000, 0, what);
    // Discarded data reads as zeroes or as the old data; never as anything else.
    let discarded = &data[4 * MIB..5 * MIB];
    assert!(
        discarded.iter().all(|&b| b == 0) || discarded.iter().all(|&b| b == 0x33),
        "{what}: discarded range holds neither zeroes nor the old data"
    );
    assert_filled(data, 5 * MIB, 4096, 0x44, what);
    assert_filled(data, 5 * MIB + 4096, 3 * MIB - 4096, 0, what);
}

#[test]
fn qemu_io_patterns_unaligned_zeroes_and_discard() {
    harness::require("qemu-io");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 8 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    qemu_io(&server.uri, QEMU_IO_PATTERN);
    // A wrong pattern is detected (the check above is not vacuous).
    let out = run_any(Command::new("qemu-io").args([
        "-f",
        "raw",
        &server.uri,
        "-c",
        "read -P 0xcd 0 4k",
    ]));
    assert!(
        text(&out).contains("Pattern verification failed"),
        "reading 0xab as 0xcd should fail:\n{}",
        text(&out)
    );
    // A second connection sees the data.
    qemu_io(
        &server.uri,
        &["read -P 0xab 0 1M", "read -P 0x22 3146241 1000"],
    );

    server.stop();
    check_qemu_io_pattern(&fs::read(&img).unwrap(), "backing file after qemu-io");
}

// ---------------------------------------------------------------------------------------------
// nbdcopy
// ---------------------------------------------------------------------------------------------

#[test]
fn nbdcopy_round_trip_single_and_multi_conn() {
    harness::require("nbdcopy");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    let size = 64 * MIB;
    harness::sparse_file(&img, size as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let rounds: [(u64, &[&str]); 2] = [(1, &[]), (2, &["--connections=4", "--requests=64"])];
    let mut last = Vec::new();
    for (seed, opts) in rounds {
        let src = dir.path().join(format!("in-{seed}.img"));
        let dst = dir.path().join(format!("out-{seed}.img"));
        let data = random_bytes(size, seed);
        fs::write(&src, &data).unwrap();
        harness::run(
            Command::new("nbdcopy")
                .args(opts)
                .arg(&src)
                .arg(&server.uri),
        );
        harness::run(
            Command::new("nbdcopy")
                .args(opts)
                .arg(&server.uri)
                .arg(&dst),
        );
        assert_same_bytes(
            &fs::read(&dst).unwrap(),
            &data,
            &format!("nbdcopy round trip {opts:?}"),
        );
        last = data;
    }

    server.stop();
    assert_same_bytes(
        &fs::read(&img).unwrap(),
        &last,
        "backing file after nbdcopy",
    );
}

// ---------------------------------------------------------------------------------------------
// fio
// ---------------------------------------------------------------------------------------------

#[test]
fn fio_verified_random_writes_one_connection() {
    harness::require("fio");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 128 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let uri = format!("--uri={}", server.uri);
    let out = run_any(&mut fio_verify_job(
        "one",
        "128M",
        &["--ioengine=nbd", &uri, "--do_verify=1"],
    ));
    assert_fio_ok(&out, 1, "fio randwrite+verify over NBD");

    // The data reached the backing file: the same job, verify only, on the file itself.
    server.stop();
    let out = run_any(&mut fio_verify_job(
        "one",
        "128M",
        &[
            "--ioengine=psync",
            &format!("--filename={}", img.display()),
            "--verify_only",
        ],
    ));
    assert_fio_ok(&out, 1, "fio verify_only of the backing file");
}

#[test]
fn fio_verified_random_writes_four_connections() {
    harness::require("fio");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 128 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let four = ["--numjobs=4", "--offset_increment=32M"];
    let uri = format!("--uri={}", server.uri);
    let mut extra = vec!["--ioengine=nbd", uri.as_str(), "--do_verify=1"];
    extra.extend(four);
    let out = run_any(&mut fio_verify_job("four", "32M", &extra));
    assert_fio_ok(&out, 4, "fio 4 jobs randwrite+verify over NBD");

    server.stop();
    let filename = format!("--filename={}", img.display());
    let mut extra = vec!["--ioengine=psync", filename.as_str(), "--verify_only"];
    extra.extend(four);
    let out = run_any(&mut fio_verify_job("four", "32M", &extra));
    assert_fio_ok(&out, 4, "fio 4 jobs verify_only of the backing file");
}

// ---------------------------------------------------------------------------------------------
// nbdfuse + loop device + ext4
// ---------------------------------------------------------------------------------------------

#[test]
fn ext4_on_loop_device_over_nbdfuse() {
    for tool in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "debugfs",
        "mount",
        "umount",
    ] {
        harness::require(tool);
    }
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 256 * MIB as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let fuse_dir = dir.path().join("fuse");
    let mnt = dir.path().join("mnt");
    fs::create_dir(&fuse_dir).unwrap();
    fs::create_dir(&mnt).unwrap();
    let fuse_log = dir.path().join("nbdfuse.log");
    // Declared after `server`, so dropped (torn down) before the server goes away.
    let mut stack = FuseLoop::attach(&fuse_dir, &server.uri, 256 * MIB as u64, &fuse_log);
    let dev = stack.dev().to_string();

    harness::run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    stack.mount(&mnt);
    let files: Vec<(String, Vec<u8>)> = vec![
        ("small.txt".into(), b"flashtier was here\n".to_vec()),
        ("a.bin".into(), random_bytes(3 * MIB, 11)),
        ("b.bin".into(), random_bytes(8 * MIB + 4321, 12)),
        ("dir/c.bin".into(), random_bytes(5 * MIB, 13)),
    ];
    fs::create_dir(mnt.join("dir")).unwrap();
    for (name, data) in &files {
        fs::write(mnt.join(name), data).unwrap();
    }
    harness::run(&mut Command::new("sync"));
    stack.umount();

    harness::assert_fsck_clean(&dev, "after writing files");

    stack.mount(&mnt);
    for (name, data) in &files {
        assert_same_bytes(
            &fs::read(mnt.join(name)).unwrap(),
            data,
            &format!("{name} after remount"),
        );
    }
    let status = stack.detach();
    assert!(
        status.success(),
        "nbdfuse exited with {status}:\n{}",
        fs::read_to_string(&fuse_log).unwrap_or_default()
    );

    // After a graceful stop the backing file itself is a clean ext4 image holding the files.
    server.stop();
    harness::assert_fsck_clean(&img, "(the backing file after a graceful stop)");
    for (name, data) in &files {
        let out = dir.path().join("dumped");
        let _ = fs::remove_file(&out);
        harness::run(
            Command::new("debugfs")
                .arg("-R")
                .arg(format!("dump /{name} {}", out.display()))
                .arg(&img),
        );
        assert_same_bytes(
            &fs::read(&out).unwrap_or_default(),
            data,
            &format!("{name} in the backing file"),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// An NBD server as the backing store
// ---------------------------------------------------------------------------------------------

#[test]
fn nbd_backing_store_via_nbdkit() {
    harness::require("nbdkit");
    harness::require("qemu-io");
    let dir = harness::scratch();
    let img = dir.path().join("nbdkit.img");
    harness::sparse_file(&img, 8 * MIB as u64);
    let sock = dir.path().join("nbdkit.sock");
    let mut nbdkit = KillOnDrop(Some(
        Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(&sock)
            .arg("file")
            .arg(&img)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.path().join("nbdkit.log")).unwrap())
            .spawn()
            .expect("cannot start nbdkit"),
    ));
    wait_until(
        Duration::from_secs(10),
        "nbdkit to create its socket",
        || sock.exists(),
    );

    let backing = format!("nbd+unix:///?socket={}", sock.display());
    let server = Server::on_socket(dir.path(), &backing, &[]);
    let json = nbdinfo_json(&server.uri);
    assert_eq!(json_u64(&json, "export-size"), 8 * MIB as u64, "{json}");

    qemu_io(&server.uri, QEMU_IO_PATTERN);
    server.stop();

    // flashtier's final flush went through to nbdkit; read the file nbdkit serves.
    check_qemu_io_pattern(&fs::read(&img).unwrap(), "nbdkit's file after qemu-io");
    assert!(
        nbdkit.child().try_wait().unwrap().is_none(),
        "nbdkit exited early:\n{}",
        fs::read_to_string(dir.path().join("nbdkit.log")).unwrap_or_default()
    );
}

// ---------------------------------------------------------------------------------------------
// Read-only
// ---------------------------------------------------------------------------------------------

#[test]
fn read_only_export_refuses_writes() {
    harness::require("nbdinfo");
    harness::require("nbdcopy");
    harness::require("qemu-io");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    let original = random_bytes(4 * MIB, 99);
    fs::write(&img, &original).unwrap();
    let server = Server::on_socket(dir.path(), path_str(&img), &["--read-only"]);

    let json = nbdinfo_json(&server.uri);
    assert!(json_bool(&json, "is_read_only"), "{json}");
    assert!(
        !json_bool(&json, "can_trim"),
        "trim on a read-only export:\n{json}"
    );
    assert!(
        !json_bool(&json, "can_zero"),
        "zero on a read-only export:\n{json}"
    );

    // Opening read-write is refused.
    let out = run_any(Command::new("qemu-io").args([
        "-f",
        "raw",
        &server.uri,
        "-c",
        "write -P 0xab 0 64k",
    ]));
    let all = text(&out);
    assert!(
        !out.status.success()
            && (all.contains("Permission denied")
                || all.contains("not permitted")
                || all.contains("read-only")),
        "a write to a read-only export did not fail ({}):\n{all}",
        out.status
    );

    // Reads work and return the file's content (qemu-io reads it back to compare).
    let copy = dir.path().join("out.img");
    harness::run(Command::new("nbdcopy").arg(&server.uri).arg(&copy));
    assert_same_bytes(&fs::read(&copy).unwrap(), &original, "read-only export");
    let out = run_any(Command::new("qemu-io").args([
        "-r",
        "-f",
        "raw",
        &server.uri,
        "-c",
        "read 0 1M",
        "-c",
        "read 1000 3000",
    ]));
    assert!(
        out.status.success() && !text(&out).to_lowercase().contains("fail"),
        "qemu-io -r read on a read-only export failed:\n{}",
        text(&out)
    );

    server.stop();
    assert_same_bytes(
        &fs::read(&img).unwrap(),
        &original,
        "backing file of a read-only export",
    );
}

// ---------------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------------

#[test]
fn graceful_shutdown_under_load_and_sigint_when_idle() {
    harness::require("fio");
    harness::require("nbdinfo");
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, 64 * MIB as u64);
    let mut server = Server::on_socket(dir.path(), path_str(&img), &[]);

    let fio_out = dir.path().join("fio.out");
    let mut fio = KillOnDrop(Some(
        Command::new("fio")
            .current_dir(dir.path())
            .args([
                "--name=load",
                "--ioengine=nbd",
                &format!("--uri={}", server.uri),
                "--rw=randwrite",
                "--bs=4k",
                "--size=64M",
                "--iodepth=32",
                "--time_based",
                "--runtime=30",
            ])
            .stdin(Stdio::null())
            .stdout(fs::File::create(&fio_out).unwrap())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start fio"),
    ));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        fio.child().try_wait().unwrap().is_none(),
        "fio stopped before the shutdown:\n{}",
        fs::read_to_string(&fio_out).unwrap_or_default()
    );
    assert!(
        server.is_running(),
        "server died under load:\n{}",
        server.log()
    );

    let started = Instant::now();
    let status = server.signal_and_wait(libc::SIGTERM);
    let took = started.elapsed();
    let log = server.log();
    assert!(
        status.success(),
        "SIGTERM under load: exit {status}:\n{log}"
    );
    assert!(
        log.contains("shut down cleanly"),
        "no 'shut down cleanly' in the log:\n{log}"
    );
    assert!(
        log.contains("shutting down: finishing in-flight requests")
            && log.contains("connections=1"),
        "the shutdown did not happen with fio's connection open:\n{log}"
    );
    assert!(
        took < Duration::from_secs(15),
        "shutdown under load took {took:?}:\n{log}"
    );
    // fio loses its connection; it must not keep the test waiting.
    let _ = wait_or_kill(fio.child(), Duration::from_secs(5));
    drop(fio);
    drop(server);

    // While idle (a client came and went), SIGINT exits 0 as well, and removes the socket.
    // (The client also keeps this clear of the start-up race in
    // `signal_right_after_the_ready_line_is_graceful`.)
    let mut server = Server::on_socket(dir.path(), path_str(&img), &[]);
    let socket = server.socket().expect("unix socket");
    let json = nbdinfo_json(&server.uri);
    assert_eq!(json_u64(&json, "export-size"), 64 * MIB as u64, "{json}");
    let status = server.signal_and_wait(libc::SIGINT);
    let log = server.log();
    assert!(status.success(), "SIGINT while idle: exit {status}:\n{log}");
    assert!(
        log.contains("SIGINT") && log.contains("shut down cleanly"),
        "SIGINT not logged as a clean shutdown:\n{log}"
    );
    assert!(
        !socket.exists(),
        "socket {socket:?} left behind after SIGINT"
    );
}

/// Scripts wait for the "listening on" line and may stop the server right away: the signal must
/// already be handled gracefully by then (exit 0, final flush, socket removed).
#[test]
fn signal_right_after_the_ready_line_is_graceful() {
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, MIB as u64);
    for (i, signal) in [libc::SIGTERM, libc::SIGINT]
        .repeat(10)
        .into_iter()
        .enumerate()
    {
        let mut server = Server::on_socket(dir.path(), path_str(&img), &[]);
        let socket = server.socket().expect("unix socket");
        let status = server.signal_and_wait(signal);
        assert!(
            status.success(),
            "attempt {i}: signal {signal} sent right after the ready line: exit {status}:\n{}",
            server.log()
        );
        assert!(
            !socket.exists(),
            "attempt {i}: socket {socket:?} left behind"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Many clients
// ---------------------------------------------------------------------------------------------

#[test]
fn eight_concurrent_clients_on_disjoint_regions() {
    harness::require("qemu-io");
    harness::require("nbdcopy");
    const CLIENTS: usize = 8;
    const REGION: usize = 4 * MIB;
    let dir = harness::scratch();
    let img = dir.path().join("backing.img");
    harness::sparse_file(&img, (CLIENTS * REGION) as u64);
    let server = Server::on_socket(dir.path(), path_str(&img), &[]);

    std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let uri = server.uri.clone();
                s.spawn(move || {
                    let base = i * REGION;
                    let pattern = 0x10 + i as u8;
                    let cmds: Vec<String> = vec![
                        // Many small writes, then a big one, interleaved with the other clients.
                        format!("aio_write -P {pattern} {base} 512k"),
                        format!("aio_write -P {pattern} {} 512k", base + 512 * 1024),
                        "aio_flush".to_string(),
                        format!("write -P {pattern} {} 3M", base + MIB),
                        format!("write -P {} {} 4k", 0xee - i, base + REGION - 4096),
                        "flush".to_string(),
                        format!("read -P {pattern} {base} 1M"),
                        format!("read -P {pattern} {} {}", base + MIB, 3 * MIB - 4096),
                        format!("read -P {} {} 4k", 0xee - i, base + REGION - 4096),
                    ];
                    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
                    qemu_io(&uri, &cmds);
                })
            })
            .collect();
        for h in handles {
            // qemu_io's panic message names the client's commands and output.
            h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
    });

    // Each region has its own client's data, checked through the server and in the file.
    let check = |data: &[u8], what: &str| {
        for i in 0..CLIENTS {
            let base = i * REGION;
            assert_filled(data, base, REGION - 4096, 0x10 + i as u8, what);
            assert_filled(data, base + REGION - 4096, 4096, (0xee - i) as u8, what);
        }
    };
    let out = dir.path().join("out.img");
    harness::run(
        Command::new("nbdcopy")
            .arg("--connections=4")
            .arg(&server.uri)
            .arg(&out),
    );
    check(&fs::read(&out).unwrap(), "export read back with nbdcopy");
    server.stop();
    check(&fs::read(&img).unwrap(), "backing file");
}

//! Damaged cache data as the operator meets it (the hardening issue's reproductions 1 and 2):
//! one flipped byte in the log loses only the record it hit, a flipped byte in a dirty block is
//! never served or written back, and `status`, `stats --json`, `scrub` and `forget-lost` say
//! and do what the README promises.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use flashtier_engine::internals::batch::{BatchHeader, Kind};
use flashtier_engine::read_superblock;
use flashtier_io::BlockDev;
use flashtier_testkit::MemDev;

use crate::harness::*;

const BS: u64 = 4096;

/// A 32 MiB cache over a 64 MiB backing file, in `dir`.
struct Setup {
    cache: String,
    backing: String,
    control: String,
}

impl Setup {
    fn new(dir: &Path) -> Setup {
        let (cache, backing) = (dir.join("cache"), dir.join("backing"));
        sparse_file(&backing, 64 << 20);
        let out = run_any(Command::new(BIN).args([
            "format",
            "--no-probe",
            "--cache",
            path_str(&cache),
            "--backing",
            path_str(&backing),
            "--size",
            "32M",
        ]));
        assert!(out.status.success(), "format failed:\n{}", text(&out));
        Setup {
            cache: path_str(&cache).into(),
            backing: path_str(&backing).into(),
            control: path_str(&dir.join("control.sock")).into(),
        }
    }

    /// Serves it in write-back with the background write-back off (nothing is written back
    /// unless asked).
    fn serve(&self, dir: &Path) -> Server {
        Server::on_socket(
            dir,
            &self.backing,
            &[
                "--cache",
                &self.cache,
                "--control-socket",
                &self.control,
                "--set",
                "writeback_controller=off",
            ],
        )
    }

    /// `flashtier ARGS --control SOCKET`, stdin not a terminal.
    fn ctl(&self, args: &[&str]) -> Output {
        run_any(
            Command::new(BIN)
                .args(args)
                .args(["--control", &self.control])
                .stdin(Stdio::null()),
        )
    }

    fn stats(&self) -> serde_json::Value {
        let out = self.ctl(&["stats", "--json"]);
        assert!(out.status.success(), "stats failed:\n{}", text(&out));
        serde_json::from_slice(&out.stdout).expect("stats --json is JSON")
    }

    /// Flips one byte of the cache file.
    fn flip(&self, offset: u64) {
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.cache)
            .unwrap();
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&dev, &mut b, offset).unwrap();
        b[0] ^= 0x5a;
        std::os::unix::fs::FileExt::write_all_at(&dev, &b, offset).unwrap();
    }

    /// Where the cache file holds the data the newest record writing block `lba` carries.
    fn data_of(&self, lba: u64) -> u64 {
        let image = std::fs::read(&self.cache).unwrap();
        let dev = MemDev::new(image.len() as _);
        dev.write_at(&image, 0, false).unwrap();
        let g = read_superblock(&dev).unwrap().geometry;
        let mut newest: Option<(u64, u64)> = None;
        for slot in 0..g.slot_count() {
            let at = g.slot_offset(slot);
            let Ok(h) = BatchHeader::decode(&image[at as usize..(at + BS) as usize]) else {
                continue;
            };
            let mut data = at + BS;
            for (i, e) in h.entries.iter().enumerate() {
                let seq = h.seq_first + i as u64;
                if e.kind == Kind::Write
                    && (e.lba..e.lba + e.nblocks as u64).contains(&lba)
                    && newest.is_none_or(|(s, _)| seq > s)
                {
                    newest = Some((seq, data + (lba - e.lba) * BS));
                }
                data += e.data_blocks() as u64 * BS;
            }
        }
        newest.expect("no record writes that block").1
    }
}

/// The pattern byte of the `i`th write of reproduction 1 (never 0: the backing store's).
fn pattern(i: u64) -> u64 {
    1 + i % 250
}

/// 200 writes, each flushed, then kill -9, and one byte flipped in the data of the 10th.
/// Before: recovery stopped at that record, 191 flushed writes were gone, and health said `ok`.
/// Now only that block is lost: EIO, listed by `status` with its offset, until `forget-lost`.
#[test]
fn a_flipped_byte_in_the_log_loses_one_block_and_says_so() {
    let dir = Scratch::new();
    let s = Setup::new(dir.path());
    let mut server = s.serve(dir.path());
    let writes: Vec<String> = (0..200)
        .flat_map(|i| {
            [
                format!("write -P {} {} 4k", pattern(i), i * 2 * BS),
                "flush".to_string(),
            ]
        })
        .collect();
    qemu_io(&server.uri, &writes);
    server.signal_and_wait(libc::SIGKILL);
    let damaged = 9 * 2; // the 10th write's block
    s.flip(s.data_of(damaged) + 100);

    let server = s.serve(dir.path());
    let mut failed = Vec::new();
    for i in 0..200 {
        let cmd = format!("read -P {} {} 4k", pattern(i), i * 2 * BS);
        let (ok, out) = try_qemu_io(&server.uri, &[cmd]);
        if !ok {
            assert!(
                out.contains("Input/output error"),
                "write {i} came back wrong, not failed:\n{out}"
            );
            failed.push(i * 2);
        }
    }
    assert_eq!(failed, vec![damaged], "only the damaged block fails");

    let status = text(&s.ctl(&["status"]));
    let health = status
        .lines()
        .find(|l| l.starts_with("health"))
        .unwrap_or_default();
    assert!(health.contains("degraded"), "{status}");
    let offset = damaged * BS;
    assert!(
        status.contains(&format!("offset {offset} (block {damaged})")),
        "status does not list the lost block:\n{status}"
    );
    let st = &s.stats()["status"];
    assert_eq!(st["lost_blocks"], 1, "{st}");
    assert_eq!(st["lost_ranges"], serde_json::json!([[damaged, 1]]), "{st}");

    // Without a terminal and without --yes, nothing is forgotten.
    let out = s.ctl(&["forget-lost", "--all"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("--yes"), "{}", text(&out));
    assert_eq!(s.stats()["status"]["lost_blocks"], 1);

    let range = format!("{offset}+4K");
    let out = s.ctl(&["forget-lost", "--range", &range, "--yes"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("forgot 1 lost block"), "{}", text(&out));
    // The backing store's older data: zeros, never written.
    qemu_io(&server.uri, &[format!("read -P 0 {offset} 4k")]);
    let st = &s.stats()["status"];
    assert_eq!(
        (&st["health"], &st["lost_blocks"]),
        (&"ok".into(), &0.into())
    );
    server.stop();
}

/// 8 MiB written in 1 MiB writes and a clean shutdown; one byte flipped in the cached data of
/// the block at 400 KiB; restart.
fn dirty_block_damaged_after_a_clean_shutdown(dir: &Path) -> (Setup, Server) {
    let s = Setup::new(dir);
    let server = s.serve(dir);
    let writes: Vec<String> = (0..8).map(|i| format!("write -P 0x5a {i}M 1M")).collect();
    qemu_io(&server.uri, &writes);
    server.stop();
    s.flip(s.data_of(100) + 7);
    let server = s.serve(dir);
    (s, server)
}

/// A flipped byte in a dirty block. Before: reads returned it and `flashtier flush` wrote it
/// into the backing store. Now the read fails, the flush writes back everything but that block,
/// and the backing store keeps its older data there.
#[test]
fn a_damaged_dirty_block_is_never_served_or_written_back() {
    let dir = Scratch::new();
    let (s, server) = dirty_block_damaged_after_a_clean_shutdown(dir.path());
    let (ok, out) = try_qemu_io(&server.uri, &["read -v 409600 16"]);
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let out = s.ctl(&["flush"]);
    assert!(out.status.success(), "flush: {}", text(&out));
    server.stop();
    let backing = std::fs::read(&s.backing).unwrap();
    for (i, b) in backing[..8 << 20].chunks(BS as usize).enumerate() {
        let want = if i == 100 { 0 } else { 0x5a };
        assert!(
            b.iter().all(|&x| x == want),
            "backing block {i} holds {:#x}.., not {want:#x}",
            b[0]
        );
    }
}

/// The scrub finds the damaged dirty block before any client reads it, says so, exits 1, and
/// the report carries it.
#[test]
fn the_scrub_finds_a_damaged_dirty_block_first() {
    let dir = Scratch::new();
    let (s, server) = dirty_block_damaged_after_a_clean_shutdown(dir.path());
    let out = s.ctl(&["scrub", "--rate", "0"]);
    assert!(
        !out.status.success(),
        "scrub found nothing:\n{}",
        text(&out)
    );
    assert!(
        text(&out).contains("1 dirty blocks lost") && text(&out).contains("forget-lost"),
        "{}",
        text(&out)
    );
    let r = s.stats();
    assert_eq!(r["status"]["lost_blocks"], 1, "{r}");
    assert_eq!(r["status"]["lost_ranges"], serde_json::json!([[100, 1]]));
    assert_eq!(
        (&r["scrub"]["done"], &r["scrub"]["lost_blocks"]),
        (&true.into(), &1.into())
    );
    assert!(r["status"]["health"]
        .as_str()
        .unwrap()
        .starts_with("degraded"));
    server.stop();
}

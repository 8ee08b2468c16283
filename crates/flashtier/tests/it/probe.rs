//! `flashtier probe`: a scratch directory on the local disk gets a full report and a usable
//! verdict; a device slow to flush is flagged (by `probe` and by `format`'s quick probe); data
//! is never overwritten without --destructive.
//!
//! The slow device is an NBD export served from this test process (a RAM disk whose FLUSH
//! sleeps, as nbdkit 1.32's delay filter cannot delay flushes) through nbdfuse and a loop
//! device, so the probe sees a real block device whose fdatasync pays the delay.

use std::io;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use flashtier_io::{BlockDev, DevInfo, ZeroOpts};
use flashtier_nbd::{Export, ListenAddr, Listener, Server, ServerConfig, ShutdownHandle};
use flashtier_testkit::MemDev;
use serde_json::Value;

use crate::harness::*;

/// What each flush of the emulated device costs: half as much again as the verdict's
/// threshold for unfit (20 ms), so the verdict cannot depend on scheduling noise.
const FLUSH_DELAY: Duration = Duration::from_millis(30);

const SUMMARY_KEYS: [&str; 8] = [
    "fsync_p50_us",
    "fdatasync_p50_us",
    "fdatasync_p99_us",
    "randread_qd1_iops",
    "randread_qd32_iops",
    "randwrite_qd1_iops",
    "randwrite_qd32_iops",
    "seqwrite_mb_s",
];

fn probe_json(args: &[&str]) -> Value {
    let out = run(Command::new(BIN).arg("probe").arg("--json").args(args));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json printed no JSON ({e}):\n{}", text(&out)))
}

#[test]
fn probe_a_local_directory_reports_every_figure_and_draws_the_timeline() {
    let dir = Scratch::new();
    let png = dir.path().join("timeline.png");
    let j = probe_json(&[
        path_str(dir.path()),
        "--seconds",
        "2",
        "--size",
        "128M",
        "--plot",
        path_str(&png),
    ]);
    for key in SUMMARY_KEYS {
        let v = j[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {j:#}"));
        assert!(v > 0.0, "{key} = {v}: {j:#}");
    }
    let verdict = j["verdict"].as_str().expect("verdict");
    assert!(
        ["ok", "warn"].contains(&verdict),
        "a local disk judged {verdict}: {j:#}"
    );
    assert!(j["reasons"].is_array(), "{j:#}");
    assert_eq!(j["sustained"].as_array().map(Vec::len), Some(2), "{j:#}");
    let png = std::fs::read(&png).expect("--plot wrote no file");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["timeline.png"], "the scratch file was not removed");
}

#[test]
fn probe_refuses_data_without_destructive_and_leaves_it_alone() {
    require("mkfs.ext4");
    require("losetup");
    let dir = Scratch::new();
    let file = dir.path().join("precious");
    random_file(&file, 32 << 20, 7);
    let before = std::fs::read(&file).unwrap();
    let out = run_any(Command::new(BIN).arg("probe").arg(&file));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("--destructive"), "{}", text(&out));
    assert!(std::fs::read(&file).unwrap() == before, "the file changed");

    let img = dir.path().join("ext4.img");
    sparse_file(&img, 32 << 20);
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img));
    let image = std::fs::read(&img).unwrap();
    let lo = Loop::attach(&img);
    let out = run_any(Command::new(BIN).args(["probe", &lo.0]));
    assert!(!out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("ext2/3/4") && said.contains("--destructive"),
        "{said}"
    );
    drop(lo);
    assert!(std::fs::read(&img).unwrap() == image, "the image changed");

    let out = run_any(
        Command::new(BIN)
            .arg("probe")
            .arg(dir.path().join("no/such/dir")),
    );
    assert!(!out.status.success(), "{}", text(&out));
}

#[test]
fn a_device_slow_to_flush_is_flagged_by_probe_and_by_format() {
    let dir = Scratch::new();
    let size = 128u64 << 20;
    let served = SlowFlushServer::start(&dir.path().join("slow.sock"), size);
    let fuse_dir = dir.path().join("fuse");
    std::fs::create_dir(&fuse_dir).unwrap();
    let stack = FuseLoop::attach(
        &fuse_dir,
        &served.uri,
        size,
        &dir.path().join("nbdfuse.log"),
    );
    let j = probe_json(&[stack.dev(), "--destructive", "--seconds", "2"]);
    let fdatasync = j["fdatasync_p50_us"].as_f64().expect("fdatasync_p50_us");
    assert!(
        fdatasync >= FLUSH_DELAY.as_micros() as f64,
        "fdatasync p50 {fdatasync} µs on a device whose flush takes {FLUSH_DELAY:?}: {j:#}"
    );
    let summary: Vec<String> = SUMMARY_KEYS
        .iter()
        .map(|k| format!("{k} {}", j[k]))
        .collect();
    eprintln!(
        "slow-flush device: {}; reasons {}",
        summary.join(", "),
        j["reasons"]
    );
    assert_eq!(j["verdict"], "unfit", "{j:#}");
    let reasons: Vec<&str> = j["reasons"]
        .as_array()
        .expect("reasons")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.starts_with("fdatasync p50") && r.contains("synchronous commits/s")),
        "no reason names the flush latency: {reasons:?}"
    );

    let backing = dir.path().join("backing");
    sparse_file(&backing, 64 << 20);
    let out = run(Command::new(BIN).args([
        "format",
        "--cache",
        stack.dev(),
        "--backing",
        path_str(&backing),
        "--force",
    ]));
    let said = text(&out);
    assert!(said.contains("quick probe of the cache device"), "{said}");
    assert!(
        said.contains("flashtier: warning:") && said.contains("fdatasync p50"),
        "format did not warn about the slow flush:\n{said}"
    );
    assert!(said.contains("flashtier: formatted"), "{said}");
    stack.detach();
    served.stop();
}

/// A loop device on a file, detached when dropped.
struct Loop(String);

impl Loop {
    fn attach(file: &Path) -> Loop {
        let dev = run_stdout(Command::new("losetup").args(["--find", "--show"]).arg(file));
        Loop(dev.trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        quiet(Command::new("losetup").arg("-d").arg(&self.0));
    }
}

/// A RAM disk whose every flush (and FUA write) takes [`FLUSH_DELAY`].
struct SlowFlush(MemDev);

impl BlockDev for SlowFlush {
    fn info(&self) -> &DevInfo {
        self.0.info()
    }
    fn describe(&self) -> String {
        "a RAM disk slow to flush".into()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.0.write_at(buf, offset, false)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        std::thread::sleep(FLUSH_DELAY);
        self.0.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.0.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.0.write_zeroes(offset, len, opts)
    }
}

/// [`SlowFlush`] served over NBD on a unix socket from a thread of this process.
struct SlowFlushServer {
    uri: String,
    shutdown: ShutdownHandle,
    thread: Option<JoinHandle<()>>,
}

impl SlowFlushServer {
    fn start(socket: &Path, size: u64) -> SlowFlushServer {
        let dev: Arc<dyn BlockDev> = Arc::new(SlowFlush(MemDev::new(size as usize)));
        let server = Server::new(Export::new("", dev), ServerConfig::default()).expect("server");
        let listener = Listener::bind(&ListenAddr::Unix(socket.to_path_buf())).expect("bind");
        let shutdown = server.shutdown_handle();
        let thread = std::thread::spawn(move || {
            if let Err(e) = server.serve(listener) {
                eprintln!("slow-flush NBD server: {e}");
            }
        });
        SlowFlushServer {
            uri: format!("nbd+unix:///?socket={}", socket.display()),
            shutdown,
            thread: Some(thread),
        }
    }

    fn stop(mut self) {
        self.shutdown.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread panicked");
        }
    }
}

impl Drop for SlowFlushServer {
    fn drop(&mut self) {
        self.shutdown.shutdown();
    }
}

//! Operating a running server from the command line: `status`, `stats` (table, `--json`,
//! `--watch`), `get`/`set` (validation, live effect, `--persist` into the config file and a
//! restart reading it), `mode` (writing dirty data back with progress), `flush` (blocking,
//! `--background`, `--cancel`, over a slow NBD backing store), `reset-stats`, the stats
//! file and its JSON, Prometheus metrics (summaries and histograms) read by the reference Python
//! parser, `config check`,
//! a failing backing store (nbdkit's error filter: degraded, dirty data kept, background
//! write-back retried, EIO on read misses, recovery), watermarks that would cross refused from
//! every source and moved together by one `set`, 100 idle control connections not locking
//! `status` out, a failed cache device exiting 3 ("not closed cleanly") at SIGTERM, and the
//! error when no server answers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use flashtier_control::config::SERVE_KEYS;
use flashtier_engine::PARAMS;
use serde_json::Value;

use crate::harness::*;

const MIB: u64 = 1 << 20;
/// The backing store's size.
const BACKING: u64 = 64 * MIB;

/// A scratch directory with a 64 MiB backing file of random data and a 96 MiB cache for it.
struct Setup {
    dir: Scratch,
    /// The file holding the backing store's data.
    backing: PathBuf,
    /// The backing store as `serve --backing` names it (the file, or an NBD URI serving it).
    backing_spec: String,
    cache: PathBuf,
    control: PathBuf,
    stats_file: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let dir = Scratch::new();
        let backing = dir.path().join("backing");
        random_file(&backing, BACKING as usize, 11);
        let spec = path_str(&backing).to_string();
        Setup::format(dir, backing, spec, "96M")
    }

    /// A cache of `size` (1 MiB segments) in `dir` for the backing store `spec`, whose data is
    /// in the file `backing`.
    fn format(dir: Scratch, backing: PathBuf, spec: String, size: &str) -> Setup {
        let cache = dir.path().join("cache");
        let out = flashtier(&[
            "format",
            "--no-probe",
            "--cache",
            path_str(&cache),
            "--backing",
            &spec,
            "--size",
            size,
            "--segment-size",
            "1M",
        ]);
        assert!(out.status.success(), "format failed:\n{}", text(&out));
        Setup {
            control: dir.path().join("control.sock"),
            stats_file: dir.path().join("stats"),
            backing,
            backing_spec: spec,
            cache,
            dir,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `flashtier serve` with the cache, the control socket and the stats file in the scratch
    /// directory (never the shared defaults under the run directory), and `extra` arguments.
    fn serve(&self, extra: &[&str]) -> Server {
        let mut args = vec![
            "--cache",
            path_str(&self.cache),
            "--control-socket",
            path_str(&self.control),
            "--stats-file",
            path_str(&self.stats_file),
        ];
        args.extend_from_slice(extra);
        Server::on_socket(self.path(), &self.backing_spec, &args)
    }

    /// Runs `flashtier ARGS --control SOCKET`.
    fn ctl(&self, args: &[&str]) -> Output {
        run_any(
            Command::new(BIN)
                .args(args)
                .arg("--control")
                .arg(&self.control),
        )
    }

    /// Runs `flashtier ARGS --control SOCKET`, which must succeed; returns its stdout.
    fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "flashtier {args:?} failed ({}):\n{}",
            out.status,
            text(&out)
        );
        String::from_utf8(out.stdout).expect("UTF-8 output")
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

    /// `flashtier stats --json`, parsed.
    fn report(&self) -> Value {
        let out = self.ctl_ok(&["stats", "--json"]);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("stats --json is not JSON ({e}):\n{out}"))
    }
}

fn flashtier(args: &[&str]) -> Output {
    run_any(Command::new(BIN).args(args))
}

/// `report.counters.NAME`; panics naming the counter if it is missing.
pub(crate) fn counter(report: &Value, name: &str) -> u64 {
    report["counters"][name].as_u64().unwrap_or_else(|| {
        panic!(
            "no counter {name:?} in stats --json's counters: {}",
            report["counters"]
        )
    })
}

/// `report.status.NAME` as a number.
fn status_u64(report: &Value, name: &str) -> u64 {
    report["status"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name:?} in stats --json's status: {}", report["status"]))
}

/// Reads `[start, start + len)` sequentially in 256 KiB requests, one at a time.
fn read_sequentially(uri: &str, start: u64, len: u64) {
    let step = 256 << 10;
    let cmds: Vec<String> = (start..start + len)
        .step_by(step)
        .map(|off| format!("read {off} {step}"))
        .collect();
    qemu_io(uri, &cmds);
}

/// The value of `f(report)` once it stops changing (two reads 150 ms apart agree), for
/// counters that background work (promotion) may still be moving.
fn settled(setup: &Setup, f: impl Fn(&Value) -> Vec<u64>) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = setup.report();
    loop {
        std::thread::sleep(Duration::from_millis(150));
        let now = setup.report();
        if f(&now) == f(&last) || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// nbdkit's file plugin serving `img` on a unix socket in `dir`, with `filters` and plugin or
/// filter `params`; returns the process (killed on drop) and its URI.
fn nbdkit_file(dir: &Path, img: &Path, filters: &[&str], params: &[&str]) -> (KillOnDrop, String) {
    require("nbdkit");
    let sock = dir.join("nbdkit.sock");
    let nbdkit = KillOnDrop(Some(
        Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(filters)
            .arg("file")
            .arg(img)
            .args(params)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start nbdkit"),
    ));
    wait_until(Duration::from_secs(10), "nbdkit's socket", || sock.exists());
    (nbdkit, format!("nbd+unix:///?socket={}", sock.display()))
}

#[test]
fn status_stats_json_and_watch_show_the_running_cache() {
    let setup = Setup::new();
    let server = setup.serve(&[]);
    qemu_io(
        &server.uri,
        &["write -P 0x5a 0 1M", "read 0 2M", "read 0 1M"],
    );

    let status = setup.ctl_ok(&["status"]);
    for what in ["writeback", "dirty"] {
        assert!(
            status.to_lowercase().contains(what),
            "status does not say {what:?}:\n{status}"
        );
    }

    let report = setup.report();
    for key in [
        "status", "job", "counters", "windows", "latency", "wear", "params",
    ] {
        assert!(
            report.get(key).is_some(),
            "stats --json lacks {key:?}: {report}"
        );
    }
    assert_eq!(report["status"]["mode"], "writeback", "{report}");
    assert_eq!(report["status"]["health"], "ok", "{report}");
    let block = status_u64(&report, "block_size");
    assert_eq!(status_u64(&report, "dirty_blocks"), MIB / block, "{report}");
    assert!(
        status_u64(&report, "cached_blocks") >= 2 * MIB / block,
        "{report}"
    );
    // Every slot is cached, unwritten or stale; the 1 MiB write's batch header is stale.
    let capacity = status_u64(&report, "capacity_blocks");
    let (unwritten, stale) = (
        status_u64(&report, "unwritten_blocks"),
        status_u64(&report, "stale_blocks"),
    );
    assert_eq!(
        status_u64(&report, "cached_blocks") + unwritten + stale,
        capacity,
        "{report}"
    );
    assert!(stale >= 1 && unwritten < capacity, "{report}");
    assert!(
        status.contains("% stale"),
        "status lacks the capacity's split:\n{status}"
    );
    assert_eq!(counter(&report, "reads"), 2, "{report}");
    assert_eq!(counter(&report, "writes"), 1, "{report}");
    assert_eq!(counter(&report, "write_blocks"), MIB / block, "{report}");
    // The second MiB was missed once; the first was hit twice (written, then read twice).
    assert_eq!(
        counter(&report, "read_miss_blocks"),
        MIB / block,
        "{report}"
    );
    assert_eq!(
        counter(&report, "read_hit_blocks"),
        2 * MIB / block,
        "{report}"
    );
    for window in ["5min", "hour", "day", "total"] {
        assert_eq!(
            report["windows"][window]["reads"].as_u64(),
            Some(2),
            "window {window}: {}",
            report["windows"]
        );
    }
    // 1 MiB written, 2 MiB read over it: 512 distinct 4 KiB blocks, estimated.
    for window in ["5min", "hour", "day", "total"] {
        let w = &report["working_set"]["windows"][window];
        let blocks = w["blocks"]
            .as_u64()
            .unwrap_or_else(|| panic!("{window}: {report}"));
        assert!(blocks.abs_diff(512) <= 26, "working set {window}: {w}");
        assert_eq!(w["bytes"].as_u64(), Some(blocks * 4096), "{w}");
    }
    // The cache is many times that: "cache 95.00 MiB = 47.5x the hour's".
    assert!(
        status.contains("working set") && status.contains("x the hour's"),
        "status lacks the working set:\n{status}"
    );
    assert_eq!(
        report["latency"]["read"]["count"].as_u64(),
        Some(2),
        "{report}"
    );
    assert_eq!(
        report["latency"]["write"]["count"].as_u64(),
        Some(1),
        "{report}"
    );
    let l = &report["latency"]["read"];
    assert!(
        l["p50_us"].as_f64().unwrap() > 0.0
            && l["p50_us"].as_f64() <= l["p99_us"].as_f64()
            && l["p99_us"].as_f64() <= l["p999_us"].as_f64(),
        "implausible read latency: {l}"
    );
    assert!(report["wear"]["cache_bytes_written"].as_u64().unwrap() >= MIB);
    for p in PARAMS {
        assert_eq!(
            report["params"][p.name], p.default,
            "stats --json's params: {}",
            report["params"]
        );
    }

    let table = setup.ctl_ok(&["stats"]);
    for what in [
        "reads",
        "read_hit_blocks",
        "promoted_blocks",
        "5min",
        "hour",
        "day",
        "total",
        "p50",
        "p99",
        "p99.9",
    ] {
        assert!(table.contains(what), "stats table lacks {what:?}:\n{table}");
    }
    assert!(
        table.contains("66.7"),
        "stats table lacks the read hit % 66.7:\n{table}"
    );

    // --watch refreshes every second until interrupted.
    let mut watch = Command::new(BIN)
        .args(["stats", "--watch", "--control", path_str(&setup.control)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start stats --watch");
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        watch.try_wait().unwrap().is_none(),
        "stats --watch exited by itself"
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(watch.id() as i32, libc::SIGINT) };
    if wait_or_kill(&mut watch, Duration::from_secs(5)).is_none() {
        panic!("stats --watch did not stop on SIGINT");
    }
    let out = watch.wait_with_output().unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    let refreshes = shown.matches("read_hit_blocks").count();
    assert!(
        refreshes >= 2,
        "stats --watch showed {refreshes} tables in 2.5 s:\n{shown}"
    );
    server.stop();
}

#[test]
fn get_and_set_validate_and_apply_live() {
    let setup = Setup::new();
    let server = setup.serve(&[]);

    let all = setup.ctl_ok(&["get", "--all"]);
    for p in PARAMS {
        let line = all
            .lines()
            .find(|l| l.split_whitespace().next() == Some(p.name))
            .unwrap_or_else(|| panic!("get --all lacks {}:\n{all}", p.name));
        assert!(
            line.contains(p.default) && line.contains(p.allowed),
            "get --all's {} line lacks its value/default {:?} or range {:?}: {line}",
            p.name,
            p.default,
            p.allowed
        );
        assert_eq!(setup.ctl_ok(&["get", p.name]).trim(), p.default);
    }
    assert_eq!(setup.ctl_ok(&["get", "mode"]).trim(), "writeback");

    // Bad values and names: exit 1, the allowed range named, nothing changed.
    for (name, value, says) in [
        ("promotion_nhit", "0", "1..=255"),
        ("promotion_nhit", "256", "1..=255"),
        ("sequential_cutoff_read_kib", "4M", "0..=1048576"),
        ("sequential_cutoff_read_kib", "-1", "0..=1048576"),
        ("promotion", "sometimes", "always | nhit | auto"),
        ("reclaim_policy", "random", "fifo | lru"),
        ("sequential_cutoff", "1", "sequential_cutoff_read_kib"),
        ("mode", "fast", "writethrough"),
    ] {
        let err = setup.ctl_fails(&["set", name, value]);
        assert!(
            err.contains(says),
            "set {name} {value} was refused without naming {says:?}: {err}"
        );
    }
    assert_eq!(setup.ctl_ok(&["get", "promotion_nhit"]).trim(), "2");
    assert_eq!(
        setup.ctl_ok(&["get", "sequential_cutoff_read_kib"]).trim(),
        "4096"
    );
    let err = setup.ctl_fails(&["get", "nonsense"]);
    assert!(err.contains("promotion_nhit"), "unclear: {err}");

    // Every parameter takes a new value live.
    for (name, value) in [
        ("reclaim_policy", "fifo"),
        ("promotion_nhit", "3"),
        ("promotion_window_secs", "60"),
        ("sequential_cutoff_write_kib", "8192"),
    ] {
        let said = setup.ctl_ok(&["set", name, value]);
        assert_eq!(said.trim(), format!("{name} = {value}"));
        assert_eq!(setup.ctl_ok(&["get", name]).trim(), value);
    }
    let report = setup.report();
    assert_eq!(report["params"]["promotion_nhit"], "3", "{report}");
    setup.ctl_ok(&["set", "reclaim_policy", "lru"]);
    setup.ctl_ok(&["set", "sequential_cutoff_write_kib", "0"]);

    // The read cutoff, live: a 16 MiB sequential read with a 1 MiB cutoff promotes little of
    // what it reads (the rest bypasses the cache); with the cutoff off it promotes everything.
    let block = status_u64(&setup.report(), "block_size");
    let region_blocks = 16 * MIB / block;
    let moving = |r: &Value| {
        vec![
            counter(r, "promoted_blocks"),
            counter(r, "bypassed_read_blocks"),
        ]
    };
    setup.ctl_ok(&["set", "sequential_cutoff_read_kib", "1024"]);
    let before = setup.report();
    read_sequentially(&server.uri, 0, 16 * MIB);
    let after = settled(&setup, moving);
    let promoted = counter(&after, "promoted_blocks") - counter(&before, "promoted_blocks");
    let bypassed =
        counter(&after, "bypassed_read_blocks") - counter(&before, "bypassed_read_blocks");
    assert!(
        promoted < region_blocks / 2 && bypassed >= region_blocks / 2,
        "with a 1 MiB read cutoff, a 16 MiB sequential read ({region_blocks} blocks) promoted \
         {promoted} blocks and bypassed {bypassed}"
    );

    setup.ctl_ok(&["set", "sequential_cutoff_read_kib", "0"]);
    let before = setup.report();
    read_sequentially(&server.uri, 32 * MIB, 16 * MIB);
    let after = settled(&setup, moving);
    let promoted = counter(&after, "promoted_blocks") - counter(&before, "promoted_blocks");
    let bypassed =
        counter(&after, "bypassed_read_blocks") - counter(&before, "bypassed_read_blocks");
    assert!(
        promoted == region_blocks && bypassed == 0,
        "with the read cutoff off, a 16 MiB sequential read ({region_blocks} blocks) promoted \
         {promoted} blocks and bypassed {bypassed}"
    );
    server.stop();
}

#[test]
fn set_persist_writes_the_config_file_and_a_restart_reads_it() {
    let setup = Setup::new();
    let config = setup.path().join("flashtier.toml");
    let socket = setup.path().join("nbd.sock");
    std::fs::write(
        &config,
        format!(
            "# Our cache.\n\
             [serve]\n\
             backing = \"{}\"\n\
             cache = \"{}\"   # the fast one\n\
             listen = \"{}\"\n\
             control_socket = \"{}\"\n\
             stats_file = \"{}\"\n\
             \n\
             [policy]\n\
             # Remember misses for a minute.\n\
             promotion_window_secs = 60\n",
            path_str(&setup.backing),
            path_str(&setup.cache),
            path_str(&socket),
            path_str(&setup.control),
            path_str(&setup.stats_file),
        ),
    )
    .unwrap();
    let server = Server::start(&["--config", path_str(&config)]);
    assert_eq!(
        setup.ctl_ok(&["get", "promotion_window_secs"]).trim(),
        "60",
        "serve --config did not apply [policy]"
    );
    assert_eq!(
        setup
            .ctl_ok(&["set", "promotion", "nhit", "--persist"])
            .trim(),
        "promotion = nhit"
    );
    setup.ctl_ok(&["set", "promotion_window_secs", "120", "--persist"]);
    setup.ctl_ok(&["set", "promotion_nhit", "4"]); // not persisted
    let err = setup.ctl_fails(&["set", "promotion_nhit", "0", "--persist"]);
    assert!(err.contains("1..=255"), "{err}");
    let saved = std::fs::read_to_string(&config).unwrap();
    for kept in [
        "# Our cache.\n",
        "\"   # the fast one\n",
        "# Remember misses for a minute.\npromotion_window_secs = 120\n",
        "promotion = \"nhit\"\n",
    ] {
        assert!(
            saved.contains(kept),
            "set --persist lost {kept:?}:\n{saved}"
        );
    }
    assert!(!saved.contains("promotion_nhit"), "{saved}");
    server.stop();

    let server = Server::start(&["--config", path_str(&config)]);
    assert_eq!(setup.ctl_ok(&["get", "promotion"]).trim(), "nhit");
    assert_eq!(
        setup.ctl_ok(&["get", "promotion_window_secs"]).trim(),
        "120"
    );
    assert_eq!(setup.ctl_ok(&["get", "promotion_nhit"]).trim(), "2");
    server.stop();

    // Flags override the file, `--set` its [policy] too.
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--mode",
        "writethrough",
        "--set",
        "promotion_window_secs=600",
    ]);
    assert_eq!(setup.ctl_ok(&["get", "mode"]).trim(), "writethrough");
    assert_eq!(
        setup.ctl_ok(&["get", "promotion_window_secs"]).trim(),
        "600"
    );
    assert_eq!(setup.ctl_ok(&["get", "promotion"]).trim(), "nhit");
    server.stop();
    let out = flashtier(&[
        "serve",
        "--config",
        path_str(&config),
        "--set",
        "promotion_nhit=0",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1..=255"),
        "a bad --set must name the allowed range: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Without --config there is nowhere to persist to.
    let server = setup.serve(&[]);
    let err = setup.ctl_fails(&["set", "promotion", "nhit", "--persist"]);
    assert!(err.contains("--config"), "unclear refusal: {err}");
    server.stop();

    // A bad value in the file: serve refuses to start, naming the file and the key.
    std::fs::write(
        &config,
        saved.replace("promotion_window_secs = 120", "promotion_window_secs = 0"),
    )
    .unwrap();
    let out = flashtier(&["serve", "--config", path_str(&config)]);
    assert!(
        !out.status.success(),
        "serve took a bad config:\n{}",
        text(&out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("flashtier.toml")
            && err.contains("promotion_window_secs")
            && err.contains("1..=86400"),
        "unclear refusal of a bad config: {err}"
    );
}

/// Runs `flashtier ARGS`, expected to refuse and exit; a server that starts instead is stopped
/// after 20 s (exit 124), failing the caller's check rather than hanging the test.
fn refused(args: &[&str]) -> Output {
    run_any(Command::new("timeout").arg("20").arg(BIN).args(args))
}

/// Watermarks that would cross are refused wherever they come from (`serve --set`, the config
/// file's `[policy]`, `config check`, `flashtier set`), in any order, naming both values; a
/// pair set in one command moves both, and persists both.
#[test]
fn crossed_watermarks_are_refused_everywhere_and_a_pair_moves_together() {
    let setup = Setup::new();
    let both = "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (10)";
    let low = "writeback_dirty_low_pct=80";
    let high = "writeback_dirty_high_pct=10";
    for sets in [[low, high], [high, low]] {
        let out = refused(&[
            "serve",
            "--backing",
            path_str(&setup.backing),
            "--cache",
            path_str(&setup.cache),
            "--control-socket",
            path_str(&setup.control),
            "--stats-file",
            path_str(&setup.stats_file),
            "--listen",
            path_str(&setup.path().join("nbd.sock")),
            "--set",
            sets[0],
            "--set",
            sets[1],
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(1) && err.contains(both) && err.contains("--set"),
            "serve --set {sets:?}:\n{}",
            text(&out)
        );
    }
    let config = setup.path().join("flashtier.toml");
    for policy in [
        "writeback_dirty_low_pct = 80\nwriteback_dirty_high_pct = 10\n",
        "writeback_dirty_high_pct = 10\nwriteback_dirty_low_pct = 80\n",
    ] {
        std::fs::write(&config, format!("[policy]\n{policy}")).unwrap();
        for cmd in [
            &["config", "check", path_str(&config)][..],
            &[
                "serve",
                "--config",
                path_str(&config),
                "--backing",
                path_str(&setup.backing),
                "--cache",
                path_str(&setup.cache),
            ][..],
        ] {
            let out = refused(cmd);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.code() == Some(1) && err.contains(both) && err.contains(":3:"),
                "{cmd:?} with {policy:?}:\n{}",
                text(&out)
            );
        }
    }
    // The file's [policy] and --set together: each fine alone, crossed together.
    std::fs::write(&config, "[policy]\nwriteback_dirty_low_pct = 60\n").unwrap();
    let out = refused(&[
        "serve",
        "--config",
        path_str(&config),
        "--backing",
        path_str(&setup.backing),
        "--cache",
        path_str(&setup.cache),
        "--set",
        "writeback_dirty_high_pct=55",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1)
            && err.contains(
                "writeback_dirty_low_pct (60) must be below writeback_dirty_high_pct (55)"
            ),
        "{}",
        text(&out)
    );

    // Live: one at a time, a crossing value is refused naming both and the way out.
    std::fs::write(
        &config,
        format!(
            "[serve]\nbacking = \"{}\"\ncache = \"{}\"\nlisten = \"{}\"\ncontrol_socket = \"{}\"\n\
             stats_file = \"{}\"\n",
            path_str(&setup.backing),
            path_str(&setup.cache),
            path_str(&setup.path().join("nbd.sock")),
            path_str(&setup.control),
            path_str(&setup.stats_file),
        ),
    )
    .unwrap();
    let server = Server::start(&["--config", path_str(&config)]);
    let err = setup.ctl_fails(&["set", "writeback_dirty_low_pct", "80"]);
    assert!(
        err.contains(
            "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (70, the \
             current value)"
        ) && err.contains("flashtier set writeback_dirty_high_pct 90 writeback_dirty_low_pct 80"),
        "{err}"
    );
    let err = setup.ctl_fails(&["set", "writeback_dirty_high_pct", "10"]);
    assert!(
        err.contains(
            "writeback_dirty_low_pct (50, the current value) must be below \
                      writeback_dirty_high_pct (10)"
        ),
        "{err}"
    );
    let err = setup.ctl_fails(&[
        "set",
        "writeback_dirty_low_pct",
        "80",
        "writeback_dirty_high_pct",
        "10",
        "--persist",
    ]);
    assert!(err.contains(both), "{err}");
    assert_eq!(
        setup.ctl_ok(&["get", "writeback_dirty_low_pct"]).trim(),
        "50"
    );
    assert_eq!(
        setup.ctl_ok(&["get", "writeback_dirty_high_pct"]).trim(),
        "70"
    );
    assert!(!std::fs::read_to_string(&config)
        .unwrap()
        .contains("writeback"));
    // Both in one command: applied and persisted together.
    let said = setup.ctl_ok(&[
        "set",
        "writeback_dirty_low_pct",
        "80",
        "writeback_dirty_high_pct",
        "90",
        "--persist",
    ]);
    assert_eq!(
        said,
        "writeback_dirty_low_pct = 80\nwriteback_dirty_high_pct = 90\n"
    );
    assert_eq!(
        setup.ctl_ok(&["get", "writeback_dirty_low_pct"]).trim(),
        "80"
    );
    server.stop();
    let server = Server::start(&["--config", path_str(&config)]);
    assert_eq!(
        setup.ctl_ok(&["get", "writeback_dirty_low_pct"]).trim(),
        "80"
    );
    assert_eq!(
        setup.ctl_ok(&["get", "writeback_dirty_high_pct"]).trim(),
        "90"
    );
    server.stop();
}

#[test]
fn config_check_accepts_the_example_and_explains_what_is_wrong() {
    let dir = Scratch::new();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../flashtier.example.toml");
    let out = flashtier(&["config", "check", path_str(&example)]);
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with(&format!("{}: ok\n", path_str(&example))),
        "{said}"
    );
    for p in PARAMS {
        assert!(
            said.contains(p.name),
            "config check does not show {}:\n{said}",
            p.name
        );
    }

    let file = dir.path().join("f.toml");
    std::fs::write(
        &file,
        "[serve]\nbacking = \"/dev/sdb\"\nthreads = 8\n[policy]\npromotion = \"nhit\"\n",
    )
    .unwrap();
    let out = flashtier(&["config", "check", path_str(&file)]);
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    for what in [
        "\"/dev/sdb\"",
        "= 8",
        "= nhit",
        "(default: 256)",
        "(default: 4096)",
    ] {
        assert!(
            said.contains(what),
            "config check does not show {what:?}:\n{said}"
        );
    }

    for (content, says) in [
        (
            "[serve]\nbacking = \"/x\"\nthreads = 0\n",
            &[":3:", "threads", "1..=1024"][..],
        ),
        (
            "[policy]\npromotion_nhit = 300\n",
            &[":2:", "promotion_nhit", "1..=255"][..],
        ),
        (
            "[serve]\nthread = 4\n",
            &["thread", "unknown", "threads"][..],
        ),
        ("[polcy]\n", &["[polcy]", "[policy]"][..]),
        ("[serve\n", &["not valid TOML"][..]),
    ] {
        std::fs::write(&file, content).unwrap();
        let out = flashtier(&["config", "check", path_str(&file)]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{content:?} passed:\n{}",
            text(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(path_str(&file)), "{content:?}: {err}");
        for s in says {
            assert!(err.contains(s), "{content:?}: {err:?} does not say {s:?}");
        }
    }
    let out = flashtier(&["config", "check", "/nonexistent/f.toml"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/f.toml"));
}

/// Every `[serve]` key is a `flashtier serve` flag with the default and range the config file
/// documents, so the file and the command line cannot drift apart.
#[test]
fn config_keys_match_serve_flags() {
    let help = String::from_utf8(run(Command::new(BIN).args(["serve", "--help"])).stdout).unwrap();
    for k in SERVE_KEYS {
        let flag = format!("--{}", k.name.replace('_', "-"));
        let at = help
            .find(&format!("      {flag}"))
            .unwrap_or_else(|| panic!("`serve --help` has no {flag} for [serve] {}", k.name));
        let section = &help[at + flag.len() + 6..];
        let section = &section[..section.find("\n      --").unwrap_or(section.len())];
        if k.default.parse::<u64>().is_ok() {
            assert!(
                section.contains(&format!("[default: {}]", k.default)),
                "{flag}'s default differs from the config file's {}:\n{section}",
                k.default
            );
        }
        if k.allowed.contains("..=") {
            let max: u64 = k.allowed.rsplit("..=").next().unwrap().parse().unwrap();
            let out = flashtier(&["serve", &flag, &(max + 1).to_string()]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.code() == Some(2) && err.contains(k.allowed),
                "serve {flag} {} was not refused with the config file's range {}: {err}",
                max + 1,
                k.allowed
            );
        }
    }
}

#[test]
fn mode_switch_writes_dirty_data_back_with_progress() {
    let setup = Setup::new();
    let server = setup.serve(&[]);
    qemu_io(&server.uri, &["write -P 0xc3 0 8M"]);
    let report = setup.report();
    let block = status_u64(&report, "block_size");
    assert_eq!(status_u64(&report, "dirty_blocks"), 8 * MIB / block);

    let err = setup.ctl_fails(&["mode", "fastest"]);
    assert!(err.contains("writethrough"), "{err}");

    let out = setup.ctl(&["mode", "writethrough"]);
    assert!(
        out.status.success(),
        "mode writethrough failed:\n{}",
        text(&out)
    );
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(
        progress.contains("dirty") && progress.contains("writethrough"),
        "mode showed no progress on stderr:\n{}",
        text(&out)
    );
    let report = setup.report();
    assert_eq!(report["status"]["mode"], "writethrough", "{report}");
    assert_eq!(status_u64(&report, "dirty_blocks"), 0, "{report}");
    assert_eq!(report["job"]["done"], true, "{report}");
    assert_eq!(report["job"]["dirty_blocks_left"], 0, "{report}");
    assert!(report["job"]["error"].is_null(), "{report}");
    assert!(
        counter(&report, "cleaned_blocks") >= 8 * MIB / block,
        "{report}"
    );
    let status = setup.ctl_ok(&["status"]);
    assert!(status.contains("writethrough"), "{status}");
    // Written back: the backing file alone has the data.
    let backing = std::fs::read(&setup.backing).unwrap();
    assert!(
        backing[..8 * MIB as usize].iter().all(|&b| b == 0xc3),
        "the backing store lacks what was written back"
    );

    // The server keeps serving in the new mode; back to write-back without waiting.
    qemu_io(&server.uri, &["write -P 0x3c 0 1M"]);
    assert_eq!(status_u64(&setup.report(), "dirty_blocks"), 0);
    setup.ctl_ok(&["mode", "writeback", "--no-wait"]);
    wait_until(Duration::from_secs(10), "mode writeback", || {
        setup.report()["status"]["mode"] == "writeback"
    });
    server.stop();
}

/// Blocks dirtied by [`flush_writes_back_in_the_foreground_background_and_can_be_cancelled`]:
/// one 4 KiB block every 64 KiB, so none coalesce and each is its own slow backing write.
const FLUSH_BLOCKS: u64 = 200;
const FLUSH_STRIDE: u64 = 64 << 10;

#[test]
fn flush_writes_back_in_the_foreground_background_and_can_be_cancelled() {
    require("nbdkit");
    // The backing store: a file behind nbdkit, one request at a time, 10 ms per write, so
    // writing the 200 dirty blocks back takes about 2 s.
    let dir = Scratch::new();
    let img = dir.path().join("slow.img");
    sparse_file(&img, FLUSH_BLOCKS * FLUSH_STRIDE);
    let (_nbdkit, uri) = nbdkit_file(
        dir.path(),
        &img,
        &["--filter=noparallel", "--filter=delay"],
        &["serialize=all-requests", "wdelay=10ms"],
    );
    let setup = Setup::format(dir, img, uri, "32M");
    let server = setup.serve(&[]);
    let pattern = |i: u64| 1 + (i % 250);
    let writes: Vec<String> = (0..FLUSH_BLOCKS)
        .map(|i| format!("write -P {} {} 4k", pattern(i), i * FLUSH_STRIDE))
        .collect();
    qemu_io(&server.uri, &writes);
    let dirty = |r: &Value| status_u64(r, "dirty_blocks");
    assert_eq!(dirty(&setup.report()), FLUSH_BLOCKS);

    let err = setup.ctl_fails(&["flush", "--cancel"]);
    assert!(err.contains("no flush is running"), "{err}");

    // In the background: returns at once, status shows the progress.
    let started = Instant::now();
    setup.ctl_ok(&["flush", "--background"]);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "--background waited"
    );
    let status = setup.ctl_ok(&["status"]);
    assert!(
        status.contains("flush") && status.contains("dirty blocks left"),
        "status shows no flush in progress:\n{status}"
    );
    let err = setup.ctl_fails(&["flush"]);
    assert!(err.contains("a flush is in progress"), "{err}");
    // Some progress, then cancel: it stops; what is left stays dirty.
    wait_until(Duration::from_secs(10), "flush progress", || {
        let j = &setup.report()["job"];
        j["dirty_blocks_left"].as_u64().unwrap() < FLUSH_BLOCKS - 10
    });
    let out = setup.ctl_ok(&["flush", "--cancel"]);
    assert!(out.contains("flush cancelled"), "{out}");
    let report = setup.report();
    let left = dirty(&report);
    assert!(left > 0 && left < FLUSH_BLOCKS, "{report}");
    assert_eq!(report["job"]["kind"], "flush", "{report}");
    assert_eq!(report["job"]["done"], true, "{report}");
    assert_eq!(report["job"]["cancelled"], true, "{report}");
    assert_eq!(report["job"]["dirty_blocks_left"], left, "{report}");
    let status = setup.ctl_ok(&["status"]);
    assert!(status.contains("flush cancelled"), "{status}");

    // In the foreground: a progress bar, then everything is on the backing store.
    let out = setup.ctl(&["flush"]);
    assert!(out.status.success(), "flush failed:\n{}", text(&out));
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(
        progress.contains("dirty left to write back") && progress.contains("/s, ETA"),
        "flush showed no progress on stderr:\n{}",
        text(&out)
    );
    let report = setup.report();
    assert_eq!(dirty(&report), 0, "{report}");
    assert_eq!(report["job"]["cancelled"], false, "{report}");
    assert_eq!(report["job"]["dirty_blocks_left"], 0, "{report}");
    assert!(report["job"]["error"].is_null(), "{report}");
    assert!(setup.ctl_ok(&["status"]).contains("last: flush, done"));
    let data = std::fs::read(&setup.backing).unwrap();
    for i in 0..FLUSH_BLOCKS {
        let at = (i * FLUSH_STRIDE) as usize;
        assert!(
            data[at..at + 4096].iter().all(|&b| b as u64 == pattern(i)),
            "block {i} is not on the backing store after flush"
        );
    }
    server.stop();
}

/// Blocks written in the backing-faults test, 64 KiB apart.
const FAULT_BLOCKS: u64 = 64;
const FAULT_STRIDE: u64 = 64 << 10;

#[test]
fn a_failing_backing_store_degrades_the_volume_keeps_dirty_data_and_recovers() {
    // nbdkit's error filter fails every read, write, zero or trim while its trigger file exists.
    let dir = Scratch::new();
    let img = dir.path().join("backing.img");
    random_file(
        &img,
        (4 * MIB) as usize + (FAULT_BLOCKS * FAULT_STRIDE) as usize,
        23,
    );
    let triggers = dir.path().to_path_buf();
    let trigger = |op: &str| triggers.join(format!("fail-{op}"));
    let params: Vec<String> = ["pread", "pwrite", "zero", "trim"]
        .iter()
        .flat_map(|op| {
            let file = match *op {
                "zero" => trigger("pwrite"),
                _ => trigger(op),
            };
            [
                format!("error-{op}-rate=100%"),
                format!("error-{op}-file={}", file.display()),
            ]
        })
        .collect();
    let params: Vec<&str> = params.iter().map(String::as_str).collect();
    let (_nbdkit, uri) = nbdkit_file(dir.path(), &img, &["--filter=error"], &params);
    let fail = |op: &str| std::fs::write(trigger(op), b"").unwrap();
    let heal = |op: &str| std::fs::remove_file(trigger(op)).unwrap();
    let setup = Setup::format(dir, img.clone(), uri, "32M");
    let mut server = setup.serve(&[]);
    let health = |r: &Value| r["status"]["health"].as_str().unwrap().to_string();
    let base = 4 * MIB;
    let pattern = |i: u64| 1 + (i % 250);
    let writes: Vec<String> = (0..FAULT_BLOCKS)
        .map(|i| format!("write -P {} {} 4k", pattern(i), base + i * FAULT_STRIDE))
        .collect();
    let reads: Vec<String> = (0..FAULT_BLOCKS)
        .map(|i| format!("read -P {} {} 4k", pattern(i), base + i * FAULT_STRIDE))
        .collect();
    qemu_io(&server.uri, &writes);
    assert_eq!(status_u64(&setup.report(), "dirty_blocks"), FAULT_BLOCKS);
    assert_eq!(health(&setup.report()), "ok");

    // A trim the backing store refuses reaches the client and degrades the volume.
    fail("trim");
    let (ok, out) = try_qemu_io(&server.uri, &["discard 0 1M"]);
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let report = setup.report();
    assert!(
        health(&report).starts_with("degraded: backing store trim failed"),
        "{report}"
    );
    heal("trim");

    // Writes fail: the flush fails, clearly; the volume is degraded; the dirty data stays and
    // reads back; the server keeps serving.
    fail("pwrite");
    let backing_errors = counter(&setup.report(), "backing_errors");
    let err = setup.ctl_fails(&["flush"]);
    assert!(err.contains("Input/output error"), "{err}");
    let report = setup.report();
    assert!(
        health(&report).starts_with("degraded: backing store write failed"),
        "{report}"
    );
    assert!(
        counter(&report, "backing_errors") > backing_errors,
        "{report}"
    );
    assert_eq!(
        status_u64(&report, "dirty_blocks"),
        FAULT_BLOCKS,
        "{report}"
    );
    let status = setup.ctl_ok(&["status"]);
    assert!(status.contains("degraded"), "{status}");
    qemu_io(&server.uri, &reads);
    assert!(server.is_running(), "the server died:\n{}", server.log());

    // A read miss the backing store fails reaches the client as EIO; cached blocks still read.
    fail("pread");
    let (ok, out) = try_qemu_io(&server.uri, &["read 0 64k"]);
    assert!(!ok && out.contains("Input/output error"), "{out}");
    qemu_io(&server.uri, &reads);
    heal("pread");

    // Background write-back (here: whenever the backing store is idle) retries with backoff
    // while writes fail, and keeps every dirty block.
    setup.ctl_ok(&["set", "writeback_idle_delay_ms", "1"]);
    wait_until(
        Duration::from_secs(30),
        "background write-back retries",
        || {
            let r = setup.report();
            counter(&r, "writeback_retries") >= 2 && r["status"]["writeback"]["state"] == "retrying"
        },
    );
    let report = setup.report();
    assert_eq!(
        status_u64(&report, "dirty_blocks"),
        FAULT_BLOCKS,
        "{report}"
    );
    assert!(
        health(&report).contains("write-back attempts failed in a row"),
        "{report}"
    );
    qemu_io(&server.uri, &reads);

    // The backing store heals: the cleaner's next retry writes everything back, and the volume
    // is ok again.
    heal("pwrite");
    wait_until(Duration::from_secs(30), "the retried write-back", || {
        status_u64(&setup.report(), "dirty_blocks") == 0
    });
    setup.ctl_ok(&["flush"]);
    let report = setup.report();
    assert_eq!(health(&report), "ok", "{report}");
    assert_eq!(status_u64(&report, "dirty_blocks"), 0, "{report}");
    let data = std::fs::read(&img).unwrap();
    for i in 0..FAULT_BLOCKS {
        let at = (base + i * FAULT_STRIDE) as usize;
        assert!(
            data[at..at + 4096].iter().all(|&b| b as u64 == pattern(i)),
            "block {i} is not on the backing store after the write-back"
        );
    }
    qemu_io(&server.uri, &["read 0 64k"]);
    server.stop();
}

#[test]
fn reset_stats_zeroes_the_counters_and_the_cache_keeps_working() {
    let setup = Setup::new();
    let server = setup.serve(&[]);
    qemu_io(&server.uri, &["write -P 0x11 0 1M", "read -P 0x11 0 1M"]);
    let report = setup.report();
    assert!(counter(&report, "reads") > 0 && counter(&report, "writes") > 0);
    setup.ctl_ok(&["reset-stats"]);
    let report = setup.report();
    for name in [
        "reads",
        "writes",
        "read_hit_blocks",
        "write_blocks",
        "read_miss_blocks",
    ] {
        assert_eq!(
            counter(&report, name),
            0,
            "{name} after reset-stats: {report}"
        );
        assert_eq!(
            report["windows"]["total"][name].as_u64(),
            Some(0),
            "window total {name} after reset-stats: {}",
            report["windows"]
        );
    }
    assert_eq!(report["latency"]["read"]["count"].as_u64().unwrap_or(0), 0);
    // The cache itself is untouched: its data is still there and served as hits.
    assert!(status_u64(&report, "dirty_blocks") > 0, "{report}");
    qemu_io(&server.uri, &["read -P 0x11 0 1M"]);
    let report = setup.report();
    let block = status_u64(&report, "block_size");
    assert_eq!(counter(&report, "reads"), 1, "{report}");
    assert_eq!(counter(&report, "read_hit_blocks"), MIB / block, "{report}");
    assert_eq!(
        report["latency"]["read"]["count"].as_u64(),
        Some(1),
        "{report}"
    );
    server.stop();
}

/// Fetches `url` and parses it with prometheus_client's parser (the reference Python
/// implementation of the text format); returns the Content-Type and one object per sample.
fn scrape(url: &str) -> (String, Vec<Value>) {
    const SCRIPT: &str = r#"
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
resp = urllib.request.urlopen(sys.argv[1], timeout=10)
body = resp.read().decode("utf-8")
samples = []
for fam in text_string_to_metric_families(body):
    for s in fam.samples:
        samples.append({"family": fam.name, "type": fam.type, "help": fam.documentation,
                        "name": s.name, "labels": s.labels, "value": s.value})
print(json.dumps({"content_type": resp.headers.get("Content-Type"), "samples": samples}))
"#;
    let python = "/usr/bin/python3";
    assert!(
        Path::new(python).exists(),
        "/usr/bin/python3 is missing: run ./test.sh, which installs python3-prometheus-client"
    );
    let out = run_any(Command::new(python).args(["-c", SCRIPT, url]));
    assert!(
        out.status.success(),
        "parsing {url} with prometheus_client failed (python3-prometheus-client is installed by \
         ./test.sh):\n{}",
        text(&out)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["content_type"].as_str().unwrap_or("").to_string(),
        v["samples"].as_array().unwrap().clone(),
    )
}

#[test]
fn prometheus_metrics_parse_and_match_stats_json() {
    let setup = Setup::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = setup.serve(&["--metrics-listen", &format!(":{port}")]);
    qemu_io(&server.uri, &["write -P 0x22 0 2M", "read 0 4M", "flush"]);
    let before = setup.report();
    let (content_type, samples) = scrape(&format!("http://127.0.0.1:{port}/metrics"));
    let after = setup.report();
    assert!(
        content_type.starts_with("text/plain") && content_type.contains("version=0.0.4"),
        "Content-Type {content_type:?}"
    );
    let sample = |name: &str| {
        samples
            .iter()
            .find(|s| s["name"] == name && s["labels"].as_object().is_some_and(|l| l.is_empty()))
    };
    // Every counter, as `flashtier_<name>_total` of a counter family with help text, between
    // the values stats --json showed just before and just after.
    let counters = after["counters"].as_object().unwrap();
    assert!(counters.len() >= 20, "{counters:?}");
    for (name, _) in counters {
        let metric = format!("flashtier_{name}_total");
        let s = sample(&metric).unwrap_or_else(|| panic!("no {metric} in the metrics"));
        assert_eq!(s["type"], "counter", "{s}");
        assert!(
            !s["help"].as_str().unwrap_or("").is_empty(),
            "{metric} has no HELP"
        );
        let v = s["value"].as_f64().unwrap();
        let (lo, hi) = (counter(&before, name) as f64, counter(&after, name) as f64);
        assert!(
            lo <= v && v <= hi,
            "{metric} = {v}, but stats --json said {lo} before and {hi} after"
        );
    }
    assert!(sample("flashtier_reads_total").unwrap()["value"].as_f64() >= Some(1.0));
    // Gauges: the cache's state.
    for name in [
        "dirty_blocks",
        "cached_blocks",
        "unwritten_blocks",
        "stale_blocks",
    ] {
        let metric = format!("flashtier_{name}");
        let s = sample(&metric).unwrap_or_else(|| panic!("no gauge {metric}"));
        assert_eq!(s["type"], "gauge", "{s}");
        assert_eq!(
            s["value"].as_f64(),
            Some(status_u64(&after, name) as f64),
            "{metric}"
        );
    }
    // The working set: a gauge per window, as stats --json has it.
    for window in ["5min", "hour", "day", "total"] {
        let s = samples
            .iter()
            .find(|s| s["name"] == "flashtier_working_set_bytes" && s["labels"]["window"] == window)
            .unwrap_or_else(|| panic!("no flashtier_working_set_bytes{{window={window:?}}}"));
        assert_eq!(s["type"], "gauge", "{s}");
        assert_eq!(
            s["value"].as_f64(),
            after["working_set"]["windows"][window]["bytes"].as_f64(),
            "{s}"
        );
    }
    // Live parameters: one info-style gauge per parameter, its value as a label.
    for (name, value) in after["params"].as_object().unwrap() {
        assert!(
            samples.iter().any(|s| s["name"] == "flashtier_param"
                && s["labels"]["name"] == *name
                && s["labels"]["value"] == *value
                && s["value"] == 1.0),
            "no flashtier_param{{name={name},value={value}}} 1 in the metrics"
        );
    }
    // Latency: a summary per operation with p50/p99/p99.9 quantiles and a count matching.
    let summaries: Vec<&Value> = samples.iter().filter(|s| s["type"] == "summary").collect();
    for op in ["read", "write", "flush"] {
        let mine: Vec<&&Value> = summaries
            .iter()
            .filter(|s| s["labels"].as_object().unwrap().values().any(|v| v == op))
            .collect();
        for q in ["0.5", "0.99", "0.999"] {
            assert!(
                mine.iter().any(|s| s["labels"]["quantile"] == q),
                "no {q} quantile for {op} among the summaries: {summaries:?}"
            );
        }
        let count = mine
            .iter()
            .find(|s| s["name"].as_str().unwrap().ends_with("_count"))
            .unwrap_or_else(|| panic!("no _count for {op}: {mine:?}"));
        let expected = after["latency"][op]["count"].as_u64().unwrap();
        assert!(expected >= 1);
        assert_eq!(count["value"].as_f64(), Some(expected as f64), "{op} count");
        // The same requests as a histogram, for quantiles over a window: cumulative buckets up
        // to +Inf, which holds them all.
        let buckets: Vec<&Value> = samples
            .iter()
            .filter(|s| {
                s["name"] == "flashtier_request_duration_seconds_bucket" && s["labels"]["op"] == op
            })
            .collect();
        assert_eq!(buckets.len(), 19, "{op}: {buckets:?}");
        assert_eq!(buckets[0]["type"], "histogram");
        let counts: Vec<f64> = buckets
            .iter()
            .map(|s| s["value"].as_f64().unwrap())
            .collect();
        assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{op}: {counts:?}");
        let inf = buckets
            .iter()
            .find(|s| s["labels"]["le"] == "+Inf")
            .unwrap();
        assert_eq!(
            inf["value"].as_f64(),
            Some(expected as f64),
            "{op} +Inf bucket"
        );
    }
    // Anything else is not found.
    let out = run_any(Command::new("/usr/bin/python3").args([
        "-c",
        "import sys, urllib.request, urllib.error\n\
         try:\n  urllib.request.urlopen(sys.argv[1], timeout=10)\n\
         except urllib.error.HTTPError as e:\n  print(e.code)\n",
        &format!("http://127.0.0.1:{port}/nothing"),
    ]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "404",
        "{}",
        text(&out)
    );
    server.stop();
}

/// Parses the stats text file's `name value` lines.
fn stats_text(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(char::is_whitespace)?;
            Some((k.to_string(), v.trim().to_string()))
        })
        .collect()
}

#[test]
fn stats_file_is_refreshed_and_agrees_with_its_json_and_stats_json() {
    let setup = Setup::new();
    let server = setup.serve(&[]);
    qemu_io(&server.uri, &["write -P 0x33 0 1M", "read 0 3M"]);
    let json_path = PathBuf::from(format!("{}.json", path_str(&setup.stats_file)));
    // The next refresh after the workload.
    let workload_done = std::time::SystemTime::now();
    wait_until(Duration::from_secs(5), "a stats file refresh", || {
        std::fs::metadata(&json_path)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t > workload_done)
    });
    let (text_file, json) = loop {
        // The text and the JSON of one refresh: read until the text did not change around the
        // read of the JSON.
        let a = std::fs::read_to_string(&setup.stats_file).unwrap();
        let j = std::fs::read_to_string(&json_path).unwrap();
        let b = std::fs::read_to_string(&setup.stats_file).unwrap();
        if a == b {
            break (a, j);
        }
    };
    let json: Value = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("{json_path:?} is not JSON ({e}):\n{json}"));
    let lines = stats_text(&text_file);
    let counters = json["counters"].as_object().unwrap();
    for (name, value) in counters {
        let line = lines
            .iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("the stats file lacks {name}:\n{text_file}"));
        assert_eq!(
            line.1,
            value.to_string(),
            "{name} in the stats file and its JSON:\n{text_file}"
        );
    }
    // Against stats --json, with the workload over: the I/O counters are equal.
    let now = setup.report();
    for name in [
        "reads",
        "writes",
        "read_hit_blocks",
        "read_miss_blocks",
        "write_blocks",
    ] {
        assert_eq!(
            json["counters"][name], now["counters"][name],
            "{name}: stats file JSON vs stats --json"
        );
    }
    assert_eq!(
        json["status"]["dirty_blocks"],
        now["status"]["dirty_blocks"]
    );
    assert!(counter(&now, "reads") >= 1);

    // It keeps being rewritten every second.
    let stamp = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let (t0, j0) = (stamp(&setup.stats_file), stamp(&json_path));
    std::thread::sleep(Duration::from_millis(1300));
    assert!(
        stamp(&setup.stats_file) > t0 && stamp(&json_path) > j0,
        "the stats file was not rewritten within 1.3 s"
    );
    server.stop();
}

/// 100 control connections that do nothing (half silent, half trickling a request line that
/// never ends) cannot lock the operator out: each `flashtier status` gets in within a second or
/// two, evicting the connection idle longest, and the server stops cleanly afterwards.
#[test]
fn idle_control_connections_never_lock_the_operator_out() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let setup = Setup::new();
    let server = setup.serve(&[]);
    let mut idle: Vec<UnixStream> = (0..100)
        .map(|i| {
            let mut s = UnixStream::connect(&setup.control).expect("connect");
            if i % 2 == 1 {
                s.write_all(b"{\"op\":\"rep").unwrap();
            }
            s
        })
        .collect();
    for round in 0..5 {
        let started = Instant::now();
        let out = setup.ctl(&["status"]);
        let took = started.elapsed();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("health"),
            "round {round}: status was locked out by idle connections:\n{}",
            text(&out)
        );
        assert!(
            took < Duration::from_secs(2),
            "round {round}: status took {took:?}"
        );
    }
    // Beyond the 64 slots, each new connection evicted an idle one, which was told why.
    let told = idle
        .iter_mut()
        .filter(|s| {
            let s: &UnixStream = s;
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut said = String::new();
            let _ = (&mut &*s).read_to_string(&mut said);
            said.contains("idle longest")
        })
        .count();
    assert!(told >= 36, "only {told} evicted connections were told why");
    drop(idle);
    server.stop();
}

/// A tmpfs of a given size mounted on a directory, unmounted when dropped: a file system that
/// fills up on demand.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir));
        Tmpfs(dir.to_path_buf())
    }

    fn resize(&self, size: &str) {
        run(Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if !quiet(Command::new("umount").arg(&self.0)) {
            quiet(Command::new("umount").arg("-l").arg(&self.0));
        }
    }
}

/// A cache device that fails (its file system full: a 32 MiB sparse cache file on a 2 MiB
/// tmpfs) is not "closed cleanly" at SIGTERM: the server exits 3 saying the cache was not
/// closed cleanly and why. Given the space back, the next start recovers every write that was
/// flushed before the failure. The same when only the final checkpoint finds no space. Then
/// it closes cleanly (exit 0).
#[test]
fn a_failed_cache_device_is_never_reported_closed_cleanly() {
    let dir = Scratch::new();
    let backing = dir.path().join("backing");
    random_file(&backing, BACKING as usize, 23);
    let template = dir.path().join("cache");
    let out = flashtier(&[
        "format",
        "--no-probe",
        "--cache",
        path_str(&template),
        "--backing",
        path_str(&backing),
        "--size",
        "32M",
        "--segment-size",
        "1M",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let small = Tmpfs::mount(&dir.path().join("small"), "2m");
    let cache = small.0.join("cache");
    run(Command::new("cp")
        .arg("--sparse=always")
        .arg(&template)
        .arg(&cache));
    let control = dir.path().join("control.sock");
    let stats = dir.path().join("stats");
    let args = [
        "--cache",
        path_str(&cache),
        "--control-socket",
        path_str(&control),
        "--stats-file",
        path_str(&stats),
    ];
    let health = || {
        let out = run_any(
            Command::new(BIN)
                .args(["status", "--control"])
                .arg(&control),
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("health"))
            .unwrap_or("")
            .to_string()
    };
    let mut server = Server::on_socket(dir.path(), path_str(&backing), &args);
    // 1 MiB writes, each flushed, until the device fails; remember which were flushed.
    let mut flushed = Vec::new();
    for i in 0..16u64 {
        let (ok, _) = try_qemu_io(
            &server.uri,
            &[
                format!("write -P {} {} 1M", 0x40 + i, i * MIB),
                "flush".into(),
            ],
        );
        if ok {
            flushed.push(i);
        }
        if health().contains("failed") {
            break;
        }
    }
    assert!(
        health().contains("failed"),
        "the cache device never failed: {}",
        health()
    );
    assert!(!flushed.is_empty(), "not even the first write fitted");
    let status = server.signal_and_wait(libc::SIGTERM);
    let log = server.log();
    assert_eq!(
        status.code(),
        Some(3),
        "exit status after SIGTERM with a failed cache:\n{log}"
    );
    assert!(
        log.contains("NOT closed cleanly") && log.contains("its device failed while serving"),
        "{log}"
    );
    assert!(
        !log.contains("cache closed cleanly"),
        "a failed cache was reported closed cleanly:\n{log}"
    );
    drop(server);

    // The space back: the log is recovered, every flushed write is there.
    small.resize("64m");
    let server = Server::on_socket(dir.path(), path_str(&backing), &args);
    assert!(
        server.log().contains("recovered after an unclean shutdown"),
        "{}",
        server.log()
    );
    let reads: Vec<String> = flushed
        .iter()
        .map(|i| format!("read -P {} {} 1M", 0x40 + i, i * MIB))
        .collect();
    qemu_io(&server.uri, &reads);

    // Now the device fails only at the end, when the final checkpoint needs space that is gone.
    qemu_io(&server.uri, &["write -P 0x33 40M 1M", "flush"]);
    let filler = small.0.join("filler");
    let _ = run_any(
        Command::new("dd")
            .args(["if=/dev/zero", "bs=1M"])
            .arg(format!("of={}", filler.display())),
    );
    let mut server = server;
    let status = server.signal_and_wait(libc::SIGTERM);
    let log = server.log();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(
        log.contains("NOT closed cleanly") && log.contains("writing its final checkpoint failed"),
        "{log}"
    );
    assert!(!log.contains("cache closed cleanly"), "{log}");
    drop(server);
    std::fs::remove_file(&filler).unwrap();
    let server = Server::on_socket(dir.path(), path_str(&backing), &args);
    qemu_io(&server.uri, &["read -P 0x33 40M 1M"]);
    qemu_io(&server.uri, &reads);
    server.stop();
}

#[test]
fn commands_without_a_server_say_which_socket_did_not_answer() {
    let dir = Scratch::new();
    let socket = dir.path().join("nobody.sock");
    for args in [
        &["status"][..],
        &["stats", "--json"][..],
        &["get", "promotion"][..],
        &["set", "promotion", "nhit"][..],
        &["mode", "writethrough"][..],
        &["flush"][..],
        &["flush", "--cancel"][..],
        &["reset-stats"][..],
    ] {
        let out = run_any(Command::new(BIN).args(args).arg("--control").arg(&socket));
        assert_eq!(out.status.code(), Some(1), "{args:?}:\n{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(path_str(&socket)),
            "{args:?} does not name the socket: {err}"
        );
    }
    // The environment variable names the socket too.
    let out = run_any(
        Command::new(BIN)
            .arg("status")
            .env("FLASHTIER_CONTROL", &socket),
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains(path_str(&socket)));
}

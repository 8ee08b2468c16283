//! `serve --trace` and `flashtier trace`, against fio: what fio did is what the trace holds, and
//! the trace converted to an iolog makes fio do it again.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::process::Command;

use flashtier_control::trace::{TraceOp, TraceReader};

use crate::harness::{self, path_str, run, run_any, run_stdout, text, Server, BIN};

/// Every request of a trace but flushes (fio's nbd engine may add one at close) and lost
/// records, as a multiset of (op, offset, length).
fn requests(trace: &Path) -> HashMap<(TraceOp, u64, u32), u32> {
    let r = TraceReader::new(BufReader::new(File::open(trace).unwrap())).unwrap();
    let mut m = HashMap::new();
    for rec in r {
        let rec = rec.unwrap();
        if !matches!(rec.op, TraceOp::Flush | TraceOp::Lost) {
            *m.entry((rec.op, rec.offset, rec.len)).or_insert(0) += 1;
        }
    }
    m
}

fn flashtier(args: &[&str]) -> String {
    run_stdout(Command::new(BIN).args(args))
}

/// Runs `flashtier ARGS`, which must fail; returns what it printed.
fn flashtier_fails(args: &[&str]) -> String {
    let out = run_any(Command::new(BIN).args(args));
    assert!(!out.status.success(), "flashtier {args:?} succeeded");
    text(&out)
}

#[test]
fn a_trace_holds_what_fio_did_and_its_iolog_makes_fio_do_it_again() {
    harness::require("fio");
    let dir = harness::scratch();
    let d = dir.path();
    let (img, img2) = (d.join("a.img"), d.join("b.img"));
    harness::sparse_file(&img, 64 << 20);
    harness::sparse_file(&img2, 64 << 20);
    let (trace_a, trace_b) = (d.join("a.trace"), d.join("b.trace"));
    let control = d.join("a.ctl");
    let server = Server::start(&[
        "--backing",
        path_str(&img),
        "--listen",
        path_str(&d.join("a.sock")),
        "--control-socket",
        path_str(&control),
        "--trace",
        path_str(&trace_a),
    ]);
    // fio's own record of what it did, to hold the trace against.
    let fio_log = d.join("fio.iolog");
    let out = run_any(Command::new("fio").args([
        "--name=t",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri),
        "--rw=randrw",
        "--bs=4k",
        "--bsrange=4k-64k",
        "--size=64M",
        "--iodepth=8",
        &format!("--write_iolog={}", fio_log.display()),
        "--output=/dev/null",
    ]));
    assert!(out.status.success(), "fio failed:\n{}", text(&out));
    let status = flashtier(&["status", "--control", path_str(&control)]);
    assert!(
        status.contains(&format!("recording to {}", trace_a.display())),
        "{status}"
    );
    // A second trace while one runs is refused, and names the running one.
    let second = d.join("second.trace");
    let refused = flashtier_fails(&[
        "trace",
        "start",
        path_str(&second),
        "--control",
        path_str(&control),
    ]);
    assert!(refused.contains("already being recorded"), "{refused}");
    // Naming another file stops nothing; naming this one stops it.
    let other = d.join("other.trace");
    let refused = flashtier_fails(&[
        "trace",
        "stop",
        path_str(&other),
        "--control",
        path_str(&control),
    ]);
    assert!(refused.contains("nothing was stopped"), "{refused}");
    let stopped = flashtier(&[
        "trace",
        "stop",
        path_str(&trace_a),
        "--control",
        path_str(&control),
    ]);
    server.stop();

    let fio_trace = d.join("fio.trace");
    flashtier(&[
        "trace",
        "from-fio",
        path_str(&fio_log),
        path_str(&fio_trace),
    ]);
    let recorded = requests(&trace_a);
    let total = recorded.values().sum::<u32>();
    assert!(total > 1000, "fio made only {total} requests");
    assert!(
        stopped.contains(&format!("stopped: {total} requests")),
        "{stopped}"
    );
    assert!(
        recorded == requests(&fio_trace),
        "the trace differs from fio's own iolog"
    );
    let show = flashtier(&["trace", "show", path_str(&trace_a)]);
    assert!(show.contains("a trace of a 64.00 MiB export"), "{show}");

    // Replayed by fio from the converted iolog into a second server (with a cache this time),
    // which records it in turn: the same requests.
    let iolog = d.join("a.iolog");
    flashtier(&["trace", "to-fio", path_str(&trace_a), path_str(&iolog)]);
    let cache = d.join("cache.img");
    harness::sparse_file(&cache, 64 << 20);
    run(&mut harness::format_command(&cache, path_str(&img2)));
    let replay_server = Server::start(&[
        "--backing",
        path_str(&img2),
        "--cache",
        path_str(&cache),
        "--listen",
        path_str(&d.join("b.sock")),
        "--trace",
        path_str(&trace_b),
    ]);
    let out = run_any(Command::new("fio").args([
        "--name=replay",
        "--ioengine=nbd",
        &format!("--uri={}", replay_server.uri),
        &format!("--read_iolog={}", iolog.display()),
        "--replay_no_stall=1",
        "--output=/dev/null",
    ]));
    assert!(out.status.success(), "fio replay failed:\n{}", text(&out));
    // Stopping the server closes the trace whole.
    replay_server.stop();
    assert!(
        requests(&trace_b) == recorded,
        "the replay's trace differs from the recorded one"
    );
    // The converters refuse to overwrite.
    let again = flashtier_fails(&["trace", "to-fio", path_str(&trace_a), path_str(&iolog)]);
    assert!(again.contains("cannot create"), "{again}");
}

/// fio's 4K zipf 0.9 random 70/30 read/write job over `server`, with `args` (size, count, ...);
/// it must succeed.
fn fio_zipf(server: &Server, args: &[&str]) {
    let uri = format!("--uri={}", server.uri);
    let out = run_any(
        Command::new("fio")
            .args([
                "--name=zipf",
                "--ioengine=nbd",
                &uri,
                "--rw=randrw",
                "--rwmixread=70",
            ])
            .args([
                "--bs=4k",
                "--random_distribution=zipf:0.9",
                "--output=/dev/null",
            ])
            .args(args),
    );
    assert!(out.status.success(), "fio failed:\n{}", text(&out));
}

/// `flashtier advise` on a trace the server recorded under fio: the reads it counts are the
/// trace's, the curves fall with size, the recommendation lies within them, and the plot is a PNG.
#[test]
fn advise_reads_a_recorded_trace_and_plots_its_curves() {
    harness::require("fio");
    let dir = harness::scratch();
    let d = dir.path();
    let img = d.join("a.img");
    harness::sparse_file(&img, 64 << 20);
    let trace = d.join("a.trace");
    let server = Server::start(&[
        "--backing",
        path_str(&img),
        "--listen",
        path_str(&d.join("a.sock")),
        "--trace",
        path_str(&trace),
    ]);
    fio_zipf(&server, &["--size=64m", "--number_ios=20000"]);
    server.stop();
    let reads: u64 = requests(&trace)
        .iter()
        .filter(|((op, _, _), _)| *op == TraceOp::Read)
        .map(|(&(_, _, len), &n)| n as u64 * (len as u64 / 4096))
        .sum();
    let plot = d.join("curves.png");
    let json: serde_json::Value = serde_json::from_str(&flashtier(&[
        "advise",
        path_str(&trace),
        "--json",
        "--plot",
        path_str(&plot),
    ]))
    .unwrap();
    assert_eq!(json["reads"].as_u64(), Some(reads), "{json}");
    assert_eq!(
        json["sample_rate"].as_f64(),
        Some(1.0),
        "a small trace is analysed whole"
    );
    let curve = json["curve"].as_array().unwrap();
    assert!(curve.len() >= 2, "{json}");
    let lru: Vec<f64> = curve
        .iter()
        .map(|p| p["lru_miss_ratio"].as_f64().unwrap())
        .collect();
    assert!(
        lru.windows(2).all(|w| w[1] <= w[0]),
        "LRU misses less with more cache: {lru:?}"
    );
    // The floor: no cache misses less than the clairvoyant one, at any size.
    for p in curve {
        let opt = p["opt_miss_ratio"].as_f64().unwrap();
        let best = ["lru_miss_ratio", "fifo_miss_ratio", "s3fifo_miss_ratio"]
            .iter()
            .map(|k| p[k].as_f64().unwrap())
            .fold(f64::MAX, f64::min);
        assert!(opt > 0.0 && opt <= best + 1e-12, "{p}");
    }
    let ws = json["working_set_bytes"].as_u64().unwrap();
    let rec = json["recommended_bytes"].as_u64().unwrap();
    assert!(rec > 0 && rec <= ws && ws <= 64 << 20, "{json}");
    assert!(std::fs::read(&plot)
        .unwrap()
        .starts_with(b"\x89PNG\r\n\x1a\n"));
    // The table says the same; a trace that is not one is refused.
    let table = flashtier(&["advise", path_str(&trace), "--sizes", "1M,8M"]);
    assert!(
        table.contains("S3-FIFO") && table.contains("OPT") && table.contains("recommended:"),
        "{table}"
    );
    let bad = flashtier_fails(&["advise", path_str(&img)]);
    assert!(bad.contains("cannot read"), "{bad}");
}

/// `advise --engine` replays a trace through a real cache rather than a model of one: on the
/// trace a server with the same cache recorded, at the pace it recorded it, it misses about as
/// often as that server did (measured in five runs, two beside two busy loops: the server
/// 38.6–39.0%, the replay within 0.33 points of it each time; exact LRU 34.1%, so a replay that
/// fell back to LRU would fail), and keeps about as much of the cache live.
#[test]
fn advise_engine_misses_like_the_server_that_recorded_the_trace() {
    harness::require("fio");
    let dir = harness::scratch();
    let d = dir.path();
    let (img, cache, trace, control) = (
        d.join("b.img"),
        d.join("c.img"),
        d.join("b.trace"),
        d.join("ctl.sock"),
    );
    harness::sparse_file(&img, 128 << 20);
    harness::format_cache(&cache, &img, "32M");
    let server = harness::serve(
        d,
        &img,
        &control,
        &["--cache", path_str(&cache), "--trace", path_str(&trace)],
    );
    fio_zipf(
        &server,
        &[
            "--size=128m",
            "--number_ios=60000",
            "--iodepth=16",
            "--norandommap",
            "--randrepeat=1",
        ],
    );
    let report = harness::report(&control);
    server.stop();
    let counter = |name| crate::control::counter(&report, name) as f64;
    let status = |name: &str| report["status"][name].as_f64().unwrap();
    let served_miss =
        counter("read_miss_blocks") / (counter("read_miss_blocks") + counter("read_hit_blocks"));
    let served_live = status("cached_blocks") / status("capacity_blocks");
    let capacity = (status("capacity_blocks") as u64 * 4096).to_string();
    let json: serde_json::Value = serde_json::from_str(&flashtier(&[
        "advise",
        path_str(&trace),
        "--sample",
        "1",
        "--json",
        "--engine",
        "--segment-size",
        "1M",
        "--sizes",
        &capacity,
        "--scratch-dir",
        path_str(d),
    ]))
    .unwrap();
    let row = &json["curve"][0];
    let replayed_miss = row["flashtier_miss_ratio"].as_f64().unwrap();
    let replayed_live = row["flashtier_live_share"].as_f64().unwrap();
    assert!(
        (replayed_miss - served_miss).abs() <= 0.02,
        "the server missed {served_miss:.4}, the replay {replayed_miss:.4}: {row}"
    );
    assert!(
        (replayed_live - served_live).abs() <= 0.15,
        "the server ended {served_live:.3} live, the replay {replayed_live:.3}: {row}"
    );
    // The scratch cache is gone.
    let left: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("flashtier-advise-")
        })
        .collect();
    assert!(left.is_empty(), "scratch files left behind");
}

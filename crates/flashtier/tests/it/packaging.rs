//! What an installed flashtier relies on, checked from the source tree: `--version` names the
//! commit and `status` the running server's version.

use std::path::Path;
use std::process::Command;

use crate::harness::*;

/// What `flashtier --version` prints after the name.
fn version() -> String {
    let out = run_stdout(Command::new(BIN).arg("--version"));
    out.trim()
        .strip_prefix("flashtier ")
        .unwrap_or_else(|| panic!("--version printed {out:?}"))
        .to_string()
}

/// A pass-through server on a 16 MiB file in `dir`, its control socket and stats file there.
fn serve_in(dir: &Path, env: &[(&str, &str)]) -> Server {
    let backing = dir.join("backing");
    sparse_file(&backing, 16 << 20);
    let socket = dir.join("nbd.sock");
    let control = dir.join("control.sock");
    let stats = dir.join("stats");
    Server::start_with_env(
        &[
            "--backing",
            path_str(&backing),
            "--listen",
            path_str(&socket),
            "--control-socket",
            path_str(&control),
            "--stats-file",
            path_str(&stats),
        ],
        env,
    )
}

#[test]
fn version_names_the_commit_and_status_shows_the_servers() {
    let v = version();
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".to_string(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        });
    let expected = format!("{} (git {commit}, built ", env!("CARGO_PKG_VERSION"));
    assert!(
        v.starts_with(&expected),
        "--version: {v:?}, expected {expected:?}…"
    );
    let date = v[expected.len()..].trim_end_matches(')');
    assert!(
        date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-',
        "build date {date:?} in {v:?}"
    );

    let dir = Scratch::new();
    let server = serve_in(dir.path(), &[]);
    let control = dir.path().join("control.sock");
    let status = run_stdout(
        Command::new(BIN)
            .args(["status", "--control"])
            .arg(&control),
    );
    let line = status
        .lines()
        .find(|l| l.starts_with("version"))
        .unwrap_or_else(|| panic!("no version line in `flashtier status`:\n{status}"));
    assert_eq!(line["version".len()..].trim(), v, "{status}");
    let json = run_stdout(
        Command::new(BIN)
            .args(["stats", "--json", "--control"])
            .arg(&control),
    );
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["status"]["version"], v.as_str());
    server.stop();
}

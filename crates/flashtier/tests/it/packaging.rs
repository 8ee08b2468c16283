//! What an installed flashtier relies on, checked from the source tree: `--version` names the
//! commit and `status` the running server's version; `serve` tells systemd READY=1 only once
//! its socket accepts connections and STOPPING=1 at SIGTERM (`Type=notify`).

use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

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

/// Waits up to 20 s for a datagram on `sock`.
fn receive(sock: &UnixDatagram, what: &str) -> String {
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = sock
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no {what} notification within 20 s: {e}"));
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn serve_notifies_systemd_ready_once_listening_and_stopping_at_sigterm() {
    let dir = Scratch::new();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let mut server = serve_in(dir.path(), &[("NOTIFY_SOCKET", path_str(&notify_path))]);
    let ready = receive(&notify, "READY=1");
    assert!(
        ready.lines().any(|l| l == "READY=1"),
        "first notification {ready:?}"
    );
    // Sent only once the socket accepts connections: a client connecting now gets in.
    UnixStream::connect(server.socket().unwrap())
        .unwrap_or_else(|e| panic!("READY=1 sent, but the NBD socket refuses: {e}"));
    qemu_io(&server.uri, &["write -P 0x11 0 64k", "read -P 0x11 0 64k"]);

    let status = server.signal_and_wait(libc::SIGTERM);
    let stopping = receive(&notify, "STOPPING=1");
    assert!(
        stopping.lines().any(|l| l == "STOPPING=1"),
        "after SIGTERM: {stopping:?}"
    );
    assert!(status.success(), "{status}:\n{}", server.log());
    notify.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    assert!(
        notify.recv(&mut buf).is_err(),
        "more notifications than READY and STOPPING: {:?}",
        String::from_utf8_lossy(&buf)
    );
}

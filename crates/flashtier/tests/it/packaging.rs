//! What an installed flashtier relies on, checked from the source tree: `--version` names the
//! commit and `status` the running server's version; `serve` tells systemd READY=1 only once
//! its socket accepts connections and STOPPING=1 at SIGTERM (`Type=notify`); the man pages and
//! completions generated from the clap definition cover every subcommand and option.

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

/// The subcommands `flashtier --help` lists (clap's own `help` aside).
fn subcommands() -> Vec<String> {
    let help = run_stdout(Command::new(BIN).arg("--help"));
    let commands = help
        .split("Commands:\n")
        .nth(1)
        .expect("a Commands: section")
        .split("\n\n")
        .next()
        .unwrap();
    commands
        .lines()
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every `--long` option `flashtier ARGS --help` lists.
fn long_options(args: &[&str]) -> Vec<String> {
    let help = run_stdout(Command::new(BIN).args(args).arg("--help"));
    let mut opts: Vec<String> = help
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .split(['=', '[', '<', ','])
                .next()
                .unwrap()
                .to_string()
        })
        .filter(|w| !w.is_empty())
        .collect();
    opts.sort();
    opts.dedup();
    opts
}

#[test]
fn man_pages_and_completions_cover_every_subcommand_and_option() {
    require("man");
    let dir = Scratch::new();
    let man = dir.path().join("man");
    run(Command::new(BIN).arg("generate").arg("man").arg(&man));
    let subs = subcommands();
    assert!(subs.len() >= 15, "{subs:?}");
    assert!(
        !subs.contains(&"generate".to_string()),
        "generate is hidden"
    );
    let render = |page: &str| {
        let path = man.join(format!("{page}.1"));
        assert!(path.exists(), "no man page {path:?}");
        run_stdout(
            Command::new("man")
                .arg("-l")
                .arg(&path)
                .env("MANWIDTH", "200")
                .env_remove("MAN_KEEP_FORMATTING"),
        )
    };
    let top = render("flashtier");
    for sub in &subs {
        assert!(
            top.contains(&format!("flashtier-{sub}(1)")),
            "{sub} in flashtier(1)"
        );
        let page = render(&format!("flashtier-{sub}"));
        // Every option --help lists is on the page (both come from the same definition).
        for opt in long_options(&[sub]) {
            assert!(
                page.contains(&format!("--{opt}")),
                "--{opt} of `flashtier {sub} --help` missing from flashtier-{sub}(1)"
            );
        }
    }
    render("flashtier-config-check");
    let serve = render("flashtier-serve");
    assert!(
        serve.contains("Exit status after SIGINT/SIGTERM"),
        "{serve}"
    );
    assert!(!man.join("flashtier-help.1").exists());
    assert!(!man.join("flashtier-generate.1").exists());

    let comp = dir.path().join("completions");
    run(Command::new(BIN)
        .arg("generate")
        .arg("completions")
        .arg(&comp));
    // bash: `flashtier se<TAB>` offers serve and set; `flashtier serve --end<TAB>` the option.
    let complete = |words: &str| {
        run_stdout(Command::new("bash").arg("-c").arg(format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
             COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}; \
             _flashtier flashtier \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; \
             echo \"${{COMPREPLY[*]}}\"",
            path_str(&comp.join("flashtier.bash"))
        )))
    };
    assert_eq!(complete("flashtier se").trim(), "serve set");
    assert_eq!(complete("flashtier serve --endu").trim(), "--endurance-tbw");
    assert!(!complete("flashtier ge").contains("generate"));
    for (shell, file) in [("zsh", "_flashtier"), ("fish", "flashtier.fish")] {
        require(shell);
        run(Command::new(shell).arg("-n").arg(comp.join(file)));
    }
    let fish = std::fs::read_to_string(comp.join("flashtier.fish")).unwrap();
    assert!(
        fish.contains("-l endurance-tbw"),
        "fish completes serve's options"
    );
}

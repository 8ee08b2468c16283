//! What an installed flashtier relies on, checked from the source tree: `--version` names the
//! commit and `status` the running server's version; `serve` tells systemd READY=1 only once
//! its socket accepts connections and STOPPING=1 at SIGTERM (`Type=notify`); the man pages and
//! completions generated from the clap definition cover every subcommand and option; the
//! alert rules load and fire in promtool, and the Grafana dashboard and the rules use only
//! metric names a running server exports. The Debian package itself is built, installed and
//! removed by scripts/test-package.sh.

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

/// packaging/prometheus/, packaging/grafana/ in the source tree.
fn packaging(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../packaging")
        .join(path)
}

#[test]
fn alert_rules_load_and_fire_in_promtool() {
    require("promtool");
    let rules = packaging("prometheus/flashtier-rules.yml");
    let out = run_stdout(
        Command::new("promtool")
            .arg("check")
            .arg("rules")
            .arg(&rules),
    );
    assert!(out.contains("SUCCESS: 6 rules found"), "{out}");
    // Each alert fires on the series it is meant for, and only then.
    run(Command::new("promtool")
        .args(["test", "rules", "flashtier-rules.test.yml"])
        .current_dir(packaging("prometheus")));
}

/// The metric names a PromQL expression reads: identifiers that are not functions, keywords,
/// label names (in `{}` or a `by (...)`-style list), strings, numbers or durations.
fn metric_names(expr: &str) -> Vec<String> {
    // Keywords, and aggregation operators (not followed by their parenthesis when a
    // `by (...)` comes first).
    const KEYWORDS: &str = "by without on ignoring group_left group_right and or unless bool \
        offset inf nan sum min max avg group stddev stdvar count count_values bottomk topk";
    // After these, a parenthesised list of label names.
    const LABEL_LISTS: &str = "by without on ignoring group_left group_right";
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let (mut i, mut braces, mut brackets) = (0, 0, 0);
    // Inside the parentheses after `by`, `on`, ...: label names.
    let mut label_list = false;
    let mut last_word = String::new();
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            '{' => braces += 1,
            '}' => braces -= 1,
            '[' => brackets += 1,
            ']' => brackets -= 1,
            '(' if LABEL_LISTS.split(' ').any(|k| k == last_word) => label_list = true,
            ')' if label_list => label_list = false,
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let after_digit = start > 0 && chars[start - 1].is_ascii_digit();
                let is_call = chars[i..].iter().find(|c| !c.is_whitespace()) == Some(&'(');
                if braces == 0
                    && brackets == 0
                    && !label_list
                    && !after_digit
                    && !is_call
                    && !KEYWORDS
                        .split_whitespace()
                        .any(|k| k == word.to_lowercase())
                {
                    names.push(word.clone());
                }
                last_word = word;
                continue;
            }
            c if !c.is_whitespace() => last_word.clear(),
            _ => {}
        }
        i += 1;
    }
    names
}

#[test]
fn promql_metric_names_are_found_and_nothing_else() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (instance, op, le) (rate(a_bucket{op=~\"read|x\"}[5m]))) > 0.05"
        ),
        ["a_bucket"]
    );
    assert_eq!(
        metric_names(
            "100 * b / c > on(instance, job) d{name=\"x_y\"} and e offset 5m unless f == 1e6"
        ),
        ["b", "c", "d", "e", "f"]
    );
    assert_eq!(metric_names("increase(g_total[10m]) > 0"), ["g_total"]);
}

/// Every `expr` string in a JSON document, and what `label_values(METRIC, LABEL)` template
/// queries name.
fn json_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    ("query" | "definition", serde_json::Value::String(s))
                        if s.starts_with("label_values(") =>
                    {
                        let inner = &s["label_values(".len()..];
                        out.push(inner.split([',', ')']).next().unwrap().trim().to_string());
                    }
                    _ => json_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| json_exprs(v, out)),
        _ => {}
    }
}

/// Every metric name a `GET /metrics` of `port` declares (`# TYPE`) or has a sample of.
fn exported_metric_names(port: u16) -> std::collections::BTreeSet<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let (head, text) = body.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{body}");
    text.lines()
        .filter_map(|l| match l.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if l.starts_with('#') || l.is_empty() => None,
            None => l.split(['{', ' ']).next(),
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn dashboard_and_alert_rules_use_only_metrics_the_server_exports() {
    let dir = Scratch::new();
    let backing = dir.path().join("backing");
    let cache = dir.path().join("cache");
    sparse_file(&backing, 16 << 20);
    run(Command::new(BIN)
        .args([
            "format",
            "--no-probe",
            "--size",
            "32M",
            "--segment-size",
            "1M",
            "--cache",
        ])
        .arg(&cache)
        .arg("--backing")
        .arg(&backing));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!(":{port}");
    let server = Server::on_socket(
        dir.path(),
        path_str(&backing),
        &[
            "--cache",
            path_str(&cache),
            "--control-socket",
            path_str(&dir.path().join("control.sock")),
            "--stats-file",
            path_str(&dir.path().join("stats")),
            "--metrics-listen",
            &metrics,
            "--endurance-tbw",
            "600",
        ],
    );
    qemu_io(&server.uri, &["write -P 0x5a 0 1M", "read 0 2M", "flush"]);
    let exported = exported_metric_names(port);
    server.stop();
    assert!(exported.len() > 40, "{exported:?}");

    let mut exprs = Vec::new();
    let dashboard = packaging("grafana/flashtier.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboard).unwrap()).unwrap();
    json_exprs(&json, &mut exprs);
    let from_dashboard = exprs.len();
    assert!(
        from_dashboard >= 20,
        "only {from_dashboard} queries in {dashboard:?}"
    );
    let rules = std::fs::read_to_string(packaging("prometheus/flashtier-rules.yml")).unwrap();
    for line in rules.lines() {
        if let Some(expr) = line.trim().strip_prefix("expr:") {
            let expr = expr.trim();
            assert!(
                !expr.starts_with(['|', '>']),
                "keep each rule's expr on one line (the test reads them so): {line}"
            );
            exprs.push(expr.trim_matches(['"', '\'']).to_string());
        }
    }
    assert_eq!(exprs.len() - from_dashboard, 6, "one expr per alert");

    let mut used = std::collections::BTreeSet::new();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric in {expr:?}");
        used.extend(names);
    }
    let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard or the alert rules use metrics the server does not export: {missing:?}\n\
         exported: {exported:?}"
    );
    // The dashboard covers what the issue asked for.
    for name in [
        "flashtier_read_hit_blocks_total",
        "flashtier_request_duration_seconds_bucket",
        "flashtier_request_duration_seconds_count",
        "flashtier_dirty_bytes",
        "flashtier_cleaned_blocks_total",
        "flashtier_backing_errors_total",
        "flashtier_cache_errors_total",
        "flashtier_healthy",
        "flashtier_wear_days_to_rated_tbw",
    ] {
        assert!(used.contains(name), "{name} is on no panel or rule");
    }
}

//! Starting and stopping `flashtier serve`, running external tools, and scratch files.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_flashtier");

/// A scratch directory on a real filesystem (O_DIRECT does not work on tmpfs).
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("flashtier-it-")
        .tempdir_in("/var/tmp")
        .expect("cannot create scratch directory")
}

/// Panics with an actionable message if `tool` is not on PATH.
pub fn require(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{tool}` is not installed: run ./test.sh, which installs every tool the tests use"
    );
}

/// A file of `size` pseudo-random bytes (deterministic for a seed).
pub fn random_file(path: &Path, size: usize, seed: u64) {
    let mut x = seed | 1;
    let mut data = vec![0u8; size];
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    std::fs::write(path, data).expect("cannot write random file");
}

/// A sparse file of `size` bytes.
pub fn sparse_file(path: &Path, size: u64) {
    let f = std::fs::File::create(path).expect("cannot create file");
    f.set_len(size).expect("cannot size file");
}

/// Runs a command to completion and returns its output; panics with the command's output if it
/// fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a command and returns its stdout as a string (panics if it fails).
pub fn run_stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).expect("non-UTF-8 output")
}

/// A running `flashtier serve`.
pub struct Server {
    child: Option<Child>,
    /// The NBD URI printed by the server (export name included).
    pub uri: String,
    /// The listening address as printed (`unix:/path` or `tcp:host:port`).
    pub listen: String,
    stderr_path: PathBuf,
    _logs: tempfile::TempDir,
}

impl Server {
    /// Starts `flashtier serve` with `args` and waits until it listens.
    pub fn start(args: &[&str]) -> Server {
        let logs = tempfile::tempdir().expect("tempdir");
        let stderr_path = logs.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("log file");
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(args)
            .env("FLASHTIER_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cannot start flashtier");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("flashtier: listening on ") {
                        let (listen, tail) = rest.split_once(" (connect with ").expect("format");
                        let uri = tail.trim_end_matches(')').to_string();
                        return Server {
                            child: Some(child),
                            uri,
                            listen: listen.to_string(),
                            stderr_path,
                            _logs: logs,
                        };
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait();
                    panic!(
                        "flashtier serve {args:?} did not start ({status:?}):\n{}",
                        std::fs::read_to_string(&stderr_path).unwrap_or_default()
                    );
                }
            }
        }
    }

    /// Starts a server on a fresh socket in `dir` serving `backing`, with extra `args`.
    pub fn on_socket(dir: &Path, backing: &str, args: &[&str]) -> Server {
        let socket = dir.join(format!("flashtier-{}.sock", std::process::id()));
        let socket = socket.to_str().expect("utf-8 path").to_string();
        let mut all = vec!["--backing", backing, "--listen", &socket];
        all.extend_from_slice(args);
        Server::start(&all)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The unix socket path, if listening on one.
    pub fn socket(&self) -> Option<PathBuf> {
        self.listen.strip_prefix("unix:").map(PathBuf::from)
    }

    /// What the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Sends `signal` and waits (up to 30 s) for the process to exit.
    pub fn signal_and_wait(&mut self, signal: i32) -> ExitStatus {
        let mut child = self.child.take().expect("server already stopped");
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("flashtier did not exit within 30 s of signal {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Graceful stop (SIGTERM); asserts a clean exit.
    pub fn stop(mut self) {
        let status = self.signal_and_wait(libc::SIGTERM);
        assert!(
            status.success(),
            "flashtier exited with {status} after SIGTERM:\n{}",
            self.log()
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

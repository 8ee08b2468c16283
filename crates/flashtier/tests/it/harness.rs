//! Starting and stopping `flashtier serve`, running external tools, scratch files, and the
//! nbdfuse + loop device stack.

#![allow(dead_code)]

use std::fs;
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

/// A scratch directory that is kept when the test fails (a panic while it is dropped), with its
/// path printed, for a post-mortem; removed otherwise.
pub struct Scratch(Option<tempfile::TempDir>);

impl Scratch {
    pub fn new() -> Scratch {
        Scratch(Some(scratch()))
    }

    pub fn path(&self) -> &Path {
        self.0.as_ref().expect("scratch directory").path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(dir) = self.0.take() {
                eprintln!("test failed: its files are kept in {:?}", dir.keep());
            }
        }
    }
}

/// Whether `tool` is on PATH.
pub fn has(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).is_file()))
        .unwrap_or(false)
}

/// Panics with an actionable message if `tool` is not on PATH.
pub fn require(tool: &str) {
    assert!(
        has(tool),
        "`{tool}` is not installed: run ./test.sh, which installs every tool the tests use"
    );
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Deterministic pseudo-random numbers (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A seed from the environment variable `var` if set (to repeat a run), else from the clock.
pub fn seed_from_env(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
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

/// stdout and stderr of a finished command, for messages and greps.
pub fn text(out: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command that may fail; returns its output.
pub fn run_any(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command without its output; returns whether it worked (for cleanup paths).
pub fn quiet(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to `timeout` for `child` to exit; kills it if it does not. Returns the exit status if
/// it exited on its own.
pub fn wait_or_kill(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends SIGKILL to `pids` unless dropped within `timeout`, so that a hung server turns into
/// failing requests (and a failing test) instead of a test that never ends. The caller keeps the
/// processes unreaped (their `Child` not yet waited for) while the watchdog is armed, so a pid
/// cannot have been reused.
pub struct Watchdog {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Arms the watchdog; when it fires, each process's thread stacks go to
    /// `STACKS_DIR/hung-PID-stacks.txt` before it is killed.
    pub fn arm(what: String, timeout: Duration, pids: &[u32], stacks_dir: &Path) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        let pids = pids.to_vec();
        let stacks_dir = stacks_dir.to_path_buf();
        let thread = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(timeout) {
                for &pid in &pids {
                    let stacks = stacks_dir.join(format!("hung-{pid}-stacks.txt"));
                    let _ = fs::write(&stacks, thread_stacks(pid));
                    eprintln!(
                        "watchdog: {what} still running after {timeout:?} (a hang): thread stacks \
                         of pid {pid} in {stacks:?}; killing it"
                    );
                    // SAFETY: signalling our own unreaped children.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
            }
        });
        Watchdog {
            disarm: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.disarm.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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

/// `flashtier format --cache CACHE --backing BACKING` without the quick probe of the cache
/// device (about 2 s a format; `probe.rs` tests it), for the caller to add arguments and run.
pub fn format_command(cache: &Path, backing: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["format", "--no-probe", "--cache"])
        .arg(cache)
        .args(["--backing", backing]);
    cmd
}

/// A running `flashtier serve`.
pub struct Server {
    child: Option<Child>,
    /// The NBD URI printed by the server (export name included).
    pub uri: String,
    /// The listening address as printed (`unix:/path` or `tcp:host:port`).
    pub listen: String,
    stderr_path: PathBuf,
    /// Holds the server's log; kept when the test fails.
    logs: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts `flashtier serve` with `args` and waits until it listens.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let logs = tempfile::tempdir().expect("tempdir");
        let stderr_path = logs.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("log file");
        // Servers of tests running at once must not share the default control socket and stats
        // file (`/run/flashtier/` as root): the second one would fail with "Address already in
        // use" (found as a flaky CI failure of `tcp_listen_on_port_zero_reports_the_real_port`
        // while the MariaDB test's server held the default socket). Each gets its own unless the
        // test names them (or a config file does).
        let private = |flag: &str| !args.iter().any(|a| *a == flag || *a == "--config");
        let mut own = Vec::new();
        if private("--control-socket") {
            own.push("--control-socket".to_string());
            own.push(logs.path().join("control.sock").display().to_string());
        }
        if private("--stats-file") {
            own.push("--stats-file".to_string());
            own.push(logs.path().join("stats").display().to_string());
        }
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(args)
            .args(&own)
            .env("FLASHTIER_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cannot start flashtier");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Keep reading after the ready line: the server may print more, and a closed pipe
            // would fail its next write.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
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
                            logs: Some(logs),
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

    /// Sends `signal` and waits (up to 30 s) for the process to exit. A server that does not
    /// exit is hung: its thread stacks are saved beside its log, then it is killed and the test
    /// fails.
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
                let stacks_path = self.stderr_path.with_file_name("stacks.txt");
                let stacks = thread_stacks(child.id());
                let _ = fs::write(&stacks_path, &stacks);
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "flashtier (pid {}) did not exit within 30 s of signal {signal}: hung. Thread \
                     stacks in {stacks_path:?}; its log:\n{}",
                    child.id(),
                    self.log()
                );
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
        if std::thread::panicking() {
            if let Some(logs) = self.logs.take() {
                eprintln!(
                    "test failed: flashtier's log (and thread stacks if it hung) kept in {:?}",
                    logs.keep()
                );
            }
        }
    }
}

/// Every thread's stack of process `pid`, for a hang report: which threads used CPU over two
/// seconds (a livelock spins, a deadlock sleeps), each thread's kernel view (name, state, wait
/// channel), and gdb's backtraces when gdb is installed.
pub fn thread_stacks(pid: u32) -> String {
    let cpu_ticks = || -> Vec<(String, String, u64)> {
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            return Vec::new();
        };
        let mut v: Vec<_> = tasks
            .flatten()
            .map(|task| {
                let dir = task.path();
                let read = |f: &str| fs::read_to_string(dir.join(f)).unwrap_or_default();
                let stat = read("stat");
                // Fields after the command name: state is the first, utime and stime the 12th
                // and 13th.
                let after: Vec<&str> = stat
                    .rsplit_once(')')
                    .map_or("", |(_, rest)| rest)
                    .split_whitespace()
                    .collect();
                let ticks = |i: usize| after.get(i).and_then(|v| v.parse::<u64>().ok());
                let line = format!(
                    "tid {} {:?} state {} wchan {}",
                    task.file_name().to_string_lossy(),
                    read("comm").trim(),
                    after.first().unwrap_or(&"?"),
                    read("wchan").trim()
                );
                let tid = task.file_name().to_string_lossy().into_owned();
                (tid, line, ticks(11).unwrap_or(0) + ticks(12).unwrap_or(0))
            })
            .collect();
        v.sort();
        v
    };
    let before = cpu_ticks();
    std::thread::sleep(Duration::from_secs(2));
    let mut out = String::from("CPU ticks used by each thread over 2 s:\n");
    for (tid, line, ticks) in cpu_ticks() {
        let was = before.iter().find(|b| b.0 == tid).map_or(0, |b| b.2);
        out += &format!("{line} cpu +{}\n", ticks.saturating_sub(was));
    }
    if has("gdb") {
        let gdb = Command::new("timeout")
            .args(["120", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
            .args(["-ex", "set pagination off", "-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .output();
        match gdb {
            Ok(o) => out += &String::from_utf8_lossy(&o.stdout),
            Err(e) => out += &format!("gdb failed: {e}\n"),
        }
    }
    out
}

/// `e2fsck -fn` on `target` (a device or an image file) must find nothing to fix; `when` says
/// at which point, for the message. Returns e2fsck's summary line.
pub fn assert_fsck_clean(target: impl AsRef<std::ffi::OsStr>, when: &str) -> String {
    let target = target.as_ref();
    let out = run_any(Command::new("e2fsck").arg("-fn").arg(target));
    assert!(
        out.status.success(),
        "e2fsck -fn {target:?} {when} found problems ({}):\n{}",
        out.status,
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string()
}

/// nbdfuse exposing an NBD export as the file `FUSE_DIR/nbd`, a loop device on that file, and
/// optionally a mount of the loop device. Dropping it tears everything down, best effort and in
/// dependency order, so a failing test leaves no mount, loop device or FUSE file system behind.
pub struct FuseLoop {
    fuse_dir: PathBuf,
    nbdfuse: Option<Child>,
    dev: Option<String>,
    mounted: Option<PathBuf>,
}

impl FuseLoop {
    /// Starts nbdfuse on `uri` in `fuse_dir` (its stderr going to `log`), waits until its file
    /// shows `size` bytes, and binds a loop device to the file.
    pub fn attach(fuse_dir: &Path, uri: &str, size: u64, log: &Path) -> FuseLoop {
        for tool in ["nbdfuse", "fusermount3", "losetup", "mount", "umount"] {
            require(tool);
        }
        let nbdfuse = Command::new("nbdfuse")
            .arg(fuse_dir)
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(log).expect("nbdfuse log"))
            .spawn()
            .expect("cannot start nbdfuse");
        let mut stack = FuseLoop {
            fuse_dir: fuse_dir.to_path_buf(),
            nbdfuse: Some(nbdfuse),
            dev: None,
            mounted: None,
        };
        let file = fuse_dir.join("nbd");
        wait_until(
            Duration::from_secs(20),
            "nbdfuse to expose FUSE_DIR/nbd",
            || fs::metadata(&file).is_ok_and(|m| m.len() == size),
        );
        let dev = run_stdout(
            Command::new("losetup")
                .args(["--find", "--show"])
                .arg(&file),
        )
        .trim()
        .to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        stack.dev = Some(dev);
        stack
    }

    /// The loop device, e.g. /dev/loop3.
    pub fn dev(&self) -> &str {
        self.dev.as_deref().expect("no loop device")
    }

    pub fn mount(&mut self, mnt: &Path) {
        run(Command::new("mount").arg(self.dev()).arg(mnt));
        self.mounted = Some(mnt.to_path_buf());
    }

    pub fn umount(&mut self) {
        if let Some(mnt) = self.mounted.take() {
            run(Command::new("umount").arg(&mnt));
        }
    }

    /// The orderly way out: unmount, detach the loop device, unmount the FUSE file system (each
    /// step must work); returns nbdfuse's exit status.
    pub fn detach(mut self) -> ExitStatus {
        self.umount();
        if let Some(dev) = self.dev.take() {
            run(Command::new("losetup").arg("-d").arg(&dev));
            assert!(
                loop_released(&dev, Duration::from_secs(20)),
                "{dev} still bound 20 s after losetup -d"
            );
        }
        self.unmount_fuse()
    }

    /// After the server behind the stack died: unmount lazily (the file system's last writes
    /// fail: nothing after the crash may reach the disk), detach the loop device and wait until
    /// the kernel has let go of it, and only then unmount the FUSE file system (busy while the
    /// loop device holds its file).
    pub fn tear_down_wreckage(mut self) {
        if let Some(mnt) = self.mounted.take() {
            run(Command::new("umount").arg("-l").arg(&mnt));
        }
        if let Some(dev) = self.dev.take() {
            // With the file system still shutting down, the kernel may only mark the device for
            // auto-clear; it is released once the last user lets go.
            quiet(Command::new("losetup").arg("-d").arg(&dev));
            assert!(
                loop_released(&dev, Duration::from_secs(30)),
                "{dev} still bound 30 s after the crash and losetup -d:\n{}",
                text(&run_any(Command::new("losetup").arg("-l")))
            );
        }
        self.unmount_fuse();
    }

    /// fusermount3 -u (retrying while busy), then waits for nbdfuse to exit.
    fn unmount_fuse(&mut self) -> ExitStatus {
        let mut child = self.nbdfuse.take().expect("nbdfuse not running");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let out = run_any(Command::new("fusermount3").arg("-u").arg(&self.fuse_dir));
            if out.status.success() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                quiet(Command::new("fusermount3").arg("-uz").arg(&self.fuse_dir));
                let _ = child.wait();
                panic!(
                    "fusermount3 -u {:?} kept failing for 15 s:\n{}",
                    self.fuse_dir,
                    text(&out)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        match wait_or_kill(&mut child, Duration::from_secs(30)) {
            Some(status) => status,
            None => {
                quiet(Command::new("fusermount3").arg("-uz").arg(&self.fuse_dir));
                panic!("nbdfuse did not exit within 30 s of fusermount3 -u");
            }
        }
    }
}

impl Drop for FuseLoop {
    fn drop(&mut self) {
        if let Some(mnt) = self.mounted.take() {
            if !quiet(Command::new("umount").arg(&mnt)) {
                quiet(Command::new("umount").arg("-l").arg(&mnt));
            }
        }
        if let Some(dev) = self.dev.take() {
            quiet(Command::new("losetup").arg("-d").arg(&dev));
            loop_released(&dev, Duration::from_secs(10));
        }
        if let Some(mut child) = self.nbdfuse.take() {
            quiet(Command::new("fusermount3").arg("-u").arg(&self.fuse_dir));
            if wait_or_kill(&mut child, Duration::from_secs(5)).is_none() {
                quiet(Command::new("fusermount3").arg("-uz").arg(&self.fuse_dir));
            }
        }
    }
}

/// Waits up to `timeout` for loop device `dev` (e.g. /dev/loop3) to lose its backing file;
/// returns whether it did.
fn loop_released(dev: &str, timeout: Duration) -> bool {
    let name = dev.trim_start_matches("/dev/");
    let backing = PathBuf::from(format!("/sys/block/{name}/loop/backing_file"));
    let deadline = Instant::now() + timeout;
    while backing.exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing behind.
pub struct KillOnDrop(pub Option<Child>);

impl KillOnDrop {
    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child already taken")
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs qemu-io on `uri` with the given `-c` commands: whether every command succeeded (exit
/// status 0 and no "failed"/"error"/"can't"/"not permitted" in the output: qemu-io reports some
/// failures only there), and its output.
pub fn try_qemu_io<S: AsRef<str>>(uri: &str, commands: &[S]) -> (bool, String) {
    require("qemu-io");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in commands {
        cmd.arg("-c").arg(c.as_ref());
    }
    let out = run_any(&mut cmd);
    let all = text(&out);
    let lower = all.to_lowercase();
    let ok = out.status.success()
        && !lower.contains("fail")
        && !lower.contains("error")
        && !lower.contains("can't")
        && !lower.contains("not permitted");
    (ok, all)
}

/// [`try_qemu_io`], asserting that every command succeeded; returns the output.
pub fn qemu_io<S: AsRef<str>>(uri: &str, commands: &[S]) -> String {
    let (ok, all) = try_qemu_io(uri, commands);
    let commands: Vec<&str> = commands.iter().map(AsRef::as_ref).collect();
    assert!(
        ok,
        "qemu-io {commands:?} on {uri} reported a problem:\n{all}"
    );
    all
}

/// `flashtier ARGS --control SOCKET`.
pub fn ctl(socket: &Path, args: &[&str]) -> Output {
    run_any(Command::new(BIN).args(args).arg("--control").arg(socket))
}

/// [`ctl`], which must succeed; returns what it printed.
pub fn ctl_ok(socket: &Path, args: &[&str]) -> String {
    let out = ctl(socket, args);
    assert!(out.status.success(), "flashtier {args:?}:\n{}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// `flashtier stats --json` of the server at `socket`, parsed.
pub fn report(socket: &Path) -> serde_json::Value {
    serde_json::from_str(&ctl_ok(socket, &["stats", "--json"])).unwrap()
}

/// `flashtier serve` of `img` on a socket in `dir`, its control socket at `control`, with `args`.
pub fn serve(dir: &Path, img: &Path, control: &Path, args: &[&str]) -> Server {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--control-socket", path_str(control)]);
    Server::on_socket(dir, path_str(img), &all)
}

/// Formats a cache file of `size` with 1 MiB segments for `img`.
pub fn format_cache(cache: &Path, img: &Path, size: &str) {
    let out = run_any(format_command(cache, path_str(img)).args([
        "--size",
        size,
        "--segment-size",
        "1M",
    ]));
    assert!(out.status.success(), "{}", text(&out));
}

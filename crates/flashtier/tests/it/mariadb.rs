//! A real database through flashtier, crashed: MariaDB on ext4 on a loop device on nbdfuse on
//! `flashtier serve --mode writeback`, whose backing store is an emulated slow disk (nbdkit with
//! a 4 ms delay per request, one request at a time). sysbench `oltp_read_write` and a commit
//! ledger run against it; then mariadbd and flashtier are killed with SIGKILL together (a power
//! cut as far as the database is concerned), the wreckage is torn down, and everything is
//! started again on the same files:
//!
//! - flashtier reports recovery after an unclean shutdown;
//! - `e2fsck -fy` replays the ext4 journal without finding real damage, then `e2fsck -fn` is
//!   clean;
//! - mariadbd starts, running InnoDB crash recovery with no `[ERROR]` in its log (with
//!   `innodb_doublewrite=OFF` a torn page would not be repairable, and a stale one shows up as a
//!   page LSN "in the future"), and `CHECK TABLE` and `mysqlcheck --all-databases --extended`
//!   report every table OK;
//! - committed data is there: each sysbench table still holds exactly `--table-size` rows
//!   (oltp_read_write deletes and re-inserts a row in one transaction), and every commit the
//!   ledger client saw acknowledged is present, with no gaps.
//!
//! At the end: clean shutdown of everything, `e2fsck -fn` clean, and a clean reopen of the cache.
//! Every step that could hang on a hung flashtier runs under a watchdog that kills flashtier, so
//! the test fails rather than waiting forever; a failing run keeps its files and logs.
//!
//! Default 5 cycles of 3-7 s of load; FLASHTIER_LONG=1 runs 30 cycles of 3-40 s (past
//! flashtier's 30 s checkpoint interval). FLASHTIER_MARIADB_SEED=N repeats the load durations.

use std::fs;
use std::io::{BufRead, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::{
    self, path_str, quiet, run_any, text, wait_or_kill, wait_until, FuseLoop, Rng, Scratch, Server,
    Watchdog,
};

const MIB: u64 = 1 << 20;
const DISK_BYTES: u64 = 1024 * MIB;
const TABLES: usize = 4;
const TABLE_SIZE: u64 = 5000;

// ---------------------------------------------------------------------------------------------
// The stack: nbdkit (slow disk) → flashtier → nbdfuse → loop → ext4 → mariadbd
// ---------------------------------------------------------------------------------------------

fn kill_9(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// What the ledger client saw acknowledged.
struct Ledger {
    acked: AtomicU64,
    last_ack: Mutex<Instant>,
}

impl Ledger {
    fn new() -> Ledger {
        Ledger {
            acked: AtomicU64::new(0),
            last_ack: Mutex::new(Instant::now()),
        }
    }

    fn acked(&self, id: u64) {
        self.acked.store(id, Ordering::SeqCst);
        *self.last_ack.lock().unwrap() = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.last_ack.lock().unwrap().elapsed()
    }
}

/// A commit takes milliseconds (every layer under InnoDB's log fsync is local, the slow disk
/// sits behind the write-back cache): the database stalled if none was acknowledged for this
/// long, and is hung if none comes for `HUNG_AFTER`.
const STALL: Duration = Duration::from_secs(2);
const HUNG_AFTER: Duration = Duration::from_secs(60);

struct Paths {
    img: PathBuf,
    nbdkit_sock: PathBuf,
    cache: PathBuf,
    ft_sock: PathBuf,
    fuse_dir: PathBuf,
    mnt: PathBuf,
    run: PathBuf,
    cnf: PathBuf,
    db_sock: PathBuf,
    logs: PathBuf,
}

/// Everything running, torn down (kill, unmount, detach, fusermount) on drop, in dependency
/// order, so a failing test leaves nothing behind.
struct Rig {
    p: Paths,
    nbdkit: Option<Child>,
    flashtier: Option<Server>,
    fuse: Option<FuseLoop>,
    mariadbd: Option<Child>,
    sysbench: Option<Child>,
    ledger: Option<Child>,
    /// Numbers each start's logs.
    starts: u32,
}

impl Drop for Rig {
    fn drop(&mut self) {
        // First flashtier: if it hung, everything above it (mariadbd, the mount, the loop
        // device) is stuck in I/O until it is gone.
        if let Some(server) = &mut self.flashtier {
            if server.is_running() {
                // SAFETY: signalling our own child, not yet reaped.
                unsafe { libc::kill(server.pid() as i32, libc::SIGKILL) };
            }
        }
        kill_9(&mut self.sysbench);
        kill_9(&mut self.ledger);
        kill_9(&mut self.mariadbd);
        drop(self.fuse.take());
        if let Some(mut server) = self.flashtier.take() {
            if server.is_running() {
                server.signal_and_wait(libc::SIGKILL);
            }
            self.save_log("flashtier", &server.log());
        }
        kill_9(&mut self.nbdkit);
    }
}

impl Rig {
    fn log_file(&mut self, what: &str) -> (PathBuf, fs::File) {
        let path = self.p.logs.join(format!("{:02}-{what}.log", self.starts));
        let f = fs::File::create(&path).unwrap();
        (path, f)
    }

    fn save_log(&mut self, what: &str, log: &str) {
        let (_, mut f) = self.log_file(what);
        f.write_all(log.as_bytes()).unwrap();
    }

    fn start_nbdkit(&mut self) {
        let (_, log) = self.log_file("nbdkit");
        let child = Command::new("nbdkit")
            .arg("-U")
            .arg(&self.p.nbdkit_sock)
            .args([
                "-f",
                "--exit-with-parent",
                "--filter=noparallel",
                "--filter=delay",
                "file",
            ])
            .arg(&self.p.img)
            .args(["serialize=all-requests", "rdelay=4ms", "wdelay=4ms"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("cannot start nbdkit");
        self.nbdkit = Some(child);
        let sock = self.p.nbdkit_sock.clone();
        wait_until(Duration::from_secs(10), "nbdkit's socket", || sock.exists());
    }

    fn backing_uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.p.nbdkit_sock.display())
    }

    fn format_cache(&self) {
        harness::run(Command::new(harness::BIN).args([
            "format",
            "--no-probe",
            "--cache",
            path_str(&self.p.cache),
            "--size",
            "512M",
            "--backing",
            &self.backing_uri(),
        ]));
    }

    /// Starts flashtier in `mode`; returns its log so far (the open/recovery report).
    fn start_flashtier(&mut self, mode: &str) -> String {
        let uri = self.backing_uri();
        let server = Server::start(&[
            "--cache",
            path_str(&self.p.cache),
            "--backing",
            &uri,
            "--listen",
            path_str(&self.p.ft_sock),
            "--mode",
            mode,
        ]);
        let log = server.log();
        self.flashtier = Some(server);
        log
    }

    /// SIGTERM: flashtier must write its last checkpoint and exit 0.
    fn stop_flashtier(&mut self) {
        let mut server = self.flashtier.take().expect("flashtier");
        let status = server.signal_and_wait(libc::SIGTERM);
        let log = server.log();
        self.save_log("flashtier", &log);
        assert!(
            status.success(),
            "flashtier exited with {status} after SIGTERM:\n{log}"
        );
    }

    /// Kills flashtier if it hangs: its clients' requests then fail, so the test fails instead of
    /// waiting forever. Drop the watchdog before stopping or killing flashtier.
    fn watchdog(&self, what: &str) -> Watchdog {
        let pid = self.flashtier.as_ref().expect("flashtier").pid();
        Watchdog::arm(
            what.to_string(),
            Duration::from_secs(300),
            &[pid],
            &self.p.logs,
        )
    }

    /// nbdfuse on flashtier's export, and a loop device on its file; returns the device.
    fn attach(&mut self) -> String {
        let uri = self.flashtier.as_ref().expect("flashtier").uri.clone();
        let (log, _) = self.log_file("nbdfuse");
        let fuse = FuseLoop::attach(&self.p.fuse_dir, &uri, DISK_BYTES, &log);
        let dev = fuse.dev().to_string();
        self.fuse = Some(fuse);
        dev
    }

    fn fuse(&mut self) -> &mut FuseLoop {
        self.fuse.as_mut().expect("not attached")
    }

    fn dev(&self) -> String {
        self.fuse.as_ref().expect("not attached").dev().to_string()
    }

    /// Orderly: umount, detach, fusermount (asserting each step works).
    fn detach_clean(&mut self) {
        let status = self.fuse.take().expect("not attached").detach();
        assert!(status.success(), "nbdfuse exited with {status}");
    }

    // --- MariaDB ----------------------------------------------------------------------------

    fn write_cnf(&self) {
        let cnf = format!(
            "[mysqld]\n\
             user=root\n\
             datadir={data}\n\
             socket={sock}\n\
             pid-file={run}/mariadbd.pid\n\
             log-error={run}/error.log\n\
             skip-networking\n\
             skip-name-resolve\n\
             innodb_buffer_pool_size=64M\n\
             innodb_log_file_size=48M\n\
             innodb_doublewrite=OFF\n\
             innodb_flush_log_at_trx_commit=1\n\
             max_connections=50\n",
            data = self.p.mnt.join("data").display(),
            sock = self.p.db_sock.display(),
            run = self.p.run.display(),
        );
        fs::write(&self.p.cnf, cnf).unwrap();
    }

    fn defaults_file(&self) -> String {
        format!("--defaults-file={}", self.p.cnf.display())
    }

    fn install_db(&self) {
        let install = if harness::has("mariadb-install-db") {
            "mariadb-install-db"
        } else {
            "mysql_install_db"
        };
        let out = run_any(
            Command::new(install)
                .arg(self.defaults_file())
                .args(["--user=root", "--skip-test-db"])
                .arg(format!("--datadir={}", self.p.mnt.join("data").display())),
        );
        assert!(out.status.success(), "{install} failed:\n{}", text(&out));
    }

    /// The error log from byte `from` on (it is appended to by every start).
    fn error_log(&self, from: usize) -> String {
        let log = fs::read(self.p.run.join("error.log")).unwrap_or_default();
        String::from_utf8_lossy(log.get(from..).unwrap_or_default()).into_owned()
    }

    fn error_log_len(&self) -> usize {
        fs::metadata(self.p.run.join("error.log")).map_or(0, |m| m.len() as usize)
    }

    /// Starts mariadbd and waits until it answers; returns how long that took and what it wrote
    /// to its error log meanwhile.
    fn start_mariadb(&mut self) -> (Duration, String) {
        let started = Instant::now();
        let log_from = self.error_log_len();
        let server = if harness::has("mariadbd") {
            "mariadbd"
        } else {
            "mysqld"
        };
        let (_, out) = self.log_file("mariadbd-out");
        let child = Command::new(server)
            .arg(self.defaults_file())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {server}: {e}"));
        self.mariadbd = Some(child);
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            if let Some(status) = self.mariadbd.as_mut().unwrap().try_wait().unwrap() {
                self.mariadbd = None;
                panic!(
                    "{server} exited with {status} while starting:\n{}",
                    self.error_log(log_from)
                );
            }
            if quiet(self.client("mariadb-admin").arg("ping")) {
                return (started.elapsed(), self.error_log(log_from));
            }
            assert!(
                Instant::now() < deadline,
                "{server} did not answer within 240 s:\n{}",
                self.error_log(log_from)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A client command connected to our server as root.
    fn client(&self, tool: &str) -> Command {
        let mut cmd = Command::new(tool);
        cmd.arg("--no-defaults")
            .arg(format!("--socket={}", self.p.db_sock.display()))
            .arg("--user=root");
        cmd
    }

    /// Runs SQL; returns the rows (tab-separated, no column names).
    fn sql(&self, query: &str) -> String {
        harness::run_stdout(self.client("mariadb").args(["-N", "-B", "-e", query]))
    }

    fn stop_mariadb(&mut self) {
        let out = run_any(self.client("mariadb-admin").arg("shutdown"));
        assert!(
            out.status.success(),
            "mariadb-admin shutdown:\n{}",
            text(&out)
        );
        let mut child = self.mariadbd.take().expect("mariadbd");
        let status = wait_or_kill(&mut child, Duration::from_secs(120))
            .expect("mariadbd did not stop within 120 s of shutdown");
        assert!(
            status.success(),
            "mariadbd exited with {status}:\n{}",
            self.error_log(self.error_log_len().saturating_sub(8192))
        );
    }

    fn sysbench(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("sysbench");
        cmd.args([
            "oltp_read_write",
            "--db-driver=mysql",
            "--mysql-user=root",
            "--mysql-db=sbtest",
        ])
        .arg(format!("--mysql-socket={}", self.p.db_sock.display()))
        .arg(format!("--tables={TABLES}"))
        .arg(format!("--table-size={TABLE_SIZE}"))
        .args(args);
        cmd
    }

    /// A client that inserts ledger rows one autocommit transaction at a time, from `next`, and
    /// records in `ledger` the highest id whose commit was acknowledged, and when.
    fn start_ledger(&mut self, next: u64, ledger: Arc<Ledger>) -> std::thread::JoinHandle<()> {
        let (_, err) = self.log_file("ledger");
        let mut child = self
            .client("mariadb")
            .args(["-N", "-B", "--unbuffered", "sbtest"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("cannot start the ledger client");
        let mut stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        self.ledger = Some(child);
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for id in next.. {
                let stmt = format!(
                    "INSERT INTO ledger (id, pad) VALUES ({id}, REPEAT('x', 100)); SELECT {id};\n"
                );
                if stdin.write_all(stmt.as_bytes()).is_err() || stdin.flush().is_err() {
                    return;
                }
                match lines.next() {
                    Some(Ok(l)) if l.trim() == id.to_string() => ledger.acked(id),
                    _ => return,
                }
            }
        })
    }

    // --- Checks -----------------------------------------------------------------------------

    /// e2fsck -fy (journal replay, orphans), then e2fsck -fn must be clean.
    fn fsck_after_crash(&self) -> String {
        let dev = self.dev();
        let out = run_any(Command::new("e2fsck").arg("-fy").arg(&dev));
        let code = out.status.code().unwrap_or(-1);
        let all = text(&out);
        assert!(
            code == 0 || code == 1,
            "e2fsck -fy {dev} after the crash exited {code} (uncorrected errors):\n{all}"
        );
        // After journal replay a crash-consistent device needs nothing but the summary counters
        // (which ext4 does not journal) and orphan processing.
        let benign = [
            "Free blocks count wrong",
            "Free inodes count wrong",
            "Directories count wrong",
            "orphan",
            "Orphan",
        ];
        let stdout = String::from_utf8_lossy(&out.stdout);
        // e2fsck prints the problem, then "Fix? yes" (or similar) on the same or the next line.
        let lines: Vec<&str> = stdout.lines().collect();
        let damage: Vec<String> = (0..lines.len())
            .filter(|&i| lines[i].contains("? yes"))
            .map(|i| format!("{} {}", if i > 0 { lines[i - 1] } else { "" }, lines[i]))
            .filter(|problem| !benign.iter().any(|b| problem.contains(b)))
            .collect();
        assert!(
            damage.is_empty(),
            "e2fsck -fy {dev} had to repair real damage after the crash ({damage:?}):\n{all}"
        );
        let summary = harness::assert_fsck_clean(&dev, "after e2fsck -fy");
        let replayed = if all.contains("recovering journal") {
            "journal replayed"
        } else {
            "no journal replay"
        };
        format!("e2fsck -fy exit {code} ({replayed}); -fn clean: {summary}")
    }

    /// CHECK TABLE, mysqlcheck, row counts, the ledger. Returns the ledger's highest id.
    fn check_database(&self, acked: u64) -> (u64, String) {
        let tables: Vec<String> = (1..=TABLES).map(|i| format!("sbtest.sbtest{i}")).collect();
        let check = self.sql(&format!("CHECK TABLE {}, sbtest.ledger", tables.join(", ")));
        let status: Vec<&str> = check
            .lines()
            .filter(|l| l.split('\t').nth(2) == Some("status"))
            .collect();
        assert!(
            status.len() == TABLES + 1 && status.iter().all(|l| l.ends_with("\tOK")),
            "CHECK TABLE does not report OK for every table:\n{check}"
        );
        assert!(
            !check.to_lowercase().contains("error") && !check.to_lowercase().contains("corrupt"),
            "CHECK TABLE reports problems:\n{check}"
        );

        let out = run_any(
            self.client("mysqlcheck")
                .arg("--all-databases")
                .arg("--extended"),
        );
        let report = String::from_utf8_lossy(&out.stdout).to_string();
        let lower = report.to_lowercase();
        let ok_tables = report
            .lines()
            .filter(|l| l.trim_end().ends_with("OK"))
            .count();
        assert!(
            out.status.success()
                && !lower.contains("error")
                && !lower.contains("corrupt")
                && !lower.contains("warning")
                && ok_tables > TABLES,
            "mysqlcheck --all-databases found problems ({}):\n{}",
            out.status,
            text(&out)
        );

        for (i, t) in tables.iter().enumerate() {
            let n: u64 = self
                .sql(&format!("SELECT COUNT(*) FROM {t}"))
                .trim()
                .parse()
                .unwrap();
            assert_eq!(
                n, TABLE_SIZE,
                "{t} holds {n} rows instead of {TABLE_SIZE}: a transaction was torn or lost"
            );
            // Every row again through sysbench's secondary index (k_N on table N), and every
            // byte of every row through the primary key.
            let by_k: u64 = self
                .sql(&format!(
                    "SELECT COUNT(*) FROM {t} FORCE INDEX (k_{}) WHERE k >= 0",
                    i + 1
                ))
                .trim()
                .parse()
                .unwrap();
            assert_eq!(
                by_k,
                TABLE_SIZE,
                "{t}: the secondary index k_{} sees {by_k} rows",
                i + 1
            );
            let bytes = self.sql(&format!("SELECT SUM(LENGTH(c) + LENGTH(pad)) FROM {t}"));
            assert!(
                bytes.trim().parse::<u64>().is_ok_and(|b| b > 0),
                "cannot read the rows of {t}: {bytes:?}"
            );
        }

        let row = self.sql("SELECT COUNT(*), COALESCE(MAX(id), 0) FROM sbtest.ledger");
        let mut f = row.split_whitespace().map(|v| v.parse::<u64>().unwrap());
        let (count, max) = (f.next().unwrap(), f.next().unwrap());
        assert!(
            max >= acked,
            "the ledger lost acknowledged commits: highest id {max}, but {acked} was acknowledged"
        );
        assert_eq!(
            count, max,
            "the ledger has gaps: {count} rows up to id {max} (committed rows lost)"
        );
        (
            max,
            format!(
                "CHECK TABLE OK ({} tables), mysqlcheck OK ({ok_tables} tables), {TABLES}x{TABLE_SIZE} \
                 rows, ledger {count} rows (last acknowledged {acked})",
                TABLES + 1
            ),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------------------------

#[test]
fn mariadb_survives_kill_9_of_itself_and_flashtier() {
    for tool in [
        "nbdkit",
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
        "sysbench",
        "mariadb",
        "mariadb-admin",
        "mysqlcheck",
    ] {
        harness::require(tool);
    }
    assert!(
        harness::has("mariadbd") || harness::has("mysqld"),
        "mariadbd is not installed: run ./test.sh, which installs every tool the tests use"
    );
    let long = std::env::var("FLASHTIER_LONG").is_ok_and(|v| v == "1");
    // Long runs also load for longer, past flashtier's 30 s checkpoint interval.
    let (cycles, max_load_ms) = if long { (30, 40_000) } else { (5, 7_000) };
    let seed = harness::seed_from_env("FLASHTIER_MARIADB_SEED");
    println!(
        "mariadb: {cycles} cycles, seed {seed} (FLASHTIER_MARIADB_SEED={seed} repeats the load \
         durations)"
    );
    let mut rng = Rng::new(seed);
    let t_all = Instant::now();

    let dir = Scratch::new();
    let d = dir.path();
    let p = Paths {
        img: d.join("slow.img"),
        nbdkit_sock: d.join("nbdkit.sock"),
        cache: d.join("cache.img"),
        ft_sock: d.join("ft.sock"),
        fuse_dir: d.join("fuse"),
        mnt: d.join("mnt"),
        run: d.join("run"),
        cnf: d.join("my.cnf"),
        db_sock: d.join("run/mariadbd.sock"),
        logs: d.join("logs"),
    };
    for dir in [&p.fuse_dir, &p.mnt, &p.run, &p.logs] {
        fs::create_dir(dir).unwrap();
    }
    harness::sparse_file(&p.img, DISK_BYTES);
    let mut rig = Rig {
        p,
        nbdkit: None,
        flashtier: None,
        fuse: None,
        mariadbd: None,
        sysbench: None,
        ledger: None,
        starts: 0,
    };

    // First start: slow disk, cache, file system, database, tables.
    let t = Instant::now();
    rig.start_nbdkit();
    rig.format_cache();
    rig.start_flashtier("writeback");
    let watchdog = rig.watchdog("setup");
    let dev = rig.attach();
    harness::run(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-E",
                "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
            ])
            .arg(&dev),
    );
    let mnt = rig.p.mnt.clone();
    rig.fuse().mount(&mnt);
    rig.write_cnf();
    rig.install_db();
    let (up, _) = rig.start_mariadb();
    rig.sql(
        "CREATE DATABASE sbtest; \
         CREATE TABLE sbtest.ledger (id BIGINT PRIMARY KEY, pad CHAR(100)) ENGINE=InnoDB",
    );
    let t_prepare = Instant::now();
    let out = run_any(&mut rig.sysbench(&["prepare"]));
    assert!(
        out.status.success(),
        "sysbench prepare failed:\n{}",
        text(&out)
    );
    // mariadb-install-db writes the Aria system tables (mysql.help_*, mysql.*_stats) without
    // fsync: a crash seconds later legitimately loses them (as a power cut would), which is not
    // what this test is about. Setup is finished, durably, before the first crash.
    harness::run(Command::new("sync").arg("-f").arg(&mnt));
    drop(watchdog);
    println!(
        "mariadb: setup {} (mariadbd up in {}, sysbench prepare {})",
        secs(t.elapsed()),
        secs(up),
        secs(t_prepare.elapsed())
    );

    let mut ledger_next = 1;
    let mut total_acked = 0;
    let mut total_replayed = 0;
    for cycle in 0..cycles {
        rig.starts += 1;
        let t_cycle = Instant::now();
        // Load: sysbench and the ledger, then kill -9 of mariadbd and flashtier together.
        let (sb_out_path, sb_out) = rig.log_file("sysbench");
        rig.sysbench = Some(
            rig.sysbench(&["--threads=4", "--time=3600", "--report-interval=1", "run"])
                .stdin(Stdio::null())
                .stdout(sb_out.try_clone().unwrap())
                .stderr(sb_out)
                .spawn()
                .expect("cannot start sysbench"),
        );
        let progress = Arc::new(Ledger::new());
        let ledger = rig.start_ledger(ledger_next, progress.clone());
        let load = Duration::from_millis(3000 + rng.below(max_load_ms - 3000));
        std::thread::sleep(load);
        // A kill -9 would hide a hang: tell a stall from a hang before crashing.
        while progress.idle() > STALL && progress.idle() < HUNG_AFTER {
            std::thread::sleep(Duration::from_millis(100));
        }
        if progress.idle() >= HUNG_AFTER {
            let pid = rig.flashtier.as_ref().unwrap().pid();
            let stacks = rig
                .p
                .logs
                .join(format!("cycle-{cycle}-flashtier-stacks.txt"));
            fs::write(&stacks, harness::thread_stacks(pid)).unwrap();
            panic!(
                "cycle {cycle}: no commit acknowledged for {HUNG_AFTER:?} under load (ledger at \
                 {}); flashtier's thread stacks in {stacks:?}",
                progress.acked.load(Ordering::SeqCst)
            );
        }
        if let Some(status) = rig.sysbench.as_mut().unwrap().try_wait().unwrap() {
            panic!(
                "sysbench stopped early ({status}):\n{}",
                fs::read_to_string(&sb_out_path).unwrap_or_default()
            );
        }
        let ft_pid = rig.flashtier.as_ref().unwrap().pid() as i32;
        let db_pid = rig.mariadbd.as_ref().unwrap().id() as i32;
        // SAFETY: signalling our own children, back to back.
        unsafe {
            libc::kill(ft_pid, libc::SIGKILL);
            libc::kill(db_pid, libc::SIGKILL);
        }
        let t_crash = Instant::now();
        let mut server = rig.flashtier.take().unwrap();
        server.signal_and_wait(libc::SIGKILL);
        rig.save_log("flashtier", &server.log());
        drop(server);
        let _ = rig.mariadbd.take().unwrap().wait();
        kill_9(&mut rig.sysbench);
        kill_9(&mut rig.ledger);
        let _ = ledger.join();
        let acked = progress.acked.load(Ordering::SeqCst);
        let sb_report = fs::read_to_string(&sb_out_path).unwrap_or_default();
        let tps = sb_report
            .lines()
            .rev()
            .find(|l| l.contains(" tps: "))
            .and_then(|l| l.split(" tps: ").nth(1))
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        assert!(
            acked >= ledger_next,
            "cycle {cycle}: the ledger committed nothing in {load:?}"
        );

        // Wreckage out, everything back in.
        rig.fuse.take().expect("attached").tear_down_wreckage();
        let t_teardown = t_crash.elapsed();
        let t = Instant::now();
        let ft_log = rig.start_flashtier("writeback");
        let watchdog = rig.watchdog(&format!("cycle {cycle}: recovery and checks"));
        let recovery_line = ft_log
            .lines()
            .find(|l| l.contains("cache recovered after an unclean shutdown"))
            .unwrap_or_else(|| {
                panic!("cycle {cycle}: flashtier did not report recovery after kill -9:\n{ft_log}")
            });
        let recovery = recovery_line
            .find("replayed_records")
            .map_or(String::new(), |i| recovery_line[i..].to_string());
        total_replayed += recovery
            .strip_prefix("replayed_records=")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no replayed_records in {recovery_line:?}"));
        rig.attach();
        let t_restart = t.elapsed();
        let t = Instant::now();
        let fsck = rig.fsck_after_crash();
        let t_fsck = t.elapsed();
        rig.fuse().mount(&mnt);
        let (t_db, db_log) = rig.start_mariadb();
        // InnoDB must have crashed (or the test did not test anything) and recovered without
        // complaint: a page older than the redo log expects ("log sequence number ... is in the
        // future"), a checksum failure or a torn page shows up here as an [ERROR].
        assert!(
            db_log.contains("Starting crash recovery"),
            "cycle {cycle}: mariadbd did not run InnoDB crash recovery after kill -9:\n{db_log}"
        );
        let errors: Vec<&str> = db_log.lines().filter(|l| l.contains("[ERROR]")).collect();
        assert!(
            errors.is_empty(),
            "cycle {cycle}: mariadbd reported errors while recovering ({errors:#?}):\n{db_log}"
        );
        let t = Instant::now();
        let (max, checks) = rig.check_database(acked);
        let t_checks = t.elapsed();
        drop(watchdog);
        ledger_next = max + 1;
        total_acked = acked;
        println!(
            "cycle {cycle}: load {} (sysbench ~{tps} tps, ledger acked up to {acked}); teardown {}; \
             flashtier recovered ({recovery}) + nbdfuse + loop {}; {fsck} in {}; mariadbd up \
             after InnoDB crash recovery in {}; {checks} in {}; cycle {}",
            secs(load),
            secs(t_teardown),
            secs(t_restart),
            secs(t_fsck),
            secs(t_db),
            secs(t_checks),
            secs(t_cycle.elapsed()),
        );
    }

    // Clean shutdown of everything; the file system must be clean and the cache reopen cleanly.
    let t = Instant::now();
    let watchdog = rig.watchdog("clean shutdown");
    rig.stop_mariadb();
    rig.fuse().umount();
    harness::assert_fsck_clean(rig.dev(), "after a clean shutdown");
    rig.detach_clean();
    drop(watchdog);
    rig.stop_flashtier();
    rig.starts += 1;
    let log = rig.start_flashtier("writeback");
    assert!(
        log.contains("cache opened after a clean shutdown"),
        "flashtier did not reopen cleanly after SIGTERM:\n{log}"
    );
    let watchdog = rig.watchdog("clean reopen");
    rig.attach();
    harness::assert_fsck_clean(rig.dev(), "after reopening the cache");
    rig.detach_clean();
    drop(watchdog);
    rig.stop_flashtier();
    println!(
        "mariadb summary: {cycles} crash cycles of mariadbd + flashtier (kill -9), every recovery \
         clean (flashtier replaying {total_replayed} records in all, e2fsck, InnoDB, CHECK TABLE, \
         mysqlcheck, row counts, {total_acked} ledger commits); clean shutdown and e2fsck -fn \
         clean in {}; total {}",
        secs(t.elapsed()),
        secs(t_all.elapsed())
    );
    drop(rig);
}

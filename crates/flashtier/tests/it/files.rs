//! The files and sockets `flashtier serve` creates, against other users and odd umasks: the
//! stats files are never written through a link another user planted (as `nobody`, in a
//! sticky world-writable directory and in a directory `nobody` owns); stats files are 0644,
//! sockets 0600 and created directories 0755 under umask 000; `set --persist` keeps the config
//! file's mode and owner; the run directory is created 0755 and refused when another user owns
//! it or others can write it. Needs root (to act as `nobody`).

use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::harness::*;

/// `nobody`'s uid and gid.
fn nobody() -> (u32, u32) {
    let name = CString::new("nobody").unwrap();
    // SAFETY: getpwnam returns null or a pointer to a static record, read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "no user `nobody` on this machine");
    // SAFETY: checked non-null just above.
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

fn chown(path: &Path, (uid, gid): (u32, u32)) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Mode bits of `path` itself (not following a link).
fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{path:?}: {e}"))
        .mode()
        & 0o7777
}

fn mkdir(path: &Path, mode: u32, owner: (u32, u32)) -> PathBuf {
    std::fs::create_dir(path).unwrap();
    chmod(path, mode);
    chown(path, owner);
    path.to_path_buf()
}

/// A scratch directory other users can traverse (scratch directories are 0700), with a 16 MiB
/// backing file `nobody` may use.
fn shared_scratch() -> (Scratch, PathBuf) {
    let dir = Scratch::new();
    chmod(dir.path(), 0o755);
    let backing = dir.path().join("backing");
    sparse_file(&backing, 16 << 20);
    chown(&backing, nobody());
    (dir, backing)
}

/// How to start `flashtier serve`: as whom, with which umask and environment.
#[derive(Default)]
struct As {
    nobody: bool,
    umask: Option<libc::mode_t>,
    env: Vec<(&'static str, PathBuf)>,
    env_remove: Vec<&'static str>,
}

// Both spawners apply the same settings; `command` is the one description of them.

impl As {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve").args(args).env("FLASHTIER_LOG", "info");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        for k in &self.env_remove {
            cmd.env_remove(k);
        }
        if self.nobody {
            let (uid, gid) = nobody();
            cmd.uid(uid).gid(gid);
        }
        if let Some(mask) = self.umask {
            // SAFETY: umask is async-signal-safe and cannot fail.
            unsafe {
                cmd.pre_exec(move || {
                    libc::umask(mask);
                    Ok(())
                });
            }
        }
        cmd
    }

    /// Starts the server and waits for its "listening on" line.
    fn serve(&self, args: &[&str]) -> Running {
        let mut child = self
            .command(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start flashtier");
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.starts_with("flashtier: listening on ") => {
                    return Running(KillOnDrop(Some(child)))
                }
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    let out = child.wait_with_output().unwrap();
                    panic!("flashtier serve {args:?} did not start:\n{}", text(&out));
                }
            }
        }
    }

    /// Runs a server expected to refuse to start; one that starts anyway is stopped after 20 s
    /// (exit 124), failing the caller's check instead of hanging the test.
    fn refused(&self, args: &[&str]) -> Output {
        let cmd = self.command(args);
        let program = cmd.get_program().to_owned();
        // The same settings, applied to `timeout`, which flashtier inherits.
        let mut timeout = Command::new("timeout");
        timeout.arg("20").arg(program).args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => timeout.env(k, v),
                None => timeout.env_remove(k),
            };
        }
        if self.nobody {
            let (uid, gid) = nobody();
            timeout.uid(uid).gid(gid);
        }
        if let Some(mask) = self.umask {
            // SAFETY: umask is async-signal-safe and cannot fail.
            unsafe {
                timeout.pre_exec(move || {
                    libc::umask(mask);
                    Ok(())
                });
            }
        }
        drop(cmd);
        run_any(&mut timeout)
    }
}

struct Running(KillOnDrop);

impl Running {
    fn pid(&mut self) -> u32 {
        self.0.child().id()
    }

    /// SIGTERM, and the exit status.
    fn stop(mut self) -> ExitStatus {
        let child = self.0.child();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        wait_or_kill(child, Duration::from_secs(30)).expect("flashtier did not exit after SIGTERM")
    }
}

/// The attack of issue 10: a root server writes its stats file into a directory another user
/// can write; that user plants symlinks to a root-only file where the server's temporary file
/// (formerly `.NAME.tmp-PID`) and the stats files go. The file must stay untouched and the
/// stats files must stay regular files of mode 0644, still refreshed.
#[test]
fn stats_files_are_never_written_through_another_users_links() {
    let (dir, backing) = shared_scratch();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious root-only data\n").unwrap();
    chmod(&victim, 0o600);
    let private = mkdir(&dir.path().join("private"), 0o700, (0, 0));
    let targets = [
        // /tmp-like: sticky and world-writable, owned by root.
        mkdir(&dir.path().join("sticky"), 0o1777, (0, 0)),
        // A directory the attacker owns (links there are followed whatever
        // fs.protected_symlinks says).
        mkdir(&dir.path().join("theirs"), 0o755, nobody()),
    ];
    for (i, target) in targets.iter().enumerate() {
        let stats = target.join("ft.stats");
        let control = private.join(format!("control-{i}.sock"));
        let listen = private.join(format!("nbd-{i}.sock"));
        let mut server = As::default().serve(&[
            "--backing",
            path_str(&backing),
            "--listen",
            path_str(&listen),
            "--control-socket",
            path_str(&control),
            "--stats-file",
            path_str(&stats),
        ]);
        let pid = server.pid();
        let mut links = vec![
            target.join(format!(".ft.stats.tmp-{pid}")),
            target.join(format!(".ft.stats.json.tmp-{pid}")),
        ];
        if target.ends_with("theirs") {
            // The owner of the directory may also replace the files themselves.
            links.push(stats.clone());
            links.push(target.join("ft.stats.json"));
        }
        for link in &links {
            let ln = run_any(
                Command::new("runuser")
                    .args(["-u", "nobody", "--", "ln", "-sfn"])
                    .arg(&victim)
                    .arg(link),
            );
            assert!(ln.status.success(), "ln -s as nobody: {}", text(&ln));
        }
        let planted = std::time::SystemTime::now();
        std::thread::sleep(Duration::from_millis(2500));
        assert_eq!(
            String::from_utf8_lossy(&std::fs::read(&victim).unwrap()),
            "precious root-only data\n",
            "the root server wrote through a link `nobody` planted in {target:?}"
        );
        assert_eq!(mode(&victim), 0o600, "the victim's mode changed");
        for f in [stats.clone(), target.join("ft.stats.json")] {
            let m = std::fs::symlink_metadata(&f).unwrap();
            assert!(m.is_file(), "{f:?} is not a regular file");
            assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o644), "{f:?}");
        }
        assert!(
            std::fs::metadata(&stats).unwrap().modified().unwrap() > planted,
            "the stats file stopped being refreshed"
        );
        assert!(std::fs::read_to_string(&stats)
            .unwrap()
            .contains("client_writes"));
        assert!(server.stop().success());
    }
}

/// Under umask 000 (and 077), what the server creates gets the modes it means: stats files
/// 0644, sockets 0600, directories it creates 0755; `set --persist` keeps the config file's
/// mode and owner.
#[test]
fn modes_do_not_depend_on_the_umask() {
    let (dir, backing) = shared_scratch();
    let cache = dir.path().join("cache");
    let out = run_any(Command::new(BIN).args([
        "format",
        "--no-probe",
        "--cache",
        path_str(&cache),
        "--backing",
        path_str(&backing),
        "--size",
        "8M",
        "--segment-size",
        "1M",
    ]));
    assert!(out.status.success(), "{}", text(&out));
    for umask in [0o000, 0o077] {
        let base = dir.path().join(format!("umask-{umask:03o}"));
        std::fs::create_dir(&base).unwrap();
        let config = base.join("flashtier.toml");
        std::fs::write(&config, "[policy]\npromotion = \"always\"\n").unwrap();
        chmod(&config, 0o640);
        chown(&config, nobody());
        let control = base.join("ctl/control.sock");
        let stats = base.join("stats/ft.stats");
        let listen = base.join("nbd/nbd.sock");
        let server = As {
            umask: Some(umask),
            ..As::default()
        }
        .serve(&[
            "--config",
            path_str(&config),
            "--backing",
            path_str(&backing),
            "--cache",
            path_str(&cache),
            "--listen",
            path_str(&listen),
            "--control-socket",
            path_str(&control),
            "--stats-file",
            path_str(&stats),
        ]);
        let expect = [
            (stats.clone(), 0o644),
            (base.join("stats/ft.stats.json"), 0o644),
            (control.clone(), 0o600),
            (listen.clone(), 0o600),
        ];
        for (p, m) in &expect {
            assert_eq!(mode(p), *m, "{p:?} under umask {umask:03o}");
        }
        if umask == 0 {
            // Directories it creates are never writable by others (under 077 they may be
            // stricter: the operator asked for that).
            for d in ["ctl", "stats", "nbd"] {
                assert_eq!(mode(&base.join(d)), 0o755, "{d} under umask 000");
            }
        }
        // Rewritten files keep the modes too.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(mode(&stats), 0o644);
        let set = run_any(
            Command::new(BIN)
                .args(["set", "promotion", "nhit", "--persist", "--control"])
                .arg(&control),
        );
        assert!(set.status.success(), "{}", text(&set));
        let m = std::fs::metadata(&config).unwrap();
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (nobody().0, nobody().1, 0o640),
            "set --persist changed the config file's owner or mode"
        );
        assert!(std::fs::read_to_string(&config)
            .unwrap()
            .contains("promotion = \"nhit\""));
        assert!(server.stop().success());
    }
}

/// The run directory (here `$XDG_RUNTIME_DIR/flashtier` and `$TMPDIR/flashtier-UID` of a server
/// run as `nobody`) is created 0755 under umask 000, and refused, with a message that says why
/// and writing nothing, when another user owns it or others can write it.
#[test]
fn the_run_directory_is_ours_or_refused() {
    let (dir, backing) = shared_scratch();
    let (uid, _) = nobody();
    let serve_args = ["--backing", path_str(&backing)];

    // Created: 0755 whatever the umask, with the defaults inside.
    let xdg = mkdir(&dir.path().join("xdg"), 0o700, nobody());
    let server = As {
        nobody: true,
        umask: Some(0),
        env: vec![("XDG_RUNTIME_DIR", xdg.clone())],
        ..As::default()
    }
    .serve(&serve_args);
    let run = xdg.join("flashtier");
    assert_eq!(mode(&run), 0o755, "run directory under umask 000");
    assert_eq!(std::fs::metadata(&run).unwrap().uid(), uid);
    for (name, m) in [
        ("nbd.sock", 0o600),
        ("control.sock", 0o600),
        ("stats", 0o644),
        ("stats.json", 0o644),
    ] {
        assert_eq!(mode(&run.join(name)), m, "{name}");
    }
    assert!(server.stop().success());

    // Refused: owned by another user (writable by all, or not), or ours but writable by others
    // (sticky or not). Both the XDG location and the /tmp fallback.
    let cases: [(&str, u32, (u32, u32), &str); 4] = [
        ("other-open", 0o777, (0, 0), "belongs to uid 0"),
        ("other", 0o755, (0, 0), "belongs to uid 0"),
        ("ours-open", 0o777, nobody(), "mode 0777"),
        ("ours-sticky", 0o1777, nobody(), "mode 1777"),
    ];
    for (name, m, owner, says) in cases {
        let parent = mkdir(&dir.path().join(name), 0o1777, (0, 0));
        for (env, env_remove, run) in [
            (
                vec![("XDG_RUNTIME_DIR", parent.clone())],
                vec![],
                parent.join("flashtier"),
            ),
            (
                vec![("TMPDIR", parent.clone())],
                vec!["XDG_RUNTIME_DIR"],
                parent.join(format!("flashtier-{uid}")),
            ),
        ] {
            mkdir(&run, m, owner);
            let how = As {
                nobody: true,
                env,
                env_remove,
                ..As::default()
            };
            let out = how.refused(&serve_args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.code() == Some(1) && err.contains(path_str(&run)) && err.contains(says),
                "{run:?} ({m:04o}, owner {owner:?}) was not refused for {says:?}:\n{}",
                text(&out)
            );
            assert_eq!(
                std::fs::read_dir(&run).unwrap().count(),
                0,
                "something was created in {run:?}"
            );
            assert_eq!(mode(&run), m, "{run:?}'s mode was changed");
            std::fs::remove_dir(&run).unwrap();
        }
    }
}

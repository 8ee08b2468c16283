//! Records what `flashtier --version` (and `flashtier status`, for a running server) reports
//! beside the crate version: the git commit it was built from and the build date.
//!
//! - `FLASHTIER_GIT_COMMIT`: `git rev-parse --short HEAD`, or the variable of that name when set
//!   (a distribution building from a tarball knows its commit), else `unknown` (no git, or not
//!   a checkout: `cargo install` from a crate tarball).
//! - `FLASHTIER_BUILD_DATE`: `YYYY-MM-DD` (UTC) of `SOURCE_DATE_EPOCH` when set (reproducible
//!   builds), else of now.
//!
//! The script reruns only when HEAD moves (a commit, a checkout), not on every build: cargo
//! watches the HEAD file of this worktree and the ref it points to. A worktree's `.git` is a file
//! naming its own git directory, whose HEAD is private while branch refs live in the common one;
//! `git rev-parse --git-dir/--git-common-dir` resolves both.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=FLASHTIER_GIT_COMMIT");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");

    let commit = match std::env::var("FLASHTIER_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => git_commit().unwrap_or_else(|| "unknown".into()),
    };
    println!("cargo:rustc-env=FLASHTIER_GIT_COMMIT={commit}");

    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
    println!("cargo:rustc-env=FLASHTIER_BUILD_DATE={}", date(secs));
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(std::env::var_os("CARGO_MANIFEST_DIR")?)
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

/// The short commit of HEAD, after telling cargo which files to watch for it to change.
fn git_commit() -> Option<String> {
    // Relative paths come back relative to the manifest directory.
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let abs = |p: String| dir.join(p);
    let git_dir = abs(git(&["rev-parse", "--git-dir"])?);
    let common_dir = abs(git(&["rev-parse", "--git-common-dir"])?);
    watch(&git_dir.join("HEAD"));
    // On a branch: its loose ref, or packed-refs while it has none (the directory is watched
    // then, since a commit creates the loose ref there). Detached: HEAD holds the commit.
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        let loose = common_dir.join(&branch);
        if loose.exists() {
            watch(&loose);
        } else if let Some(parent) = loose.parent().filter(|p| p.exists()) {
            watch(parent);
        }
        watch(&common_dir.join("packed-refs"));
    }
    git(&["rev-parse", "--short", "HEAD"])
}

/// A path cargo reruns the script for. Only existing ones: cargo reruns on every build for a
/// path that does not exist.
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `YYYY-MM-DD` of a Unix time, UTC (Howard Hinnant's days-to-civil algorithm).
fn date(secs: i64) -> String {
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

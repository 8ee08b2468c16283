//! The run directory: where `flashtier serve` puts its sockets and stats file unless told
//! otherwise, and where the control commands look for the control socket.
//!
//! `/run/flashtier` as root, else `$XDG_RUNTIME_DIR/flashtier` (else `/tmp/flashtier-UID`).
//! Whoever can write this directory can replace the sockets (and so impersonate the server to
//! `flashtier status`, or hold its socket names) and plant links where the stats files go. So
//! [`prepare`] creates it mode 0755 whatever the umask, and refuses one that exists but is not
//! a directory of ours that only we can write: owned by another user, a symlink, or writable by
//! group or others. A sticky bit does not make a shared directory acceptable: it only stops
//! others deleting our files, not creating theirs under the names we are about to use. The
//! operator fixes such a directory (`chown`, `chmod 755`, or removes it) or names other paths
//! (`--listen`, `--control-socket`, `--stats-file`).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The mode of a run directory flashtier creates.
pub const MODE: u32 = 0o755;

/// Why the run directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// Creating, opening or examining the directory failed (its parent missing, no permission).
    #[error("cannot create the run directory {}: {source}", dir.display())]
    Create {
        /// The run directory.
        dir: PathBuf,
        /// The failing call's error.
        #[source]
        source: io::Error,
    },
    /// The path is a symlink or something other than a directory; never followed.
    #[error(
        "the run directory {} is a symbolic link or not a directory; remove it, or give \
         --listen, --control-socket and --stats-file elsewhere",
        dir.display()
    )]
    NotADirectory {
        /// The run directory.
        dir: PathBuf,
    },
    /// The directory belongs to another user, who could replace what flashtier puts there.
    #[error(
        "the run directory {} belongs to uid {owner}, not to this server (uid {me}): whoever owns \
         it can replace the sockets and files flashtier creates there. Remove it (flashtier \
         recreates it), or give --listen, --control-socket and --stats-file elsewhere",
        dir.display()
    )]
    NotOurs {
        /// The run directory.
        dir: PathBuf,
        /// The uid owning it.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// Group or others can write the directory, so they could replace what flashtier puts there.
    #[error(
        "the run directory {} has mode {mode:04o}: other users can write it and so replace the \
         sockets and files flashtier creates there. `chmod 755` it (or remove it: flashtier \
         recreates it mode 0755), or give --listen, --control-socket and --stats-file elsewhere",
        dir.display()
    )]
    Writable {
        /// The run directory.
        dir: PathBuf,
        /// Its permission bits (including setuid, setgid and sticky).
        mode: u32,
    },
}

/// The run directory for this user.
pub fn default_path() -> PathBuf {
    let uid = flashtier_io::sys::effective_uid();
    if uid == 0 {
        return PathBuf::from("/run/flashtier");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("flashtier"),
        None => std::env::temp_dir().join(format!("flashtier-{uid}")),
    }
}

/// Creates `dir` (mode [`MODE`]; its parent must exist) or checks the one that is there: a
/// directory, not a symlink, owned by this user, not writable by group or others.
pub fn prepare(dir: &Path) -> Result<(), RunDirError> {
    let created = match DirBuilder::new().mode(MODE).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(source) => {
            return Err(RunDirError::Create {
                dir: dir.to_path_buf(),
                source,
            })
        }
    };
    // Checked on an open descriptor, never by path again: what is checked is what is used.
    let d = open_dir(dir).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) | Some(libc::ENOTDIR) => RunDirError::NotADirectory {
            dir: dir.to_path_buf(),
        },
        _ => RunDirError::Create {
            dir: dir.to_path_buf(),
            source: e,
        },
    })?;
    let create = |source| RunDirError::Create {
        dir: dir.to_path_buf(),
        source,
    };
    let meta = d.metadata().map_err(create)?;
    let me = flashtier_io::sys::effective_uid();
    if meta.uid() != me {
        return Err(RunDirError::NotOurs {
            dir: dir.to_path_buf(),
            owner: meta.uid(),
            me,
        });
    }
    if created {
        // The umask may have taken bits away (0700 is safe, but the stats file is for
        // monitoring to read) or, at 000, left none to take: the mode is exactly MODE.
        d.set_permissions(std::fs::Permissions::from_mode(MODE))
            .map_err(create)?;
    } else if meta.mode() & 0o022 != 0 {
        return Err(RunDirError::Writable {
            dir: dir.to_path_buf(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

fn open_dir(dir: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn created_0755_and_accepted_again() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("flashtier");
        prepare(&dir).unwrap();
        assert_eq!(mode(&dir), MODE);
        prepare(&dir).unwrap();
        // Stricter than ours is the owner's choice.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        prepare(&dir).unwrap();
    }

    #[test]
    fn writable_by_others_is_refused_even_when_sticky() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("flashtier");
        std::fs::create_dir(&dir).unwrap();
        for m in [0o777, 0o1777, 0o775, 0o757] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(m)).unwrap();
            let e = prepare(&dir).unwrap_err();
            assert!(matches!(e, RunDirError::Writable { .. }), "{m:o}: {e}");
            assert!(e.to_string().contains(&format!("{m:04o}")), "{e}");
            assert_eq!(mode(&dir), m, "left as it was");
        }
    }

    #[test]
    fn symlinks_and_files_are_refused() {
        let parent = tempfile::tempdir().unwrap();
        let real = parent.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = parent.path().join("flashtier");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = prepare(&link).unwrap_err();
        assert!(matches!(e, RunDirError::NotADirectory { .. }), "{e}");
        let file = parent.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare(&file).unwrap_err();
        assert!(matches!(e, RunDirError::NotADirectory { .. }), "{e}");
        let e = prepare(&parent.path().join("no/such")).unwrap_err();
        assert!(matches!(e, RunDirError::Create { .. }), "{e}");
    }

    #[test]
    fn another_users_directory_is_refused() {
        if flashtier_io::sys::effective_uid() != 0 {
            eprintln!("skipped: needs root to give a directory away");
            return;
        }
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("flashtier");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = prepare(&dir).unwrap_err();
        assert!(
            matches!(e, RunDirError::NotOurs { owner: 65534, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("uid 65534"), "{e}");
    }
}

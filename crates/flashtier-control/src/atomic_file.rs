//! Replacing a file so that a reader sees the old content or the new, never half of either, and
//! so that nothing another user put in the directory can redirect the write.
//!
//! The server runs as root and may be told to write into a directory other users can write
//! (`--stats-file /tmp/ft.stats`). So the new content goes to a temporary file whose name is
//! random (nobody can plant a symlink at it in advance), created with `O_CREAT | O_EXCL |
//! O_NOFOLLOW` (an existing file or symlink at that name is an error, never opened), private
//! until it has its final mode, which is set with `fchmod` on the open file (so the umask the
//! server was started with does not matter, and no path is looked up again). `rename(2)` then
//! puts it in place; it replaces whatever is at the target, a symlink included, without
//! following it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Whether the new content must survive a crash once `replace` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// Sync the file and its directory (a config file an operator changed).
    Synced,
    /// No syncs (the stats file: rewritten every second and worthless after a crash).
    Volatile,
}

/// The permissions the new file gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Perms {
    /// Exactly this mode, whatever was there before and whatever the umask.
    Fixed(u32),
    /// The mode, owner and group of the file being replaced (a config file an operator set up);
    /// `new` for a file that does not exist yet. A symlink at the path is refused: replacing it
    /// would silently cut the operator's link, and writing through it is what this module
    /// never does.
    Keep { new: u32 },
}

/// Writes `data` to a fresh temporary file beside `path` and renames it over `path`; the
/// temporary file is removed if anything fails.
pub(crate) fn replace(
    path: &Path,
    data: &[u8],
    durability: Durability,
    perms: Perms,
) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file name"))?;
    // (mode, Some((uid, gid)) to keep)
    let (mode, owner) = match perms {
        Perms::Fixed(mode) => (mode, None),
        Perms::Keep { new } => match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is a symbolic link; the file is replaced, not written through a \
                         link: name the file it points to instead",
                        path.display()
                    ),
                ))
            }
            Ok(m) if !m.file_type().is_file() => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} is not a regular file", path.display()),
                ))
            }
            Ok(m) => (m.mode() & 0o777, Some((m.uid(), m.gid()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => (new, None),
            Err(e) => return Err(e),
        },
    };
    let (tmp, mut f) = create_temp(&dir, &file_name.to_string_lossy())?;
    let synced = durability == Durability::Synced;
    let result = (|| {
        if let Some((uid, gid)) = owner {
            let m = f.metadata()?;
            if (m.uid(), m.gid()) != (uid, gid) {
                std::os::unix::fs::fchown(&f, Some(uid), Some(gid)).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "cannot keep {}'s owner {uid}:{gid} on its replacement: {e}",
                            path.display()
                        ),
                    )
                })?;
            }
        }
        // After the chown: changing the owner clears set-id bits, and the mode must be exact.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        if synced {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)?;
        if synced {
            File::open(&dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Creates `.NAME.tmp-RANDOM` in `dir`, mode 0600, refusing to open anything that exists.
fn create_temp(dir: &Path, name: &str) -> io::Result<(PathBuf, File)> {
    let mut last = None;
    // A collision of 64 random bits means someone is guessing; a few tries show it is not luck.
    for _ in 0..4 {
        let tmp = dir.join(format!(".{name}.tmp-{:016x}", random_u64()?));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
}

/// 64 bits from the kernel's random source.
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut buf = [0u8; 8];
    flashtier_io::sys::fill_random(&mut buf)?;
    Ok(u64::from_ne_bytes(buf))
}

/// Creates `dir` and its missing parents mode 0755 (less if the umask says so, never more: a
/// directory the server creates is never writable by others).
pub(crate) fn create_dirs(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_symlink_at_the_target_is_replaced_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let target = dir.path().join("stats");
        symlink(&victim, &target).unwrap();
        replace(&target, b"new", Durability::Volatile, Perms::Fixed(0o644)).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(&target).unwrap().is_file());
        assert_eq!(mode(&target), 0o644);
    }

    #[test]
    fn temp_names_are_random_and_existing_names_are_never_opened() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = create_temp(dir.path(), "x").unwrap();
        let (b, _) = create_temp(dir.path(), "x").unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".x.tmp-") && name.len() == ".x.tmp-".len() + 16);
        assert_eq!(mode(&a), 0o600, "private until it has its final mode");
        // The open itself refuses a name that exists, symlink or not.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let planted = dir.path().join("planted");
        symlink(&victim, &planted).unwrap();
        let e = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&planted)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn fixed_modes_ignore_the_old_file_and_keep_modes_keep_it() {
        let dir = tempfile::tempdir().unwrap();
        let stats = dir.path().join("stats");
        std::fs::write(&stats, b"old").unwrap();
        std::fs::set_permissions(&stats, std::fs::Permissions::from_mode(0o666)).unwrap();
        replace(&stats, b"new", Durability::Volatile, Perms::Fixed(0o644)).unwrap();
        assert_eq!(mode(&stats), 0o644);

        let config = dir.path().join("flashtier.toml");
        std::fs::write(&config, b"old").unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o640)).unwrap();
        let keep = Perms::Keep { new: 0o644 };
        replace(&config, b"new", Durability::Synced, keep).unwrap();
        assert_eq!(mode(&config), 0o640);
        assert_eq!(std::fs::read(&config).unwrap(), b"new");
        let fresh = dir.path().join("fresh.toml");
        replace(&fresh, b"new", Durability::Synced, keep).unwrap();
        assert_eq!(mode(&fresh), 0o644);

        // A symlinked config is refused and neither it nor its target changes.
        let link = dir.path().join("link.toml");
        symlink(&config, &link).unwrap();
        let e = replace(&link, b"evil", Durability::Synced, keep).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&config).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.contains(".tmp-")), "{names:?}");
    }

    #[test]
    fn a_kept_owner_survives_the_replacement() {
        if flashtier_io::sys::effective_uid() != 0 {
            eprintln!("skipped: needs root to give a file away");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("flashtier.toml");
        std::fs::write(&config, b"old").unwrap();
        std::os::unix::fs::chown(&config, Some(65534), Some(65534)).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
        replace(
            &config,
            b"new",
            Durability::Synced,
            Perms::Keep { new: 0o644 },
        )
        .unwrap();
        let m = std::fs::metadata(&config).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o777), (65534, 65534, 0o600));
    }

    #[test]
    fn created_directories_are_never_writable_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b");
        create_dirs(&deep).unwrap();
        for d in [dir.path().join("a"), deep] {
            assert_eq!(mode(&d) & 0o022, 0, "{d:?}");
        }
    }
}

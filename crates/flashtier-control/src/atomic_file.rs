//! Replacing a file so that a reader sees the old content or the new, never half of either.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Whether the new content must survive a crash once `replace` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// Sync the file and its directory (a config file an operator changed).
    Synced,
    /// No syncs (the stats file: rewritten every second and worthless after a crash).
    Volatile,
}

/// Writes `data` to a temporary file beside `path` (keeping the old file's permissions) and
/// renames it over `path`; the temporary file is removed if anything fails.
pub(crate) fn replace(path: &Path, data: &[u8], durability: Durability) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let synced = durability == Durability::Synced;
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            f.set_permissions(meta.permissions())?;
        }
        f.write_all(data)?;
        if synced {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)?;
        if synced {
            std::fs::File::open(&dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

//! The cat-able stats file: `PATH` (`name value` lines) and `PATH.json` (the report), both
//! replaced atomically (temp file + rename), so a reader never sees half a file. They are
//! mode 0644 whatever the umask (monitoring reads them; nobody else writes them), and written
//! safely even in a directory other users can write (see `atomic_file`).

use std::io;
use std::path::{Path, PathBuf};

use crate::atomic_file::{create_dirs, replace, Durability, Perms};

/// The stats files' mode.
const MODE: u32 = 0o644;
use crate::report::Report;

/// The two stats files one report is written to every tick.
pub(crate) struct StatsFile {
    text: PathBuf,
    json: PathBuf,
}

impl StatsFile {
    /// Files at `path` and `path.json`; the directory is created (0755) if missing.
    pub fn create(path: &Path) -> io::Result<StatsFile> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            create_dirs(dir)?;
        }
        let mut json = path.as_os_str().to_owned();
        json.push(".json");
        Ok(StatsFile {
            text: path.to_path_buf(),
            json: PathBuf::from(json),
        })
    }

    /// The text file (`name value` lines).
    pub fn path(&self) -> &Path {
        &self.text
    }

    /// The JSON twin: the text file's path with `.json` appended.
    pub fn json_path(&self) -> &Path {
        &self.json
    }

    /// Writes both files from one report, so their numbers agree.
    pub fn write(&self, report: &Report) -> io::Result<()> {
        let perms = Perms::Fixed(MODE);
        replace(
            &self.text,
            report.to_stats_text().as_bytes(),
            Durability::Volatile,
            perms,
        )?;
        let mut json = serde_json::to_vec_pretty(report).map_err(io::Error::other)?;
        json.push(b'\n');
        replace(&self.json, &json, Durability::Volatile, perms)
    }

    /// Removes both files (on shutdown: a file that stopped changing would mislead a monitor).
    pub fn remove(&self) {
        for p in [&self.text, &self.json] {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::tests::cached;
    use flashtier_io::BlockDev;

    #[test]
    fn text_and_json_carry_the_same_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let (c, dev) = cached(None);
        dev.write_at(&[3u8; 8192], 0, false).unwrap();
        let f = StatsFile::create(&dir.path().join("run/stats")).unwrap();
        f.write(&c.report()).unwrap();
        let text = std::fs::read_to_string(f.path()).unwrap();
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(f.json_path()).unwrap()).unwrap();
        let counters = json["counters"].as_object().unwrap();
        assert!(!counters.is_empty());
        for (k, v) in counters {
            let line = text
                .lines()
                .find(|l| l.split(' ').next() == Some(k.as_str()))
                .unwrap_or_else(|| panic!("{k} missing"));
            assert_eq!(line, format!("{k} {v}"));
        }
        assert_eq!(counters["writes"], 1);
        f.remove();
        assert!(!f.path().exists() && !f.json_path().exists());
        assert_eq!(
            std::fs::read_dir(dir.path().join("run")).unwrap().count(),
            0,
            "no temp files left"
        );
    }
}

//! `flashtier config check FILE`: validate a config file and show what it sets.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use flashtier_control::config::{self, Config};
use flashtier_engine::PARAMS;

#[derive(Args, Debug)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub command: ConfigCommand,
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Check a config file the way `flashtier serve --config FILE` reads it: every table and key
    /// known, every value allowed. Prints "FILE: ok" and each setting (the default where the
    /// file sets nothing), or what is wrong (file, line, key and the allowed values) and exits
    /// with status 1. flashtier.example.toml in the source tree documents every key.
    Check {
        /// The config file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

pub fn run(args: ConfigArgs) -> anyhow::Result<()> {
    match args.command {
        ConfigCommand::Check { file } => {
            let config = config::load(&file)?;
            print!("{}", summary(&config));
            Ok(())
        }
    }
}

/// "FILE: ok", then every `[serve]` key and live parameter: its value where the file sets it,
/// else the default that applies.
fn summary(config: &Config) -> String {
    let run_dir = crate::serve::default_run_dir();
    let width = config::SERVE_KEYS
        .iter()
        .map(|k| k.name.len())
        .chain(PARAMS.iter().map(|p| p.name.len()))
        .max()
        .unwrap_or(0);
    let mut out = format!("{}: ok\n[serve]\n", config.path.display());
    for (key, value) in config.serve.entries() {
        let line = match value {
            Some(v) => format!("  {:width$} = {v}", key.name),
            None => {
                let default = match key.name {
                    "listen" => run_dir.join("nbd.sock").display().to_string(),
                    "control_socket" => run_dir.join("control.sock").display().to_string(),
                    "stats_file" => run_dir.join("stats").display().to_string(),
                    _ => key.default.to_string(),
                };
                format!("  {:width$}   (default: {default})", key.name)
            }
        };
        writeln!(out, "{line}").unwrap();
    }
    out.push_str("[policy]\n");
    for p in PARAMS {
        let line = match config.policy.iter().find(|(name, _)| name == p.name) {
            Some((_, v)) => format!("  {:width$} = {v}", p.name),
            None => format!("  {:width$}   (default: {})", p.name, p.default),
        };
        writeln!(out, "{line}").unwrap();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_shows_what_is_set_and_the_defaults_of_the_rest() {
        let text = "[serve]\nbacking = \"/dev/sdb\"\nthreads = 8\n\
                    [policy]\nsequential_cutoff_read_kib = 1024\n";
        let config = config::parse(std::path::Path::new("/etc/f.toml"), text).unwrap();
        let s = summary(&config);
        assert!(s.starts_with("/etc/f.toml: ok\n[serve]\n"), "{s}");
        let has = |what: &str| assert!(s.lines().any(|l| l.contains(what)), "no {what:?}:\n{s}");
        for what in [
            "backing",
            "= \"/dev/sdb\"",
            "= 8",
            "sequential_cutoff_read_kib",
            "= 1024",
            "(default: 256)",
            "(default: lru)",
            "control.sock)",
        ] {
            has(what);
        }
        let lines = s.lines().count();
        assert_eq!(lines, 3 + config::SERVE_KEYS.len() + PARAMS.len(), "{s}");
    }
}

//! `flashtier generate man|completions DIR` (hidden): man pages and shell completions made from
//! the clap definition the binary parses with, so they cannot drift from it. The Debian package
//! (scripts/build-deb.sh) ships what this writes.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use clap_complete::Shell;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Man pages: flashtier.1, and flashtier-SUBCOMMAND.1 for each subcommand (nested ones as
    /// flashtier-config-check.1).
    Man {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
    /// Completions: flashtier.bash, _flashtier (zsh) and flashtier.fish.
    Completions {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
}

/// Writes what `args` asks for, made from `cmd`, the whole command line interface.
pub fn run(args: GenerateArgs, mut cmd: clap::Command) -> anyhow::Result<()> {
    let (What::Man { dir } | What::Completions { dir }) = &args.what;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let written = match args.what {
        What::Man { ref dir } => {
            // clap's `help` subcommand (`flashtier help serve` = `flashtier serve --help`) has no
            // page of its own to list. Built, subcommands know their full names
            // (`flashtier-serve`) and the global options.
            cmd = cmd.disable_help_subcommand(true);
            cmd.build();
            let mut written = Vec::new();
            man_pages(&cmd, dir, &mut written)?;
            written
        }
        What::Completions { ref dir } => {
            let mut cmd = without_hidden_subcommands(&cmd);
            [Shell::Bash, Shell::Zsh, Shell::Fish]
                .into_iter()
                .map(|shell| clap_complete::generate_to(shell, &mut cmd, "flashtier", dir))
                .collect::<Result<_, _>>()
                .with_context(|| format!("cannot write completions to {}", dir.display()))?
        }
    };
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}

/// `cmd` (not yet built) without its hidden subcommands (`generate`), which clap_complete
/// would offer: a copy of its name, help, options and visible subcommands, all completions use.
fn without_hidden_subcommands(cmd: &clap::Command) -> clap::Command {
    clap::Command::new("flashtier")
        .version(crate::VERSION)
        .about(cmd.get_about().cloned().unwrap_or_default())
        .args(cmd.get_arguments().cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned())
}

/// The page of `cmd`, then those of its visible subcommands, recursively.
fn man_pages(cmd: &clap::Command, dir: &Path, written: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    let page = clap_mangen::Man::new(cmd.clone())
        .date(env!("FLASHTIER_BUILD_DATE"))
        // The page's footer; its VERSION section has the commit and build date.
        .source(format!("flashtier {}", env!("CARGO_PKG_VERSION")))
        .manual("flashtier manual");
    let path = page
        .generate_to(dir)
        .with_context(|| format!("cannot write a man page to {}", dir.display()))?;
    written.push(path);
    for sub in cmd.get_subcommands() {
        // `help` is clap's own (`flashtier help serve` = `flashtier serve --help`).
        if !sub.is_hide_set() && sub.get_name() != "help" {
            man_pages(sub, dir, written)?;
        }
    }
    Ok(())
}

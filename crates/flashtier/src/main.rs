//! The `flashtier` command.

mod backing;
mod demo;
mod format;
mod serve;
mod units;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "flashtier",
    version,
    about = "A fast, crash-safe storage cache in front of slow disks, exported as an NBD block device",
    long_about = "flashtier puts fast tiers in front of a slow store (a spinning disk, a network or \
cloud volume, any NBD server) and exports the result over the NBD protocol, so the Linux kernel \
client, qemu, libnbd's tools (nbdinfo, nbdcopy, nbdfuse) and fio can use it as an ordinary block \
device.\n\nStart with `flashtier demo`, then `flashtier serve --help`."
)]
struct Cli {
    /// Log filter for messages on stderr: error, warn, info, debug, trace, or per-module
    /// directives such as `flashtier_nbd=debug`. [default: info; warn for `demo`, whose report
    /// goes to stdout]
    #[arg(long, global = true, env = "FLASHTIER_LOG")]
    log: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prepare a cache file or device (an SSD) for a backing store.
    Format(format::FormatArgs),
    /// Serve a backing store over NBD, through a cache if one is given, until SIGINT/SIGTERM.
    Serve(serve::ServeArgs),
    /// Run a short, self-contained showcase: create a backing store, serve it, drive a workload
    /// through NBD, verify every byte, and report what happened.
    Demo(demo::DemoArgs),
}

fn main() {
    let cli = Cli::parse();
    let default_log = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info",
    };
    let log = cli.log.as_deref().unwrap_or(default_log);
    let filter = tracing_subscriber::EnvFilter::try_new(log).unwrap_or_else(|e| {
        eprintln!("flashtier: invalid --log filter '{log}': {e}");
        std::process::exit(2);
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();

    let result = match cli.command {
        Command::Format(args) => format::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Demo(args) => demo::run(args),
    };
    if let Err(e) = result {
        eprintln!("flashtier: error: {e:#}");
        std::process::exit(1);
    }
}

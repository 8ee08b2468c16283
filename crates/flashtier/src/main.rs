//! The `flashtier` command.

mod adopt;
mod advise;
mod backing;
mod config_cmd;
mod confirm;
mod ctl;
mod demo;
mod format;
mod generate;
mod integrity_cmd;
mod notify;
mod png;
mod probe;
mod serve;
mod shutdown;
mod trace_cmd;
mod units;

use clap::{CommandFactory, Parser, Subcommand};

/// What `flashtier --version` prints after the name, and what a running server reports in
/// `flashtier status`: the crate version, the commit and the build date (recorded by build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("FLASHTIER_GIT_COMMIT"),
    ", built ",
    env!("FLASHTIER_BUILD_DATE"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "flashtier",
    version = VERSION,
    about = "A fast, crash-safe storage cache in front of slow disks, exported as an NBD block device",
    long_about = "flashtier puts fast tiers in front of a slow store (a spinning disk, a network or \
cloud volume, any NBD server) and exports the result over the NBD protocol, so the Linux kernel \
client, qemu, libnbd's tools (nbdinfo, nbdcopy, nbdfuse) and fio can use it as an ordinary block \
device.\n\nStart with `flashtier demo`, then `flashtier serve --help`. While a server runs, \
`flashtier status`, `stats`, `get`, `set`, `mode`, `flush`, `reset-stats`, `detach`, `attach`, \
`scrub`, `forget-lost` and `memcached` operate it through its control socket."
)]
struct Cli {
    /// Log filter for messages on stderr: error, warn, info, debug, trace, or per-module
    /// directives such as `flashtier_nbd=debug`. [default: info for `serve`, `format` and
    /// `probe`; warn for the others, whose answers go to stdout]
    #[arg(long, global = true, env = "FLASHTIER_LOG")]
    log: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prepare a cache file or device (an SSD) for a backing store.
    Format(format::FormatArgs),
    /// Measure whether a device (or the filesystem a directory is on) is fit to be a write-back
    /// cache device: flush latency, random and sequential I/O, a sustained write timeline, what
    /// sysfs says of it, and a verdict with reasons. Writes only to a scratch file it creates,
    /// unless --destructive.
    Probe(probe::ProbeArgs),
    /// Serve a backing store over NBD, through a cache if one is given, until SIGINT/SIGTERM.
    Serve(Box<serve::ServeArgs>),
    /// Run a short, self-contained showcase: create a backing store, serve it, drive a workload
    /// through NBD, verify every byte, and report what happened.
    Demo(demo::DemoArgs),
    /// Show a running server's state: mode, sizes, used and dirty space, health, and the mode
    /// switch or flush in progress.
    Status(ctl::StatusArgs),
    /// Show a running server's statistics: counters in total and over the last 5 minutes, hour
    /// and day, hit rates, latency percentiles per operation, and the flash wear forecast.
    Stats(ctl::StatsArgs),
    /// Show a live parameter of a running server (or `--all` of them, with defaults and allowed
    /// values).
    Get(ctl::GetArgs),
    /// Change live parameters of a running server, effective from the next request, without a
    /// restart; several at once change together (`--persist` also writes them to the config
    /// file). Parameters are listed in --help.
    Set(ctl::SetArgs),
    /// Switch a running server's cache mode live; leaving write-back first writes every dirty
    /// block back, with a progress bar.
    Mode(ctl::ModeArgs),
    /// Write every dirty block of a running server back to the backing store and flush it,
    /// with a progress bar (--background returns at once; --cancel stops a running flush).
    Flush(ctl::FlushArgs),
    /// Start a running server's counters, windows and latency histograms again from zero (the
    /// cache's contents are untouched).
    ResetStats(ctl::ResetStatsArgs),
    /// Take the cache out of a running server: write every dirty block back, then serve the
    /// backing store directly and release the cache device (formatted empty). --force discards
    /// dirty data instead (asks for confirmation).
    Detach(ctl::DetachArgs),
    /// Put a cache back into a running server (the device `detach` released, or --cache PATH),
    /// formatted empty first: what it held is stale.
    Attach(ctl::AttachArgs),
    /// Check every block a running server's cache holds against its checksum, in the
    /// background and rate-limited: damaged clean blocks are dropped, damaged dirty blocks
    /// reported lost.
    Scrub(integrity_cmd::ScrubArgs),
    /// Acknowledge lost blocks of a running server (all, or a byte range): reads of them stop
    /// failing and return the backing store's older data. Asks for confirmation.
    ForgetLost(integrity_cmd::ForgetLostArgs),
    /// Operate a running server's memcached tier: list its servers with their health and
    /// statistics, add or remove a server, change what it stores (inclusive or victim), turn it
    /// on or off.
    Memcached(ctl::MemcachedArgs),
    /// Record a running server's client requests (`trace start FILE`, `trace stop`), summarise
    /// a trace (`trace show`), and convert it to and from fio's iolog (`trace to-fio`,
    /// `trace from-fio`) to replay it.
    Trace(trace_cmd::TraceArgs),
    /// Estimate from a trace (`flashtier trace`) how the read miss ratio falls with the cache's
    /// size, for exact LRU, FIFO and S3-FIFO (spatially sampled, with the error stated) and, with
    /// `--engine`, flashtier itself (the trace replayed through a real cache), and recommend a
    /// size; `--plot` draws the curves.
    Advise(advise::AdviseArgs),
    /// Work with config files (`flashtier config check FILE`).
    Config(config_cmd::ConfigArgs),
    /// Write the man pages or shell completions made from this command line definition (for
    /// packaging: `flashtier generate man DIR`, `flashtier generate completions DIR`).
    #[command(hide = true)]
    Generate(generate::GenerateArgs),
}

fn main() {
    let cli = Cli::parse();
    let default_log = match cli.command {
        // probe runs for a minute: its progress shows on stderr.
        Command::Format(_) | Command::Serve(_) | Command::Probe(_) => "info",
        // demo's report and the control commands' answers go to stdout; only trouble to stderr.
        _ => "warn",
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
        Command::Probe(args) => probe::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Demo(args) => demo::run(args),
        Command::Status(args) => ctl::status(args),
        Command::Stats(args) => ctl::stats(args),
        Command::Get(args) => ctl::get(args),
        Command::Set(args) => ctl::set(args),
        Command::Mode(args) => ctl::mode(args),
        Command::Flush(args) => ctl::flush(args),
        Command::ResetStats(args) => ctl::reset_stats(args),
        Command::Detach(args) => ctl::detach(args),
        Command::Attach(args) => ctl::attach(args),
        Command::Scrub(args) => integrity_cmd::scrub(args),
        Command::ForgetLost(args) => integrity_cmd::forget_lost(args),
        Command::Memcached(args) => ctl::memcached(args),
        Command::Config(args) => config_cmd::run(args),
        Command::Trace(args) => trace_cmd::run(args),
        Command::Advise(args) => advise::run(args),
        Command::Generate(args) => generate::run(args, Cli::command()),
    };
    if let Err(e) = result {
        eprintln!("flashtier: error: {}", error_chain(&e));
        let code = match e.downcast_ref::<shutdown::CacheNotClosed>() {
            Some(_) => shutdown::CacheNotClosed::EXIT_CODE,
            None => 1,
        };
        std::process::exit(code);
    }
}

/// The error and its causes, `: `-separated, skipping a cause the message before it already
/// quotes (library errors often embed their source in their text, and anyhow's `{:#}` would
/// print it twice: "cannot listen on :80: Address already in use: Address already in use").
pub(crate) fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_quoted_by_its_error_is_not_repeated() {
        let io = std::io::Error::from_raw_os_error(libc::EADDRINUSE);
        let e = anyhow::Error::new(flashtier_nbd::ServerError::Bind(":80".into(), io))
            .context("metrics listener");
        let text = error_chain(&e);
        assert_eq!(text.matches("in use").count(), 1, "{text}");
        assert!(
            text.starts_with("metrics listener: cannot listen on :80: "),
            "{text}"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_chain(&plain), "outer: inner");
    }
}

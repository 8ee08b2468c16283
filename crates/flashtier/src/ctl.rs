//! The control subcommands: `status`, `stats`, `get`, `set`, `mode`, `flush`, `reset-stats`,
//! `detach`, `attach`, `memcached`. Each talks to a running `flashtier serve` over its control socket
//! (flashtier_control::Client).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use flashtier_control::protocol::MemcachedRequest;
use flashtier_control::render::render_memcached;
use flashtier_control::report::JobReport;
use flashtier_control::{Client, MODES};
use flashtier_engine::PARAMS;
use flashtier_memcached::MemcachedMode;

use crate::serve::default_run_dir;
use crate::units::fmt_bytes;

#[derive(Args, Debug)]
pub struct ControlOpt {
    /// The control socket of the running `flashtier serve` (its --control-socket).
    /// [default: control.sock in the run directory: /run/flashtier/control.sock as root, else
    /// $XDG_RUNTIME_DIR/flashtier/control.sock]
    #[arg(long, value_name = "SOCKET", env = "FLASHTIER_CONTROL")]
    control: Option<PathBuf>,
}

impl ControlOpt {
    pub(crate) fn connect(&self) -> anyhow::Result<Client> {
        let path = self
            .control
            .clone()
            .unwrap_or_else(|| default_run_dir().join("control.sock"));
        Ok(Client::connect(&path)?)
    }
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Counters count since the server started or the last `flashtier reset-stats`; the 5min, hour and \
day columns are what happened in that last stretch of time (or since the start, when the server \
has run for less). Latency is per request as NBD clients see it. The same report is in the stats \
file's .json (refreshed every second) and, with --metrics-listen, at /metrics.")]
pub struct StatsArgs {
    /// Print the report as JSON (the same object as the stats file's .json); with --watch, one
    /// JSON object per line every second.
    #[arg(long)]
    json: bool,
    /// Refresh every second until interrupted (Ctrl-C).
    #[arg(long)]
    watch: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_long_help = params_help())]
pub struct GetArgs {
    /// The parameter (see `flashtier set --help` for the list), or `mode`.
    #[arg(
        value_name = "PARAM",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    param: Option<String>,
    /// Show every parameter with its value, default and allowed values.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = params_help())]
pub struct SetArgs {
    /// The parameter to change (listed below), or `mode` (as `flashtier mode`), and its new
    /// value; a bad one is refused with the allowed range and nothing changes. Several pairs
    /// change together, all or none: parameters that constrain each other (the low write-back
    /// watermark stays below the high one) are checked as the whole change leaves them: `set
    /// writeback_dirty_high_pct 90 writeback_dirty_low_pct 80` is accepted where `set
    /// writeback_dirty_low_pct 80` alone (above the current high watermark) is refused.
    #[arg(
        value_names = ["PARAM", "VALUE"],
        num_args = 2..,
        required = true,
        allow_negative_numbers = true
    )]
    settings: Vec<String>,
    /// Also write the values to the server's config file (serve --config FILE), keeping the
    /// rest of the file, so they survive a restart. Fails if the server has no config file.
    #[arg(long)]
    persist: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
pub struct ModeArgs {
    /// writeback, writethrough, writearound or passthrough. Leaving writeback first writes every
    /// dirty block back to the backing store, while the cache keeps serving.
    #[arg(value_name = "MODE")]
    mode: String,
    /// Start the switch and return at once; `flashtier status` shows the progress.
    #[arg(long)]
    no_wait: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Without options, waits with a progress bar on stderr (dirty data left, rate, estimated time) and \
returns once the backing store durably holds everything written before the flush started: every \
block dirty then is written back (sorted by address, coalesced), then the backing store is \
flushed. The cache keeps serving meanwhile; blocks written during the flush stay dirty. \
Interrupting this command (Ctrl-C) does not stop the flush; `flashtier flush --cancel` does.")]
pub struct FlushArgs {
    /// Start the flush and return at once; `flashtier status` shows the progress and, later,
    /// the completion.
    #[arg(long, conflicts_with = "cancel")]
    background: bool,
    /// Stop the running flush after the backing write in flight: what was written back is
    /// clean (and flushed to the backing store), the rest stays dirty, safely in the cache.
    #[arg(long)]
    cancel: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
pub struct ResetStatsArgs {
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Without --force: every dirty block is written back to the backing store (progress bar on stderr, \
as for `flashtier flush`; the cache keeps serving meanwhile) and the cache switches to \
passthrough; then the export serves the backing store directly, once the requests in flight \
through the cache are answered (clients stay connected), and the cache is released: closed, and \
its device formatted empty, because it would hold stale data as soon as the backing store \
changes. The backing store then holds everything, so it can be copied, snapshotted or moved. \
Interrupting this command (Ctrl-C) does not stop the detach.\n\n\
While detached, `flashtier status` shows `cache: detached`; get, set, mode and flush are refused. \
`flashtier attach` brings an empty cache back (the released device, or another one).\n\n\
With --force, nothing is written back: writes that clients were told are done, but that are only \
in the cache, are LOST, and the backing store is served with the older data. Use it only when the \
backing store cannot take the write-back (it is failing) or the data does not matter. It asks \
you to type `discard` first; without a terminal it needs --yes-discard-dirty-data.")]
pub struct DetachArgs {
    /// Do not write dirty blocks back: discard them (data loss; see below). Asks for
    /// confirmation.
    #[arg(long)]
    force: bool,
    /// Confirm --force without the interactive question (for scripts).
    #[arg(long, requires = "force")]
    yes_discard_dirty_data: bool,
    /// Start the detach and return at once; `flashtier status` shows the progress.
    #[arg(long)]
    no_wait: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
The device is formatted empty for this server's backing store before it is used: whatever it held \
is stale, since the backing store was served (and written) without a cache. A device holding a \
flashtier cache other than the one detached from this server (another backing store's, maybe \
with dirty data nobody has written back) is refused unless --force. A new device is formatted \
with the `flashtier format` defaults (4 KiB blocks, 4 MiB segments, reclaim lru); the released \
device keeps its geometry. The live parameters the detached cache had (or the server's config \
file [policy] and --set) apply to the new cache. Clients stay connected throughout.")]
pub struct AttachArgs {
    /// The cache file or device. [default: the device released by `flashtier detach`]
    #[arg(long, value_name = "FILE|DEVICE")]
    cache: Option<PathBuf>,
    /// writeback, writethrough, writearound or passthrough. [default: the mode the detached
    /// cache had, else serve's --mode, else writeback]
    #[arg(long)]
    mode: Option<String>,
    /// Format the device even if it holds another flashtier cache; whatever that cache held
    /// that its backing store lacks is lost.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
The memcached tier (`serve --memcached HOST:PORT[,...]`) keeps copies of clean blocks in a pool of \
memcached servers, below the cache (or in front of the backing store without one). Keys are spread \
over the servers by consistent hashing, so adding or removing a server moves only its share of \
them. memcached never holds the only copy of anything, and a value is used only when it is \
provably the block's newest data: losing a server, or the whole pool, costs hits, never data.\n\n\
Servers added or removed here, and the mode set here, last until the server stops; to keep them, \
edit `memcached` and `memcached_mode` in the [serve] section of the config file.")]
pub struct MemcachedArgs {
    #[command(subcommand)]
    command: MemcachedCommand,
}

#[derive(Subcommand, Debug)]
pub enum MemcachedCommand {
    /// Show the tier (mode, on or off, hits) and one line per server: address, health (up, or
    /// down with how long and when it is retried), gets, hits, misses, sets, errors, timeouts
    /// and p50/p99 round-trip latency, counted since the server was added or the last
    /// `flashtier reset-stats`.
    List {
        /// Print the tier's report as JSON (the `memcached` object of `flashtier stats --json`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Add a server to the pool. It takes its share of the keys from the next request on
    /// (those keys miss until they are stored there again); an address that is already in the
    /// pool, or does not parse or resolve, is refused.
    Add {
        /// The server's address.
        #[arg(value_name = "HOST:PORT")]
        server: String,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Remove a server from the pool: its keys go to the other servers (and miss until stored
    /// there). Its counters stay in the pool's totals.
    Remove {
        /// The server's address, as `flashtier memcached list` shows it.
        #[arg(value_name = "HOST:PORT")]
        server: String,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Change what the tier stores (the live parameter memcached_mode, as `flashtier set
    /// memcached_mode MODE`): inclusive stores blocks read from and written to the store below
    /// and leaves a value in place on a hit; victim stores blocks a faster tier evicts and
    /// removes a value on a hit (the SSD tier hands its evictions down, or with no cache the
    /// RAM tier; with neither, victim stores nothing new). Effective from the next request.
    Mode {
        /// inclusive or victim.
        #[arg(value_name = "MODE", value_parser = parse_memcached_mode)]
        mode: MemcachedMode,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Turn the tier on: reads look in the pool again, and blocks are stored.
    On {
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Turn the tier off: requests go straight to the store below, nothing is looked up or
    /// stored. Writes still keep the tier's versions exact, so turning it on again never serves
    /// a value a write made old meanwhile.
    Off {
        #[command(flatten)]
        control: ControlOpt,
    },
}

fn parse_memcached_mode(s: &str) -> Result<MemcachedMode, String> {
    s.parse()
}

/// The parameter list for `set --help` and `get --help`.
fn params_help() -> String {
    let mut s = String::from("Parameters (applied live, from the next request):\n");
    s.push_str(&format!(
        "\n  mode\n      The cache mode; switching shows progress as with `flashtier mode`.\n      \
         allowed: {MODES}\n"
    ));
    for p in PARAMS {
        s.push_str(&format!(
            "\n  {}\n      {}\n      default: {}; allowed: {}\n",
            p.name, p.doc, p.default, p.allowed
        ));
    }
    s.push_str(&format!(
        "\n  memcached_mode\n      What the memcached tier stores, on a server started with \
         --memcached (as `flashtier memcached mode`); not saved by --persist: edit \
         `memcached_mode` in the config file's [serve].\n      default: {}; allowed: {}\n",
        MemcachedMode::default(),
        flashtier_memcached::tier::MODES
    ));
    s
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let report = args.control.connect()?.report()?;
    print!("{}", report.render_status());
    Ok(())
}

pub fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    if args.watch {
        // --watch runs until interrupted, so an interrupt must end it even when the shell that
        // started us ignores SIGINT for its background jobs (`cmd &` in a script, nohup), which
        // the default disposition would inherit.
        // SAFETY: restoring the default action of a signal this process installs no handler for.
        unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    }
    let tty = std::io::stdout().is_terminal();
    loop {
        let started = Instant::now();
        let shown = if args.json {
            let v = client.report_json()?;
            if args.watch {
                format!("{}\n", serde_json::to_string(&v)?)
            } else {
                format!("{}\n", serde_json::to_string_pretty(&v)?)
            }
        } else {
            client.report()?.render_table()
        };
        let mut out = std::io::stdout().lock();
        if args.watch && tty && !args.json {
            // Home and clear: the table redraws in place.
            out.write_all(b"\x1b[H\x1b[2J")?;
        }
        out.write_all(shown.as_bytes())?;
        if args.watch && !tty && !args.json {
            out.write_all(b"\n")?;
        }
        out.flush()?;
        drop(out);
        if !args.watch {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(started.elapsed()));
    }
}

pub fn get(args: GetArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    let Some(param) = args.param else {
        let rows = client.params()?;
        let mut table = vec![[
            "parameter".to_string(),
            "value".into(),
            "default".into(),
            "allowed".into(),
        ]];
        table.extend(
            rows.into_iter()
                .map(|r| [r.name, r.value, r.default, r.allowed]),
        );
        let w: Vec<usize> = (0..3)
            .map(|i| {
                table
                    .iter()
                    .map(|r| r[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for r in table {
            println!(
                "{:w0$}  {:w1$}  {:w2$}  {}",
                r[0],
                r[1],
                r[2],
                r[3],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2]
            );
        }
        return Ok(());
    };
    println!("{}", client.get(&param)?);
    Ok(())
}

pub fn set(args: SetArgs) -> anyhow::Result<()> {
    let pairs = args.settings.chunks_exact(2);
    if !pairs.remainder().is_empty() {
        anyhow::bail!(
            "expected PARAM VALUE pairs, got {} words: {}",
            args.settings.len(),
            args.settings.join(" ")
        );
    }
    let settings: Vec<(String, String)> = pairs.map(|p| (p[0].clone(), p[1].clone())).collect();
    let mut client = args.control.connect()?;
    if let [(name, value)] = &settings[..] {
        let value = client.set(name, value, args.persist)?;
        if name == "mode" {
            wait_for_switch(&mut client, &value)?;
        }
        println!("{name} = {value}");
        return Ok(());
    }
    for (name, value) in client.set_many(&settings, args.persist)? {
        println!("{name} = {value}");
    }
    Ok(())
}

pub fn mode(args: ModeArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    let mode = client.mode(&args.mode)?;
    if args.no_wait {
        eprintln!("flashtier: switching to {mode} in the background; `flashtier status` shows the progress");
    } else {
        wait_for_switch(&mut client, &mode)?;
    }
    println!("mode = {mode}");
    Ok(())
}

pub fn reset_stats(args: ResetStatsArgs) -> anyhow::Result<()> {
    args.control.connect()?.reset_stats()?;
    println!("statistics reset");
    Ok(())
}

pub fn detach(args: DetachArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    if args.force {
        let report = client.report()?;
        if let Some(c) = &report.status.cache_status {
            eprintln!(
                "flashtier: WARNING: detach --force DISCARDS the cache's dirty data: {} ({} \
                 blocks) that clients wrote but the backing store does not have yet will be \
                 LOST, and the backing store will be served with the older data in its place. \
                 `flashtier detach` without --force writes it back first.",
                fmt_bytes(c.dirty_bytes),
                c.dirty_blocks
            );
        }
        if !args.yes_discard_dirty_data {
            crate::confirm::typed(
                "discard",
                "discard dirty data and detach",
                "Pass --yes-discard-dirty-data to confirm, or run `flashtier detach` without \
                 --force, which writes the data back first",
            )?;
        }
    }
    let dirty = client.detach(args.force)?;
    if args.no_wait {
        eprintln!("flashtier: detaching in the background; `flashtier status` shows the progress");
        return Ok(());
    }
    let job = wait_for_job(&mut client, !args.force)?;
    if let Some(e) = &job.error {
        anyhow::bail!(
            "the detach failed: {e} (`flashtier status` shows whether the cache is still attached)"
        );
    }
    if args.force {
        println!(
            "detached: {dirty} dirty blocks discarded; the backing store is served directly \
             (`flashtier attach` brings an empty cache back)"
        );
    } else {
        println!(
            "detached: the backing store holds everything and is served directly \
             (`flashtier attach` brings an empty cache back)"
        );
    }
    Ok(())
}

pub fn attach(args: AttachArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    // The server resolves the path, from its own working directory.
    let cache = args
        .cache
        .as_deref()
        .map(std::path::absolute)
        .transpose()
        .context("cannot resolve the --cache path")?;
    let cache = cache
        .as_deref()
        .map(|p| p.to_str().context("the --cache path is not UTF-8"))
        .transpose()?;
    let a = client.attach(cache, args.mode.as_deref(), args.force)?;
    println!(
        "attached: {} ({} of cache, mode {}, empty); the export serves through it",
        a.device,
        fmt_bytes(a.capacity_bytes),
        a.mode
    );
    Ok(())
}

pub fn flush(args: FlushArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    if args.cancel {
        client.flush_cancel()?;
        let job = wait_for_job(&mut client, false)?;
        if let Some(e) = &job.error {
            anyhow::bail!("the flush failed: {e}");
        }
        if job.cancelled {
            println!(
                "flush cancelled: {} dirty blocks left",
                job.dirty_blocks_left
            );
        } else {
            println!("the flush had already finished");
        }
        return Ok(());
    }
    client.flush()?;
    if args.background {
        eprintln!("flashtier: flushing in the background; `flashtier status` shows the progress");
        return Ok(());
    }
    let job = wait_for_job(&mut client, true)?;
    if let Some(e) = &job.error {
        anyhow::bail!("the flush failed: {e} (what was not written back is still dirty)");
    }
    if job.cancelled {
        anyhow::bail!(
            "the flush was cancelled; {} dirty blocks left",
            job.dirty_blocks_left
        );
    }
    println!("flushed: the backing store holds everything written before the flush");
    Ok(())
}

pub fn memcached(args: MemcachedArgs) -> anyhow::Result<()> {
    let (req, control) = match args.command {
        MemcachedCommand::List { json, control } => {
            let m = control.connect()?.memcached(MemcachedRequest::List)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&m)?);
            } else {
                println!("memcached: {}", render_memcached(&m));
                print!("{}", m.render_servers());
            }
            return Ok(());
        }
        MemcachedCommand::Add { server, control } => (MemcachedRequest::Add { server }, control),
        MemcachedCommand::Remove { server, control } => {
            (MemcachedRequest::Remove { server }, control)
        }
        MemcachedCommand::Mode { mode, control } => {
            let mode = mode.to_string();
            (MemcachedRequest::Mode { mode }, control)
        }
        MemcachedCommand::On { control } => (MemcachedRequest::On, control),
        MemcachedCommand::Off { control } => (MemcachedRequest::Off, control),
    };
    let m = control.connect()?.memcached(req.clone())?;
    let n = m.servers.len();
    let servers = format!("{n} server{}", if n == 1 { "" } else { "s" });
    match req {
        MemcachedRequest::Add { server } => println!("added {server}: {servers} in the pool"),
        MemcachedRequest::Remove { server } => println!("removed {server}: {servers} left"),
        MemcachedRequest::Mode { .. } => {
            println!("memcached_mode = {}", m.mode);
            if m.mode == MemcachedMode::Victim.to_string() {
                eprintln!(
                    "flashtier: note: victim stores only blocks the tier above evicts (the \
                     SSD tier, or with no cache the RAM tier): a server with neither stores \
                     nothing new in this mode"
                );
            }
        }
        MemcachedRequest::On => println!("memcached tier on"),
        MemcachedRequest::Off => {
            println!("memcached tier off: requests go straight to the store below")
        }
        MemcachedRequest::List => {}
    }
    Ok(())
}

/// Follows the mode switch to `mode` until it is done (see [`wait_for_job`]). Fails if the
/// switch failed.
fn wait_for_switch(client: &mut Client, mode: &str) -> anyhow::Result<()> {
    let job = wait_for_job(client, true)?;
    if let Some(e) = &job.error {
        anyhow::bail!("switching to {mode} failed: {e} (the mode is unchanged)");
    }
    Ok(())
}

/// Follows the server's job until it is done, with a progress bar on stderr (a line per second
/// when stderr is not a terminal), then a summary line when `summary`; returns its last report.
fn wait_for_job(client: &mut Client, summary: bool) -> anyhow::Result<JobReport> {
    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now() - Duration::from_secs(1);
    let job = loop {
        let report = client.report()?;
        let job = report.job.context("the server reports no job")?;
        if job.done {
            break job;
        }
        let block = report
            .status
            .cache_status
            .map_or(1, |c| c.block_size as u64);
        if tty {
            eprint!("\r{}\x1b[K", progress(&job, block));
        } else if last_line.elapsed() >= Duration::from_secs(1) {
            eprintln!("{}", progress(&job, block));
            last_line = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(if tty { 200 } else { 250 }));
    };
    if tty {
        eprint!("\r\x1b[K");
    }
    if summary && job.error.is_none() {
        let written = job
            .dirty_blocks_at_start
            .saturating_sub(job.dirty_blocks_left);
        eprintln!(
            "{}: {} in {:.1} s, dirty blocks written back: {written}, dirty blocks left: {}",
            job.what,
            if job.cancelled { "cancelled" } else { "done" },
            job.elapsed_secs,
            job.dirty_blocks_left
        );
    }
    Ok(job)
}

/// `[#########.....................]  30%  flush: 7.00 MiB of 10.00 MiB dirty left, 1.50 MiB/s,
/// ETA 5 s` (`block` = the cache's block size).
fn progress(job: &JobReport, block: u64) -> String {
    const WIDTH: u64 = 30;
    let total = job.dirty_blocks_at_start.max(job.dirty_blocks_left);
    if total == 0 {
        return format!("{}: no dirty blocks to write back", job.what);
    }
    let done = total - job.dirty_blocks_left.min(total);
    let filled = (done * WIDTH / total) as usize;
    let rate = (done * block) as f64 / job.elapsed_secs.max(0.001);
    let eta = if done == 0 {
        "ETA unknown".to_string()
    } else {
        format!("ETA {:.0} s", (job.dirty_blocks_left * block) as f64 / rate)
    };
    format!(
        "[{}{}] {:3}%  {}: {} of {} dirty left to write back, {}/s, {eta}, {:.0} s so far",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled),
        done * 100 / total,
        job.what,
        fmt_bytes(job.dirty_blocks_left * block),
        fmt_bytes(total * block),
        fmt_bytes(rate as u64),
        job.elapsed_secs
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_bar() {
        let mut job = JobReport {
            what: "mode writeback -> writethrough".into(),
            kind: "mode".into(),
            from: "writeback".into(),
            to: "writethrough".into(),
            done: false,
            cancelled: false,
            error: None,
            dirty_blocks_left: 25,
            dirty_blocks_at_start: 100,
            elapsed_secs: 2.0,
        };
        let p = progress(&job, 1 << 20);
        assert!(
            p.starts_with("[######################........]  75%"),
            "{p}"
        );
        assert!(p.contains("writethrough") && p.contains("dirty"), "{p}");
        // 75 MiB in 2 s: 37.5 MiB/s, 25 MiB left in 0.67 s.
        assert!(
            p.contains("25.00 MiB of 100.00 MiB dirty left")
                && p.contains("37.50 MiB/s")
                && p.contains("ETA 1 s"),
            "{p}"
        );
        job.dirty_blocks_left = 100;
        assert!(progress(&job, 4096).contains("ETA unknown"));
    }

    #[test]
    fn help_lists_every_parameter() {
        let h = params_help();
        for p in PARAMS {
            assert!(h.contains(p.name) && h.contains(p.allowed), "{}", p.name);
        }
    }
}

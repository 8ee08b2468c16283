//! The control subcommands: `status`, `stats`, `get`, `set`, `mode`, `reset-stats`. Each talks to
//! a running `flashtier serve` over its control socket (flashtier_control::Client).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use flashtier_control::report::JobReport;
use flashtier_control::{Client, MODES};
use flashtier_engine::PARAMS;

use crate::serve::default_run_dir;

#[derive(Args, Debug)]
pub struct ControlOpt {
    /// The control socket of the running `flashtier serve` (its --control-socket).
    /// [default: control.sock in the run directory: /run/flashtier/control.sock as root, else
    /// $XDG_RUNTIME_DIR/flashtier/control.sock]
    #[arg(long, value_name = "SOCKET", env = "FLASHTIER_CONTROL")]
    control: Option<PathBuf>,
}

impl ControlOpt {
    fn connect(&self) -> anyhow::Result<Client> {
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
    /// The parameter to change (listed below), or `mode` (as `flashtier mode`).
    #[arg(value_name = "PARAM")]
    param: String,
    /// The new value; a bad one is refused with the allowed range and nothing changes.
    #[arg(value_name = "VALUE", allow_negative_numbers = true)]
    value: String,
    /// Also write the value to the server's config file (serve --config FILE), keeping the
    /// rest of the file, so it survives a restart. Fails if the server has no config file.
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
pub struct ResetStatsArgs {
    #[command(flatten)]
    control: ControlOpt,
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
    s
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let report = args.control.connect()?.report()?;
    print!("{}", report.render_status());
    Ok(())
}

pub fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
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
    let mut client = args.control.connect()?;
    let value = client.set(&args.param, &args.value, args.persist)?;
    if args.param == "mode" {
        wait_for_switch(&mut client, &value)?;
    }
    println!("{} = {value}", args.param);
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

/// Follows the mode switch to `mode` until it is done, with a progress bar on stderr (a line
/// per second when stderr is not a terminal). Fails if the switch failed.
fn wait_for_switch(client: &mut Client, mode: &str) -> anyhow::Result<()> {
    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now() - Duration::from_secs(1);
    let job = loop {
        let job = client
            .report()?
            .job
            .context("the server reports no mode switch")?;
        if job.done {
            break job;
        }
        if tty {
            eprint!("\r{}\x1b[K", progress(&job));
        } else if last_line.elapsed() >= Duration::from_secs(1) {
            eprintln!("{}", progress(&job));
            last_line = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(if tty { 200 } else { 250 }));
    };
    if tty {
        eprint!("\r\x1b[K");
    }
    if let Some(e) = &job.error {
        anyhow::bail!("switching to {mode} failed: {e} (the mode is unchanged)");
    }
    let written = job
        .dirty_blocks_at_start
        .saturating_sub(job.dirty_blocks_left);
    eprintln!(
        "{}: done in {:.1} s, dirty blocks written back: {written}, dirty blocks left: {}",
        job.what, job.elapsed_secs, job.dirty_blocks_left
    );
    Ok(())
}

/// `[#########...........]  45%  mode writeback -> writethrough: 1234 of 2245 dirty blocks left`
fn progress(job: &JobReport) -> String {
    const WIDTH: u64 = 30;
    let total = job.dirty_blocks_at_start.max(job.dirty_blocks_left);
    if total == 0 {
        return format!("{}: no dirty blocks to write back, switching", job.what);
    }
    let done = total - job.dirty_blocks_left.min(total);
    let filled = (done * WIDTH / total) as usize;
    format!(
        "[{}{}] {:3}%  {}: {} of {} dirty blocks left to write back, {:.0} s",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled),
        done * 100 / total,
        job.what,
        job.dirty_blocks_left,
        total,
        job.elapsed_secs
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_bar() {
        let job = JobReport {
            what: "mode writeback -> writethrough".into(),
            from: "writeback".into(),
            to: "writethrough".into(),
            done: false,
            error: None,
            dirty_blocks_left: 25,
            dirty_blocks_at_start: 100,
            elapsed_secs: 2.0,
        };
        let p = progress(&job);
        assert!(
            p.starts_with("[######################........]  75%"),
            "{p}"
        );
        assert!(p.contains("writethrough") && p.contains("dirty"), "{p}");
    }

    #[test]
    fn help_lists_every_parameter() {
        let h = params_help();
        for p in PARAMS {
            assert!(h.contains(p.name) && h.contains(p.allowed), "{}", p.name);
        }
    }
}

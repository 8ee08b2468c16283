//! `flashtier scrub` and `flashtier forget-lost`: finding damaged data before a client does, and
//! acknowledging data that is gone. Both talk to a running server over its control socket.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use flashtier_control::render::render_scrub;
use flashtier_control::report::{blocks_touched, ScrubStatus};
use flashtier_control::Client;

use crate::ctl::ControlOpt;
use crate::units::{fmt_bytes, parse_size};

#[derive(Args, Debug)]
#[command(after_help = "\
The scrub reads every block the cache holds and checks it against its checksum, beside client \
I/O. A damaged clean block is dropped from the cache (the backing store has it; the next read \
fetches it from there). A damaged dirty block is lost: its newest data existed only in the cache. \
It is listed by `flashtier status`, reads of it fail with EIO, and it is never written back; it \
stays so until a client writes it again or `flashtier forget-lost` acknowledges the loss.\n\n\
Without --background, waits with progress on stderr and prints what it found; the exit status is \
0 when the cache holds no lost block afterwards, 1 when it does. Interrupting this command \
(Ctrl-C) does not stop the scrub; `flashtier scrub --cancel` does. A detach stops it too.")]
pub struct ScrubArgs {
    /// Read at most this many bytes per second from the cache device (K, M, G suffixes), so
    /// clients keep most of its bandwidth; 0: as fast as it goes.
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = parse_size)]
    rate: u64,
    /// Start the scrub and return at once; `flashtier scrub --status` (or `status`) shows it.
    #[arg(long, conflicts_with_all = ["cancel", "status"])]
    background: bool,
    /// Stop the running scrub after the read in flight.
    #[arg(long, conflicts_with = "status")]
    cancel: bool,
    /// Show the running or last scrub and return.
    #[arg(long)]
    status: bool,
    #[command(flatten)]
    control: ControlOpt,
}

#[derive(Args, Debug)]
#[command(after_help = "\
A lost block is one whose newest data was only in the cache and failed its checksum there (or \
whose log record recovery could not read). Reads of it fail with EIO so that no one is served \
older data as if it were current. Writing the block again clears it; so does this command, after \
which reads of it return what the backing store holds: OLDER data (whatever was written back \
before the newest write), or zeros. Do it once you have restored or rewritten what matters (e.g. \
after the database was recovered from its own log or a backup). `flashtier status` lists lost \
blocks with their byte offsets.")]
pub struct ForgetLostArgs {
    /// Forget every lost block.
    #[arg(long, required_unless_present = "range", conflicts_with = "range")]
    all: bool,
    /// Forget the lost blocks within OFFSET+LENGTH bytes of the exported device (K, M, G
    /// suffixes; OFFSET alone: the one block holding it).
    #[arg(long, value_name = "OFFSET[+LENGTH]", value_parser = parse_range)]
    range: Option<(u64, Option<u64>)>,
    /// Do not ask for confirmation (for scripts).
    #[arg(long)]
    yes: bool,
    #[command(flatten)]
    control: ControlOpt,
}

/// `OFFSET` or `OFFSET+LENGTH`, sizes as `parse_size` takes them.
fn parse_range(s: &str) -> Result<(u64, Option<u64>), String> {
    match s.split_once('+') {
        None => Ok((parse_size(s)?, None)),
        Some((off, len)) => {
            let len = parse_size(len)?;
            if len == 0 {
                return Err(format!("'{s}': the length is 0"));
            }
            Ok((parse_size(off)?, Some(len)))
        }
    }
}

pub fn scrub(args: ScrubArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    if args.status {
        match client.report()?.scrub {
            Some(s) => println!("{}", render_scrub(&s)),
            None => println!("no scrub has run since the server started"),
        }
        return Ok(());
    }
    if args.cancel {
        client.scrub_cancel()?;
        let s = wait_for_scrub(&mut client)?;
        println!("{}", render_scrub(&s));
        return Ok(());
    }
    client.scrub((args.rate > 0).then_some(args.rate))?;
    if args.background {
        eprintln!(
            "flashtier: scrubbing in the background; `flashtier scrub --status` shows the progress"
        );
        return Ok(());
    }
    let s = wait_for_scrub(&mut client)?;
    println!(
        "scrub: checked {} blocks, {} damaged clean blocks dropped (re-read from the backing \
         store), {} dirty blocks lost",
        s.checked_blocks, s.dropped_blocks, s.lost_blocks
    );
    if let Some(e) = &s.error {
        anyhow::bail!("the scrub failed: {e}");
    }
    if s.cancelled {
        anyhow::bail!("the scrub was cancelled before it checked the whole cache");
    }
    let report = client.report()?;
    let lost = report
        .status
        .cache_status
        .as_ref()
        .map_or(0, |c| c.lost_blocks);
    if lost > 0 {
        anyhow::bail!(
            "the cache holds {lost} lost block(s) (`flashtier status` lists them; reads of them \
             fail until they are written again or `flashtier forget-lost` acknowledges the loss)"
        );
    }
    Ok(())
}

/// Follows the scrub until it is done, with progress on stderr (a line every 5 s when stderr is
/// not a terminal); returns its last status.
fn wait_for_scrub(client: &mut Client) -> anyhow::Result<ScrubStatus> {
    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now();
    let s = loop {
        let s = client
            .report()?
            .scrub
            .context("the server reports no scrub")?;
        if s.done {
            break s;
        }
        if tty {
            eprint!("\r{}\x1b[K", progress(&s));
        } else if last_line.elapsed() >= Duration::from_secs(5) {
            eprintln!("{}", progress(&s));
            last_line = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if tty {
        eprint!("\r\x1b[K");
    }
    Ok(s)
}

/// `[#########.....................]  30%  scrub: 120 of 400 segments, 30720 blocks checked, 0
/// lost, 4 s so far`.
fn progress(s: &ScrubStatus) -> String {
    const WIDTH: u64 = 30;
    let total = s.segments_total.max(1);
    let done = s.segments_done.min(total);
    let filled = (done * WIDTH / total) as usize;
    format!(
        "[{}{}] {:3}%  scrub: {done} of {total} segments, {} blocks checked, {} dropped, {} lost, \
         {:.0} s so far",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled),
        done * 100 / total,
        s.checked_blocks,
        s.dropped_blocks,
        s.lost_blocks,
        s.elapsed_secs
    )
}

pub fn forget_lost(args: ForgetLostArgs) -> anyhow::Result<()> {
    let mut client = args.control.connect()?;
    let report = client.report()?;
    let c = report
        .status
        .cache_status
        .context("the server has no cache attached, so no lost blocks")?;
    if c.lost_blocks == 0 {
        println!("no lost blocks: nothing to forget");
        return Ok(());
    }
    let bs = c.block_size as u64;
    let in_range = c.lost_within(args.range.map(|(off, len)| blocks_touched(off, len, bs)));
    if in_range == 0 {
        println!(
            "no lost block in that range: nothing to forget ({} lost in all; `flashtier status` \
             lists them)",
            c.lost_blocks
        );
        return Ok(());
    }
    eprintln!(
        "flashtier: forgetting {in_range} lost block(s) ({}): reads of them will return the \
         backing store's OLDER data (or zeros) instead of failing. Their newest data is gone \
         either way; rewrite or restore it first if it matters.",
        fmt_bytes(in_range * bs)
    );
    if !args.yes {
        crate::confirm::typed("forget", "forget lost blocks", "Pass --yes to confirm")?;
    }
    let (offset, length) = match args.range {
        Some((off, len)) => (Some(off), len),
        None => (None, None),
    };
    let n = client.forget_lost(offset, length)?;
    println!("forgot {n} lost block(s); reads of them now return the backing store's data");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("4096"), Ok((4096, None)));
        assert_eq!(parse_range("400K+4K"), Ok((400 << 10, Some(4096))));
        assert!(parse_range("4096+0").is_err());
        assert!(parse_range("x+4K").is_err());
    }

    #[test]
    fn scrub_progress_bar() {
        let s = ScrubStatus {
            segments_done: 3,
            segments_total: 10,
            checked_blocks: 3000,
            lost_blocks: 1,
            ..ScrubStatus::default()
        };
        let p = progress(&s);
        assert!(
            p.starts_with("[#########.....................]  30%"),
            "{p}"
        );
        assert!(
            p.contains("3000 blocks checked") && p.contains("1 lost"),
            "{p}"
        );
    }
}

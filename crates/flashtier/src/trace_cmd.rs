//! `flashtier trace`: record a running server's client requests (`start`, `stop`), look at a
//! trace (`show`), and convert it to and from fio's iolog (`to-fio`, `from-fio`).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use flashtier_control::trace::iolog::{iolog_to_trace, trace_to_iolog, Converted};
use flashtier_control::trace::{TraceOp, TraceReader, TraceStatus};

use crate::ctl::ControlOpt;
use crate::units::fmt_bytes;

#[derive(Args, Debug)]
#[command(after_help = "\
A trace holds one 24-byte record per request (time, op, offset, length), in the order the \
requests reached the export: what the clients asked, whatever the cache did. The server writes \
it from a buffer on its own thread; if the disk cannot keep up, records are dropped, counted, \
and marked where they are missing rather than slowing the clients.")]
pub struct TraceArgs {
    #[command(subcommand)]
    pub command: TraceCommand,
}

#[derive(Subcommand, Debug)]
pub enum TraceCommand {
    /// Start recording a running server's client requests into a new file (the server creates
    /// it, mode 0600; an existing file is refused). `serve --trace FILE` does the same from the
    /// start.
    Start {
        /// The trace file to create.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Stop the running trace; returns once all of it is written and synced, and prints what it
    /// recorded. With FILE, only if the running trace goes to that file.
    Stop {
        /// The running trace's file (nothing is stopped if another trace runs).
        #[arg(value_name = "FILE")]
        file: Option<PathBuf>,
        #[command(flatten)]
        control: ControlOpt,
    },
    /// Summarise a trace: how long, how many requests of each kind, bytes, distinct 4 KiB blocks
    /// read and written, and requests the recorder dropped.
    Show {
        /// The trace file.
        #[arg(value_name = "TRACE")]
        trace: PathBuf,
    },
    /// Convert a trace to a fio iolog (version 3), to replay with
    /// `fio --read_iolog=IOLOG --ioengine=nbd --uri=...` (or against a device with
    /// --replay_redirect). Write-zeroes become writes; dropped requests are left out (both
    /// counted).
    ToFio {
        /// The trace file.
        #[arg(value_name = "TRACE")]
        trace: PathBuf,
        /// The iolog to create (must not exist).
        #[arg(value_name = "IOLOG")]
        iolog: PathBuf,
        /// The file name the iolog's requests go to.
        #[arg(long, value_name = "NAME", default_value = "flashtier")]
        file: String,
    },
    /// Convert a fio iolog (version 2 or 3: fio's --write_iolog, or blktrace converted by fio)
    /// to a trace. Requests to several files are merged into one trace.
    FromFio {
        /// The fio iolog.
        #[arg(value_name = "IOLOG")]
        iolog: PathBuf,
        /// The trace to create (must not exist).
        #[arg(value_name = "TRACE")]
        trace: PathBuf,
    },
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    match args.command {
        TraceCommand::Start { file, control } => {
            // The server runs elsewhere: a relative path means relative to here.
            let file = std::path::absolute(&file)?;
            let path = file
                .to_str()
                .context("the trace file's path is not UTF-8")?;
            let status = control.connect()?.trace_start(path)?;
            println!(
                "recording a trace of every request to {} (`flashtier trace stop` ends it)",
                status.path.display()
            );
            Ok(())
        }
        TraceCommand::Stop { file, control } => {
            let file = file.map(std::path::absolute).transpose()?;
            let path = file
                .as_deref()
                .map(|f| f.to_str().context("the trace file's path is not UTF-8"))
                .transpose()?;
            let status = control.connect()?.trace_stop(path)?;
            println!("{}", stopped(&status));
            Ok(())
        }
        TraceCommand::Show { trace } => {
            print!("{}", show(&trace)?);
            Ok(())
        }
        TraceCommand::ToFio { trace, iolog, file } => {
            let reader = open_trace(&trace)?;
            let out = BufWriter::new(create(&iolog)?);
            let c = trace_to_iolog(reader, out, &file)
                .with_context(|| format!("converting {}", trace.display()))?;
            println!("{}", converted(&c, &iolog));
            Ok(())
        }
        TraceCommand::FromFio { iolog, trace } => {
            let input = BufReader::new(
                File::open(&iolog).with_context(|| format!("cannot open {}", iolog.display()))?,
            );
            let start = std::fs::metadata(&iolog)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_micros() as u64);
            let out = BufWriter::new(create(&trace)?);
            let c = iolog_to_trace(input, out, start)
                .with_context(|| format!("converting {}", iolog.display()))?;
            println!("{}", converted(&c, &trace));
            Ok(())
        }
    }
}

fn stopped(s: &TraceStatus) -> String {
    let mut out = format!(
        "trace {} stopped: {} requests in {:.1} s, {}",
        s.path.display(),
        s.requests,
        s.seconds,
        fmt_bytes(s.bytes)
    );
    if s.lost > 0 {
        out.push_str(&format!(
            "; {} requests were dropped because the file could not keep up (marked in the \
             trace)",
            s.lost
        ));
    }
    out
}

fn converted(c: &Converted, out: &Path) -> String {
    let mut s = format!("wrote {} requests to {}", c.requests, out.display());
    if c.zeroes_as_writes > 0 {
        s.push_str(&format!(
            "; {} write-zeroes written as writes",
            c.zeroes_as_writes
        ));
    }
    if c.lost_requests > 0 {
        s.push_str(&format!(
            "; the trace lacks {} requests its recorder dropped",
            c.lost_requests
        ));
    }
    if c.files.len() > 1 {
        s.push_str(&format!(
            "; requests to {} files ({}) merged",
            c.files.len(),
            c.files.join(", ")
        ));
    }
    s
}

pub(crate) fn open_trace(path: &Path) -> anyhow::Result<TraceReader<BufReader<File>>> {
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    TraceReader::new(BufReader::with_capacity(1 << 20, f))
        .with_context(|| format!("cannot read {}", path.display()))
}

fn create(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))
}

/// Per-op counts and bytes, distinct blocks, duration: what `trace show` prints.
fn show(path: &Path) -> anyhow::Result<String> {
    const BLOCK: u64 = 4096;
    let mut reader = open_trace(path)?;
    let header = reader.header();
    let ops = [
        TraceOp::Read,
        TraceOp::Write,
        TraceOp::Flush,
        TraceOp::Trim,
        TraceOp::WriteZeroes,
    ];
    let mut count = [0u64; 5];
    let mut bytes = [0u64; 5];
    let (mut read_blocks, mut written_blocks) = (HashSet::new(), HashSet::new());
    let (mut lost, mut last_us) = (0u64, 0u64);
    for r in reader.by_ref() {
        let r = r.with_context(|| format!("reading {}", path.display()))?;
        last_us = last_us.max(r.t_us);
        let Some(i) = ops.iter().position(|&op| op == r.op) else {
            lost += u64::from(r.len);
            continue;
        };
        count[i] += 1;
        bytes[i] += u64::from(r.len);
        let blocks = r.offset / BLOCK..(r.offset + u64::from(r.len)).div_ceil(BLOCK);
        match r.op {
            TraceOp::Read => read_blocks.extend(blocks),
            TraceOp::Write | TraceOp::WriteZeroes => written_blocks.extend(blocks),
            _ => {}
        }
    }
    let mut out = format!(
        "{}: a trace of a {} export, {:.1} s from its start to its last request\n",
        path.display(),
        fmt_bytes(header.device_size),
        last_us as f64 / 1e6,
    );
    for (i, op) in ops.iter().enumerate() {
        out.push_str(&format!(
            "  {:13} {:>12} requests  {:>12}\n",
            op.name(),
            count[i],
            if *op == TraceOp::Flush {
                String::new()
            } else {
                fmt_bytes(bytes[i])
            }
        ));
    }
    let touched = read_blocks.union(&written_blocks).count() as u64;
    out.push_str(&format!(
        "  distinct 4 KiB blocks: {} read, {} written, {} in all ({})\n",
        read_blocks.len(),
        written_blocks.len(),
        touched,
        fmt_bytes(touched * BLOCK)
    ));
    if lost > 0 {
        out.push_str(&format!(
            "  {lost} requests dropped by the recorder are missing from this trace\n"
        ));
    }
    if reader.partial_bytes() > 0 {
        out.push_str(&format!(
            "  the file ends in a record cut short ({} bytes; the writer stopped mid-record)\n",
            reader.partial_bytes()
        ));
    }
    Ok(out)
}

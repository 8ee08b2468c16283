//! `flashtier probe PATH`: measures whether a device is fit to be a write-back cache device, and
//! says why not.
//!
//! What it measures, each part bounded in time (1 s each, the sustained run `--seconds`):
//! sequential write MB/s (1 MiB O_DIRECT writes and a closing fdatasync, which also writes the
//! span the random tests then use); the latency (p50/p99/max) at QD1 of a 4 KiB write followed
//! by fsync, by fdatasync, through an O_DSYNC descriptor and through an O_DIRECT|O_DSYNC one
//! (FUA where the device has it); 4 KiB O_DIRECT random read and write IOPS at QD1 and QD32
//! (32 threads); and a sustained 4 KiB random write run at QD32 with a per-second IOPS and
//! latency timeline, whose dips an average would hide. It reads what sysfs says of the device
//! (rotational, write cache, FUA, discard, model) and judges the lot ([`verdict`]).
//!
//! Safety rules: it writes only to a scratch file it creates (a directory as PATH gets one with
//! an unpredictable name, created O_EXCL; a PATH that does not exist becomes it) and removes it
//! at the end, on errors and on Ctrl-C too; an existing file, or a block device holding data
//! (a signature `format` also knows, or any non-zero byte in its first or last MiB), is
//! refused unless `--destructive`; a block device is opened O_EXCL, so a mounted or claimed one
//! is refused even then. A scratch file is allocated in full first, so a filesystem without the
//! room refuses before anything is measured.
//!
//! `flashtier format` runs [`quick`], a probe of about 2 s without the sustained run, and warns
//! when the verdict is not ok.

mod device;
mod measure;
mod plot;
mod report;
mod target;
mod verdict;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::units::parse_size;
use measure::Plan;
pub use verdict::{Level, Verdict};

/// The quick probe's time per test: nine tests in about 2 s.
const QUICK_STEP: Duration = Duration::from_millis(200);
/// The quick probe's scratch file when the cache is a file.
const QUICK_SIZE: u64 = 64 << 20;

#[derive(Args, Debug)]
#[command(after_long_help = long_help())]
pub struct ProbeArgs {
    /// What to probe: a directory (a scratch file of --size is created in it, with an
    /// unpredictable name, and removed afterwards), a file path that does not exist (created as
    /// the scratch file and removed afterwards), an existing file (only with --destructive: it
    /// is overwritten), or a block device (with --destructive when it holds data: the tests
    /// overwrite its start).
    #[arg(value_name = "PATH")]
    pub path: PathBuf,

    /// Seconds of the sustained 4K random write run (QD32), reported second by second: the
    /// dips an average hides (garbage collection, a full SLC cache). 0 skips it.
    #[arg(long, default_value_t = 60, value_name = "N")]
    pub seconds: u64,

    /// Size of the scratch file (allocated in full first; refused when the filesystem lacks
    /// the space). The random tests spread over the part the sequential test wrote.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,

    /// Allow overwriting an existing file, or a block device holding data (a filesystem,
    /// partition table, volume label, or any non-zero byte in its first or last MiB). A
    /// mounted or otherwise claimed device is refused even so.
    #[arg(long)]
    pub destructive: bool,

    /// Print the results as one JSON object instead of the table. Its top level has
    /// fsync_p50_us, fdatasync_p50_us, fdatasync_p99_us, randread_qd1_iops,
    /// randread_qd32_iops, randwrite_qd1_iops, randwrite_qd32_iops, seqwrite_mb_s, verdict
    /// (ok, warn or unfit), reasons and notes; the details (every latency, the timeline, the
    /// device's sysfs attributes) below them.
    #[arg(long)]
    pub json: bool,

    /// Also draw the sustained run's per-second IOPS and p99 latency as a PNG chart in FILE.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}

/// What `--help` says after the options: the tests, the verdict's rules (from its constants),
/// output and exit status.
fn long_help() -> String {
    format!(
        "What it measures, in this order: sequential write MB/s (1 MiB O_DIRECT writes, then \
         fdatasync; at least 64 MiB, which the random tests then spread over); the latency (p50, \
         p99, max) at QD1 of a 4K write followed by fsync, by fdatasync, through an O_DSYNC \
         descriptor, and through an O_DIRECT|O_DSYNC one (a FUA write where the device has FUA); \
         4K O_DIRECT random read and write IOPS at QD1 and at QD{qd} ({qd} threads); then the \
         sustained 4K random write run at QD{qd}, second by second. Each test but the last runs \
         for about a second, so a probe takes about 10 s plus --seconds. It also reads what \
         sysfs says of the device (for a file, of the disk under its filesystem): rotational, \
         write cache, FUA, discard, model.\n\n{rules}\n\nThe table goes to stdout (or the \
         JSON with --json), progress to stderr. Ctrl-C stops at the next I/O and removes the \
         scratch file (a second Ctrl-C exits at once). Exit status: 0 when the probe ran, \
         whatever the verdict (read it from the output); 1 when it could not (refused, no \
         space, an I/O error, interrupted).",
        qd = measure::QD,
        rules = verdict::rules_text()
    )
}

/// Sets a flag at the first SIGINT/SIGTERM (the tests stop at the next I/O and the scratch file
/// is removed), exits at the second; restores the default handling when dropped.
struct StopOnSignal {
    flag: Arc<AtomicBool>,
    ids: Vec<signal_hook::SigId>,
}

impl StopOnSignal {
    fn install() -> anyhow::Result<StopOnSignal> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let flag = Arc::new(AtomicBool::new(false));
        let mut ids = Vec::new();
        for sig in [SIGINT, SIGTERM] {
            ids.push(signal_hook::flag::register_conditional_shutdown(
                sig,
                130,
                flag.clone(),
            )?);
            ids.push(signal_hook::flag::register(sig, flag.clone())?);
        }
        Ok(StopOnSignal { flag, ids })
    }
}

impl Drop for StopOnSignal {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Everything a probe found.
struct Outcome {
    device: device::DeviceFacts,
    m: measure::Measurements,
    verdict: Verdict,
}

fn probe(target: &target::Target, plan: &Plan) -> anyhow::Result<Outcome> {
    let stop = StopOnSignal::install()?;
    let device = device::facts(&target.path);
    let m = measure::run(&target.path, target.size, plan, &stop.flag)?;
    let verdict = verdict::judge(&m, &device);
    Ok(Outcome { device, m, verdict })
}

pub fn run(args: ProbeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.plot.is_none() || args.seconds > 0,
        "--plot draws the sustained run: give --seconds 1 or more"
    );
    let target = target::open(&args.path, args.size, args.destructive)?;
    let plan = Plan {
        step: Duration::from_secs(1),
        sustained_secs: args.seconds,
        min_span: 64 << 20,
    };
    tracing::info!(
        "probing {} ({}): about {} s",
        target.path.display(),
        target.kind.describe(),
        10 + args.seconds
    );
    let o = probe(&target, &plan)?;
    let shown = args.path.to_string_lossy();
    let probed = report::Probed {
        path: &shown,
        kind: target.kind.describe(),
        size: target.size,
        device: &o.device,
        m: &o.m,
        verdict: &o.verdict,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report::json(&probed))?);
    } else {
        print!("{}", report::text(&probed));
    }
    if let Some(png) = &args.plot {
        plot::write(png, &o.m.timeline, verdict::DIP_FRACTION)?;
        tracing::info!("timeline drawn in {}", png.display());
    }
    Ok(())
}

/// The quick probe `format` runs on the cache it is about to write: the block device itself
/// (`format` has checked it and holds it exclusively), or a scratch file beside a cache file.
/// About 2 s; no sustained run.
pub fn quick(cache: &Path, block_device: bool) -> anyhow::Result<Verdict> {
    let target = if block_device {
        target::claimed_device(cache)?
    } else {
        let dir = cache
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        target::scratch_in(dir, QUICK_SIZE)?
    };
    let plan = Plan {
        step: QUICK_STEP,
        sustained_secs: 0,
        min_span: 16 << 20,
    };
    let o = probe(&target, &plan).with_context(|| format!("probing {}", target.path.display()))?;
    let m = &o.m;
    println!(
        "flashtier: quick probe of the cache device: fdatasync p50 {}, 4K random write at \
         QD{} {:.0} IOPS, sequential write {:.0} MB/s: {}",
        flashtier_control::render::fmt_us(m.fdatasync.p50_us),
        measure::QD,
        m.randwrite_qd32.iops,
        m.seqwrite_mb_s,
        o.verdict.level.as_str()
    );
    Ok(o.verdict)
}

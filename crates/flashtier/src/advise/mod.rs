//! `flashtier advise TRACE`: how the read miss ratio of a cache would fall with its size, for
//! exact LRU, FIFO and S3-FIFO, from a trace of the volume's requests (`flashtier trace`), and
//! the size that gets most of the achievable hits. Beside them, the floor no cache can go under
//! (Belady's clairvoyant MIN, `opt`): how much any policy could still win at each size.
//!
//! Spatial sampling (SHARDS, Waldspurger et al., FAST 2015): a block is analysed iff a hash of
//! its number falls below a threshold, so a fraction `R` of the blocks is kept with every one of
//! their accesses, and a cache of `S` blocks behaves on the sample like one of `S·R` blocks. The
//! error is stated, not assumed: the sample is split by another hash bit into two independent
//! halves, each analysed alone, and the largest difference between their LRU curves over the
//! sizes shown is printed (a half sample is noisier than the whole, so this overstates it).
//!
//! Counts are corrected as in SHARDS_adj: a sample that happens to hold a very hot block holds
//! more reads than its share, nearly all hits, so misses are divided by the reads the sample
//! should hold (`R` times the trace's) rather than by the reads it holds.
//!
//! Reads are what a cache is judged by; writes count as accesses (write-back and write-through
//! keep what is written) and trims drop blocks.
//!
//! With `--engine`, flashtier's own curve is added: a sample of the trace's requests replayed
//! through a real cache at each size (`engine_sim`), scaled as the sample is. It takes seconds
//! per size, so it is asked for, and it samples on its own: whole aligned groups of 16 blocks
//! (so a database page's write stays one request, one log record), at the rate that keeps about
//! `--engine-accesses` block accesses.

mod engine_sim;
mod opt;
mod plot;
mod policies;
mod stack;

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use flashtier_control::trace::TraceOp;
use serde_json::json;

use crate::trace_cmd::open_trace;
use crate::units::{fmt_bytes, parse_size};
use opt::NextReads;
use policies::{Fifo, S3Fifo, Simulated};
use stack::{LruCurve, LruStack};

/// Sampled accesses kept by default: about this many, whatever the trace's length (a few
/// seconds of simulation per policy and size).
const DEFAULT_SAMPLED_ACCESSES: u64 = 4_000_000;
/// Cache sizes in the table by default.
const DEFAULT_POINTS: usize = 12;
/// A sampled cache of fewer blocks than this says little: sizes start at this many sampled
/// blocks.
const MIN_SAMPLED_BLOCKS: u64 = 64;

#[derive(Args, Debug)]
#[command(after_help = "\
Record a trace with `flashtier trace start FILE` (or `serve --trace FILE`) under the real \
workload, then run this on it. Sizes are of the cache's data (what `format --size` gives, less \
its metadata). The recommended size is the smallest at which exact LRU gets the stated share of \
the hits an unbounded cache would get (every read but each block's first). OPT is Belady's \
clairvoyant MIN: the fewest misses any cache of that size could have, knowing every request to \
come. It is a floor, not a policy: no cache reaches it, and none goes below it.")]
pub struct AdviseArgs {
    /// The trace (from `flashtier trace`, or `trace from-fio`).
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,
    /// The cache's block size.
    #[arg(long, value_name = "BYTES", default_value = "4K", value_parser = parse_size)]
    pub block_size: u64,
    /// Fraction of the blocks analysed, 0 < R <= 1 (1: exact). Default: enough for about four
    /// million sampled accesses.
    #[arg(long, value_name = "R")]
    pub sample: Option<f64>,
    /// Cache sizes to show, comma-separated (e.g. 256M,1G,4G). Default: twelve sizes up to the
    /// trace's working set.
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// The share of the achievable hits the recommended size must reach, in percent.
    #[arg(long, value_name = "PCT", default_value_t = 90.0)]
    pub target_pct: f64,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the curves into this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Add flashtier's own curve: replay the trace's requests through a real cache of each size
    /// (scaled like the sample, on sparse files in --scratch-dir); at the recorded pace, each size
    /// takes as long as the trace did.
    #[arg(long)]
    pub engine: bool,
    /// Client threads replaying into the cache with --engine (requests in flight: they decide
    /// how many records share a log batch and its header).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub engine_clients: u32,
    /// How fast --engine replays the trace: 1 = at the pace it was recorded (the default: how
    /// far reclaim keeps up with the clients decides whether it compacts or evicts, so the pace
    /// changes what the cache keeps), 2 = twice as fast, `max` = as fast as the cache takes it.
    #[arg(long, value_name = "X|max", default_value = "1", value_parser = parse_speed)]
    pub engine_speed: Speed,
    /// About how many block accesses --engine replays per size (it samples 64 KiB groups of
    /// blocks at the rate that keeps this many).
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    pub engine_accesses: u64,
    /// A live parameter for the cache --engine replays into, as `set` takes it (repeatable: e.g.
    /// `--engine-set reclaim_compact_pct=0`), to see what a setting would do to the curve.
    #[arg(long, value_name = "NAME=VALUE")]
    pub engine_set: Vec<String>,
    /// The segment size of the cache --engine models (what `format --segment-size` gave it).
    #[arg(long, value_name = "BYTES", default_value = "4M", value_parser = parse_size)]
    pub segment_size: u64,
    /// Where --engine puts its scratch cache and backing files (removed afterwards; sparse, up
    /// to the largest size shown).
    #[arg(long, value_name = "DIR")]
    pub scratch_dir: Option<PathBuf>,
}

/// `--engine-speed`: a factor of the recorded pace, or `None` for as fast as possible.
#[derive(Debug, Clone, Copy)]
pub struct Speed(Option<f64>);

fn parse_speed(s: &str) -> Result<Speed, String> {
    if s == "max" {
        return Ok(Speed(None));
    }
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(Speed(Some(x))),
        _ => Err(format!(
            "{s:?}: a factor above 0 (1 = as recorded) or `max`"
        )),
    }
}

/// A block access of the sampled stream: the block number, and what it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read(u64),
    Write(u64),
    Trim(u64),
}

/// SHARDS' spatial sampling: whether a block is in the sample, and in which half.
#[derive(Debug, Clone, Copy)]
struct Sampler {
    /// Kept iff the hash's low 24 bits are below this.
    threshold: u64,
}

const SAMPLE_BITS: u32 = 24;

impl Sampler {
    fn new(rate: f64) -> Sampler {
        Sampler {
            threshold: ((rate * (1u64 << SAMPLE_BITS) as f64).round() as u64).max(1),
        }
    }

    fn rate(&self) -> f64 {
        self.threshold as f64 / (1u64 << SAMPLE_BITS) as f64
    }

    fn hash(block: u64) -> u64 {
        // splitmix64's finalizer: sequential blocks scatter.
        let mut z = block.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn keeps(&self, block: u64) -> bool {
        Self::hash(block) & ((1 << SAMPLE_BITS) - 1) < self.threshold
    }

    /// Which half of the sample a kept block is in (an independent bit of the hash).
    fn half(block: u64) -> usize {
        (Self::hash(block) >> 63) as usize
    }
}

/// The blocks a request touches.
fn blocks(offset: u64, len: u32, block_size: u64) -> std::ops::Range<u64> {
    let first = offset / block_size;
    let end = (offset + len as u64).div_ceil(block_size);
    first..end.max(first)
}

/// Where in the trace an access is: the number of its request, and when it was made.
#[derive(Debug, Clone, Copy)]
struct At {
    request: u64,
    t_us: u64,
}

/// Calls `f` for every block access of the trace, in order, with where it is, and with `None`
/// for a flush.
fn for_each_access(
    path: &Path,
    block_size: u64,
    mut f: impl FnMut(Option<Access>, At),
) -> anyhow::Result<()> {
    for (request, r) in open_trace(path)?.enumerate() {
        let r = r.with_context(|| format!("reading {}", path.display()))?;
        let at = At {
            request: request as u64,
            t_us: r.t_us,
        };
        let make: fn(u64) -> Access = match r.op {
            TraceOp::Read => Access::Read,
            TraceOp::Write | TraceOp::WriteZeroes => Access::Write,
            TraceOp::Trim => Access::Trim,
            TraceOp::Flush => {
                f(None, at);
                continue;
            }
            TraceOp::Lost => continue,
        };
        for b in blocks(r.offset, r.len, block_size) {
            f(Some(make(b)), at);
        }
    }
    Ok(())
}

/// What the analysis found.
struct Analysis {
    rate: f64,
    /// Block accesses in the whole trace (reads, writes).
    reads: u64,
    writes: u64,
    /// The sampled reads a sample of this rate should hold.
    expected_reads: f64,
    /// Distinct blocks accessed, estimated from the sample.
    working_set_blocks: u64,
    lru: LruCurve,
    rows: Vec<Row>,
}

impl Analysis {
    /// The smallest cache (unsampled blocks) at which exact LRU gets `fraction` of the read hits
    /// an unbounded cache gets.
    fn size_for(&self, fraction: f64) -> u64 {
        let cold = (self.lru.reads - self.lru.max_hits()) as f64;
        let achievable = (self.expected_reads - cold).max(0.0);
        let allowed_misses = cold + (1.0 - fraction) * achievable;
        let want = (self.lru.reads as f64 - allowed_misses).max(0.0).ceil() as u64;
        (self.lru.size_for_hits(want) as f64 / self.rate).ceil() as u64
    }

    /// Exact LRU's read miss ratio for a cache of `blocks` (unsampled) blocks.
    fn lru_miss_ratio(&self, blocks: u64) -> f64 {
        let sampled = (blocks as f64 * self.rate).round() as u64;
        adjusted(self.lru.reads - self.lru.hits(sampled), self.expected_reads)
    }
}

struct Row {
    blocks: u64,
    lru: f64,
    fifo: f64,
    s3fifo: f64,
    /// The floor: Belady's MIN (`opt`).
    opt: f64,
    /// |difference| of the two half samples' LRU miss ratios.
    spread: f64,
    /// flashtier's own, replayed (`--engine`); `None` when not asked for or too small to scale.
    engine: Option<EngineRow>,
}

/// flashtier at one size, replayed through a real cache.
#[derive(Debug, Clone, Copy)]
struct EngineRow {
    miss_ratio: f64,
    live_share: f64,
    header_share: f64,
}

fn analyse(args: &AdviseArgs) -> anyhow::Result<Analysis> {
    let bs = args.block_size;
    anyhow::ensure!(
        bs >= 512 && bs.is_power_of_two(),
        "--block-size must be a power of two of at least 512 bytes"
    );
    // Pass 1: how many accesses, to size the sample and the LRU stack.
    let (mut reads, mut writes) = (0u64, 0u64);
    for_each_access(&args.trace, bs, |a, _| match a {
        Some(Access::Read(_)) => reads += 1,
        Some(Access::Write(_)) => writes += 1,
        Some(Access::Trim(_)) | None => {}
    })?;
    anyhow::ensure!(
        reads > 0,
        "the trace holds no reads: nothing for a cache to hit"
    );
    let rate = match args.sample {
        Some(r) if r > 0.0 && r <= 1.0 => r,
        Some(r) => anyhow::bail!("--sample must be above 0 and at most 1 (got {r})"),
        None => (DEFAULT_SAMPLED_ACCESSES as f64 / (reads + writes) as f64).min(1.0),
    };
    let sampler = Sampler::new(rate);
    // Pass 2: the sampled stream.
    let mut sampled = Vec::new();
    for_each_access(&args.trace, bs, |a, _| {
        let Some(a) = a else { return };
        let (Access::Read(b) | Access::Write(b) | Access::Trim(b)) = a;
        if sampler.keeps(b) {
            sampled.push(a);
        }
    })?;
    let rate = sampler.rate();
    anyhow::ensure!(
        sampled.iter().any(|a| matches!(a, Access::Read(_))),
        "the sample at rate {rate} holds no reads: use a larger --sample"
    );
    let mut lru = LruStack::with_capacity(sampled.len());
    let mut halves = [
        LruStack::with_capacity(sampled.len()),
        LruStack::with_capacity(sampled.len()),
    ];
    for &a in &sampled {
        match a {
            Access::Read(b) | Access::Write(b) => {
                let read = matches!(a, Access::Read(_));
                lru.access(b, read);
                halves[Sampler::half(b)].access(b, read);
            }
            Access::Trim(b) => {
                lru.forget(b);
                halves[Sampler::half(b)].forget(b);
            }
        }
    }
    let working_set_blocks = (lru.blocks() as f64 / rate).round() as u64;
    let lru_curve = lru.curve();
    let halves = halves.map(|h| h.curve());
    let sizes: Vec<u64> = if args.sizes.is_empty() {
        default_sizes(working_set_blocks, rate)
    } else {
        args.sizes.iter().map(|s| (s / bs).max(1)).collect()
    };
    let scaled = |blocks: u64| ((blocks as f64 * rate).round() as u64).max(1);
    let next_reads = NextReads::of(&sampled);
    let mut rows: Vec<Row> = sizes
        .iter()
        .map(|&blocks| {
            let s = scaled(blocks);
            let expected = reads as f64 * rate;
            let half = |c: &LruCurve| {
                let blocks = ((blocks as f64 * rate / 2.0).round() as u64).max(1);
                adjusted(c.reads - c.hits(blocks), expected / 2.0)
            };
            Row {
                blocks,
                lru: adjusted(lru_curve.reads - lru_curve.hits(s), expected),
                fifo: adjusted(simulate(&sampled, Fifo::new(s as usize)), expected),
                s3fifo: adjusted(simulate(&sampled, S3Fifo::new(s as usize)), expected),
                opt: adjusted(next_reads.read_misses(s as usize), expected),
                spread: (half(&halves[0]) - half(&halves[1])).abs(),
                engine: None,
            }
        })
        .collect();
    if args.engine {
        replay_engine(args, reads + writes, reads, &mut rows)?;
    }
    Ok(Analysis {
        rate,
        reads,
        expected_reads: reads as f64 * rate,
        writes,
        working_set_blocks,
        lru: lru_curve,
        rows,
    })
}

/// Blocks sampled together for `--engine`: requests of up to this many aligned blocks stay whole
/// in its sample (a database's 16 KiB page is one record in the log, and four single-block
/// records would take more batch headers).
const ENGINE_SAMPLE_GROUP: u64 = 16;

/// Fills in flashtier's own miss ratios: the requests of a sample of the trace (its own: whole
/// groups of [`ENGINE_SAMPLE_GROUP`] blocks, at most about `--engine-accesses` block accesses)
/// replayed through a real cache of each row's size, scaled to the rate.
fn replay_engine(
    args: &AdviseArgs,
    accesses: u64,
    reads: u64,
    rows: &mut [Row],
) -> anyhow::Result<()> {
    let sampler = Sampler::new((args.engine_accesses as f64 / accesses.max(1) as f64).min(1.0));
    let mut ios: Vec<engine_sim::Io> = Vec::new();
    let mut last_request = u64::MAX;
    // Flushes are kept at the sample's rate, evenly: they end the log's batches and sync it.
    let mut flush_credit = 0.0;
    for_each_access(&args.trace, args.block_size, |a, at| {
        let Some(a) = a else {
            flush_credit += sampler.rate();
            if flush_credit >= 1.0 {
                flush_credit -= 1.0;
                ios.push(engine_sim::Io::flush(at.t_us));
            }
            return;
        };
        let (Access::Read(b) | Access::Write(b) | Access::Trim(b)) = a;
        if !sampler.keeps(b / ENGINE_SAMPLE_GROUP) {
            return;
        }
        let io = engine_sim::Io::of(a, at.t_us);
        match ios.last_mut() {
            Some(prev) if at.request == last_request && prev.continues_with(&io) => {
                prev.blocks += 1
            }
            _ => ios.push(io),
        }
        last_request = at.request;
    })?;
    let volume_blocks = ios
        .iter()
        .map(|io| io.block + io.blocks as u64)
        .max()
        .unwrap_or(1);
    let sampled_accesses: u64 = ios.iter().map(|io| io.blocks as u64).sum();
    let span_secs = match (ios.first(), ios.last()) {
        (Some(a), Some(b)) => b.t_us.saturating_sub(a.t_us) as f64 / 1e6,
        _ => 0.0,
    };
    let rate = sampler.rate();
    let params: Vec<(&str, &str)> = args
        .engine_set
        .iter()
        .map(|p| {
            p.split_once('=')
                .with_context(|| format!("--engine-set {p:?}: expected NAME=VALUE"))
        })
        .collect::<anyhow::Result<_>>()?;
    let scratch =
        engine_sim::Scratch::new(args.scratch_dir.as_deref().unwrap_or(&std::env::temp_dir()))?;
    let total = rows.len();
    if let Some(x) = args.engine_speed.0 {
        let replays = rows
            .iter()
            .filter(|r| {
                engine_sim::scaled_geometry(r.blocks, rate, args.block_size, args.segment_size)
                    .is_some()
            })
            .count();
        let secs = replays as f64 * span_secs / x;
        if secs > 600.0 {
            eprintln!(
                "note: {replays} replays at {x}x the recorded pace take about {:.0} minutes; \
                 --engine-speed or fewer --sizes shorten that",
                secs / 60.0
            );
        }
    }
    for (i, row) in rows.iter_mut().enumerate() {
        let Some(geometry) =
            engine_sim::scaled_geometry(row.blocks, rate, args.block_size, args.segment_size)
        else {
            continue;
        };
        let pace = match args.engine_speed.0 {
            Some(x) => format!("over {:.0} s ({x}x the recorded pace)", span_secs / x),
            None => "as fast as it takes them".to_string(),
        };
        eprintln!(
            "replaying {} requests ({sampled_accesses} block accesses) {pace} through a \
             flashtier cache for {} ({} of {total})",
            ios.len(),
            fmt_bytes(row.blocks * args.block_size),
            i + 1
        );
        let run = engine_sim::replay(
            &scratch,
            &ios,
            volume_blocks,
            args.block_size,
            geometry,
            engine_sim::Pace {
                clients: args.engine_clients as usize,
                speed: args.engine_speed.0,
            },
            &params,
        )?;
        row.engine = Some(EngineRow {
            miss_ratio: adjusted(run.read_misses, reads as f64 * rate),
            live_share: run.live_share,
            header_share: run.header_share,
        });
    }
    Ok(())
}

/// Sizes from a sampled cache of `MIN_SAMPLED_BLOCKS` (or 1/256 of the working set) up to the
/// working set, evenly spaced on a log scale.
fn default_sizes(working_set: u64, rate: f64) -> Vec<u64> {
    let top = working_set.max(1) as f64;
    let bottom = (top / 256.0).max(MIN_SAMPLED_BLOCKS as f64 / rate).min(top);
    let n = DEFAULT_POINTS;
    let mut sizes: Vec<u64> = (0..n)
        .map(|i| (bottom * (top / bottom).powf(i as f64 / (n - 1) as f64)).round() as u64)
        .collect();
    sizes.dedup();
    sizes
}

/// A miss ratio out of the reads a sample should hold (see the module's essay).
fn adjusted(misses: u64, expected_reads: f64) -> f64 {
    (misses as f64 / expected_reads.max(1.0)).min(1.0)
}

/// The read misses of `cache` on the sampled stream.
fn simulate(sampled: &[Access], mut cache: impl Simulated) -> u64 {
    let mut misses = 0u64;
    for &a in sampled {
        match a {
            Access::Read(b) => {
                misses += !cache.access(b) as u64;
            }
            Access::Write(b) => {
                cache.access(b);
            }
            Access::Trim(b) => cache.forget(b),
        }
    }
    misses
}

pub fn run(args: AdviseArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.target_pct > 0.0 && args.target_pct <= 100.0,
        "--target-pct must be above 0 and at most 100"
    );
    let a = analyse(&args)?;
    let bs = args.block_size;
    let fraction = args.target_pct / 100.0;
    let recommend_blocks = a.size_for(fraction);
    let error = a.rows.iter().map(|r| r.spread).fold(0.0, f64::max);
    if let Some(plot) = &args.plot {
        plot::write(plot, &a, bs, recommend_blocks)?;
    }
    if args.json {
        let curve: Vec<_> = a
            .rows
            .iter()
            .map(|r| {
                let mut row = json!({
                    "bytes": r.blocks * bs,
                    "lru_miss_ratio": r.lru,
                    "fifo_miss_ratio": r.fifo,
                    "s3fifo_miss_ratio": r.s3fifo,
                    "opt_miss_ratio": r.opt,
                });
                if let Some(e) = r.engine {
                    row["flashtier_miss_ratio"] = json!(e.miss_ratio);
                    row["flashtier_live_share"] = json!(e.live_share);
                    row["flashtier_header_share"] = json!(e.header_share);
                }
                row
            })
            .collect();
        let out = json!({
            "trace": args.trace,
            "block_size": bs,
            "sample_rate": a.rate,
            "reads": a.reads,
            "writes": a.writes,
            "working_set_bytes": a.working_set_blocks * bs,
            "lru_miss_ratio_unbounded": a.lru_miss_ratio(u64::MAX / 2),
            "error_estimate": error,
            "target_pct": args.target_pct,
            "recommended_bytes": recommend_blocks * bs,
            "curve": curve,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{}: {} block reads, {} block writes, working set {} ({} blocks of {})",
        args.trace.display(),
        a.reads,
        a.writes,
        fmt_bytes(a.working_set_blocks * bs),
        a.working_set_blocks,
        fmt_bytes(bs)
    );
    if a.rate < 1.0 {
        println!(
            "sampled {:.3}% of the blocks (SHARDS); the two halves of the sample differ by up \
             to {:.1} points of miss ratio",
            a.rate * 100.0,
            error * 100.0
        );
    } else {
        println!("exact: every block analysed");
    }
    println!();
    let engine_head = if args.engine {
        format!("  {:>9}  {:>6}", "flashtier", "live")
    } else {
        String::new()
    };
    println!(
        "{:>12}  {:>9}  {:>9}  {:>9}  {:>9}{engine_head}",
        "cache size", "LRU", "FIFO", "S3-FIFO", "OPT"
    );
    for r in &a.rows {
        let engine = match (args.engine, r.engine) {
            (false, _) => String::new(),
            (true, Some(e)) => format!(
                "  {:>8.1}%  {:>5.0}%",
                e.miss_ratio * 100.0,
                e.live_share * 100.0
            ),
            (true, None) => format!("  {:>9}  {:>6}", "too small", "-"),
        };
        println!(
            "{:>12}  {:>8.1}%  {:>8.1}%  {:>8.1}%  {:>8.1}%{engine}",
            fmt_bytes(r.blocks * bs),
            r.lru * 100.0,
            r.fifo * 100.0,
            r.s3fifo * 100.0,
            r.opt * 100.0
        );
    }
    println!(
        "{:>12}  {:>8.1}%  (every read but each block's first)",
        "unbounded",
        a.lru_miss_ratio(u64::MAX / 2) * 100.0
    );
    println!();
    println!(
        "recommended: {} — {:.0}% of the achievable hits with LRU (miss ratio {:.1}%)",
        fmt_bytes(recommend_blocks * bs),
        args.target_pct,
        a.lru_miss_ratio(recommend_blocks) * 100.0
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashtier_control::trace::{TraceHeader, TraceRecord, TraceWriter};

    /// A trace of 4 KiB reads and writes over `blocks` blocks: 80% of the accesses to a hot
    /// fifth, the rest uniform (xorshift, fixed seed), and a sequential scan through the middle.
    fn synthetic_trace(path: &Path, blocks: u64, requests: u64) {
        let mut out = TraceWriter::new(
            std::io::BufWriter::new(std::fs::File::create(path).unwrap()),
            TraceHeader {
                start_unix_us: 0,
                device_size: blocks * 4096,
            },
        )
        .unwrap();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..requests {
            let r = next();
            let block = if (requests / 2..requests / 2 + blocks / 4).contains(&i) {
                i - requests / 2
            } else if r % 10 < 8 {
                (r >> 8) % (blocks / 5)
            } else {
                (r >> 8) % blocks
            };
            let op = if (r >> 4) % 10 < 7 {
                TraceOp::Read
            } else {
                TraceOp::Write
            };
            out.write(&TraceRecord {
                t_us: i,
                op,
                offset: block * 4096,
                len: 4096,
                fua: false,
            })
            .unwrap();
        }
        out.finish().unwrap();
    }

    fn args(trace: &Path, sample: f64, sizes: &[u64]) -> AdviseArgs {
        AdviseArgs {
            trace: trace.to_path_buf(),
            block_size: 4096,
            sample: Some(sample),
            sizes: sizes.to_vec(),
            target_pct: 90.0,
            json: false,
            plot: None,
            engine: false,
            engine_clients: 16,
            engine_accesses: 1_000_000,
            segment_size: 4 << 20,
            engine_set: Vec::new(),
            engine_speed: Speed(Some(1.0)),
            scratch_dir: None,
        }
    }

    /// The sampled curves stay within a few points of the exact ones, and within the error the
    /// analysis states (with some slack: the stated error is one sample's spread).
    #[test]
    fn sampled_curves_follow_the_exact_ones() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.ft");
        synthetic_trace(&trace, 200_000, 600_000);
        let sizes: Vec<u64> = [8_000u64, 20_000, 40_000, 80_000, 160_000]
            .iter()
            .map(|b| b * 4096)
            .collect();
        let exact = analyse(&args(&trace, 1.0, &sizes)).unwrap();
        let sampled = analyse(&args(&trace, 0.1, &sizes)).unwrap();
        assert_eq!(exact.rate, 1.0);
        assert!((sampled.rate - 0.1).abs() < 1e-6);
        let stated = sampled.rows.iter().map(|r| r.spread).fold(0.0, f64::max);
        for (e, s) in exact.rows.iter().zip(&sampled.rows) {
            for (name, x, y) in [
                ("lru", e.lru, s.lru),
                ("fifo", e.fifo, s.fifo),
                ("s3fifo", e.s3fifo, s.s3fifo),
                ("opt", e.opt, s.opt),
            ] {
                assert!(
                    (x - y).abs() <= 0.03_f64.max(2.0 * stated),
                    "{name} at {} blocks: exact {x:.4}, sampled {y:.4}, stated error {stated:.4}",
                    e.blocks
                );
            }
        }
        // The curves fall with size, and the scan makes S3-FIFO (which keeps it out of its
        // main FIFO) beat LRU somewhere.
        assert!(exact.rows.windows(2).all(|w| w[1].lru <= w[0].lru));
        assert!(exact.rows.iter().any(|r| r.s3fifo < r.lru - 0.01));
        // No policy goes under the floor, and LRU stays well above it on this trace.
        for r in &exact.rows {
            assert!(
                r.opt <= r.lru.min(r.fifo).min(r.s3fifo) + 1e-12,
                "{}",
                r.blocks
            );
        }
        assert!(exact.rows.iter().any(|r| r.opt < r.lru - 0.05));
        // The recommendation reaches 90% of the achievable hits, and a smaller cache does not.
        let rec = exact.size_for(0.9);
        let cold = exact.lru_miss_ratio(u64::MAX / 2);
        let gain = |blocks| 1.0 - exact.lru_miss_ratio(blocks) - (1.0 - cold) * 0.9;
        assert!(gain(rec) >= -1e-9 && gain(rec - 1) < 0.0, "{rec}");
        assert!((40_000..=200_000).contains(&exact.working_set_blocks));
    }

    #[test]
    fn engine_settings_are_checked_before_they_are_replayed_with() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.ft");
        synthetic_trace(&trace, 20_000, 20_000);
        let mut a = args(&trace, 1.0, &[8 << 20]);
        a.engine = true;
        a.segment_size = 256 << 10;
        a.scratch_dir = Some(dir.path().to_path_buf());
        a.engine_set = vec!["reclaim_compact_pct".into()];
        let err = analyse(&a).err().unwrap().to_string();
        assert!(err.contains("expected NAME=VALUE"), "{err}");
        a.engine_set = vec!["reclaim_compact_pct=99".into()];
        let err = format!("{:#}", analyse(&a).err().unwrap());
        assert!(err.contains("reclaim_compact_pct=99"), "{err}");
        a.engine_set = vec!["reclaim_compact_pct=0".into()];
        let row = analyse(&a).unwrap().rows[0].engine.unwrap();
        assert!(row.miss_ratio > 0.0 && row.miss_ratio < 1.0, "{row:?}");
    }

    #[test]
    fn sizes_and_sampling_rates_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.ft");
        synthetic_trace(&trace, 1000, 2000);
        for bad in [0.0, 1.5, -1.0] {
            assert!(analyse(&args(&trace, bad, &[])).is_err(), "{bad}");
        }
        let mut a = args(&trace, 1.0, &[]);
        a.block_size = 1000;
        assert!(analyse(&a).is_err());
        let sizes = default_sizes(1_000_000, 0.01);
        assert_eq!(sizes.len(), DEFAULT_POINTS);
        assert_eq!(sizes[0], 6400, "64 sampled blocks at 1%");
        assert_eq!(*sizes.last().unwrap(), 1_000_000);
    }
}

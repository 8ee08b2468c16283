//! `flashtier advise TRACE`: how the read miss ratio of a cache would fall with its size, for
//! exact LRU, FIFO and S3-FIFO, from a trace of the volume's requests (`flashtier trace`), and
//! the size that gets most of the achievable hits.
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
the hits an unbounded cache would get (every read but each block's first).")]
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

/// Calls `f` for every block access of the trace, in order.
fn for_each_access(path: &Path, block_size: u64, mut f: impl FnMut(Access)) -> anyhow::Result<()> {
    for r in open_trace(path)? {
        let r = r.with_context(|| format!("reading {}", path.display()))?;
        let make: fn(u64) -> Access = match r.op {
            TraceOp::Read => Access::Read,
            TraceOp::Write | TraceOp::WriteZeroes => Access::Write,
            TraceOp::Trim => Access::Trim,
            TraceOp::Flush | TraceOp::Lost => continue,
        };
        for b in blocks(r.offset, r.len, block_size) {
            f(make(b));
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
    /// |difference| of the two half samples' LRU miss ratios.
    spread: f64,
}

fn analyse(args: &AdviseArgs) -> anyhow::Result<Analysis> {
    let bs = args.block_size;
    anyhow::ensure!(
        bs >= 512 && bs.is_power_of_two(),
        "--block-size must be a power of two of at least 512 bytes"
    );
    // Pass 1: how many accesses, to size the sample and the LRU stack.
    let (mut reads, mut writes) = (0u64, 0u64);
    for_each_access(&args.trace, bs, |a| match a {
        Access::Read(_) => reads += 1,
        Access::Write(_) => writes += 1,
        Access::Trim(_) => {}
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
    for_each_access(&args.trace, bs, |a| {
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
    let rows = sizes
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
                spread: (half(&halves[0]) - half(&halves[1])).abs(),
            }
        })
        .collect();
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
                json!({
                    "bytes": r.blocks * bs,
                    "lru_miss_ratio": r.lru,
                    "fifo_miss_ratio": r.fifo,
                    "s3fifo_miss_ratio": r.s3fifo,
                })
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
    println!(
        "{:>12}  {:>9}  {:>9}  {:>9}",
        "cache size", "LRU", "FIFO", "S3-FIFO"
    );
    for r in &a.rows {
        println!(
            "{:>12}  {:>8.1}%  {:>8.1}%  {:>8.1}%",
            fmt_bytes(r.blocks * bs),
            r.lru * 100.0,
            r.fifo * 100.0,
            r.s3fifo * 100.0
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
        // The recommendation reaches 90% of the achievable hits, and a smaller cache does not.
        let rec = exact.size_for(0.9);
        let cold = exact.lru_miss_ratio(u64::MAX / 2);
        let gain = |blocks| 1.0 - exact.lru_miss_ratio(blocks) - (1.0 - cold) * 0.9;
        assert!(gain(rec) >= -1e-9 && gain(rec - 1) < 0.0, "{rec}");
        assert!((40_000..=200_000).contains(&exact.working_set_blocks));
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

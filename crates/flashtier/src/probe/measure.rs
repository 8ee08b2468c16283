//! The measurements, each bounded in time: synchronous write latency four ways at QD1, O_DIRECT
//! random reads and writes at QD1 and QD32, sequential write throughput, and a sustained random
//! write run with a per-second timeline.
//!
//! QD32 is 32 threads each doing O_DIRECT pread/pwrite (the workspace has no io_uring binding,
//! and the kernel runs positioned I/O on one file from many threads in parallel).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use flashtier_control::histogram::{HistSnapshot, Histogram};
use flashtier_io::AlignedBuf;

/// The unit of the latency and IOPS tests: the cache's block size.
const BLOCK: usize = 4096;
/// Sequential writes: large enough that the device, not the syscall, sets the pace.
const SEQ_CHUNK: usize = 1 << 20;
/// The queue depth of the parallel tests and the sustained run.
pub const QD: usize = 32;
/// A latency test keeps going past its time until it has this many samples, so a device whose
/// flushes take longer than the test's time still gets a median.
const MIN_SAMPLES: u64 = 3;

/// How long each part runs.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Each latency, IOPS and sequential test.
    pub step: Duration,
    /// The sustained random write run (zero: none).
    pub sustained_secs: u64,
    /// The sequential write covers at least this much (or the whole target), so the random
    /// tests spread over written blocks: a fresh file's unwritten extents read back as zeroes
    /// without touching the device, and writing into them costs extent conversions.
    pub min_span: u64,
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    pub samples: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latency {
    fn of(h: &HistSnapshot) -> Latency {
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            samples: h.count,
            p50_us: us(h.quantile(0.5)),
            p99_us: us(h.quantile(0.99)),
            max_us: us(h.max),
        }
    }
}

/// Operations per second and their latency.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    pub iops: f64,
    pub latency: Latency,
}

/// Everything measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measurements {
    /// Bytes at the start of the target the random tests ran over (written first).
    pub span: u64,
    /// MB/s (10^6 bytes), the closing fdatasync included.
    pub seqwrite_mb_s: f64,
    /// 4 KiB pwrite then fsync, on a buffered descriptor.
    pub fsync: Latency,
    /// 4 KiB pwrite then fdatasync.
    pub fdatasync: Latency,
    /// 4 KiB pwrite on an O_DSYNC descriptor.
    pub dsync: Latency,
    /// 4 KiB pwrite on an O_DIRECT|O_DSYNC descriptor: a FUA write where the device has FUA,
    /// else a write and a flush.
    pub direct_dsync: Latency,
    pub randread_qd1: Rate,
    pub randread_qd32: Rate,
    pub randwrite_qd1: Rate,
    pub randwrite_qd32: Rate,
    /// The sustained 4 KiB random write run at QD32, second by second.
    pub timeline: Vec<Rate>,
}

/// Runs every test on `path` (`size` bytes, all of which the probe may overwrite). Stops early
/// with an error when `stop` is set (Ctrl-C).
pub fn run(path: &Path, size: u64, plan: &Plan, stop: &AtomicBool) -> anyhow::Result<Measurements> {
    let open = |flags: libc::c_int| -> anyhow::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))
    };
    let direct = open(libc::O_DIRECT).map_err(|e| {
        if is_einval(&e) {
            e.context(
                "O_DIRECT is not supported there (tmpfs?): probe a directory on the \
                       filesystem or the device the cache will use",
            )
        } else {
            e
        }
    })?;
    let mut m = Measurements::default();

    tracing::info!("sequential write");
    let (span, mb_s) = seqwrite(&direct, size, plan, stop)?;
    m.span = span;
    m.seqwrite_mb_s = mb_s;

    let buffered = open(0)?;
    tracing::info!("4K write + fsync");
    m.fsync = sync_latency(span, plan.step, stop, |buf, at| {
        buffered.write_all_at(buf, at)?;
        buffered.sync_all()
    })?;
    tracing::info!("4K write + fdatasync");
    m.fdatasync = sync_latency(span, plan.step, stop, |buf, at| {
        buffered.write_all_at(buf, at)?;
        buffered.sync_data()
    })?;
    let dsync = open(libc::O_DSYNC)?;
    tracing::info!("4K O_DSYNC write");
    m.dsync = sync_latency(span, plan.step, stop, |buf, at| dsync.write_all_at(buf, at))?;
    let direct_dsync = open(libc::O_DIRECT | libc::O_DSYNC)?;
    tracing::info!("4K O_DIRECT|O_DSYNC write");
    m.direct_dsync = sync_latency(span, plan.step, stop, |buf, at| {
        direct_dsync.write_all_at(buf, at)
    })?;

    for (write, qd, what) in [
        (false, 1, &mut m.randread_qd1),
        (false, QD, &mut m.randread_qd32),
        (true, 1, &mut m.randwrite_qd1),
        (true, QD, &mut m.randwrite_qd32),
    ] {
        tracing::info!(
            "4K random {} at QD{qd}",
            if write { "write" } else { "read" }
        );
        *what = random_io(&direct, span, qd, plan.step, write, stop)?.total;
    }

    if plan.sustained_secs > 0 {
        tracing::info!(
            "sustained 4K random write at QD{QD} for {} s",
            plan.sustained_secs
        );
        let run = random_io(
            &direct,
            span,
            QD,
            Duration::from_secs(plan.sustained_secs),
            true,
            stop,
        )?;
        m.timeline = run.per_second;
    }
    Ok(m)
}

fn is_einval(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.raw_os_error() == Some(libc::EINVAL))
}

fn check_stop(stop: &AtomicBool) -> anyhow::Result<()> {
    if stop.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// A buffer of pseudo-random bytes: devices that compress or deduplicate would flatter zeroes.
fn random_buf(len: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    let mut rng = Rng::new(seed);
    for chunk in buf.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next().to_le_bytes()[..chunk.len()]);
    }
    buf
}

/// Random offsets spread over the span, no two threads alike.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        crate::demo::next_random(&mut self.0)
    }

    /// A block-aligned offset below `span`.
    fn offset(&mut self, span: u64) -> u64 {
        self.next() % (span / BLOCK as u64) * BLOCK as u64
    }
}

/// Writes 1 MiB chunks from the start for `plan.step`, and on until `plan.min_span` is covered,
/// wrapping at the end; then fdatasync. Returns the span written and MB/s.
fn seqwrite(file: &File, size: u64, plan: &Plan, stop: &AtomicBool) -> anyhow::Result<(u64, f64)> {
    let chunk = SEQ_CHUNK as u64;
    let end = size / chunk * chunk;
    let want = plan.min_span.min(end);
    let buf = random_buf(SEQ_CHUNK, 1);
    let start = Instant::now();
    let deadline = start + plan.step;
    let (mut at, mut written, mut span) = (0u64, 0u64, 0u64);
    while written < want || Instant::now() < deadline {
        check_stop(stop)?;
        file.write_all_at(&buf, at).context("sequential write")?;
        written += chunk;
        at += chunk;
        span = span.max(at);
        if at >= end {
            at = 0;
        }
    }
    file.sync_data()
        .context("fdatasync after the sequential write")?;
    let secs = start.elapsed().as_secs_f64();
    Ok((span, written as f64 / secs / 1e6))
}

/// Times `op(4 KiB buffer, offset)` at random offsets in `span` for `step` (and at least
/// [`MIN_SAMPLES`] times).
fn sync_latency(
    span: u64,
    step: Duration,
    stop: &AtomicBool,
    mut op: impl FnMut(&[u8], u64) -> std::io::Result<()>,
) -> anyhow::Result<Latency> {
    let buf = random_buf(BLOCK, 2);
    let mut rng = Rng::new(3);
    let h = Histogram::default();
    let deadline = Instant::now() + step;
    let mut n = 0;
    while n < MIN_SAMPLES || Instant::now() < deadline {
        check_stop(stop)?;
        let t = Instant::now();
        op(&buf, rng.offset(span))?;
        h.record(t.elapsed().as_nanos() as u64);
        n += 1;
    }
    Ok(Latency::of(&h.snapshot()))
}

struct RandomRun {
    total: Rate,
    /// Whole seconds only.
    per_second: Vec<Rate>,
}

/// `threads` threads doing 4 KiB O_DIRECT reads or writes at random offsets in `span` for
/// `duration`.
fn random_io(
    file: &File,
    span: u64,
    threads: usize,
    duration: Duration,
    write: bool,
    stop: &AtomicBool,
) -> anyhow::Result<RandomRun> {
    let seconds = duration.as_secs() as usize;
    let total = Histogram::default();
    let per_second: Vec<Histogram> = (0..seconds).map(|_| Histogram::default()).collect();
    let failed = AtomicBool::new(false);
    let start = Instant::now();
    let deadline = start + duration;
    let errors: Vec<std::io::Error> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|i| {
                let (total, per_second, failed) = (&total, &per_second, &failed);
                s.spawn(move || -> std::io::Result<()> {
                    let mut buf = random_buf(BLOCK, 10 + i as u64);
                    let mut rng = Rng::new(100 + i as u64);
                    while !stop.load(Ordering::Relaxed) && !failed.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        if t >= deadline {
                            break;
                        }
                        let at = rng.offset(span);
                        let r = if write {
                            file.write_all_at(&buf, at)
                        } else {
                            file.read_exact_at(&mut buf, at)
                        };
                        if let Err(e) = r {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                        let done = Instant::now();
                        let ns = (done - t).as_nanos() as u64;
                        total.record(ns);
                        if let Some(h) = per_second.get((done - start).as_secs() as usize) {
                            h.record(ns);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().expect("probe thread panicked").err())
            .collect()
    });
    if let Some(e) = errors.into_iter().next() {
        return Err(anyhow::Error::new(e).context(format!(
            "4K random {}",
            if write { "write" } else { "read" }
        )));
    }
    check_stop(stop)?;
    let elapsed = start.elapsed().as_secs_f64();
    let rate = |h: &HistSnapshot, secs: f64| Rate {
        iops: h.count as f64 / secs,
        latency: Latency::of(h),
    };
    Ok(RandomRun {
        total: rate(&total.snapshot(), elapsed),
        per_second: per_second
            .iter()
            .map(|h| rate(&h.snapshot(), 1.0))
            .collect(),
    })
}

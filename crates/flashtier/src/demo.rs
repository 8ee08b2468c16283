//! `flashtier demo`: a self-contained tour. It creates a backing store in a work directory, serves
//! it over NBD in this process, drives a workload through a real NBD connection, verifies every
//! byte (through NBD and then directly in the backing file), and prints what happened.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use flashtier_io::{create_sparse_file, BlockDev, FileDev, FileOptions, ZeroOpts};
use flashtier_nbd::{Export, ListenAddr, Listener, NbdClient, Server, ServerConfig};

use crate::units::{fmt_bytes, parse_size};

const BLOCK: usize = 4096;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Work directory for the demo's files. [default: a new directory under $TMPDIR, removed
    /// afterwards unless --keep]
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Size of the demo's backing store.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub size: u64,

    /// Threads issuing random I/O at once (each is one request in flight).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,

    /// Keep the work directory afterwards.
    #[arg(long)]
    pub keep: bool,
}

/// Expected contents: a generation number per 4 KiB block (0 = never written, reads as zeroes).
/// Block data is a pure function of (block, generation), so verification needs no copy of it.
struct Model {
    generation: Vec<AtomicU32>,
}

impl Model {
    fn new(blocks: usize) -> Model {
        Model {
            generation: (0..blocks).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

fn fill_block(block: u64, generation: u32, out: &mut [u8]) {
    if generation == 0 {
        out.fill(0);
        return;
    }
    let mut x = block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (generation as u64) << 40;
    for word in out.chunks_exact_mut(8) {
        // splitmix64: cheap, and every block/generation pair gets distinct bytes.
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        word.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
}

/// One line of the report.
struct Phase {
    name: String,
    ops: u64,
    bytes: u64,
    elapsed: Duration,
    latencies_us: Vec<u32>,
}

impl Phase {
    fn print_header() {
        println!(
            "  {:<34} {:>7} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8}",
            "phase", "ops", "data", "time", "IOPS", "MB/s", "p50 µs", "p99 µs"
        );
    }

    fn print(&mut self) {
        self.latencies_us.sort_unstable();
        let pct = |p: f64| -> String {
            if self.latencies_us.is_empty() {
                return "-".into();
            }
            let i = ((self.latencies_us.len() - 1) as f64 * p).round() as usize;
            self.latencies_us[i].to_string()
        };
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        println!(
            "  {:<34} {:>7} {:>11} {:>7.2}s {:>9.0} {:>8.1} {:>8} {:>8}",
            self.name,
            self.ops,
            fmt_bytes(self.bytes),
            secs,
            self.ops as f64 / secs,
            self.bytes as f64 / secs / 1e6,
            pct(0.50),
            pct(0.99)
        );
    }
}

/// Runs `ops_per_thread` operations on each of `threads` threads, timing each one.
fn timed_parallel<F>(
    name: &str,
    threads: usize,
    ops_per_thread: usize,
    bytes_per_op: u64,
    op: F,
) -> anyhow::Result<Phase>
where
    F: Fn(usize, usize) -> anyhow::Result<()> + Sync,
{
    let start = Instant::now();
    let per_thread: Vec<anyhow::Result<Vec<u32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let op = &op;
                s.spawn(move || {
                    let mut lat = Vec::with_capacity(ops_per_thread);
                    for i in 0..ops_per_thread {
                        let t0 = Instant::now();
                        op(t, i)?;
                        lat.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    }
                    Ok(lat)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut latencies_us = Vec::new();
    for r in per_thread {
        latencies_us.extend(r?);
    }
    let ops = latencies_us.len() as u64;
    Ok(Phase {
        name: name.to_string(),
        ops,
        bytes: ops * bytes_per_op,
        elapsed,
        latencies_us,
    })
}

/// A small deterministic PRNG so runs are repeatable.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Reads the whole device in 1 MiB chunks and checks every block against the model.
fn verify_all(dev: &dyn BlockDev, model: &Model) -> anyhow::Result<u64> {
    let size = dev.info().size;
    let mut buf = flashtier_io::AlignedBuf::zeroed(1 << 20);
    let mut expect = vec![0u8; BLOCK];
    let mut offset = 0u64;
    while offset < size {
        let n = (size - offset).min(buf.len() as u64) as usize;
        dev.read_at(&mut buf[..n], offset)
            .with_context(|| format!("read at {offset} failed"))?;
        for (i, got) in buf[..n].chunks(BLOCK).enumerate() {
            let block = offset / BLOCK as u64 + i as u64;
            let generation = model.generation[block as usize].load(Ordering::Relaxed);
            fill_block(block, generation, &mut expect);
            if got != &expect[..got.len()] {
                bail!("block {block} does not hold generation {generation}: data is wrong");
            }
        }
        offset += n as u64;
    }
    Ok(size)
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.size < (16 << 20) || !args.size.is_multiple_of(1 << 20) {
        bail!("--size must be a whole number of MiB, at least 16M");
    }
    let (dir, remove_after) = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
            (d.clone(), false)
        }
        None => {
            let d = std::env::temp_dir().join(format!("flashtier-demo-{}", std::process::id()));
            std::fs::create_dir_all(&d)?;
            (d, !args.keep)
        }
    };
    let result = run_in(&dir, &args);
    if remove_after {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn run_in(dir: &Path, args: &DemoArgs) -> anyhow::Result<()> {
    let backing_path = dir.join("backing.img");
    let socket = dir.join("nbd.sock");
    create_sparse_file(&backing_path, args.size)?;
    let backing: Arc<dyn BlockDev> =
        Arc::new(FileDev::open(&backing_path, FileOptions::default())?);

    println!("flashtier demo: a pass-through NBD export, driven and verified end to end");
    println!();
    println!("  work directory  {}", dir.display());
    println!(
        "  backing store   {} ({})",
        backing.describe(),
        fmt_bytes(args.size)
    );

    let server = Server::new(Export::new("demo", backing), ServerConfig::default())?;
    let listener = Listener::bind(&ListenAddr::Unix(socket.clone()))?;
    let uri = format!("nbd+unix:///demo?socket={}", socket.display());
    println!("  NBD server      {} ({uri})", listener.addr());
    let shutdown = server.shutdown_handle();
    let server_thread = std::thread::spawn(move || server.serve(listener));

    let client = NbdClient::connect(&uri).context("demo client cannot connect")?;
    println!("  client          {}", client.describe());
    println!();

    let blocks = (args.size / BLOCK as u64) as usize;
    let model = Model::new(blocks);
    let mut phases = Vec::new();
    let threads = args.threads as usize;

    let flush_phase = || timed_parallel("flush", 1, 1, 0, |_, _| Ok(client.flush()?));

    // 1. Sequential 1 MiB writes over the first quarter.
    let seq_chunks = (args.size / 4 / (1 << 20)) as usize;
    phases.push(timed_parallel(
        "sequential write, 1 MiB",
        1,
        seq_chunks,
        1 << 20,
        |_, i| {
            let mut buf = flashtier_io::AlignedBuf::zeroed(1 << 20);
            let first = i * (1 << 20) / BLOCK;
            for (j, b) in buf.chunks_mut(BLOCK).enumerate() {
                fill_block((first + j) as u64, 1, b);
            }
            client.write_at(&buf, (i << 20) as u64, false)?;
            for j in 0..(1 << 20) / BLOCK {
                model.generation[first + j].store(1, Ordering::Relaxed);
            }
            Ok(())
        },
    )?);
    phases.push(flush_phase()?);

    // 2. Random 4 KiB writes from several threads; each thread owns the blocks ≡ t (mod threads),
    //    so the model is exact without locking.
    let writes_per_thread = 2000;
    phases.push(timed_parallel(
        &format!("random write, 4 KiB, {threads} threads"),
        threads,
        writes_per_thread,
        BLOCK as u64,
        |t, i| {
            let mut rng = (t as u64 + 1) * 0x2545_f491_4f6c_dd1d + i as u64;
            let block = (next_random(&mut rng) as usize % (blocks / threads)) * threads + t;
            let generation = model.generation[block].load(Ordering::Relaxed) + 1;
            let mut buf = flashtier_io::AlignedBuf::zeroed(BLOCK);
            fill_block(block as u64, generation, &mut buf);
            // Every 16th write is FUA: durable before it is acknowledged.
            client.write_at(&buf, (block * BLOCK) as u64, i % 16 == 0)?;
            model.generation[block].store(generation, Ordering::Relaxed);
            Ok(())
        },
    )?);

    // 3. Random 4 KiB reads, each checked against the model.
    phases.push(timed_parallel(
        &format!("random read + verify, 4 KiB, {threads} thr"),
        threads,
        writes_per_thread,
        BLOCK as u64,
        |t, i| {
            let mut rng = (t as u64 + 7) * 0x9e37_79b9 + i as u64 * 31;
            let block = next_random(&mut rng) as usize % blocks;
            let mut buf = flashtier_io::AlignedBuf::zeroed(BLOCK);
            client.read_at(&mut buf, (block * BLOCK) as u64)?;
            let mut expect = vec![0u8; BLOCK];
            fill_block(
                block as u64,
                model.generation[block].load(Ordering::Relaxed),
                &mut expect,
            );
            if buf[..] != expect[..] {
                bail!("random read of block {block} returned wrong data");
            }
            Ok(())
        },
    )?);

    // 4. Zero 8 MiB in the written region, with and without permission to punch holes.
    let zero_start = (args.size / 8) & !((1 << 20) - 1);
    phases.push(timed_parallel(
        "write zeroes, 2 x 4 MiB",
        1,
        2,
        4 << 20,
        |_, i| {
            let offset = zero_start + (i as u64) * (4 << 20);
            let opts = ZeroOpts {
                may_trim: i == 0,
                ..ZeroOpts::default()
            };
            client.write_zeroes(offset, 4 << 20, opts)?;
            let first = (offset / BLOCK as u64) as usize;
            for b in first..first + (4 << 20) / BLOCK {
                model.generation[b].store(0, Ordering::Relaxed);
            }
            Ok(())
        },
    )?);
    phases.push(flush_phase()?);

    // 5. Read everything back through NBD.
    let start = Instant::now();
    let verified = verify_all(&client, &model)?;
    phases.push(Phase {
        name: "verify all through NBD, 1 MiB".into(),
        ops: verified >> 20,
        bytes: verified,
        elapsed: start.elapsed(),
        latencies_us: Vec::new(),
    });

    Phase::print_header();
    for p in &mut phases {
        p.print();
    }

    drop(client);
    shutdown.shutdown();
    server_thread
        .join()
        .expect("server thread panicked")
        .context("server did not shut down cleanly")?;

    // 6. The backing file on its own must hold every byte: pass-through wrote straight to it.
    let direct = FileDev::open(&backing_path, FileOptions::default())?;
    verify_all(&direct, &model).context("backing file does not match after shutdown")?;

    let written: u64 = model
        .generation
        .iter()
        .filter(|g| g.load(Ordering::Relaxed) > 0)
        .count() as u64
        * BLOCK as u64;
    println!();
    println!(
        "  verified {} through NBD and again in the backing file after a clean shutdown;",
        fmt_bytes(verified)
    );
    println!(
        "  {} of it holds written data, the rest reads as zeroes.",
        fmt_bytes(written)
    );
    println!();
    println!(
        "  This release serves the backing store as is (pass-through). Try it with real tools:"
    );
    println!(
        "    flashtier serve --backing {} --listen {}",
        backing_path.display(),
        socket.display()
    );
    println!("    nbdinfo '{uri}'");
    if !args.keep && args.dir.is_none() {
        println!("  (the work directory is removed; pass --keep to look at it)");
    }
    Ok(())
}

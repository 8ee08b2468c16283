//! `flashtier demo`: a self-contained tour of the cache. It creates a slow backing store (a file
//! behind an emulated disk head: one request at a time, a few milliseconds each) and a cache file
//! in a work directory, serves the cached volume over NBD in this process, and drives a workload
//! through a real NBD connection: cold reads (misses), the same reads warm (hits), random writes
//! absorbed by the cache, a flush served by the cache log, a clean restart that keeps the cache
//! warm, a crash and its recovery, and finally writing everything back. Every byte is verified,
//! through NBD and again in the backing file at the end.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use flashtier_engine::{format, BackingIdentity, Cache, FormatOptions, StatsSnapshot};
use flashtier_io::{create_sparse_file, AlignedBuf, BlockDev, FileDev, FileOptions, SlowDev};
use flashtier_nbd::{Export, ListenAddr, Listener, NbdClient, Server, ServerConfig};

use crate::backing::open_cache_device;
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

    /// Size of the demo's cache file.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub cache_size: u64,

    /// Latency of the emulated slow backing store per request (one request at a time, like a
    /// disk head), in milliseconds.
    #[arg(long, default_value_t = 2)]
    pub backing_latency_ms: u64,

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

    fn get(&self, block: usize) -> u32 {
        self.generation[block].load(Ordering::Relaxed)
    }

    fn set(&self, block: usize, generation: u32) {
        self.generation[block].store(generation, Ordering::Relaxed);
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
    note: String,
}

impl Phase {
    fn print_header() {
        println!(
            "  {:<30} {:>6} {:>10} {:>7} {:>8} {:>7} {:>7}  what the cache did",
            "phase", "ops", "data", "time", "IOPS", "p50 µs", "p99 µs"
        );
    }

    fn print(mut self) {
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
            "  {:<30} {:>6} {:>10} {:>6.2}s {:>8.0} {:>7} {:>7}  {}",
            self.name,
            self.ops,
            fmt_bytes(self.bytes),
            secs,
            self.ops as f64 / secs,
            pct(0.50),
            pct(0.99),
            self.note
        );
    }
}

/// Runs `ops_per_thread` operations on each of `threads` threads, timing each one.
fn timed<F>(
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
        note: String::new(),
    })
}

/// A small deterministic PRNG so runs are repeatable.
pub(crate) fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Reads blocks `[first, first + count)` in 1 MiB requests and checks them against the model.
fn verify(dev: &dyn BlockDev, model: &Model, first: usize, count: usize) -> anyhow::Result<()> {
    let mut buf = AlignedBuf::zeroed(1 << 20);
    let mut expect = vec![0u8; BLOCK];
    let per = buf.len() / BLOCK;
    let mut b = first;
    while b < first + count {
        let n = per.min(first + count - b);
        dev.read_at(&mut buf[..n * BLOCK], (b * BLOCK) as u64)
            .with_context(|| format!("read of block {b} failed"))?;
        for (i, got) in buf[..n * BLOCK].chunks(BLOCK).enumerate() {
            let generation = model.get(b + i);
            fill_block((b + i) as u64, generation, &mut expect);
            if got != &expect[..] {
                bail!(
                    "block {} does not hold generation {generation}: data is wrong",
                    b + i
                );
            }
        }
        b += n;
    }
    Ok(())
}

/// The cached volume, served over NBD on a unix socket in this process.
struct Served {
    cache: Arc<Cache>,
    client: NbdClient,
    shutdown: flashtier_nbd::ShutdownHandle,
    thread: ServerThread,
}

type ServerThread = std::thread::JoinHandle<Result<(), flashtier_nbd::ServerError>>;

/// Serves `dev` over NBD on `socket` in this process, and connects a client to it.
fn serve(
    dev: Arc<dyn BlockDev>,
    socket: &Path,
) -> anyhow::Result<(NbdClient, flashtier_nbd::ShutdownHandle, ServerThread)> {
    let server = Server::new(Export::new("demo", dev), ServerConfig::default())?;
    let listener = Listener::bind(&ListenAddr::Unix(socket.to_path_buf()))?;
    let shutdown = server.shutdown_handle();
    let thread = std::thread::spawn(move || server.serve(listener));
    let uri = format!("nbd+unix:///demo?socket={}", socket.display());
    let client = NbdClient::connect(&uri).context("demo client cannot connect")?;
    Ok((client, shutdown, thread))
}

/// Ends what [`serve`] started.
fn stop_serving(
    client: NbdClient,
    shutdown: flashtier_nbd::ShutdownHandle,
    thread: ServerThread,
) -> anyhow::Result<()> {
    drop(client);
    shutdown.shutdown();
    thread
        .join()
        .expect("server thread panicked")
        .context("server did not shut down cleanly")?;
    Ok(())
}

impl Served {
    fn start(cache: Cache, socket: &Path) -> anyhow::Result<Served> {
        let cache = Arc::new(cache);
        let (client, shutdown, thread) = serve(cache.clone(), socket)?;
        Ok(Served {
            cache,
            client,
            shutdown,
            thread,
        })
    }

    /// Stops serving; the cache is returned still open.
    fn stop(self) -> anyhow::Result<Arc<Cache>> {
        stop_serving(self.client, self.shutdown, self.thread)?;
        Ok(self.cache)
    }
}

fn delta(after: &StatsSnapshot, before: &StatsSnapshot) -> StatsSnapshot {
    let mut d = StatsSnapshot::default();
    macro_rules! sub {
        ($($f:ident),*) => { $(d.$f = after.$f - before.$f;)* };
    }
    sub!(
        read_hit_blocks,
        read_miss_blocks,
        promoted_blocks,
        write_blocks,
        backing_read_bytes,
        backing_write_bytes,
        cache_syncs,
        cleaned_blocks,
        cleaner_writes
    );
    d
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.size < (16 << 20) || !args.size.is_multiple_of(1 << 20) {
        bail!("--size must be a whole number of MiB, at least 16M");
    }
    if args.cache_size < (8 << 20) {
        bail!("--cache-size must be at least 8M");
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
    let cache_path = dir.join("cache.img");
    let socket = dir.join("nbd.sock");
    create_sparse_file(&backing_path, args.size)?;
    create_sparse_file(&cache_path, args.cache_size)?;
    let latency = Duration::from_millis(args.backing_latency_ms);
    let open_backing = || -> anyhow::Result<Arc<dyn BlockDev>> {
        let file: Arc<dyn BlockDev> =
            Arc::new(FileDev::open(&backing_path, FileOptions::default())?);
        Ok(Arc::new(SlowDev::new(file, latency)))
    };
    let identity = BackingIdentity {
        size: args.size,
        name: backing_path.display().to_string(),
        fingerprint: Vec::new(),
    };
    let cache_str = cache_path.display().to_string();
    let opts = FormatOptions {
        segment_size: 1 << 20,
        ..FormatOptions::default()
    };
    format(&*open_cache_device(&cache_str)?, identity.clone(), opts)?;
    let open = || -> anyhow::Result<Cache> {
        Ok(Cache::open(
            open_cache_device(&cache_str)?,
            open_backing()?,
            &identity,
            None,
        )?)
    };

    println!("flashtier demo: an SSD cache in front of a slow disk, served over NBD");
    println!();
    println!("  work directory  {}", dir.display());
    println!(
        "  backing store   {} ({}), behind an emulated disk head: one request at a time, {} ms each",
        backing_path.display(),
        fmt_bytes(args.size),
        args.backing_latency_ms
    );
    println!(
        "  cache           {} ({}), write-back, log-structured, crash-safe",
        cache_path.display(),
        fmt_bytes(args.cache_size)
    );
    println!(
        "  NBD             nbd+unix:///demo?socket={}",
        socket.display()
    );
    println!();

    let blocks = (args.size / BLOCK as u64) as usize;
    let model = Model::new(blocks);
    let threads = args.threads as usize;
    let cache_blocks = (args.cache_size / BLOCK as u64) as usize;
    // A working set that fits in the cache with room to spare for the writes below.
    let working_set = (cache_blocks / 4).min(blocks / 2).max(threads);
    let hot_reads = working_set / threads;

    // Seed the backing store directly (no cache) so cold reads have something to find.
    {
        let file = FileDev::open(&backing_path, FileOptions::default())?;
        let mut buf = vec![0u8; BLOCK];
        for b in 0..working_set {
            fill_block(b as u64, 1, &mut buf);
            file.write_at(&buf, (b * BLOCK) as u64, false)?;
            model.set(b, 1);
        }
        file.flush()?;
    }

    Phase::print_header();
    let mut served = Served::start(open()?, &socket)?;
    let read_set = |served: &Served, name: &str| -> anyhow::Result<Phase> {
        let before = served.cache.stats();
        let mut p = timed(name, threads, hot_reads, BLOCK as u64, |t, i| {
            let block = i * threads + t;
            let mut buf = AlignedBuf::zeroed(BLOCK);
            served.client.read_at(&mut buf, (block * BLOCK) as u64)?;
            let mut expect = vec![0u8; BLOCK];
            fill_block(block as u64, model.get(block), &mut expect);
            if buf[..] != expect[..] {
                bail!("read of block {block} returned wrong data");
            }
            Ok(())
        })?;
        let d = delta(&served.cache.stats(), &before);
        p.note = format!(
            "{} hits, {} misses read from the slow disk",
            d.read_hit_blocks, d.read_miss_blocks
        );

        Ok(p)
    };

    // 1-2. The working set, cold then warm.
    read_set(&served, "read working set (cold)")?.print();
    // Promotions are written asynchronously; let them land before reading warm.
    std::thread::sleep(Duration::from_millis(200));
    read_set(&served, "read working set (warm)")?.print();

    // 3. Random writes: absorbed by the cache (write-back), sequential on the SSD.
    let before = served.cache.stats();
    let writes_per_thread = (working_set / threads).min(2000);
    let mut p = timed(
        "random 4K writes",
        threads,
        writes_per_thread,
        BLOCK as u64,
        |t, i| {
            let mut rng = (t as u64 + 1)
                .wrapping_mul(0x2545_f491_4f6c_dd1d)
                .wrapping_add(i as u64);
            // Each thread owns the blocks ≡ t (mod threads), so the model is exact without locks.
            let block = (next_random(&mut rng) as usize % (working_set / threads)) * threads + t;
            let generation = model.get(block) + 1;
            let mut buf = AlignedBuf::zeroed(BLOCK);
            fill_block(block as u64, generation, &mut buf);
            served
                .client
                .write_at(&buf, (block * BLOCK) as u64, false)?;
            model.set(block, generation);
            Ok(())
        },
    )?;
    let d = delta(&served.cache.stats(), &before);
    p.note = format!(
        "absorbed: {} written to the slow disk",
        fmt_bytes(d.backing_write_bytes)
    );
    p.print();

    // 4. FLUSH: made durable by one sync of the cache log, not by draining to the slow disk.
    let before = served.cache.stats();
    let mut p = timed("flush", 1, 1, 0, |_, _| Ok(served.client.flush()?))?;
    let d = delta(&served.cache.stats(), &before);
    p.note = format!(
        "{} sync of the cache log; {} written to the slow disk",
        d.cache_syncs,
        fmt_bytes(d.backing_write_bytes)
    );
    p.print();

    // 5. Clean restart: the cache comes back warm.
    let cache = served.stop()?;
    let t0 = Instant::now();
    cache.close()?;
    drop(cache);
    let reopened = open()?;
    let restart = t0.elapsed();
    let report = reopened.report().clone();
    served = Served::start(reopened, &socket)?;
    let mut p = read_set(&served, "read after clean restart")?;
    p.note = format!(
        "restart took {} ms with {} blocks cached ({} dirty); {}",
        restart.as_millis(),
        report.cached_blocks,
        report.dirty_blocks,
        p.note
    );
    p.print();

    // 6. Crash: stop without closing the cache (as kill -9 would), then recover.
    let cache = served.stop()?;
    drop(cache);
    let t0 = Instant::now();
    let recovered = open()?;
    let recovery = t0.elapsed();
    let report = recovered.report().clone();
    served = Served::start(recovered, &socket)?;
    let start = Instant::now();
    verify(&served.client, &model, 0, blocks)?;
    let mut p = Phase {
        name: "verify all after a crash".into(),
        ops: (blocks * BLOCK) as u64 >> 20,
        bytes: (blocks * BLOCK) as u64,
        elapsed: start.elapsed(),
        latencies_us: Vec::new(),
        note: String::new(),
    };
    p.note = format!(
        "recovery replayed {} records in {} ms; every byte as written",
        report.replayed_records,
        recovery.as_millis()
    );
    p.print();

    // 7. Write everything back to the slow disk: sorted, coalesced.
    let before = served.cache.stats();
    let dirty = served.cache.status().dirty_blocks;
    let start = Instant::now();
    served.cache.write_back_all()?;
    let d = delta(&served.cache.stats(), &before);
    Phase {
        name: "write back dirty blocks".into(),
        ops: d.cleaner_writes,
        bytes: d.backing_write_bytes,
        elapsed: start.elapsed(),
        latencies_us: Vec::new(),
        note: format!(
            "{dirty} dirty blocks written back in {} sorted, coalesced writes",
            d.cleaner_writes
        ),
    }
    .print();
    let cache = served.stop()?;
    let status = cache.status();
    let stats = cache.stats();
    cache.close()?;
    drop(cache);

    // 8. The backing file on its own now holds every byte.
    let direct = FileDev::open(&backing_path, FileOptions::default())?;
    verify(&direct, &model, 0, blocks).context("backing file does not match after write-back")?;

    // 9. The memcached tier, in front of the slow disk without the SSD tier.
    memcached_tour(&socket, &model, working_set, threads, &open_backing)?;

    println!();
    println!(
        "  verified {} through NBD after the crash, and again in the backing file alone after \
         write-back.",
        fmt_bytes(args.size)
    );
    println!(
        "  cache: {} blocks cached in {} of index RAM ({:.1} bytes per cache block); {} log \
         batches held {} records; writes up to {} are atomic.",
        status.cached_blocks,
        fmt_bytes(status.index_bytes as u64),
        status.index_bytes as f64 / status.capacity_blocks.max(1) as f64,
        stats.batches,
        stats.records,
        fmt_bytes(status.atomic_write_bytes as u64)
    );
    println!();
    println!("  Try it with real tools:");
    println!(
        "    flashtier format --cache {} --backing {} --force",
        cache_path.display(),
        backing_path.display()
    );
    println!(
        "    flashtier serve --cache {} --backing {} --listen {}",
        cache_path.display(),
        backing_path.display(),
        socket.display()
    );
    println!(
        "    nbdinfo 'nbd+unix:///flashtier?socket={}'",
        socket.display()
    );
    if !args.keep && args.dir.is_none() {
        println!("  (the work directory is removed; pass --keep to look at it)");
    }
    Ok(())
}

/// The memcached tier over the slow disk (no SSD tier): the working set read cold (from the slow
/// disk, stored in memcached), warm (from memcached), then with memcached killed (from the slow
/// disk again, no error). Skipped, saying so, when memcached is not installed.
fn memcached_tour(
    socket: &Path,
    model: &Model,
    working_set: usize,
    threads: usize,
    open_backing: &dyn Fn() -> anyhow::Result<Arc<dyn BlockDev>>,
) -> anyhow::Result<()> {
    use flashtier_memcached::{MemcachedMode, MemcachedTier, Pool, PoolOptions};
    let Some(binary) = find_in_path("memcached") else {
        println!(
            "  {:<30} memcached is not installed: the memcached tier is not shown (apt-get \
             install memcached, or scripts/install-deps.sh)",
            "memcached tier"
        );
        return Ok(());
    };
    let mut server = MemcachedProcess::start(&binary)?;
    let pool = Pool::new(&[server.addr.clone()], PoolOptions::default())?;
    let tier = Arc::new(MemcachedTier::new(
        open_backing()?,
        Arc::new(pool),
        0xde40,
        MemcachedMode::Inclusive,
    )?);
    let (client, shutdown, thread) = serve(tier.clone(), socket)?;
    let per_thread = working_set / threads;
    let read_set = |name: &str| -> anyhow::Result<()> {
        let before = tier.stats();
        let mut p = timed(name, threads, per_thread, BLOCK as u64, |t, i| {
            let block = i * threads + t;
            let mut buf = AlignedBuf::zeroed(BLOCK);
            client.read_at(&mut buf, (block * BLOCK) as u64)?;
            let mut expect = vec![0u8; BLOCK];
            fill_block(block as u64, model.get(block), &mut expect);
            if buf[..] != expect[..] {
                bail!("read of block {block} through the memcached tier returned wrong data");
            }
            Ok(())
        })?;
        let after = tier.stats();
        let totals = tier.pool().totals();
        p.note = format!(
            "{} memcached hits, {} read from the slow disk; server errors so far {}",
            after.hit_blocks - before.hit_blocks,
            after.miss_blocks - before.miss_blocks,
            totals.errors + totals.timeouts
        );
        p.print();
        Ok(())
    };
    println!();
    println!(
        "  memcached tier: the slow disk alone with a memcached server ({}) in front, no SSD \
         tier",
        server.addr
    );
    read_set("memcached: read cold")?;
    read_set("memcached: read warm")?;
    server.kill();
    read_set("memcached killed: read")?;
    stop_serving(client, shutdown, thread)
}

/// The first `name` in `$PATH` that is a file.
fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A memcached process on a free loopback port, killed when dropped.
struct MemcachedProcess {
    child: Option<std::process::Child>,
    addr: String,
}

impl MemcachedProcess {
    fn start(binary: &Path) -> anyhow::Result<MemcachedProcess> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut cmd = std::process::Command::new(binary);
        cmd.args(["-l", "127.0.0.1", "-U", "0", "-m", "64"])
            .args(["-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // memcached refuses to run as root unless told whom to run as.
        if flashtier_io::sys::effective_uid() == 0 {
            cmd.args(["-u", "root"]);
        }
        let mut server = MemcachedProcess {
            child: Some(cmd.spawn().context("cannot start memcached")?),
            addr: format!("127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&server.addr).is_err() {
            if Instant::now() > deadline {
                server.kill();
                bail!("memcached did not start listening on {}", server.addr);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(server)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for MemcachedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

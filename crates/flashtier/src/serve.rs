//! `flashtier serve`: export a backing store over NBD.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use flashtier_nbd::{Export, ListenAddr, Listener, Server, ServerConfig, ShutdownHandle};

use std::sync::Arc;

use flashtier_engine::{Cache, Mode};
use flashtier_io::BlockDev;

use crate::backing::{backing_identity, open_backing, open_cache_device, BackingOptions};
use crate::units::fmt_bytes;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Backing store: a file, a block device, or an NBD URI such as nbd://host:10809/export or
    /// nbd+unix:///export?socket=/path.
    #[arg(long, value_name = "PATH|NBD-URI")]
    pub backing: String,

    /// Cache file or device, prepared with `flashtier format` for this backing store. Without
    /// it, the backing store is served as is (pass-through).
    #[arg(long, value_name = "FILE|DEVICE")]
    pub cache: Option<String>,

    /// Cache mode: writeback (writes land in the cache and are written back later),
    /// writethrough (writes go to both before they are acknowledged), writearound (writes go to
    /// the backing store; reads are cached) or passthrough (the cache is bypassed). Leaving
    /// write-back writes all dirty blocks back first. [default: the mode the cache was formatted
    /// or last served with]
    #[arg(long, requires = "cache")]
    pub mode: Option<Mode>,

    /// Where clients connect: a unix socket path (created mode 0600), or HOST:PORT for TCP.
    /// `:PORT` listens on loopback only; name an address (e.g. 0.0.0.0:10809) to listen beyond
    /// this machine. [default: /run/flashtier/nbd.sock as root, else
    /// $XDG_RUNTIME_DIR/flashtier/nbd.sock]
    #[arg(long, value_name = "SOCKET|HOST:PORT")]
    pub listen: Option<String>,

    /// Name of the export. Clients asking for the empty (default) name get it too.
    #[arg(long, default_value = "flashtier")]
    pub export_name: String,

    /// Serve read-only: writes, trims and zeroing fail with EPERM.
    #[arg(long)]
    pub read_only: bool,

    /// Open a backing file or block device with O_DIRECT, bypassing the kernel page cache.
    #[arg(long)]
    pub direct: bool,

    /// Requests executed at once per connection.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: u32,

    /// Most client connections served at once; more are refused.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_connections: u32,

    /// On SIGINT/SIGTERM, seconds to wait for clients to collect the replies to requests already
    /// executed before closing their connections anyway (a client that stopped reading would
    /// otherwise hold the shutdown forever).
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    pub shutdown_grace: u64,
}

/// The directory for sockets and runtime files when none is given.
pub fn default_run_dir() -> PathBuf {
    // SAFETY: geteuid has no failure modes.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/flashtier");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("flashtier"),
        None => std::env::temp_dir().join(format!("flashtier-{}", unsafe { libc::geteuid() })),
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let listen = match &args.listen {
        Some(s) => ListenAddr::parse(s)?,
        None => ListenAddr::Unix(default_run_dir().join("nbd.sock")),
    };
    let backing = open_backing(
        &args.backing,
        BackingOptions {
            direct: args.direct,
            read_only: args.read_only,
        },
    )?;
    let (dev, cache): (Arc<dyn BlockDev>, Option<Arc<Cache>>) = match &args.cache {
        None => (backing, None),
        Some(path) => {
            let cache = open_cache(path, &args, backing)?;
            (cache.clone(), Some(cache))
        }
    };
    let mut export = Export::new(args.export_name.clone(), dev);
    export.force_read_only = args.read_only;
    let config = ServerConfig {
        threads_per_connection: args.threads as usize,
        max_connections: args.max_connections as usize,
        shutdown_grace: std::time::Duration::from_secs(args.shutdown_grace),
        ..ServerConfig::default()
    };
    let what = match &cache {
        None => "pass-through".to_string(),
        Some(c) => format!(
            "writes up to {} atomic",
            fmt_bytes(c.atomic_write_bytes() as u64)
        ),
    };
    let read_only = if export.read_only() {
        ", read-only"
    } else {
        ""
    };
    let summary = format!(
        "{} ({}, {what}{read_only})",
        export.dev.describe(),
        fmt_bytes(export.dev.info().size),
    );
    let server = Server::new(export, config)?;
    // Before the socket exists: a signal sent as soon as a script sees it must already be graceful.
    install_signal_handlers(server.shutdown_handle())?;
    let listener = Listener::bind(&listen)?;
    let uri = match listener.addr() {
        ListenAddr::Unix(p) => format!("nbd+unix:///{}?socket={}", args.export_name, p.display()),
        ListenAddr::Tcp(a) => format!("nbd://{a}/{}", args.export_name),
    };
    // Scripts wait for this line to know the socket is ready.
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "flashtier: serving {summary} as export '{}'",
        args.export_name
    )?;
    writeln!(
        out,
        "flashtier: listening on {} (connect with {uri})",
        listener.addr()
    )?;
    out.flush()?;
    drop(out);

    let served = server.serve(listener).context("server failed");
    drop(server);
    if let Some(cache) = cache {
        // The server has flushed; a final checkpoint makes the next start near-instant.
        let status = cache.status();
        cache.close().context("closing the cache failed")?;
        tracing::info!(
            cached_blocks = status.cached_blocks,
            dirty_blocks = status.dirty_blocks,
            "cache closed cleanly"
        );
    }
    served
}

fn open_cache(
    path: &str,
    args: &ServeArgs,
    backing: Arc<dyn BlockDev>,
) -> anyhow::Result<Arc<Cache>> {
    if backing.info().read_only || args.read_only {
        anyhow::bail!("a cache needs a writable backing store (drop --read-only or --cache)");
    }
    let identity = backing_identity(&args.backing, backing.info().size)?;
    let dev = open_cache_device(path)?;
    let cache = Cache::open(dev, backing, &identity, args.mode)
        .with_context(|| format!("cannot use cache {path}"))?;
    let r = cache.report();
    if r.clean_shutdown {
        tracing::info!(
            cached_blocks = r.cached_blocks,
            dirty_blocks = r.dirty_blocks,
            time_ms = r.recovery_time.as_millis() as u64,
            "cache opened after a clean shutdown"
        );
    } else {
        tracing::warn!(
            replayed_records = r.replayed_records,
            replayed_batches = r.replayed_batches,
            cached_blocks = r.cached_blocks,
            dirty_blocks = r.dirty_blocks,
            time_ms = r.recovery_time.as_millis() as u64,
            "cache recovered after an unclean shutdown"
        );
    }
    Ok(Arc::new(cache))
}

/// First SIGINT/SIGTERM: graceful shutdown. A second one: exit at once.
fn install_signal_handlers(handle: ShutdownHandle) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("cannot install signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for (count, signal) in signals.forever().enumerate() {
                let name = if signal == SIGINT {
                    "SIGINT"
                } else {
                    "SIGTERM"
                };
                if count == 0 {
                    tracing::info!(
                        "{name}: finishing in-flight requests and flushing (send again to exit \
                         immediately)"
                    );
                    handle.shutdown();
                } else {
                    eprintln!("flashtier: {name} again: exiting without waiting");
                    std::process::exit(130);
                }
            }
        })
        .context("cannot spawn signal thread")?;
    Ok(())
}

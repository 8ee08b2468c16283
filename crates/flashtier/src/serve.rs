//! `flashtier serve`: export a backing store over NBD.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use flashtier_control::config::{self, Config};
use flashtier_control::{
    ControlError, ControlPlane, ControlPlaneOptions, Controller, ControllerOptions, DetachOptions,
    PersistFn, Switchable, Timed,
};
use flashtier_engine::{Cache, Mode};
use flashtier_io::BlockDev;
use flashtier_nbd::tls::{ServerTls, ServerTlsOptions, TlsMode};
use flashtier_nbd::{Export, ListenAddr, Listener, Server, ServerConfig, ShutdownHandle};

use crate::backing::{backing_identity, open_backing, open_cache_device, BackingOptions};
use crate::shutdown;
use crate::units::fmt_bytes;

#[derive(Args, Debug)]
#[command(after_help = "\
Files: the control socket (default RUN/control.sock), the stats file (default RUN/stats, rewritten \
every second as `name value` lines) and RUN/stats.json beside it (the report of `flashtier stats \
--json`), where RUN is /run/flashtier as root, else $XDG_RUNTIME_DIR/flashtier. Defaults already in \
use by another running server are skipped with a warning; paths given explicitly must be free.\n\n\
With --config FILE, options come from the file's [serve] table and options on the command line \
override them; its [policy] values are applied once the cache is open. `flashtier config check \
FILE` validates a file.\n\n\
Exit status after SIGINT/SIGTERM: 0 when every request was answered, the export flushed and the \
cache closed cleanly (final checkpoint written); 3 when the cache was not closed cleanly because \
its device failed (while serving or at the final checkpoint): its data stays on the device and \
the next start recovers its log; 1 for any other failure (the message says which), including not \
starting at all; 2 for a bad command line; 130 after a second signal (exit without waiting).")]
pub struct ServeArgs {
    /// Read options from this TOML file ([serve]: these options; [policy]: live parameters).
    /// Options given on the command line override the file. `flashtier set --persist` writes
    /// changes back to it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Backing store: a file, a block device, or an NBD URI such as nbd://host:10809/export or
    /// nbd+unix:///export?socket=/path. Required, here or in the config file.
    #[arg(long, value_name = "PATH|NBD-URI")]
    pub backing: Option<String>,

    /// Cache file or device, prepared with `flashtier format` for this backing store. Without
    /// it, the backing store is served as is (pass-through) until `flashtier attach --cache`
    /// adds one.
    #[arg(long, value_name = "FILE|DEVICE")]
    pub cache: Option<String>,

    /// Cache mode: writeback (writes land in the cache and are written back later),
    /// writethrough (writes go to both before they are acknowledged), writearound (writes go to
    /// the backing store; reads are cached) or passthrough (the cache is bypassed). Leaving
    /// write-back writes all dirty blocks back first. Needs a cache. [default: the mode the
    /// cache was formatted or last served with]
    #[arg(long)]
    pub mode: Option<Mode>,

    /// Where clients connect: a unix socket path (created mode 0600), or HOST:PORT for TCP.
    /// `:PORT` listens on loopback only; name an address (e.g. 0.0.0.0:10809) to listen beyond
    /// this machine. [default: /run/flashtier/nbd.sock as root, else
    /// $XDG_RUNTIME_DIR/flashtier/nbd.sock]
    #[arg(long, value_name = "SOCKET|HOST:PORT")]
    pub listen: Option<String>,

    /// TLS (NBD's STARTTLS): off, on (clients may upgrade) or require (nothing but STARTTLS is
    /// answered before TLS runs: every client must authenticate). Needs --tls-certificates or
    /// --tls-psk. Use require whenever --listen names an address other machines can reach.
    /// [default: off]
    #[arg(long, value_name = "off|on|require")]
    pub tls: Option<TlsMode>,

    /// X.509 credentials for TLS: a directory with server-cert.pem and server-key.pem (and
    /// ca-cert.pem for --tls-verify-peer), as nbdkit's --tls-certificates and qemu's
    /// tls-creds-x509 use. Clients connect with e.g.
    /// `nbdinfo 'nbds://HOST:PORT/?tls-certificates=DIR'` (DIR holding the CA's ca-cert.pem).
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,

    /// Pre-shared keys for TLS: a file of `username:hexkey` lines (as nbdkit's --tls-psk and
    /// qemu's keys.psk; e.g. `alice:$(openssl rand -hex 32)`), mode 0600. Clients connect with
    /// e.g. `nbdinfo 'nbds://alice@HOST:PORT/?tls-psk-file=FILE'`.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,

    /// With --tls-certificates: require a client certificate signed by DIR/ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,

    /// Name of the export. Clients asking for the empty (default) name get it too.
    /// [default: flashtier]
    #[arg(long)]
    pub export_name: Option<String>,

    /// Serve read-only: writes, trims and zeroing fail with EPERM.
    #[arg(long)]
    pub read_only: bool,

    /// Open a backing file or block device with O_DIRECT, bypassing the kernel page cache.
    #[arg(long)]
    pub direct: bool,

    /// Requests executed at once per connection. [default: 16]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=config::MAX_THREADS as i64))]
    pub threads: Option<u32>,

    /// Most client connections served at once. When all are taken, a new client gets the slot
    /// of one that is still in its handshake after 1 s, connected but unused for 1 s, not
    /// reading its replies for 2 s, or idle for 10 s (in that order, longest first); with none
    /// of those it is refused. [default: 256]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=config::MAX_CONNECTIONS as i64))]
    pub max_connections: Option<u32>,

    /// Seconds a client has to finish the handshake (the TLS handshake included), counted from
    /// when it connected, however slowly it sends. [default: 10]
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub handshake_timeout: Option<u32>,

    /// MiB of request payload (READ replies, WRITE data) held at once for all clients together.
    /// When it is spent, connections stop reading requests until replies drain, and a client
    /// that has not read its replies for 2 s is disconnected to make room. [default: 1024]
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u32).range(1..=config::MAX_REQUEST_MEMORY_MIB as i64))]
    pub request_memory_mib: Option<u32>,

    /// MiB of request payload one connection may hold; a client that does not read its replies
    /// stops being read from once they fill it. A single larger request is still served alone.
    /// [default: 64]
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u32).range(1..=config::MAX_REQUEST_MEMORY_MIB as i64))]
    pub request_memory_per_connection_mib: Option<u32>,

    /// Worker threads shared by all connections, beyond each connection's own thread (which
    /// is all an idle connection has). Extra threads start as requests arrive and stop after
    /// 5 s without work. [default: 512]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=config::MAX_WORKER_POOL as i64))]
    pub worker_pool: Option<u32>,

    /// On SIGINT/SIGTERM, seconds to wait for clients to collect the replies to requests already
    /// executed before closing their connections anyway (a client that stopped reading would
    /// otherwise hold the shutdown forever). [default: 30]
    #[arg(long, value_name = "SECS")]
    pub shutdown_grace: Option<u64>,

    /// The control API's unix socket (created mode 0600), used by `flashtier status`, `stats`,
    /// `get`, `set`, `mode` and `reset-stats` (their --control option).
    /// [default: control.sock in the run directory]
    #[arg(long, value_name = "SOCKET")]
    pub control_socket: Option<PathBuf>,

    /// Serve Prometheus metrics (GET /metrics, text format 0.0.4) over HTTP on HOST:PORT;
    /// `:PORT` listens on loopback only. [default: off]
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,

    /// The stats file, rewritten every second: one `name value` line per counter and figure,
    /// and PATH.json beside it with `flashtier stats --json`'s report. Removed on exit.
    /// [default: stats in the run directory, e.g. /run/flashtier/stats and
    /// /run/flashtier/stats.json as root]
    #[arg(long, value_name = "PATH")]
    pub stats_file: Option<PathBuf>,

    /// The cache device's rated endurance in terabytes written (TBW, from its data sheet), for
    /// the wear forecast in `flashtier stats`: days until the device reaches it at the recent
    /// write rate. [default: none, no forecast]
    #[arg(long, value_name = "TB", value_parser = parse_tbw)]
    pub endurance_tbw: Option<f64>,

    /// Set a live parameter when the cache opens, e.g. `--set sequential_cutoff_read_kib=0`;
    /// repeatable, and it overrides the config file's [policy]. Parameters, their defaults and
    /// allowed values: `flashtier get --all`, or `flashtier set --help`. Needs a cache.
    #[arg(long = "set", value_name = "PARAM=VALUE", value_parser = parse_param_setting)]
    pub set: Vec<(String, String)>,

    /// The backing store was replaced on purpose (a new disk, a restored or copied image): use
    /// the cache for it although it was formatted for another one. The cache starts empty
    /// (what it held belongs to the old store). Refused while it holds the old store's dirty
    /// data, unless --discard-dirty. Command line only, never from the config file.
    #[arg(long)]
    pub accept_new_backing: bool,

    /// With --accept-new-backing: drop the old backing store's dirty data (writes it never
    /// received are LOST). Asks you to type `discard`; without a terminal it needs
    /// --yes-discard-dirty-data.
    #[arg(long, requires = "accept_new_backing")]
    pub discard_dirty: bool,

    /// Confirm --discard-dirty without the interactive question (for scripts).
    #[arg(long, requires = "discard_dirty")]
    pub yes_discard_dirty_data: bool,
}

fn parse_param_setting(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}' is not PARAM=VALUE"))?;
    let (name, value) = (name.trim(), value.trim());
    flashtier_engine::tunables::validate(name, value).map_err(|e| e.to_string())?;
    Ok((name.to_string(), value.to_string()))
}

fn parse_tbw(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("'{s}' is not a positive number of terabytes")),
    }
}

/// The options in force: the command line over the config file over the defaults.
struct Settings {
    backing: String,
    cache: Option<String>,
    mode: Option<Mode>,
    listen: Option<String>,
    tls: ServerTlsOptions,
    export_name: String,
    read_only: bool,
    direct: bool,
    threads: u32,
    max_connections: u32,
    handshake_timeout: u32,
    request_memory_mib: u32,
    request_memory_per_connection_mib: u32,
    worker_pool: u32,
    shutdown_grace: u64,
    /// The path, and whether it was asked for (a default in use is skipped, a given one is not).
    control_socket: (PathBuf, bool),
    metrics_listen: Option<String>,
    stats_file: (PathBuf, bool),
    endurance_tbw: Option<f64>,
    /// Live parameters to apply at open: the config file's [policy], then `--set` (which wins).
    policy: Vec<(String, String)>,
    config: Option<Config>,
    /// `--accept-new-backing` and how to treat dirty data then.
    adopt: Option<crate::adopt::AdoptOptions>,
}

impl Settings {
    fn new(args: ServeArgs) -> anyhow::Result<Settings> {
        let config = args.config.as_deref().map(config::load).transpose()?;
        let file = config.as_ref().map(|c| c.serve.clone()).unwrap_or_default();
        let mode = match (args.mode, &file.mode) {
            (Some(m), _) => Some(m),
            (None, Some(m)) => Some(m.parse().map_err(|e: String| anyhow::anyhow!(e))?),
            (None, None) => None,
        };
        let cache = args.cache.or(file.cache);
        if mode.is_some() && cache.is_none() {
            anyhow::bail!("--mode needs a cache (--cache, or `cache` in the config file)");
        }
        let has_set = !args.set.is_empty();
        if has_set && cache.is_none() {
            anyhow::bail!("--set needs a cache (--cache, or `cache` in the config file)");
        }
        if args.accept_new_backing && cache.is_none() {
            anyhow::bail!(
                "--accept-new-backing needs a cache (--cache, or `cache` in the config file)"
            );
        }
        let adopt = args
            .accept_new_backing
            .then_some(crate::adopt::AdoptOptions {
                discard_dirty: args.discard_dirty,
                yes_discard_dirty_data: args.yes_discard_dirty_data,
            });
        let mut policy = config
            .as_ref()
            .map(|c| c.policy.clone())
            .unwrap_or_default();
        policy.extend(args.set);
        // Values that constrain each other are checked as the file and --set leave them together.
        flashtier_engine::tunables::validate_all(&policy).with_context(|| {
            format!(
                "the live parameters of {} do not fit together",
                match (&config, has_set) {
                    (Some(c), true) => format!("{} [policy] and --set", c.path.display()),
                    (Some(c), false) => format!("{} [policy]", c.path.display()),
                    (None, _) => "--set".to_string(),
                }
            )
        })?;
        let run_dir = default_run_dir();
        let given = |p: Option<PathBuf>, default: &str| match p {
            Some(p) => (p, true),
            None => (run_dir.join(default), false),
        };
        Ok(Settings {
            backing: args.backing.or(file.backing).ok_or_else(|| {
                anyhow::anyhow!(
                    "no backing store: give --backing (or `backing` in [serve] of --config)"
                )
            })?,
            cache,
            mode,
            listen: args.listen.or(file.listen),
            tls: ServerTlsOptions {
                mode: match (args.tls, &file.tls) {
                    (Some(m), _) => m,
                    (None, Some(m)) => m.parse().map_err(|e: String| anyhow::anyhow!(e))?,
                    (None, None) => TlsMode::Off,
                },
                certificates: args
                    .tls_certificates
                    .or(file.tls_certificates.map(PathBuf::from)),
                psk: args.tls_psk.or(file.tls_psk.map(PathBuf::from)),
                verify_peer: args.tls_verify_peer || file.tls_verify_peer.unwrap_or(false),
            },
            export_name: args
                .export_name
                .or(file.export_name)
                .unwrap_or_else(|| "flashtier".into()),
            read_only: args.read_only || file.read_only.unwrap_or(false),
            direct: args.direct || file.direct.unwrap_or(false),
            threads: args.threads.or(file.threads).unwrap_or(16),
            max_connections: args.max_connections.or(file.max_connections).unwrap_or(256),
            handshake_timeout: args
                .handshake_timeout
                .or(file.handshake_timeout)
                .unwrap_or(10),
            request_memory_mib: args
                .request_memory_mib
                .or(file.request_memory_mib)
                .unwrap_or(1024),
            request_memory_per_connection_mib: args
                .request_memory_per_connection_mib
                .or(file.request_memory_per_connection_mib)
                .unwrap_or(64),
            worker_pool: args.worker_pool.or(file.worker_pool).unwrap_or(512),
            shutdown_grace: args.shutdown_grace.or(file.shutdown_grace).unwrap_or(30),
            control_socket: given(
                args.control_socket
                    .or(file.control_socket.map(PathBuf::from)),
                "control.sock",
            ),
            metrics_listen: args.metrics_listen.or(file.metrics_listen),
            stats_file: given(
                args.stats_file.or(file.stats_file.map(PathBuf::from)),
                "stats",
            ),
            endurance_tbw: args.endurance_tbw.or(file.endurance_tbw),
            policy,
            config,
            adopt,
        })
    }
}

/// The directory for sockets and runtime files when none is given.
pub use flashtier_control::run_dir::default_path as default_run_dir;

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let args = Settings::new(args)?;
    // Created (0755) or checked (ours, writable only by us) before anything goes in it.
    if args.listen.is_none() || !args.control_socket.1 || !args.stats_file.1 {
        flashtier_control::run_dir::prepare(&default_run_dir())?;
    }
    let listen = match &args.listen {
        Some(s) => ListenAddr::parse(s)?,
        None => ListenAddr::Unix(default_run_dir().join("nbd.sock")),
    };
    let tls = ServerTls::new(&args.tls).context("TLS")?;
    let backing = open_backing(
        &args.backing,
        BackingOptions {
            direct: args.direct,
            read_only: args.read_only,
        },
    )?;
    let cache = match &args.cache {
        None => None,
        Some(path) => Some(open_cache(path, &args, backing.clone())?),
    };
    let inner: Arc<dyn BlockDev> = match &cache {
        Some(c) => c.clone(),
        None => backing.clone(),
    };
    // `flashtier detach` and `attach` swap what is exported underneath the clients.
    let export = Arc::new(Switchable::new(inner));
    // Every request the clients make is timed, cache or pass-through.
    let timed = Arc::new(Timed::new(export.clone()));
    let identity = backing_identity(&args.backing, backing.info().size)?;
    let backing_spec = args.backing.clone();
    let controller = Arc::new(Controller::new(ControllerOptions {
        version: crate::VERSION.into(),
        dev: timed.clone(),
        cache: cache.clone(),
        latencies: timed.latencies(),
        endurance_tbw: args.endurance_tbw,
        persist: args.config.as_ref().map(|c| {
            let path = c.path.clone();
            Box::new(move |settings: &[(String, String)]| {
                config::persist(&path, settings).map_err(Into::into)
            }) as PersistFn
        }),
        detach: Some(DetachOptions {
            export,
            backing,
            identity,
            open_device: Box::new(move |path: &str| {
                open_attached_device(path, &backing_spec).map_err(|e| format!("{e:#}").into())
            }),
            policy: args.policy.clone(),
            mode: args.mode,
        }),
    }));
    let mut export = Export::new(args.export_name.clone(), timed);
    export.force_read_only = args.read_only;
    let server_config = ServerConfig {
        threads_per_connection: args.threads as usize,
        max_connections: args.max_connections as usize,
        handshake_timeout: std::time::Duration::from_secs(args.handshake_timeout.into()),
        request_memory: u64::from(args.request_memory_mib) << 20,
        request_memory_per_connection: u64::from(args.request_memory_per_connection_mib) << 20,
        worker_pool: args.worker_pool as usize,
        tls: tls.clone(),
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
    // From here on the controller holds the cache (detach may release it, attach replace it).
    drop(cache);
    let server = Server::new(export, server_config)?;
    // Before the socket exists: a signal sent as soon as a script sees it must already be graceful.
    install_signal_handlers(server.shutdown_handle())?;
    let plane = start_control_plane(controller.clone(), &args)?;
    let listener = Listener::bind(&listen)?;
    let s = if tls.is_some() { "s" } else { "" };
    let uri = match listener.addr() {
        ListenAddr::Unix(p) => {
            format!("nbd{s}+unix:///{}?socket={}", args.export_name, p.display())
        }
        ListenAddr::Tcp(a) => format!("nbd{s}://{a}/{}", args.export_name),
    };
    warn_if_exposed(listener.addr(), args.tls.mode);
    // Scripts wait for the "listening on" line to know the sockets are ready, and may close
    // stdout right after it: it comes last, and its text stays as it is.
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "flashtier: serving {summary} as export '{}'",
        args.export_name
    )?;
    if let Some(socket) = plane.control_socket() {
        writeln!(
            out,
            "flashtier: control socket {} (flashtier status, stats, get, set, mode, flush, \
             detach, attach, reset-stats)",
            socket.display()
        )?;
    }
    if let Some((text, json)) = plane.stats_files() {
        writeln!(
            out,
            "flashtier: stats file {} and {}, rewritten every second",
            text.display(),
            json.display()
        )?;
    }
    if let Some(t) = &tls {
        writeln!(
            out,
            "flashtier: TLS {} ({})",
            if t.mode() == TlsMode::Require {
                "required"
            } else {
                "offered"
            },
            t.description()
        )?;
    }
    if let Some(addr) = plane.metrics_addr() {
        writeln!(
            out,
            "flashtier: Prometheus metrics at http://{addr}/metrics"
        )?;
    }
    writeln!(
        out,
        "flashtier: listening on {} (connect with {uri})",
        listener.addr()
    )?;
    out.flush()?;
    drop(out);
    // Under systemd (Type=notify): units ordered after this one start now, not before the
    // socket accepts connections.
    crate::notify::notify(&format!(
        "READY=1\nSTATUS=serving {summary} on {}",
        listener.addr()
    ));

    let served = server.serve(listener).context("server failed");
    drop(server);
    // Stop answering control requests before the cache closes under them.
    plane.stop();
    // The cache attached now (a detach releasing it finishes first).
    shutdown::finish(controller.take_cache(), served)
}

/// Serving a disk beyond this machine without authentication is allowed, but never silently.
fn warn_if_exposed(addr: &ListenAddr, tls: TlsMode) {
    let ListenAddr::Tcp(a) = addr else { return };
    if a.ip().is_loopback() || tls == TlsMode::Require {
        return;
    }
    let what = if tls == TlsMode::On {
        "TLS is offered but not required"
    } else {
        "TLS is off"
    };
    let msg = format!(
        "listening on {a}, reachable from other machines, and {what}: anyone who can reach this \
         address can read and write the disk without authentication. Use --tls require with \
         --tls-certificates or --tls-psk."
    );
    eprintln!("flashtier: WARNING: {msg}");
    tracing::warn!("{msg}");
}

/// Starts the control socket, the stats file and the metrics listener. A default control
/// socket that another running server holds is skipped with a warning (so is the default
/// stats file then: the run directory's files are that server's); explicit paths must be free.
fn start_control_plane(
    controller: Arc<Controller>,
    args: &Settings,
) -> anyhow::Result<ControlPlane> {
    let (socket, socket_given) = &args.control_socket;
    let (stats, stats_given) = &args.stats_file;
    let opts = ControlPlaneOptions {
        control_socket: Some(socket.clone()),
        metrics_listen: args.metrics_listen.clone(),
        stats_file: Some(stats.clone()),
    };
    let started = match ControlPlane::start(controller.clone(), &opts) {
        Err(ControlError::Listen(flashtier_nbd::ServerError::InUse(_))) if !socket_given => {
            tracing::warn!(
                "the default control socket {} belongs to another running server; serving \
                 without a control socket{} (give --control-socket and --stats-file to have them)",
                socket.display(),
                if *stats_given { "" } else { " and stats file" },
            );
            let opts = ControlPlaneOptions {
                control_socket: None,
                stats_file: stats_given.then(|| stats.clone()),
                ..opts
            };
            ControlPlane::start(controller, &opts)
        }
        r => r,
    };
    started.with_context(|| {
        format!(
            "cannot start the control plane (control socket {}, stats file {})",
            socket.display(),
            stats.display()
        )
    })
}

fn open_cache(
    path: &str,
    args: &Settings,
    backing: Arc<dyn BlockDev>,
) -> anyhow::Result<Arc<Cache>> {
    if backing.info().read_only || args.read_only {
        anyhow::bail!("a cache needs a writable backing store (drop --read-only or --cache)");
    }
    let identity = backing_identity(&args.backing, backing.info().size)?;
    let dev = open_cache_device(path)?;
    if let Some(opts) = &args.adopt {
        crate::adopt::adopt_new_backing(&*dev, path, &identity, opts)?;
    }
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
    // Live parameters from the config file and --set, as one change (validated when parsed;
    // checked again here).
    cache
        .set_params(&args.policy)
        .context("cannot apply the live parameters")?;
    Ok(Arc::new(cache))
}

/// Opens `flashtier attach --cache PATH` as `--cache` is opened, refusing the backing store
/// itself (or anything sharing its storage), which the format that follows would destroy.
fn open_attached_device(path: &str, backing: &str) -> anyhow::Result<Arc<dyn BlockDev>> {
    crate::backing::refuse_backing_as_cache(path, backing)?;
    open_cache_device(path)
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
                    crate::notify::notify("STOPPING=1\nSTATUS=stopping: answering the requests in flight, flushing, closing the cache");
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

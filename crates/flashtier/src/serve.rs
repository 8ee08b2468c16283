//! `flashtier serve`: export a backing store over NBD.

use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use flashtier_control::config::{self, Config, OptValue, ServeConfig};
use flashtier_control::{
    ControlError, ControlPlane, ControlPlaneOptions, Controller, ControllerOptions, DetachOptions,
    PersistFn, Switchable, Timed,
};
use flashtier_engine::{BackingIdentity, Cache, Mode};
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

    /// The options of `[serve]`, one flag per key of `config::SERVE_KEYS`.
    #[command(flatten)]
    pub options: ServeOptions,

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
    if name == MEMCACHED_MODE {
        value.parse::<flashtier_memcached::MemcachedMode>()?;
    } else {
        flashtier_engine::tunables::validate(name, value).map_err(|e| e.to_string())?;
    }
    Ok((name.to_string(), value.to_string()))
}

/// The one live parameter that is the memcached tier's, not the cache's: `--set` takes it too.
const MEMCACHED_MODE: &str = "memcached_mode";

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
    trace: Option<PathBuf>,
    endurance_tbw: Option<f64>,
    /// The memcached tier's servers (none: no tier), its mode and request timeout.
    memcached: Option<Vec<String>>,
    memcached_mode: flashtier_memcached::MemcachedMode,
    memcached_timeout: std::time::Duration,
    /// The RAM tier's size in bytes (none: no tier) and eviction order.
    ram_cache: Option<u64>,
    ram_cache_policy: flashtier_ram::RamPolicy,
    /// Live parameters to apply at open: the config file's [policy], then `--set` (which wins).
    policy: Vec<(String, String)>,
    config: Option<Config>,
    /// `--accept-new-backing` and how to treat dirty data then.
    adopt: Option<crate::adopt::AdoptOptions>,
}

impl Settings {
    fn new(mut args: ServeArgs) -> anyhow::Result<Settings> {
        // `--set memcached_mode=M` is the tier's and needs no cache; the last one given wins.
        let memcached_mode_set = args
            .set
            .iter()
            .rev()
            .find(|(n, _)| n == MEMCACHED_MODE)
            .map(|(_, v)| v.clone());
        args.set.retain(|(n, _)| n != MEMCACHED_MODE);
        let config = args.config.as_deref().map(config::load).transpose()?;
        let file = config.as_ref().map(|c| c.serve.clone()).unwrap_or_default();
        let given = file.overridden_by(&args.options.0);
        // Whether a path was given (a default in use is skipped, a given one is not) is known
        // only before the defaults fill in.
        let (control_socket_given, stats_file_given) =
            (given.control_socket.is_some(), given.stats_file.is_some());
        if given.memcached.is_none()
            && (given.memcached_mode.is_some() || memcached_mode_set.is_some())
        {
            anyhow::bail!(
                "memcached_mode needs a memcached tier (--memcached HOST:PORT,..., or \
                 `memcached` in the config file)"
            );
        }
        let o = given.with_defaults();
        let mode = o
            .mode
            .as_deref()
            .map(Mode::from_str)
            .transpose()
            .map_err(|e| anyhow::anyhow!(e))?;
        let cache = o.cache;
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
        let path = |p: Option<String>, given: bool, default: &str| match p {
            Some(p) => (PathBuf::from(p), given),
            None => (run_dir.join(default), false),
        };
        Ok(Settings {
            backing: o.backing.ok_or_else(|| {
                anyhow::anyhow!(
                    "no backing store: give --backing (or `backing` in [serve] of --config)"
                )
            })?,
            cache,
            mode,
            listen: o.listen,
            tls: ServerTlsOptions {
                mode: defaulted(o.tls)
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!(e))?,
                certificates: o.tls_certificates.map(PathBuf::from),
                psk: o.tls_psk.map(PathBuf::from),
                verify_peer: defaulted(o.tls_verify_peer),
            },
            export_name: defaulted(o.export_name),
            read_only: defaulted(o.read_only),
            direct: defaulted(o.direct),
            threads: defaulted(o.threads),
            max_connections: defaulted(o.max_connections),
            handshake_timeout: defaulted(o.handshake_timeout),
            request_memory_mib: defaulted(o.request_memory_mib),
            request_memory_per_connection_mib: defaulted(o.request_memory_per_connection_mib),
            worker_pool: defaulted(o.worker_pool),
            shutdown_grace: defaulted(o.shutdown_grace),
            control_socket: path(o.control_socket, control_socket_given, "control.sock"),
            metrics_listen: o.metrics_listen,
            stats_file: path(o.stats_file, stats_file_given, "stats"),
            // The server creates it; relative to where `serve` was started, as the user meant.
            trace: o.trace.map(std::path::absolute).transpose()?,
            endurance_tbw: o.endurance_tbw,
            memcached: o
                .memcached
                .map(|list| list.split(',').map(str::to_string).collect()),
            memcached_mode: memcached_mode_set
                .unwrap_or_else(|| defaulted(o.memcached_mode))
                .parse()
                .map_err(|e: String| anyhow::anyhow!(e))?,
            memcached_timeout: std::time::Duration::from_millis(
                defaulted(o.memcached_timeout_ms).into(),
            ),
            ram_cache: o
                .ram_cache
                .map(|size| crate::units::parse_size(&size).map_err(|e| anyhow::anyhow!(e)))
                .transpose()
                .context("--ram-cache")?,
            ram_cache_policy: defaulted(o.ram_cache_policy)
                .parse()
                .map_err(|e: String| anyhow::anyhow!(e))?,
            policy,
            config,
            adopt,
        })
    }
}

/// The value of an option that has a default, after `ServeConfig::with_defaults`.
fn defaulted<T>(value: Option<T>) -> T {
    value.expect("an option with a default has a value once the defaults are in")
}

/// The `[serve]` options on the command line: one flag per entry of `config::SERVE_KEYS`, with
/// its documentation and checks, so the flags and the config file cannot drift apart. A flag
/// not given is `None`, and the config file or the default applies.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions(pub ServeConfig);

impl clap::FromArgMatches for ServeOptions {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut options = ServeOptions::default();
        options.update_from_arg_matches(matches)?;
        Ok(options)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        for k in config::SERVE_KEYS {
            let value = match k.kind {
                // A flag only ever says "on": without it the config file's value applies.
                config::Kind::Flag => matches.get_flag(k.name).then_some(OptValue::Flag(true)),
                _ => matches.get_one::<OptValue>(k.name).cloned(),
            };
            if let Some(v) = value {
                k.set(&mut self.0, v);
            }
        }
        Ok(())
    }
}

impl Args for ServeOptions {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        for k in config::SERVE_KEYS {
            let arg = clap::Arg::new(k.name).long(k.flag()).help(k.help_doc());
            let arg = match k.kind {
                config::Kind::Flag => arg.action(clap::ArgAction::SetTrue),
                _ => arg
                    .value_name(k.value_name)
                    .value_parser(move |s: &str| k.parse_arg(s)),
            };
            cmd = cmd.arg(arg);
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
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
    let identity = backing_identity(&args.backing, backing.info().size)?;
    let memcached = match &args.memcached {
        None => None,
        Some(servers) => Some(open_memcached(servers, &args, &identity, backing.clone())?),
    };
    // The memcached tier stands where the backing store was: below the cache, or exported.
    let backing: Arc<dyn BlockDev> = match &memcached {
        Some(tier) => tier.clone(),
        None => backing,
    };
    // The tier directly above the memcached tier hands it its evictions (its victim mode).
    let victims = memcached
        .clone()
        .map(|tier| Arc::new(MemcachedVictims(tier)));
    // With no cache, the RAM tier stands directly on the memcached tier (or the backing
    // store), the only place it can hand its evictions down: nothing else writes below it. A
    // cache attached later goes above it.
    let ram_over_backing = match args.ram_cache {
        Some(bytes) if args.cache.is_none() => {
            let sink = victims
                .clone()
                .map(|v| v as Arc<dyn flashtier_ram::EvictionSink>);
            Some(open_ram(bytes, &args, backing.clone(), sink)?)
        }
        _ => None,
    };
    let victim_sink = victims.map(|v| v as Arc<dyn flashtier_engine::VictimSink>);
    let backing: Arc<dyn BlockDev> = match &ram_over_backing {
        Some(ram) => ram.clone(),
        None => backing,
    };
    let cache = match &args.cache {
        None => None,
        Some(path) => {
            let cache = open_cache(path, &args, &identity, backing.clone())?;
            cache.set_victim_sink(victim_sink.clone());
            Some(cache)
        }
    };
    let inner: Arc<dyn BlockDev> = match &cache {
        Some(c) => c.clone(),
        None => backing.clone(),
    };
    // `flashtier detach` and `attach` swap what is exported underneath the clients.
    let export = Arc::new(Switchable::new(inner));
    // With a cache, the RAM tier stands above it and above detach and attach, which change
    // where blocks are kept, never what they hold.
    let ram = match (args.ram_cache, ram_over_backing) {
        (_, Some(ram)) => Some(ram),
        (Some(bytes), None) => Some(open_ram(bytes, &args, export.clone(), None)?),
        (None, None) => None,
    };
    let exported: Arc<dyn BlockDev> = match &ram {
        Some(ram) if cache.is_some() => ram.clone(),
        _ => export.clone(),
    };
    // Every request the clients make is timed, cache or pass-through.
    let timed = Arc::new(Timed::new(exported));
    let backing_spec = args.backing.clone();
    let controller = Arc::new(Controller::new(ControllerOptions {
        version: crate::VERSION.into(),
        dev: timed.clone(),
        cache: cache.clone(),
        latencies: timed.latencies(),
        tracer: timed.tracer(),
        working_set: timed.working_set(),
        endurance_tbw: args.endurance_tbw,
        memcached: memcached.clone(),
        ram: ram.clone(),
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
            victim_sink,
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
    if let Some(path) = &args.trace {
        controller
            .start_trace(path)
            .with_context(|| format!("--trace {}", path.display()))?;
    }
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
             detach, attach, reset-stats{})",
            socket.display(),
            if memcached.is_some() {
                ", memcached"
            } else {
                ""
            }
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
    if let Some(tier) = &memcached {
        writeln!(
            out,
            "flashtier: memcached tier, {} mode, {} (flashtier memcached list)",
            tier.mode(),
            args.memcached.as_deref().unwrap_or_default().join(", ")
        )?;
    }
    if let Some(ram) = &ram {
        writeln!(
            out,
            "flashtier: RAM tier of {}, {} eviction{}",
            fmt_bytes(ram.stats().capacity_bytes),
            ram.policy(),
            if args.cache.is_some() {
                ", above the cache"
            } else {
                ""
            }
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
    if let Some(path) = &args.trace {
        writeln!(
            out,
            "flashtier: recording a trace of every request to {} (flashtier trace stop ends it)",
            path.display()
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
    // Every request is answered: the trace is complete, and is synced before the exit.
    match controller.stop_trace(None) {
        Ok(t) => tracing::info!(path = %t.path.display(), requests = t.requests, lost = t.lost,
            "trace closed"),
        Err(ControlError::Trace(flashtier_control::trace::TraceStartError::NotRunning)) => {}
        Err(e) => eprintln!("flashtier: the trace is incomplete: {e}"),
    }
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
    identity: &BackingIdentity,
    backing: Arc<dyn BlockDev>,
) -> anyhow::Result<Arc<Cache>> {
    if backing.info().read_only || args.read_only {
        anyhow::bail!("a cache needs a writable backing store (drop --read-only or --cache)");
    }
    let dev = open_cache_device(path)?;
    if let Some(opts) = &args.adopt {
        crate::adopt::adopt_new_backing(&*dev, path, identity, opts)?;
    }
    let cache = Cache::open(dev, backing, identity, args.mode)
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

/// The memcached tier over `backing`, its keys in the namespace of the backing store's identity
/// (two hosts sharing a pool for different stores never meet).
fn open_memcached(
    servers: &[String],
    args: &Settings,
    identity: &BackingIdentity,
    backing: Arc<dyn BlockDev>,
) -> anyhow::Result<Arc<flashtier_memcached::MemcachedTier>> {
    use flashtier_memcached::{MemcachedMode, MemcachedTier, Pool, PoolOptions};
    let pool = Pool::new(
        servers,
        PoolOptions {
            timeout: args.memcached_timeout,
            ..PoolOptions::default()
        },
    )
    .context("--memcached")?;
    // Any rendering of the identity that is the same for the whole run will do: every start
    // draws a new generation, so namespaces never need to match across builds.
    let namespace = flashtier_memcached::value::namespace_of(format!("{identity:?}").as_bytes());
    let tier = MemcachedTier::new(backing, Arc::new(pool), namespace, args.memcached_mode)
        .context("cannot start the memcached tier")?;
    if args.memcached_mode == MemcachedMode::Victim
        && args.cache.is_none()
        && args.ram_cache.is_none()
    {
        let msg = "memcached_mode victim stores only blocks a faster tier evicts (the SSD tier's, \
                   or the RAM tier's without a cache), and there is neither --cache nor \
                   --ram-cache: the memcached tier will store nothing (inclusive stores what is \
                   read from and written to the backing store)";
        eprintln!("flashtier: WARNING: {msg}");
        tracing::warn!("{msg}");
    }
    Ok(Arc::new(tier))
}

/// The memcached tier as the sink of the evictions of the tier directly above it, the SSD tier's
/// or the RAM tier's (its `victim` mode).
struct MemcachedVictims(Arc<flashtier_memcached::MemcachedTier>);

impl flashtier_engine::VictimSink for MemcachedVictims {
    fn wants(&self) -> bool {
        self.0.takes_victims()
    }

    fn tags(&self, offset: u64, len: usize, out: &mut Vec<flashtier_io::versions::Tag>) -> bool {
        self.0.victim_tags(offset, len, out)
    }

    fn offer(&self, offset: u64, tags: &[flashtier_io::versions::Tag], data: &[u8]) {
        self.0.offer_tagged(offset, tags, data);
    }

    fn ship(&self) {
        self.0.ship_victims();
    }
}

impl flashtier_ram::EvictionSink for MemcachedVictims {
    fn evicted(&self, block: u64, data: &[u8]) {
        self.0.offer_victim(block, data);
    }

    fn ship(&self) {
        self.0.ship_victims();
    }
}

/// The RAM tier of `bytes` over `below`, refused when the machine does not have that much
/// memory at all, and with a warning when it does not have it free now.
fn open_ram(
    bytes: u64,
    args: &Settings,
    below: Arc<dyn BlockDev>,
    sink: Option<Arc<dyn flashtier_ram::EvictionSink>>,
) -> anyhow::Result<Arc<flashtier_ram::RamTier>> {
    if let Some((total, available)) = memory_info() {
        if bytes >= total {
            anyhow::bail!(
                "--ram-cache {} is more than this machine's memory ({})",
                fmt_bytes(bytes),
                fmt_bytes(total)
            );
        }
        if bytes > available {
            let msg = format!(
                "--ram-cache {} is more than the memory available now ({}): the RAM tier fills \
                 as blocks are read, and the system may swap or kill processes when it is full",
                fmt_bytes(bytes),
                fmt_bytes(available)
            );
            eprintln!("flashtier: WARNING: {msg}");
            tracing::warn!("{msg}");
        }
    }
    Ok(Arc::new(flashtier_ram::RamTier::new(
        below,
        bytes,
        args.ram_cache_policy,
        sink,
    )))
}

/// (MemTotal, MemAvailable) in bytes, from /proc/meminfo.
fn memory_info() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kib| kib << 10)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::{Cli, Command};

    fn serve(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        let argv = ["flashtier", "serve"].iter().chain(args);
        match Cli::try_parse_from(argv)?.command {
            Command::Serve(a) => Ok(*a),
            _ => unreachable!(),
        }
    }

    /// Every `[serve]` key is a `serve` flag with the key's documentation and checks, and
    /// every value the config file takes means the same on the command line.
    #[test]
    fn every_serve_key_is_a_flag_with_its_doc_and_checks() {
        Cli::command().debug_assert();
        let cmd = Cli::command();
        let sub = cmd.find_subcommand("serve").unwrap();
        let mut argv = Vec::new();
        let mut file = String::from("[serve]\n");
        for k in config::SERVE_KEYS {
            let arg = sub
                .get_arguments()
                .find(|a| a.get_id() == k.name)
                .unwrap_or_else(|| panic!("no flag for {}", k.name));
            assert_eq!(arg.get_long(), Some(k.flag().as_str()));
            assert_eq!(arg.get_help().unwrap().to_string(), k.help_doc());
            assert!(k.help_doc().starts_with(k.doc.split('{').next().unwrap()));
            let value = match k.example {
                config::Example::Set(v) | config::Example::Commented(v) => v,
                config::Example::Default => k.default,
            };
            let v = config::parse(
                std::path::Path::new("f.toml"),
                &format!("[serve]\n{} = {value}\n", k.name),
            )
            .map(|c| k.get(&c.serve).unwrap())
            .unwrap();
            if v == OptValue::Flag(false) {
                continue;
            }
            file.push_str(&format!("{} = {}\n", k.name, v.to_toml()));
            argv.push(format!("--{}", k.flag()));
            if !matches!(k.kind, config::Kind::Flag) {
                argv.push(v.plain());
            }
        }
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let given = serve(&argv).unwrap().options.0;
        let from_file = config::parse(std::path::Path::new("f.toml"), &file)
            .unwrap()
            .serve;
        assert_eq!(given, from_file);
        // Not given is None (the file or the default applies); bad values are refused with
        // what is allowed.
        assert_eq!(serve(&[]).unwrap().options.0, ServeConfig::default());
        for (flag, value, says) in [
            ("--threads", "0", "1..=1024"),
            ("--mode", "fast", "writethrough"),
            ("--tls", "maybe", "off | on | require"),
            ("--endurance-tbw", "0", "> 0"),
            ("--metrics-listen", "localhost", "[HOST]:PORT"),
            ("--cache", "", "non-empty"),
        ] {
            let e = serve(&[flag, value]).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(flag), "{e}");
        }
        assert_eq!(
            serve(&["--mode", "WT"]).unwrap().options.0.mode.as_deref(),
            Some("writethrough")
        );
    }
}

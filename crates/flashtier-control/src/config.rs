//! The config file: `flashtier serve --config FILE`, `flashtier set --persist` and
//! `flashtier config check FILE`.
//!
//! TOML with two tables: `[serve]` holds the `flashtier serve` options (the long flags' names with
//! `_` for `-`; flags given on the command line override them) and `[policy]` the live parameters
//! of [`flashtier_engine::PARAMS`]. [`load`] checks every value the way the command line and the
//! control API do (the same validators), so a file that loads starts a server; [`persist`] changes
//! one value in place, keeping the rest of the file and its comments.
//!
//! Each `serve` option is one entry of [`SERVE_KEYS`] (ripgrep's one-`Flag`-per-flag is the
//! model): its name, documentation, default, allowed values, how a value is checked, and which
//! [`ServeConfig`] field holds it. The `[serve]` keys, the `serve` command line (built from the
//! table by the binary), its `--help`, the defaults in force and `config check` all read it, and
//! [`example`] renders it with [`PARAMS`] as the repository's `flashtier.example.toml` (a test
//! keeps the two equal).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use flashtier_engine::{tunables, Mode, ParamError, PARAMS};
use flashtier_nbd::tls::TlsMode;
use toml_edit::{Item, Table, TableLike, Value};

/// A parsed and validated config file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    /// The `[serve]` table: options of `flashtier serve`, each checked.
    pub serve: ServeConfig,
    /// `[policy]` in file order: (parameter name, value as `Cache::set_param` takes it).
    pub policy: Vec<(String, String)>,
}

/// The `serve` options, from the `[serve]` table or the command line; `None` = not given.
/// [`SERVE_KEYS`] says what each field means and takes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeConfig {
    /// The slow store being cached: a file, a block device or an NBD URI. Required.
    pub backing: Option<String>,
    /// The cache file or device; none: the backing store is exported as is (pass-through).
    pub cache: Option<String>,
    /// A valid mode's canonical name (`writeback`, ...).
    pub mode: Option<String>,
    /// Where NBD clients connect: a unix socket path, or `HOST:PORT`.
    pub listen: Option<String>,
    /// `off`, `on` or `require`.
    pub tls: Option<String>,
    /// Directory of X.509 credentials for TLS.
    pub tls_certificates: Option<String>,
    /// File of `username:hexkey` pre-shared keys for TLS.
    pub tls_psk: Option<String>,
    /// With certificates: require a client certificate signed by the CA.
    pub tls_verify_peer: Option<bool>,
    /// The NBD export's name (default `flashtier`).
    pub export_name: Option<String>,
    /// Refuse writes, trims and zeroing; only without a cache.
    pub read_only: Option<bool>,
    /// Open the backing store with `O_DIRECT`.
    pub direct: Option<bool>,
    /// Requests executed at once per connection (default 16).
    pub threads: Option<u32>,
    /// Client connections served at once (default 256).
    pub max_connections: Option<u32>,
    /// Seconds a client has to finish the handshake (default 10).
    pub handshake_timeout: Option<u32>,
    /// MiB of request payload held at once for all clients (default 1024).
    pub request_memory_mib: Option<u32>,
    /// MiB of request payload one connection may hold (default 64).
    pub request_memory_per_connection_mib: Option<u32>,
    /// Worker threads shared by all connections (default 512).
    pub worker_pool: Option<u32>,
    /// Seconds to let clients collect their replies at shutdown (default 30).
    pub shutdown_grace: Option<u64>,
    /// The control socket's path (default: `control.sock` in the run directory).
    pub control_socket: Option<String>,
    /// `HOST:PORT` or `:PORT` for Prometheus metrics; none: no metrics listener.
    pub metrics_listen: Option<String>,
    /// The stats file's path (default: `stats` in the run directory).
    pub stats_file: Option<String>,
    /// Record every client request into a new trace file at this path from the start.
    pub trace: Option<String>,
    /// The cache device's rated endurance in TB written, for the wear forecast.
    pub endurance_tbw: Option<f64>,
    /// The RAM tier's size, canonical (`512M`, `4G`, ...); none: no RAM tier.
    pub ram_cache: Option<String>,
    /// The order the RAM tier evicts in: `lru` or `fifo`.
    pub ram_cache_policy: Option<String>,
    /// The memcached tier's servers, `HOST:PORT` separated by commas; none: no memcached tier.
    pub memcached: Option<String>,
    /// What the memcached tier stores: `inclusive` or `victim`.
    pub memcached_mode: Option<String>,
    /// Milliseconds a memcached request may take before its server is skipped.
    pub memcached_timeout_ms: Option<u32>,
}

impl ServeConfig {
    /// Every `[serve]` key in [`SERVE_KEYS`] order with its value in TOML syntax, if set.
    pub fn entries(&self) -> Vec<(&'static KeyInfo, Option<String>)> {
        SERVE_KEYS
            .iter()
            .map(|k| (k, k.get(self).map(|v| v.to_toml())))
            .collect()
    }

    /// These options with every one that `over` gives replaced by its value there (the command
    /// line over the config file).
    pub fn overridden_by(mut self, over: &ServeConfig) -> ServeConfig {
        for k in SERVE_KEYS {
            if let Some(v) = k.get(over) {
                k.set(&mut self, v);
            }
        }
        self
    }

    /// These options with every one not given set to its default, where it has one.
    pub fn with_defaults(mut self) -> ServeConfig {
        for k in SERVE_KEYS {
            if let (None, Some(v)) = (k.get(&self), k.default_value()) {
                k.set(&mut self, v);
            }
        }
        self
    }
}

/// A `serve` option's value, checked as its key takes it.
#[derive(Debug, Clone, PartialEq)]
pub enum OptValue {
    /// For [`Kind::Text`] keys.
    Text(String),
    /// For [`Kind::Flag`] keys.
    Flag(bool),
    /// For [`Kind::Int`] keys.
    Int(u64),
    /// For [`Kind::Positive`] keys.
    Number(f64),
}

impl OptValue {
    /// In TOML syntax, as the config file and `config check` show it.
    pub fn to_toml(&self) -> String {
        let v = match self {
            OptValue::Text(s) => Value::from(s.as_str()),
            OptValue::Flag(b) => Value::from(*b),
            OptValue::Int(n) => return n.to_string(),
            OptValue::Number(x) => Value::from(*x),
        };
        v.to_string().trim().to_string()
    }

    /// As the command line takes it.
    pub fn plain(&self) -> String {
        match self {
            OptValue::Text(s) => s.clone(),
            OptValue::Flag(b) => b.to_string(),
            OptValue::Int(n) => n.to_string(),
            OptValue::Number(x) => x.to_string(),
        }
    }
}

/// How a `serve` option's values are written and checked.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// A string, empty or not as `empty` says; `check` (if any) gives the canonical form of a
    /// value it accepts.
    Text {
        /// Whether the empty string is accepted.
        empty: bool,
        /// Validates and canonicalizes a value; `None` from it refuses the value.
        check: Option<fn(&str) -> Option<String>>,
    },
    /// `true` or `false`; on the command line, a flag that sets it.
    Flag,
    /// An integer in `lo..=hi`.
    Int {
        /// Smallest value accepted.
        lo: u64,
        /// Largest value accepted.
        hi: u64,
    },
    /// A finite number above 0.
    Positive,
}

/// Reads and writes the [`ServeConfig`] field of one key.
#[derive(Debug, Clone, Copy)]
pub struct Access {
    get: fn(&ServeConfig) -> Option<OptValue>,
    set: fn(&mut ServeConfig, OptValue),
}

/// A [`ServeConfig`] field's type, as an [`OptValue`].
trait Field: Sized {
    fn into_value(self) -> OptValue;
    fn from_value(v: OptValue) -> Option<Self>;
}

impl Field for String {
    fn into_value(self) -> OptValue {
        OptValue::Text(self)
    }
    fn from_value(v: OptValue) -> Option<Self> {
        match v {
            OptValue::Text(s) => Some(s),
            _ => None,
        }
    }
}

impl Field for bool {
    fn into_value(self) -> OptValue {
        OptValue::Flag(self)
    }
    fn from_value(v: OptValue) -> Option<Self> {
        match v {
            OptValue::Flag(b) => Some(b),
            _ => None,
        }
    }
}

impl Field for u64 {
    fn into_value(self) -> OptValue {
        OptValue::Int(self)
    }
    fn from_value(v: OptValue) -> Option<Self> {
        match v {
            OptValue::Int(n) => Some(n),
            _ => None,
        }
    }
}

impl Field for u32 {
    fn into_value(self) -> OptValue {
        OptValue::Int(self.into())
    }
    fn from_value(v: OptValue) -> Option<Self> {
        u64::from_value(v).and_then(|n| n.try_into().ok())
    }
}

impl Field for f64 {
    fn into_value(self) -> OptValue {
        OptValue::Number(self)
    }
    fn from_value(v: OptValue) -> Option<Self> {
        match v {
            OptValue::Number(x) => Some(x),
            _ => None,
        }
    }
}

/// The [`Access`] of field `$f` of [`ServeConfig`].
macro_rules! field {
    ($f:ident) => {
        Access {
            get: |c: &ServeConfig| c.$f.clone().map(Field::into_value),
            set: |c: &mut ServeConfig, v: OptValue| c.$f = Field::from_value(v),
        }
    };
}

/// Everything about one `serve` option: the `[serve]` key, the command line flag (the key with
/// `-` for `_`), their documentation, default and checks.
#[derive(Debug, Clone, Copy)]
pub struct KeyInfo {
    /// The key; the flag is `--` and the key with `-` for `_`.
    pub name: &'static str,
    /// What it does. `{key}` names another option: rendered as `key` in the config file and
    /// `--key` in `--help` ([`KeyInfo::file_doc`], [`KeyInfo::help_doc`]).
    pub doc: &'static str,
    /// What applies when the option is not given: with `default_is_value`, the value in TOML
    /// syntax (checked as any other); else a description.
    pub default: &'static str,
    /// Whether `default` is a value (checked and applied) rather than prose.
    pub default_is_value: bool,
    /// The allowed values, as errors and the example file show them.
    pub allowed: &'static str,
    /// The flag's value placeholder in `--help`.
    pub value_name: &'static str,
    /// How values are written and checked.
    pub kind: Kind,
    /// How the example file shows the key.
    pub example: Example,
    access: Access,
}

/// A key's line in the example file: a value in TOML syntax, set or commented out, or the
/// default commented out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Example {
    /// The key set to this value.
    Set(&'static str),
    /// The key with this value, commented out.
    Commented(&'static str),
    /// The key with its default, commented out.
    Default,
}

fn tls_mode(v: &str) -> Option<String> {
    v.parse::<TlsMode>().ok().map(|m| m.to_string())
}

fn mode(v: &str) -> Option<String> {
    Mode::from_str(v).ok().map(|m| m.name().to_string())
}

/// The smallest RAM tier: one 4 KiB block.
const MIN_RAM_CACHE: u64 = 4096;

/// A size of at least [`MIN_RAM_CACHE`] as `parse_size` takes it, written with the largest
/// binary unit that divides it exactly (`536870912` and `512MiB` become `512M`).
fn ram_cache_size(v: &str) -> Option<String> {
    let n = crate::render::parse_size(v)
        .ok()
        .filter(|&n| n >= MIN_RAM_CACHE)?;
    let unit = [("T", 40), ("G", 30), ("M", 20), ("K", 10)]
        .into_iter()
        .find(|&(_, shift)| n.trailing_zeros() >= shift);
    Some(match unit {
        Some((unit, shift)) => format!("{}{unit}", n >> shift),
        None => n.to_string(),
    })
}

fn ram_cache_policy(v: &str) -> Option<String> {
    v.trim()
        .parse::<flashtier_ram::RamPolicy>()
        .ok()
        .map(|p| p.to_string())
}

fn memcached_servers(v: &str) -> Option<String> {
    let servers: Vec<&str> = v.split(',').map(str::trim).collect();
    servers
        .iter()
        .all(|s| !s.is_empty() && host_port(s).is_some())
        .then(|| servers.join(","))
}

fn memcached_mode(v: &str) -> Option<String> {
    v.parse::<flashtier_memcached::MemcachedMode>()
        .ok()
        .map(|m| m.to_string())
}

fn host_port(v: &str) -> Option<String> {
    v.rsplit_once(':')
        .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
        .then(|| v.to_string())
}

/// A non-empty string without further checks (a path, an address checked when it is used).
const TEXT: Kind = Kind::Text {
    empty: false,
    check: None,
};

/// Every `serve` option, in the order `--help`, the example file and `config check` show them.
pub const SERVE_KEYS: &[KeyInfo] = &[
    KeyInfo {
        name: "backing",
        doc: "The slow backing store: a file, a block device, or an NBD URI such as \
              nbd://host:10809/export or nbd+unix:///export?socket=/path.",
        default: "none, required (on the command line or in the config file)",
        default_is_value: false,
        allowed: "a path or an NBD URI",
        value_name: "PATH|NBD-URI",
        kind: TEXT,
        example: Example::Set("\"/dev/sdb\""),
        access: field!(backing),
    },
    KeyInfo {
        name: "cache",
        doc: "The cache file or device (an SSD partition), prepared with `flashtier format` for \
              this backing store. Without it the backing store is served as is (pass-through) \
              until `flashtier attach --cache` adds one.",
        default: "none",
        default_is_value: false,
        allowed: "a path",
        value_name: "FILE|DEVICE",
        kind: TEXT,
        example: Example::Set("\"/dev/nvme0n1p1\""),
        access: field!(cache),
    },
    KeyInfo {
        name: "mode",
        doc: "Cache mode: writeback (writes land in the cache and are written back later), \
              writethrough (writes go to both before they are acknowledged), writearound (writes \
              go to the backing store; reads are cached) or passthrough (the cache is bypassed). \
              Needs a cache. Change it live with `flashtier mode MODE` (leaving write-back writes \
              every dirty block back first); `flashtier set mode MODE --persist` also writes it \
              to the config file.",
        default: "the mode the cache was formatted or last served with",
        default_is_value: false,
        allowed: "writeback | writethrough | writearound | passthrough",
        value_name: "MODE",
        kind: Kind::Text {
            empty: false,
            check: Some(mode),
        },
        example: Example::Commented("\"writeback\""),
        access: field!(mode),
    },
    KeyInfo {
        name: "listen",
        doc: "Where NBD clients connect: a unix socket path (created mode 0600), or HOST:PORT for \
              TCP. :PORT listens on loopback only; name an address (e.g. 0.0.0.0:10809) to listen \
              beyond this machine.",
        default: "/run/flashtier/nbd.sock as root, else $XDG_RUNTIME_DIR/flashtier/nbd.sock",
        default_is_value: false,
        allowed: "a socket path or [HOST]:PORT",
        value_name: "SOCKET|HOST:PORT",
        kind: TEXT,
        example: Example::Set("\"/run/flashtier/nbd.sock\""),
        access: field!(listen),
    },
    KeyInfo {
        name: "tls",
        doc: "TLS (NBD's STARTTLS): off, on (clients may upgrade) or require (nothing but \
              STARTTLS is answered before TLS runs: every client must authenticate). Needs \
              {tls_certificates} or {tls_psk}. Use require whenever {listen} names an address \
              other machines can reach.",
        default: "\"off\"",
        default_is_value: true,
        allowed: "off | on | require",
        value_name: "off|on|require",
        kind: Kind::Text {
            empty: false,
            check: Some(tls_mode),
        },
        example: Example::Commented("\"require\""),
        access: field!(tls),
    },
    KeyInfo {
        name: "tls_certificates",
        doc: "X.509 credentials for TLS: a directory with server-cert.pem and server-key.pem \
              (and ca-cert.pem for {tls_verify_peer}), as nbdkit's --tls-certificates and qemu's \
              tls-creds-x509 use. Clients connect with e.g. \
              `nbdinfo 'nbds://HOST:PORT/?tls-certificates=DIR'` (DIR holding the CA's \
              ca-cert.pem).",
        default: "none",
        default_is_value: false,
        allowed: "a directory",
        value_name: "DIR",
        kind: TEXT,
        example: Example::Commented("\"/etc/flashtier/pki\""),
        access: field!(tls_certificates),
    },
    KeyInfo {
        name: "tls_psk",
        doc: "Pre-shared keys for TLS: a file of `username:hexkey` lines (as nbdkit's --tls-psk \
              and qemu's keys.psk; e.g. `alice:$(openssl rand -hex 32)`), mode 0600. Clients \
              connect with e.g. `nbdinfo 'nbds://alice@HOST:PORT/?tls-psk-file=FILE'`.",
        default: "none",
        default_is_value: false,
        allowed: "a path",
        value_name: "FILE",
        kind: TEXT,
        example: Example::Commented("\"/etc/flashtier/keys.psk\""),
        access: field!(tls_psk),
    },
    KeyInfo {
        name: "tls_verify_peer",
        doc: "With {tls_certificates}: require a client certificate signed by its ca-cert.pem.",
        default: "false",
        default_is_value: true,
        allowed: "true | false",
        value_name: "",
        kind: Kind::Flag,
        example: Example::Default,
        access: field!(tls_verify_peer),
    },
    KeyInfo {
        name: "export_name",
        doc: "The NBD export's name. Clients asking for the empty (default) name get it too.",
        default: "\"flashtier\"",
        default_is_value: true,
        allowed: "a string",
        value_name: "EXPORT_NAME",
        kind: Kind::Text {
            empty: true,
            check: None,
        },
        example: Example::Default,
        access: field!(export_name),
    },
    KeyInfo {
        name: "read_only",
        doc: "Serve read-only: writes, trims and zeroing fail with EPERM (not with a cache).",
        default: "false",
        default_is_value: true,
        allowed: "true | false",
        value_name: "",
        kind: Kind::Flag,
        example: Example::Default,
        access: field!(read_only),
    },
    KeyInfo {
        name: "direct",
        doc: "Open a backing file or block device with O_DIRECT, bypassing the kernel page cache.",
        default: "false",
        default_is_value: true,
        allowed: "true | false",
        value_name: "",
        kind: Kind::Flag,
        example: Example::Default,
        access: field!(direct),
    },
    KeyInfo {
        name: "threads",
        doc: "Requests executed at once per connection. A write-back write holds its thread until \
              its log batch is written, so this also bounds how many writes one batch gathers: \
              with a client keeping 32 4 KiB writes in flight, 64 rather than 16 gave 1.24x the \
              IOPS and 20% less server CPU per write, but MariaDB under sysbench was no faster \
              with it (2-4% fewer transactions/s, within noise), so 16 stays the default; raise \
              it for clients that keep many writes in flight. Extra threads start only as \
              requests arrive.",
        default: "16",
        default_is_value: true,
        allowed: "1..=1024",
        value_name: "THREADS",
        kind: Kind::Int { lo: 1, hi: 1024 },
        example: Example::Default,
        access: field!(threads),
    },
    KeyInfo {
        name: "max_connections",
        doc: "Most client connections served at once. When all are taken, a new client gets the \
              slot of one that is still in its handshake after 1 s, connected but unused for 1 s, \
              not reading its replies for 2 s, or idle for 10 s (in that order, longest first); \
              with none of those it is refused.",
        default: "256",
        default_is_value: true,
        allowed: "1..=65536",
        value_name: "MAX_CONNECTIONS",
        kind: Kind::Int { lo: 1, hi: 65536 },
        example: Example::Default,
        access: field!(max_connections),
    },
    KeyInfo {
        name: "handshake_timeout",
        doc: "Seconds a client has to finish the handshake (the TLS handshake included), counted \
              from when it connected, however slowly it sends.",
        default: "10",
        default_is_value: true,
        allowed: "1..=3600",
        value_name: "SECS",
        kind: Kind::Int { lo: 1, hi: 3600 },
        example: Example::Default,
        access: field!(handshake_timeout),
    },
    KeyInfo {
        name: "request_memory_mib",
        doc: "MiB of request payload (READ replies, WRITE data) held at once for all clients \
              together. When it is spent, connections stop reading requests until replies drain, \
              and a client that has not read its replies for 2 s is disconnected to make room.",
        default: "1024",
        default_is_value: true,
        // 1 TiB.
        allowed: "1..=1048576",
        value_name: "MIB",
        kind: Kind::Int { lo: 1, hi: 1 << 20 },
        example: Example::Default,
        access: field!(request_memory_mib),
    },
    KeyInfo {
        name: "request_memory_per_connection_mib",
        doc: "MiB of request payload one connection may hold; a client that does not read its \
              replies stops being read from once they fill it. A single larger request is still \
              served alone.",
        default: "64",
        default_is_value: true,
        allowed: "1..=1048576",
        value_name: "MIB",
        kind: Kind::Int { lo: 1, hi: 1 << 20 },
        example: Example::Default,
        access: field!(request_memory_per_connection_mib),
    },
    KeyInfo {
        name: "worker_pool",
        doc: "Worker threads shared by all connections, beyond each connection's own thread \
              (which is all an idle connection has). Extra threads start as requests arrive and \
              stop after 5 s without work.",
        default: "512",
        default_is_value: true,
        allowed: "0..=65536",
        value_name: "N",
        kind: Kind::Int { lo: 0, hi: 65536 },
        example: Example::Default,
        access: field!(worker_pool),
    },
    KeyInfo {
        name: "shutdown_grace",
        doc: "On SIGINT/SIGTERM, seconds to wait for clients to collect the replies to requests \
              already executed before closing their connections anyway (a client that stopped \
              reading would otherwise hold the shutdown forever).",
        default: "30",
        default_is_value: true,
        allowed: "0 or more (seconds)",
        value_name: "SECS",
        // TOML integers are signed.
        kind: Kind::Int {
            lo: 0,
            hi: i64::MAX as u64,
        },
        example: Example::Default,
        access: field!(shutdown_grace),
    },
    KeyInfo {
        name: "control_socket",
        doc: "The control API's unix socket (created mode 0600), which `flashtier status`, \
              `stats`, `get`, `set`, `mode` and `reset-stats` use (their --control option).",
        default: "control.sock in the run directory (/run/flashtier as root, else \
                  $XDG_RUNTIME_DIR/flashtier)",
        default_is_value: false,
        allowed: "a socket path",
        value_name: "SOCKET",
        kind: TEXT,
        example: Example::Commented("\"/run/flashtier/control.sock\""),
        access: field!(control_socket),
    },
    KeyInfo {
        name: "metrics_listen",
        doc: "Serve Prometheus metrics (GET /metrics, text format 0.0.4) over HTTP on this \
              address. :PORT listens on loopback only.",
        default: "off",
        default_is_value: false,
        allowed: "[HOST]:PORT",
        value_name: "HOST:PORT",
        kind: Kind::Text {
            empty: false,
            check: Some(host_port),
        },
        example: Example::Commented("\"127.0.0.1:9633\""),
        access: field!(metrics_listen),
    },
    KeyInfo {
        name: "stats_file",
        doc: "A cat-able stats file, rewritten every second: one `name value` line per counter \
              and figure, and PATH.json beside it with `flashtier stats --json`'s report. Removed \
              on exit.",
        default: "stats in the run directory (/run/flashtier/stats as root)",
        default_is_value: false,
        allowed: "a path",
        value_name: "PATH",
        kind: TEXT,
        example: Example::Commented("\"/run/flashtier/stats\""),
        access: field!(stats_file),
    },
    KeyInfo {
        name: "trace",
        doc: "Record every client request (time, op, offset, length) into a new trace file at \
              this path from the start, to summarise (`flashtier trace show`) or replay \
              with fio (`flashtier trace to-fio`). The file must not exist. `flashtier trace \
              stop` ends it; it is closed on exit. 24 bytes per request.",
        default: "off",
        default_is_value: false,
        allowed: "a path to a file that does not exist",
        value_name: "FILE",
        kind: TEXT,
        example: Example::Commented("\"/var/lib/flashtier/db.trace\""),
        access: field!(trace),
    },
    KeyInfo {
        name: "endurance_tbw",
        doc: "The cache device's rated endurance in terabytes written (its data sheet's TBW), for \
              the wear forecast in `flashtier stats`: days until the device reaches it at the \
              recent write rate.",
        default: "none, no wear forecast",
        default_is_value: false,
        allowed: "a number > 0",
        value_name: "TB",
        kind: Kind::Positive,
        example: Example::Commented("600"),
        access: field!(endurance_tbw),
    },
    KeyInfo {
        name: "ram_cache",
        doc: "A RAM tier of this size: the hottest clean blocks in this process's memory, above \
              the SSD tier ({cache}); with no {cache} it sits on the memcached tier \
              ({memcached}) or the backing store. Reads of whole 4 KiB blocks, up to 1 MiB each, \
              are answered from it and kept in it; other reads pass through. Writes go through \
              to the tier below, so the RAM tier only ever holds clean copies (a write drops or \
              replaces them). Memory is bounded: the size (rounded down to whole 4 KiB blocks) \
              plus about 1% for its index and a version table of up to 32 MiB. Its hits, \
              evictions and memory are counted in `flashtier status` and `flashtier stats`.",
        default: "none, no RAM tier",
        default_is_value: false,
        allowed: "a size of 4K or more, in bytes or with K, M, G, T (binary multiples), e.g. \
                  512M, 4G",
        value_name: "SIZE",
        kind: Kind::Text {
            empty: false,
            check: Some(ram_cache_size),
        },
        example: Example::Commented("\"4G\""),
        access: field!(ram_cache),
    },
    KeyInfo {
        name: "ram_cache_policy",
        doc: "The order the RAM tier ({ram_cache}) evicts in when it is full (the SSD tier's \
              reclaim_policy family): lru (the block read least recently first) or fifo (the \
              block kept longest first; hits do not reorder).",
        default: "\"lru\"",
        default_is_value: true,
        allowed: flashtier_ram::store::POLICIES,
        value_name: "lru|fifo",
        kind: Kind::Text {
            empty: false,
            check: Some(ram_cache_policy),
        },
        example: Example::Default,
        access: field!(ram_cache_policy),
    },
    KeyInfo {
        name: "memcached",
        doc: "A pool of memcached servers as a second-level cache of clean blocks (WaffleGrid's \
              idea), between the cache and the backing store, or in front of the backing store \
              without {cache}. Keys are spread over the servers by consistent hashing. memcached \
              only ever holds copies of what the backing store holds, each checked against a \
              version this process keeps before it is used: a lost, restarted, stale or shared \
              server costs hits, never data. Add and remove servers live with `flashtier \
              memcached add|remove`.",
        default: "none, no memcached tier",
        default_is_value: false,
        allowed: "HOST:PORT[,HOST:PORT...]",
        value_name: "HOST:PORT,...",
        kind: Kind::Text {
            empty: false,
            check: Some(memcached_servers),
        },
        example: Example::Commented("\"10.0.0.5:11211,10.0.0.6:11211\""),
        access: field!(memcached),
    },
    KeyInfo {
        name: "memcached_mode",
        doc: "What the memcached tier stores: inclusive (blocks read from and written to the \
              backing store; a hit leaves them there) or victim (blocks a faster tier evicts; a \
              hit removes them). In victim mode the tier directly above hands its evictions down: \
              the SSD tier ({cache}; reclaim then reads the clean blocks it evicts from the cache \
              device), or, with no {cache}, the RAM tier ({ram_cache}); with neither, victim \
              stores nothing. Change it live with `flashtier memcached mode MODE` or `flashtier set \
              memcached_mode MODE`.",
        default: "\"inclusive\"",
        default_is_value: true,
        allowed: "inclusive | victim",
        value_name: "inclusive|victim",
        kind: Kind::Text {
            empty: false,
            check: Some(memcached_mode),
        },
        example: Example::Default,
        access: field!(memcached_mode),
    },
    KeyInfo {
        name: "memcached_timeout_ms",
        doc: "How long one memcached request may take. A server that fails or times out is \
              skipped (its reads go to the backing store) and tried again after a backoff from \
              100 ms doubling to 5 s.",
        default: "5",
        default_is_value: true,
        allowed: "1..=10000",
        value_name: "MS",
        kind: Kind::Int { lo: 1, hi: 10000 },
        example: Example::Default,
        access: field!(memcached_timeout_ms),
    },
];

impl KeyInfo {
    /// The command line flag, without `--`.
    pub fn flag(&self) -> String {
        self.name.replace('_', "-")
    }

    /// The value this option has in `config`, if it is given.
    pub fn get(&self, config: &ServeConfig) -> Option<OptValue> {
        (self.access.get)(config)
    }

    /// Gives the option `value` in `config`: one [`KeyInfo::parse_arg`] or the config file
    /// checked.
    pub fn set(&self, config: &mut ServeConfig, value: OptValue) {
        (self.access.set)(config, value);
    }

    /// The value that applies when the option is not given, if there is one.
    pub fn default_value(&self) -> Option<OptValue> {
        if !self.default_is_value {
            return None;
        }
        let value: Value = self.default.parse().ok()?;
        self.parse_item(&Item::Value(value)).ok()
    }

    /// [`KeyInfo::doc`] as the config file says it.
    pub fn file_doc(&self) -> String {
        render_refs(self.doc, |k| k.name.to_string())
    }

    /// [`KeyInfo::doc`] as `serve --help` says it, with the default (flags have none to show).
    pub fn help_doc(&self) -> String {
        let doc = render_refs(self.doc, |k| format!("--{}", k.flag()));
        let default = match self.default_value() {
            Some(v) => v.plain(),
            None => self.default.to_string(),
        };
        match self.kind {
            Kind::Flag => doc,
            _ => format!("{doc} [default: {default}]"),
        }
    }

    /// Checks a value given on the command line.
    pub fn parse_arg(&self, arg: &str) -> Result<OptValue, String> {
        let wrong = || format!("allowed {}", self.allowed);
        match self.kind {
            Kind::Text { empty, check } => {
                if !empty && arg.trim().is_empty() {
                    return Err(format!("expected a non-empty string ({})", self.allowed));
                }
                match check {
                    Some(check) => check(arg).map(OptValue::Text).ok_or_else(wrong),
                    None => Ok(OptValue::Text(arg.to_string())),
                }
            }
            Kind::Flag => arg.parse().map(OptValue::Flag).map_err(|_| wrong()),
            Kind::Int { lo, hi } => arg
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|n| (lo..=hi).contains(n))
                .map(OptValue::Int)
                .ok_or_else(wrong),
            Kind::Positive => arg
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .map(OptValue::Number)
                .ok_or_else(wrong),
        }
    }

    /// Checks the value of the key in a config file; the error says what is wrong and what is
    /// allowed.
    fn parse_item(&self, item: &Item) -> Result<OptValue, String> {
        let shown = item
            .as_value()
            .map(|v| v.to_string().trim().to_string())
            .unwrap_or_else(|| "a table".to_string());
        let wrong = || format!("invalid value {shown}: allowed {}", self.allowed);
        match self.kind {
            Kind::Text { empty, check } => {
                let v = match item.as_str() {
                    Some(v) if empty || !v.trim().is_empty() => v,
                    _ if empty => return Err(wrong()),
                    _ => {
                        return Err(format!(
                            "invalid value {shown}: expected a non-empty string ({})",
                            self.allowed
                        ))
                    }
                };
                match check {
                    Some(check) => check(v).map(OptValue::Text).ok_or_else(wrong),
                    None => Ok(OptValue::Text(v.to_string())),
                }
            }
            Kind::Flag => item.as_bool().map(OptValue::Flag).ok_or_else(wrong),
            Kind::Int { lo, hi } => item
                .as_integer()
                .and_then(|n| u64::try_from(n).ok())
                .filter(|n| (lo..=hi).contains(n))
                .map(OptValue::Int)
                .ok_or_else(wrong),
            Kind::Positive => item
                .as_float()
                .or_else(|| item.as_integer().map(|n| n as f64))
                .filter(|v| v.is_finite() && *v > 0.0)
                .map(OptValue::Number)
                .ok_or_else(wrong),
        }
    }
}

/// `doc` with each `{key}` of another option written as `name` makes it.
fn render_refs(doc: &str, name: impl Fn(&KeyInfo) -> String) -> String {
    let mut out = doc.to_string();
    for k in SERVE_KEYS {
        out = out.replace(&format!("{{{}}}", k.name), &name(k));
    }
    out
}

/// A config file that cannot be read, parsed, validated or written.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Reading or writing the file failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// The config file.
        path: PathBuf,
        /// What was being done, e.g. `read config file`.
        action: &'static str,
        /// The system call's error.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("{}: not valid TOML: {message}", path.display())]
    Syntax {
        /// The config file.
        path: PathBuf,
        /// The parser's message, with the line and column.
        message: String,
    },
    /// A key is unknown, or a value is of the wrong type or refused by its check.
    #[error("{}{}: {key}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        /// The config file.
        path: PathBuf,
        /// 1-based line of the key, where known.
        line: Option<usize>,
        /// `[table] key`, or `[table]` for a table.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

/// Reads, parses and validates the config file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        action: "read config file",
        source,
    })?;
    parse(path, &text)
}

/// Parses and validates `text`, the content of the file `path` (named in errors).
pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
    let doc = toml_edit::Document::parse(text).map_err(|e| ConfigError::Syntax {
        path: path.to_path_buf(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let p = Parser { path, text };
    let mut config = Config {
        path: path.to_path_buf(),
        ..Config::default()
    };
    let root = doc.as_table();
    for (name, item) in root.iter() {
        let key = root.key(name);
        match name {
            "serve" | "policy" => {
                let table = item.as_table_like().ok_or_else(|| {
                    p.invalid(
                        key.and_then(|k| k.span()),
                        name.to_string(),
                        format!("must be a table ([{name}])"),
                    )
                })?;
                if name == "serve" {
                    config.serve = p.serve(table)?;
                } else {
                    config.policy = p.policy(table)?;
                }
            }
            _ if item.is_table_like() => {
                return Err(p.invalid(
                    item.span().or_else(|| key.and_then(|k| k.span())),
                    format!("[{name}]"),
                    "unknown table (allowed: [serve], [policy])".to_string(),
                ))
            }
            _ => {
                return Err(p.invalid(
                    key.and_then(|k| k.span()),
                    name.to_string(),
                    "a key outside any table: put it under [serve] or [policy]".to_string(),
                ))
            }
        }
    }
    Ok(config)
}

/// The mode of a config file `persist` creates (an existing one keeps its mode, owner and
/// group).
pub const NEW_FILE_MODE: u32 = 0o644;

/// Sets each `(name, value)` in the config file at `path`: `[policy].name` for a live
/// parameter, `[serve].mode` for `mode`. The values are checked first, and the file as a whole
/// after (parameters that constrain each other); the rest of the file (comments, other keys,
/// layout) is kept. Written atomically (temporary file, fsync, rename), so a crash leaves the
/// old file or the new one; a missing file is created (mode [`NEW_FILE_MODE`]). A symlink at
/// `path` is refused rather than replaced or written through.
pub fn persist<N: AsRef<str>, V: AsRef<str>>(
    path: &Path,
    settings: &[(N, V)],
) -> Result<(), ConfigError> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(ConfigError::Io {
                path: path.to_path_buf(),
                action: "read config file",
                source,
            })
        }
    };
    let mut new = old.unwrap_or_default();
    for (name, value) in settings {
        new = set_in_text(path, &new, name.as_ref(), value.as_ref())?;
    }
    parse(path, &new)?;
    use crate::atomic_file::{replace, Durability, Perms};
    replace(
        path,
        new.as_bytes(),
        Durability::Synced,
        Perms::Keep { new: NEW_FILE_MODE },
    )
    .map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        action: "write config file",
        source,
    })
}

/// [`persist`] of one value without the I/O: `text` with `name` set to `value`. The value is
/// validated, and the result's syntax; [`parse`] checks the whole (as [`persist`] does, once
/// every value is in).
pub fn set_in_text(
    path: &Path,
    text: &str,
    name: &str,
    value: &str,
) -> Result<String, ConfigError> {
    let (table_name, value) = if name == "mode" {
        let mode = Mode::from_str(value.trim()).map_err(|e| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: None,
            key: "[serve] mode".to_string(),
            message: format!("invalid value '{value}': {e}"),
        })?;
        ("serve", Value::from(mode.name()))
    } else {
        tunables::validate(name, value).map_err(|e| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: None,
            key: format!("[policy] {name}"),
            message: param_message(&e),
        })?;
        ("policy", toml_value(value.trim()))
    };
    let mut doc: toml_edit::DocumentMut =
        text.parse()
            .map_err(|e: toml_edit::TomlError| ConfigError::Syntax {
                path: path.to_path_buf(),
                message: e.to_string().trim_end().to_string(),
            })?;
    let root = doc.as_table_mut();
    if !root.contains_key(table_name) {
        root.insert(table_name, Item::Table(Table::new()));
    }
    let table = root[table_name]
        .as_table_like_mut()
        .ok_or_else(|| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: None,
            key: table_name.to_string(),
            message: format!("must be a table ([{table_name}])"),
        })?;
    let mut value = value;
    match table.get_mut(name) {
        Some(Item::Value(old)) => {
            // Keep the whitespace and the comment on the same line.
            *value.decor_mut() = old.decor().clone();
            *old = value;
        }
        _ => {
            table.insert(name, Item::Value(value));
        }
    }
    Ok(doc.to_string())
}

/// A [`ParamError`] without the parameter's name (the error already names the key).
fn param_message(e: &ParamError) -> String {
    match e {
        ParamError::Unknown { known, .. } => format!("unknown parameter (known: {known})"),
        ParamError::Invalid { value, allowed, .. } => {
            format!("invalid value '{value}': allowed {allowed}")
        }
        e @ ParamError::Conflict { .. } => e.to_string(),
    }
}

struct Parser<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Parser<'_> {
    fn invalid(
        &self,
        span: Option<std::ops::Range<usize>>,
        key: String,
        message: String,
    ) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            line: span.map(|s| line_of(self.text, s.start)),
            key,
            message,
        }
    }

    fn serve(&self, table: &dyn TableLike) -> Result<ServeConfig, ConfigError> {
        let mut s = ServeConfig::default();
        for (name, item) in table.iter() {
            let span = span_of(table, name, item);
            let key = format!("[serve] {name}");
            let info = SERVE_KEYS.iter().find(|k| k.name == name).ok_or_else(|| {
                let known: Vec<_> = SERVE_KEYS.iter().map(|k| k.name).collect();
                self.invalid(
                    span.clone(),
                    key.clone(),
                    format!(
                        "unknown key{} (allowed: {})",
                        did_you_mean(name, &known),
                        known.join(", ")
                    ),
                )
            })?;
            let value = info
                .parse_item(item)
                .map_err(|message| self.invalid(span.clone(), key, message))?;
            info.set(&mut s, value);
        }
        Ok(s)
    }

    fn policy(&self, table: &dyn TableLike) -> Result<Vec<(String, String)>, ConfigError> {
        let mut policy = Vec::new();
        let mut spans = Vec::new();
        for (name, item) in table.iter() {
            let span = span_of(table, name, item);
            let key = format!("[policy] {name}");
            let bad = |what: String| self.invalid(span.clone(), key.clone(), what);
            if name == "mode" {
                return Err(bad(
                    "the mode is set in [serve] (mode = \"writeback\", ...), not in [policy]"
                        .to_string(),
                ));
            }
            let value = match item.as_value() {
                Some(Value::Integer(n)) => n.value().to_string(),
                Some(Value::String(s)) => s.value().trim().to_string(),
                _ => {
                    let info = tunables::info(name).map_err(|e| bad(param_message(&e)))?;
                    let shown = item
                        .as_value()
                        .map(|v| v.to_string().trim().to_string())
                        .unwrap_or_else(|| "a table".to_string());
                    return Err(bad(format!(
                        "invalid value {shown}: allowed {}",
                        info.allowed
                    )));
                }
            };
            tunables::validate(name, &value).map_err(|e| {
                let known: Vec<_> = PARAMS.iter().map(|p| p.name).collect();
                match e {
                    ParamError::Unknown { .. } => bad(format!(
                        "unknown parameter{} (known: {})",
                        did_you_mean(name, &known),
                        known.join(", ")
                    )),
                    e => bad(param_message(&e)),
                }
            })?;
            policy.push((name.to_string(), value));
            spans.push(span);
        }
        // Values that constrain each other, as the file leaves them (over the defaults), in
        // whatever order the file has them; the error points at the later of the two keys.
        if let Err(e @ ParamError::Conflict { below, above, .. }) = tunables::validate_all(&policy)
        {
            let (i, name) = policy
                .iter()
                .enumerate()
                .rev()
                .find(|(_, (n, _))| n == below || n == above)
                .map(|(i, (n, _))| (i, n.clone()))
                .expect("a conflict involves a key of the file");
            return Err(self.invalid(spans[i].clone(), format!("[policy] {name}"), e.to_string()));
        }
        Ok(policy)
    }
}

/// Where the key `name` (else its value) is in the parsed text.
fn span_of(table: &dyn TableLike, name: &str, item: &Item) -> Option<std::ops::Range<usize>> {
    table
        .key(name)
        .and_then(|k| k.span())
        .or_else(|| item.span())
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// ", did you mean 'x'?" when one known name is close to `name` (a typo), else "".
fn did_you_mean(name: &str, known: &[&str]) -> String {
    let best = known
        .iter()
        .map(|k| (edit_distance(name, k), *k))
        .min()
        .filter(|(d, k)| *d <= 2.max(k.len() / 4) || k.starts_with(name) || name.starts_with(k));
    match best {
        Some((_, k)) => format!(", did you mean '{k}'?"),
        None => String::new(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(row[j + 1])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// Width of the example file's comment lines.
const WIDTH: usize = 96;

/// `text` as `# ` comment lines of at most [`WIDTH`] columns.
fn comment(out: &mut String, text: &str) {
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > WIDTH && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

/// One documented key of the example file.
fn entry(out: &mut String, doc: &str, default: &str, allowed: &str, line: &str) {
    out.push('\n');
    comment(out, doc);
    comment(out, &format!("Default: {default}. Allowed: {allowed}."));
    out.push_str(line);
    out.push('\n');
}

/// A parameter's value as TOML: an integer if it is one, else a string.
fn toml_value(v: &str) -> Value {
    match v.parse::<i64>() {
        Ok(n) => Value::from(n),
        Err(_) => Value::from(v),
    }
}

/// The content of the repository's `flashtier.example.toml`: every `[serve]` key and every live
/// parameter, with its meaning, default and allowed values.
pub fn example() -> String {
    let mut out = String::new();
    out.push_str(
        "# flashtier configuration: `flashtier serve --config FILE`.\n\
         #\n\
         # Every key is optional; an absent key takes the default shown. Options given on the\n\
         # command line override the file. Check a file with `flashtier config check FILE`.\n\
         # Generated from the code's documentation of each key (a test keeps the two equal).\n\
         \n\
         # The `flashtier serve` options, named like its flags with '_' for '-' (see\n\
         # `flashtier serve --help`). They apply when the server starts.\n\
         [serve]\n",
    );
    for k in SERVE_KEYS {
        let line = match k.example {
            Example::Set(v) => format!("{} = {v}", k.name),
            Example::Commented(v) => format!("# {} = {v}", k.name),
            Example::Default => format!("# {} = {}", k.name, k.default),
        };
        entry(&mut out, &k.file_doc(), k.default, k.allowed, &line);
    }
    out.push_str(
        "\n\
         # Live parameters: applied when the server starts, and changeable while it serves with\n\
         # `flashtier set NAME VALUE` (`--persist` also writes the value here); `flashtier get\n\
         # --all` shows the current values. The values below are the defaults.\n\
         [policy]\n",
    );
    for p in PARAMS {
        let line = format!("{} = {}", p.name, toml_value(p.default));
        entry(&mut out, p.doc, p.default, p.allowed, &line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path() -> &'static Path {
        Path::new("/etc/flashtier.toml")
    }

    fn err(text: &str) -> String {
        parse(path(), text).unwrap_err().to_string()
    }

    const FULL: &str = r#"
# A comment.
[serve]
backing = "/dev/sdb"
cache = "/dev/nvme0n1p1"
listen = "/run/flashtier/nbd.sock"
tls = "require"
tls_certificates = "/etc/flashtier/pki"
tls_psk = "/etc/flashtier/keys.psk"
tls_verify_peer = true
mode = "write-through"
export_name = "db"
read_only = false
direct = true
threads = 8
max_connections = 65536
handshake_timeout = 5
request_memory_mib = 2048
request_memory_per_connection_mib = 32
worker_pool = 0
shutdown_grace = 0
control_socket = "/run/flashtier/control.sock"
metrics_listen = ":9633"
stats_file = "/run/flashtier/stats"
trace = "/var/lib/flashtier/db.trace"
endurance_tbw = 600
ram_cache = "512MiB"
ram_cache_policy = "fifo"
memcached = "10.0.0.5:11211, 10.0.0.6:11211"
memcached_mode = "victim"
memcached_timeout_ms = 20

[policy]
reclaim_policy = "fifo"
reclaim_compact_pct = 25
sequential_cutoff_read_kib = 1024
sequential_cutoff_write_kib = "512"
promotion = "nhit"
promotion_nhit = 3
promotion_window_secs = 60
writeback_controller = "off"
writeback_dirty_target_pct = 20
writeback_dirty_high_pct = 80
writeback_dirty_low_pct = 40
writeback_max_age_secs = 30
writeback_idle_delay_ms = 500
writeback_rate_max_kib = 2048
writeback_order = "lru"
writeback_max_inflight = 8
writeback_max_io_kib = 512
"#;

    #[test]
    fn every_documented_key_is_read() {
        let c = parse(path(), FULL).unwrap();
        let expected = ServeConfig {
            backing: Some("/dev/sdb".into()),
            cache: Some("/dev/nvme0n1p1".into()),
            listen: Some("/run/flashtier/nbd.sock".into()),
            tls: Some("require".into()),
            tls_certificates: Some("/etc/flashtier/pki".into()),
            tls_psk: Some("/etc/flashtier/keys.psk".into()),
            tls_verify_peer: Some(true),
            mode: Some("writethrough".into()),
            export_name: Some("db".into()),
            read_only: Some(false),
            direct: Some(true),
            threads: Some(8),
            max_connections: Some(65536),
            handshake_timeout: Some(5),
            request_memory_mib: Some(2048),
            request_memory_per_connection_mib: Some(32),
            worker_pool: Some(0),
            shutdown_grace: Some(0),
            control_socket: Some("/run/flashtier/control.sock".into()),
            metrics_listen: Some(":9633".into()),
            stats_file: Some("/run/flashtier/stats".into()),
            trace: Some("/var/lib/flashtier/db.trace".into()),
            endurance_tbw: Some(600.0),
            ram_cache: Some("512M".into()),
            ram_cache_policy: Some("fifo".into()),
            memcached: Some("10.0.0.5:11211,10.0.0.6:11211".into()),
            memcached_mode: Some("victim".into()),
            memcached_timeout_ms: Some(20),
        };
        assert_eq!(c.serve, expected);
        assert_eq!(c.path, path());
        let policy: Vec<(&str, &str)> = c
            .policy
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            policy,
            [
                ("reclaim_policy", "fifo"),
                ("reclaim_compact_pct", "25"),
                ("sequential_cutoff_read_kib", "1024"),
                ("sequential_cutoff_write_kib", "512"),
                ("promotion", "nhit"),
                ("promotion_nhit", "3"),
                ("promotion_window_secs", "60"),
                ("writeback_controller", "off"),
                ("writeback_dirty_target_pct", "20"),
                ("writeback_dirty_high_pct", "80"),
                ("writeback_dirty_low_pct", "40"),
                ("writeback_max_age_secs", "30"),
                ("writeback_idle_delay_ms", "500"),
                ("writeback_rate_max_kib", "2048"),
                ("writeback_order", "lru"),
                ("writeback_max_inflight", "8"),
                ("writeback_max_io_kib", "512"),
            ]
        );
        // Every key the tables document is in this test's file.
        for k in SERVE_KEYS {
            assert!(
                FULL.contains(&format!("\n{} = ", k.name)),
                "{} untested",
                k.name
            );
        }
        for p in PARAMS {
            assert!(
                FULL.contains(&format!("\n{} = ", p.name)),
                "{} untested",
                p.name
            );
        }
        // entries() shows every set key.
        assert!(c.serve.entries().iter().all(|(_, v)| v.is_some()));
        assert_eq!(c.serve.entries()[11].1.as_deref(), Some("8"));
        assert_eq!(c.serve.entries()[0].1.as_deref(), Some("\"/dev/sdb\""));
        // An empty file is a valid config that sets nothing.
        assert_eq!(parse(path(), "").unwrap().serve, ServeConfig::default());
    }

    #[test]
    fn every_key_round_trips_through_persist() {
        // Each parameter at a non-default allowed value, persisted into an empty file, a file
        // with other keys, and over an existing value, loads back as set.
        let values = [
            ("reclaim_policy", "fifo"),
            ("reclaim_compact_pct", "0"),
            ("sequential_cutoff_read_kib", "1048576"),
            ("sequential_cutoff_write_kib", "0"),
            ("promotion", "nhit"),
            ("promotion_nhit", "255"),
            ("promotion_window_secs", "86400"),
            ("writeback_controller", "off"),
            ("writeback_dirty_target_pct", "100"),
            ("writeback_dirty_high_pct", "100"),
            ("writeback_dirty_low_pct", "99"),
            ("writeback_max_age_secs", "86400"),
            ("writeback_idle_delay_ms", "3600000"),
            ("writeback_rate_max_kib", "16777216"),
            ("writeback_order", "lru"),
            ("writeback_max_inflight", "64"),
            ("writeback_max_io_kib", "16384"),
        ];
        assert_eq!(values.len(), PARAMS.len(), "a parameter is missing here");
        let mut text = String::new();
        for (name, value) in values {
            text = set_in_text(path(), &text, name, value).unwrap();
            let c = parse(path(), &text).unwrap();
            assert!(
                c.policy.contains(&(name.to_string(), value.to_string())),
                "{text}"
            );
        }
        for p in PARAMS {
            text = set_in_text(path(), &text, p.name, p.default).unwrap();
        }
        let c = parse(path(), &text).unwrap();
        for p in PARAMS {
            assert!(c
                .policy
                .contains(&(p.name.to_string(), p.default.to_string())));
        }
        assert_eq!(
            c.policy.len(),
            PARAMS.len(),
            "a key was duplicated:\n{text}"
        );
        // Numbers are written as TOML integers, words as strings.
        assert!(text.contains("promotion_nhit = 2\n"), "{text}");
        assert!(text.contains("promotion = \"auto\"\n"), "{text}");
        for m in Mode::ALL {
            let t = set_in_text(path(), &text, "mode", &m.name().to_uppercase()).unwrap();
            assert_eq!(
                parse(path(), &t).unwrap().serve.mode.as_deref(),
                Some(m.name())
            );
        }
    }

    #[test]
    fn persist_keeps_comments_and_other_keys_and_writes_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("flashtier.toml");
        let original = "# Top comment.\n\
                        [serve]\n\
                        backing = \"/dev/sdb\"   # the slow disk\n\
                        \n\
                        # Policy comment.\n\
                        [policy]\n\
                        # About the cutoff.\n\
                        sequential_cutoff_read_kib = 4096  # trailing\n\
                        promotion = \"always\"\n";
        std::fs::write(&file, original).unwrap();
        persist(&file, &[("sequential_cutoff_read_kib", "1024")]).unwrap();
        persist(&file, &[("promotion_nhit", "4")]).unwrap();
        persist(&file, &[("mode", "wt")]).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        for kept in [
            "# Top comment.\n",
            "backing = \"/dev/sdb\"   # the slow disk\n",
            "# Policy comment.\n",
            "# About the cutoff.\nsequential_cutoff_read_kib = 1024  # trailing\n",
            "promotion = \"always\"\n",
            "promotion_nhit = 4\n",
            "mode = \"writethrough\"\n",
        ] {
            assert!(text.contains(kept), "lost {kept:?}:\n{text}");
        }
        let c = load(&file).unwrap();
        assert_eq!(c.serve.mode.as_deref(), Some("writethrough"));
        assert_eq!(c.serve.backing.as_deref(), Some("/dev/sdb"));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["flashtier.toml"]);

        // A missing file is created.
        let new = dir.path().join("new.toml");
        persist(&new, &[("promotion", "nhit")]).unwrap();
        assert_eq!(
            load(&new).unwrap().policy,
            [("promotion".to_string(), "nhit".to_string())]
        );

        // Bad values and names are refused and leave the file as it was.
        let before = std::fs::read_to_string(&file).unwrap();
        for (name, value, says) in [
            ("promotion_nhit", "0", "allowed 1..=255"),
            ("sequential_cutoff", "1", "known: reclaim_policy"),
            ("mode", "fast", "writeback"),
        ] {
            let e = persist(&file, &[(name, value)]).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("flashtier.toml"), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&file).unwrap(), before);
        // A file that is not TOML is not overwritten.
        std::fs::write(&file, "[policy\n").unwrap();
        let e = persist(&file, &[("promotion", "nhit")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid TOML"), "{e}");
        // A directory that does not exist is an error naming the file.
        let e = persist(&dir.path().join("no/such.toml"), &[("promotion", "nhit")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no/such.toml"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_naming_the_file_line_key_and_what_is_allowed() {
        let cases: &[(&str, &[&str])] = &[
            (
                "[serve]\nthreads = 0\n",
                &[":2:", "[serve] threads", "1..=1024"],
            ),
            ("[serve]\n\nthreads = 1025\n", &[":3:", "1..=1024"]),
            (
                "[serve]\nthreads = \"8\"\n",
                &["[serve] threads", "1..=1024"],
            ),
            (
                "[serve]\nmax_connections = 65537\n",
                &["max_connections", "1..=65536"],
            ),
            (
                "[serve]\nshutdown_grace = -1\n",
                &["shutdown_grace", "0 or more"],
            ),
            (
                "[serve]\nmode = \"fast\"\n",
                &["[serve] mode", "\"fast\"", "writethrough"],
            ),
            (
                "[serve]\nread_only = \"yes\"\n",
                &["read_only", "true | false"],
            ),
            ("[serve]\nbacking = 3\n", &["backing", "string"]),
            ("[serve]\ncache = \"\"\n", &["cache", "non-empty"]),
            (
                "[serve]\nmetrics_listen = \"localhost\"\n",
                &["metrics_listen", "[HOST]:PORT"],
            ),
            ("[serve]\nendurance_tbw = 0\n", &["endurance_tbw", "> 0"]),
            ("[serve]\nendurance_tbw = nan\n", &["endurance_tbw", "> 0"]),
            (
                "[policy]\npromotion_nhit = 0\n",
                &[":2:", "[policy] promotion_nhit", "'0'", "allowed 1..=255"],
            ),
            (
                "[policy]\nsequential_cutoff_read_kib = 2000000\n",
                &["sequential_cutoff_read_kib", "0..=1048576"],
            ),
            (
                "[policy]\npromotion = \"sometimes\"\n",
                &["always | nhit | auto"],
            ),
            (
                "[policy]\npromotion = true\n",
                &["promotion", "always | nhit | auto"],
            ),
            ("[policy]\nreclaim_policy = [\"lru\"]\n", &["fifo | lru"]),
            (
                "[policy]\nmode = \"writeback\"\n",
                &["[policy] mode", "[serve]"],
            ),
        ];
        for (text, says) in cases {
            let e = err(text);
            assert!(e.starts_with("/etc/flashtier.toml"), "{text:?}: {e}");
            for s in *says {
                assert!(e.contains(s), "{text:?}: {e:?} does not say {s:?}");
            }
        }
    }

    /// `ram_cache` takes a size of at least one block and writes it canonically;
    /// `ram_cache_policy` takes the RAM tier's eviction orders.
    #[test]
    fn ram_cache_keys_take_sizes_and_policies() {
        let key = |name: &str| SERVE_KEYS.iter().find(|k| k.name == name).unwrap();
        for (given, canonical) in [
            ("64M", "64M"),
            ("64MiB", "64M"),
            ("67108864", "64M"),
            (" 1g ", "1G"),
            ("4096", "4K"),
            ("1536K", "1536K"),
            ("5000", "5000"),
            ("2T", "2T"),
        ] {
            let text = format!("[serve]\nram_cache = \"{given}\"\n");
            let c = parse(path(), &text).unwrap_or_else(|e| panic!("{given}: {e}"));
            assert_eq!(c.serve.ram_cache.as_deref(), Some(canonical), "{given}");
            assert_eq!(
                key("ram_cache").parse_arg(given),
                Ok(OptValue::Text(canonical.into()))
            );
        }
        for bad in ["0", "lots", "4095", "-1M", "99999999999T"] {
            let e = err(&format!("[serve]\nram_cache = \"{bad}\"\n"));
            for says in [
                ":2:",
                "[serve] ram_cache",
                bad,
                "allowed a size of 4K or more",
            ] {
                assert!(e.contains(says), "{bad}: {e:?} does not say {says:?}");
            }
            let e = key("ram_cache").parse_arg(bad).unwrap_err();
            assert!(e.contains("4K or more"), "{bad}: {e}");
        }
        let e = err("[serve]\nram_cache = 4096\n");
        assert!(e.contains("ram_cache") && e.contains("string"), "{e}");

        for policy in ["lru", "fifo", " fifo "] {
            let text = format!("[serve]\nram_cache_policy = \"{policy}\"\n");
            let c = parse(path(), &text).unwrap();
            assert_eq!(c.serve.ram_cache_policy.as_deref(), Some(policy.trim()));
        }
        let e = err("[serve]\nram_cache_policy = \"random\"\n");
        for says in [
            ":2:",
            "[serve] ram_cache_policy",
            "\"random\"",
            "allowed lru | fifo",
        ] {
            assert!(e.contains(says), "{e:?} does not say {says:?}");
        }
        let e = key("ram_cache_policy").parse_arg("random").unwrap_err();
        assert_eq!(e, "allowed lru | fifo");

        // No RAM tier unless asked; LRU when there is one.
        let d = ServeConfig::default().with_defaults();
        assert_eq!(d.ram_cache, None);
        assert_eq!(d.ram_cache_policy.as_deref(), Some("lru"));
        let help = key("ram_cache").help_doc();
        assert!(
            help.contains("--cache") && help.contains("--memcached"),
            "{help}"
        );
        assert!(help.ends_with("[default: none, no RAM tier]"), "{help}");
        assert!(key("memcached_mode").help_doc().contains("--ram-cache"));
    }

    #[test]
    fn watermarks_are_checked_together_in_any_order() {
        for (text, line, key, says) in [
            (
                "[policy]\nwriteback_dirty_low_pct = 80\nwriteback_dirty_high_pct = 10\n",
                ":3:",
                "[policy] writeback_dirty_high_pct",
                "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (10)",
            ),
            (
                "[policy]\nwriteback_dirty_high_pct = 10\n\nwriteback_dirty_low_pct = 80\n",
                ":4:",
                "[policy] writeback_dirty_low_pct",
                "writeback_dirty_low_pct (80) must be below writeback_dirty_high_pct (10)",
            ),
            (
                "[policy]\nwriteback_dirty_low_pct = 80\n",
                ":2:",
                "[policy] writeback_dirty_low_pct",
                "(80) must be below writeback_dirty_high_pct (70, the default)",
            ),
        ] {
            let e = err(text);
            for s in [line, key, says] {
                assert!(e.contains(s), "{text:?}: {e:?} does not say {s:?}");
            }
        }
        for ok in [
            "[policy]\nwriteback_dirty_low_pct = 80\nwriteback_dirty_high_pct = 90\n",
            "[policy]\nwriteback_dirty_high_pct = 90\nwriteback_dirty_low_pct = 80\n",
        ] {
            parse(path(), ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }

        // persist: a value that would leave the file invalid is refused and changes nothing;
        // both at once are written.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("flashtier.toml");
        std::fs::write(&file, "[policy]\nwriteback_dirty_high_pct = 60\n").unwrap();
        let e = persist(&file, &[("writeback_dirty_low_pct", "80")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flashtier.toml") && e.contains("(80) must be below") && e.contains("(60)"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "[policy]\nwriteback_dirty_high_pct = 60\n"
        );
        persist(
            &file,
            &[
                ("writeback_dirty_low_pct", "80"),
                ("writeback_dirty_high_pct", "90"),
            ],
        )
        .unwrap();
        let policy = load(&file).unwrap().policy;
        assert!(policy.contains(&("writeback_dirty_low_pct".into(), "80".into())));
        assert!(policy.contains(&("writeback_dirty_high_pct".into(), "90".into())));
    }

    #[test]
    fn unknown_tables_and_keys_are_refused() {
        let cases: &[(&str, &[&str])] = &[
            (
                "[serve]\nbacking = \"/x\"\nthread = 4\n",
                &[
                    ":3:",
                    "[serve] thread",
                    "unknown key",
                    "did you mean 'threads'",
                    "max_connections",
                ],
            ),
            (
                "[policy]\nsequential_cutoff = 4\n",
                &[
                    ":2:",
                    "unknown parameter",
                    "did you mean",
                    "sequential_cutoff_read_kib",
                ],
            ),
            (
                "[policy]\nfrobnicate = 4\n",
                &["unknown parameter (known: reclaim_policy"],
            ),
            (
                "# x\n[sever]\nthreads = 1\n",
                &[":2:", "[sever]", "unknown table", "[serve], [policy]"],
            ),
            (
                "threads = 4\n",
                &[":1:", "threads", "outside any table", "[serve]"],
            ),
            ("serve = 4\n", &["serve", "must be a table"]),
            (
                "[[policy]]\npromotion = \"nhit\"\n",
                &["policy", "must be a table"],
            ),
            ("[serve.extra]\nx = 1\n", &["[serve] extra", "unknown key"]),
            (
                "[serve]\nthreads = 4\nthreads = 5\n",
                &["not valid TOML", "line 3"],
            ),
            (
                "[policy\n",
                &["/etc/flashtier.toml: not valid TOML", "line 1"],
            ),
        ];
        for (text, says) in cases {
            let e = err(text);
            for s in *says {
                assert!(e.contains(s), "{text:?}: {e:?} does not say {s:?}");
            }
        }
        // Inline tables and dotted keys are TOML too.
        let c = parse(
            path(),
            "serve = { threads = 4 }\npolicy.promotion = \"nhit\"\n",
        )
        .unwrap();
        assert_eq!(c.serve.threads, Some(4));
        assert_eq!(c.policy, [("promotion".into(), "nhit".into())]);
        let e = load(Path::new("/nonexistent/flashtier.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/flashtier.toml"), "{e}");
    }

    /// The repository's example file is [`example`]'s output: every key and parameter with its
    /// current documentation and default. `FLASHTIER_BLESS=1 cargo test` rewrites it.
    #[test]
    fn the_example_file_documents_every_key_and_loads() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../flashtier.example.toml");
        let expected = example();
        if std::env::var_os("FLASHTIER_BLESS").is_some() {
            std::fs::write(&file, &expected).unwrap();
        }
        let actual = std::fs::read_to_string(&file).unwrap_or_default();
        for p in PARAMS {
            let line = format!("\n{} = {}\n", p.name, toml_value(p.default));
            assert!(
                actual.contains(&line),
                "{file:?} lacks {line:?} (regenerate it: FLASHTIER_BLESS=1 cargo test -p \
                 flashtier-control the_example_file)"
            );
        }
        assert!(
            actual == expected,
            "{file:?} is out of date with the documentation of the keys and parameters \
             (regenerate it: FLASHTIER_BLESS=1 cargo test -p flashtier-control the_example_file)"
        );
        let c = load(&file).unwrap();
        assert_eq!(c.policy.len(), PARAMS.len());
        for p in PARAMS {
            assert!(c
                .policy
                .contains(&(p.name.to_string(), p.default.to_string())));
            assert!(
                expected.contains(p.allowed),
                "{} range not documented",
                p.name
            );
        }
        for k in SERVE_KEYS {
            assert!(
                expected.contains(&format!("\n{} = ", k.name))
                    || expected.contains(&format!("\n# {} = ", k.name))
            );
        }
        // The commented-out lines are valid settings too.
        let uncommented: String = expected
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest
                        .split_once(" = ")
                        .is_some_and(|(k, _)| SERVE_KEYS.iter().any(|s| s.name == k)) =>
                {
                    rest
                }
                _ => l,
            })
            .collect::<Vec<_>>()
            .join("\n");
        let c = parse(&file, &uncommented).unwrap();
        assert!(
            c.serve.entries().iter().all(|(_, v)| v.is_some()),
            "{uncommented}"
        );
    }

    /// Each `[serve]` entry agrees with itself and with its field: a unique name and a doc; a
    /// default that is a value parses and passes the entry's own check, and one that only
    /// describes what applies does not look like one; the allowed text is what the check takes;
    /// every value the example shows passes; and every value round-trips through the field, the
    /// config file (parse, then `entries` rendering it back) and the command line parser.
    #[test]
    fn every_serve_key_is_consistent() {
        for (i, k) in SERVE_KEYS.iter().enumerate() {
            assert!(
                SERVE_KEYS[..i].iter().all(|o| o.name != k.name),
                "{} twice",
                k.name
            );
            assert!(
                k.doc.ends_with('.') && !k.doc.contains("{ "),
                "{}: doc",
                k.name
            );
            for doc in [k.file_doc(), k.help_doc()] {
                assert!(
                    !doc.contains('{'),
                    "{}: a reference to no option: {doc}",
                    k.name
                );
            }
            match (k.default_is_value, k.default_value()) {
                (true, None) => panic!("{}: default {} does not parse", k.name, k.default),
                (false, Some(v)) => panic!("{}: default {} looks like {v:?}", k.name, k.default),
                _ => {}
            }
            match k.kind {
                Kind::Int { lo, hi } if k.name != "shutdown_grace" => {
                    assert_eq!(k.allowed, format!("{lo}..={hi}"), "{}", k.name);
                    assert!(k.parse_arg(&(hi + 1).to_string()).is_err(), "{}", k.name);
                }
                Kind::Flag => assert_eq!(k.allowed, "true | false"),
                Kind::Text {
                    check: Some(check), ..
                } if k.allowed.contains(" | ") => {
                    for word in k.allowed.split(" | ") {
                        assert_eq!(check(word).as_deref(), Some(word), "{}", k.name);
                    }
                }
                _ => {}
            }
            let example = match k.example {
                Example::Set(v) | Example::Commented(v) => v,
                Example::Default => k.default,
            };
            let mut values: Vec<_> = k.default_value().into_iter().collect();
            let text = format!("[serve]\n{} = {example}\n", k.name);
            let from_file = parse(path(), &text).unwrap_or_else(|e| panic!("{e}"));
            values.push(k.get(&from_file.serve).expect("the example sets it"));
            for v in values {
                let mut c = ServeConfig::default();
                k.set(&mut c, v.clone());
                assert_eq!(k.get(&c), Some(v.clone()), "{}: the field holds it", k.name);
                let (_, shown) = c
                    .entries()
                    .into_iter()
                    .find(|(e, _)| e.name == k.name)
                    .unwrap();
                let text = format!("[serve]\n{} = {}\n", k.name, shown.unwrap());
                assert_eq!(parse(path(), &text).unwrap().serve, c, "{text}");
                if !matches!(k.kind, Kind::Flag) {
                    assert_eq!(k.parse_arg(&v.plain()), Ok(v), "{}: command line", k.name);
                }
            }
        }
        // The defaults in force, and the command line over the file.
        let d = ServeConfig::default().with_defaults();
        assert_eq!(d.threads, Some(16));
        assert_eq!(d.tls.as_deref(), Some("off"));
        assert_eq!(d.export_name.as_deref(), Some("flashtier"));
        assert_eq!((d.backing, d.read_only), (None, Some(false)));
        let file = ServeConfig {
            threads: Some(8),
            backing: Some("/a".into()),
            ..ServeConfig::default()
        };
        let cli = ServeConfig {
            backing: Some("/b".into()),
            ..ServeConfig::default()
        };
        let o = file.overridden_by(&cli);
        assert_eq!((o.threads, o.backing.as_deref()), (Some(8), Some("/b")));
    }

    #[test]
    fn line_numbers_and_suggestions() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 99), 3);
        assert_eq!(
            did_you_mean("threds", &["threads", "direct"]),
            ", did you mean 'threads'?"
        );
        assert_eq!(did_you_mean("zzzzzzz", &["threads", "direct"]), "");
    }
}

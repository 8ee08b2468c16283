//! # flashtier-nbd: the Network Block Device protocol, both ends
//!
//! flashtier is reached through NBD: the Linux kernel client, qemu, libnbd's tools (nbdinfo,
//! nbdcopy, nbdfuse) and fio all speak it. This crate is the protocol and nothing else; it knows
//! nothing about caching. The server exports any [`flashtier_io::BlockDev`] (the engine's cached
//! volume, or a plain file for pass-through), and the client *is* a `BlockDev`, so the backing
//! store can be any NBD server.
//!
//! ## Server
//! - [`handshake`]: fixed newstyle only; options EXPORT_NAME, INFO, GO, LIST, ABORT, STARTTLS,
//!   STRUCTURED_REPLY, LIST/SET_META_CONTEXT (`base:allocation`). Every other option, including
//!   EXTENDED_HEADERS, gets `ERR_UNSUP` with its payload consumed. [`tls`] authenticates clients
//!   with X.509 certificates or pre-shared keys (OpenSSL), optionally or required.
//! - [`transmission`]: READ, WRITE, FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), CACHE,
//!   BLOCK_STATUS, DISC; FUA accepted on every command. Requests are validated once, here, and get
//!   the spec's errno (EINVAL, ENOSPC, EPERM, EIO, ENOTSUP, EOVERFLOW) through the one errno map in
//!   [`errmap`]. Many requests run at once per connection and are answered out of order.
//! - [`server`]: accepts on a unix socket (created 0600) or TCP (loopback unless named), one thread
//!   per connection for the handshake and transmission plus workers spawned on demand, and a
//!   graceful shutdown that answers every request already read, then flushes.
//! - [`limits`]: what one client may cost: request memory budgets (per connection and in all),
//!   a shared worker pool, and the policy for reclaiming connections when a newcomer needs room;
//!   [`deadline`]: one deadline for the whole handshake.
//!
//! `CAN_MULTI_CONN` is advertised: every connection shares one device, and a FLUSH on any of them
//! makes every write that was answered before it durable, because `BlockDev::flush` covers all
//! completed writes.
//!
//! Malformed or hostile input never panics and never affects other clients: the handshake and request parsers
//! are bounded (option payloads ≤ 64 KiB parsed, ≤ 16 MiB drained, then the connection is dropped),
//! a bad request magic drops only that connection, and both parsers are fuzzed (`fuzz/`).

pub mod client;
pub mod deadline;
pub mod errmap;
pub mod export;
pub mod handshake;
pub mod limits;
pub mod net;
mod outbound;
pub mod server;
pub mod tls;
pub mod transmission;
pub mod uri;
pub mod wire;

pub use client::NbdClient;
pub use export::Export;
pub use net::{bind_unix, ListenAddr, Listener};
pub use server::{Server, ServerConfig, ShutdownHandle};
pub use uri::NbdUri;

/// Errors setting up or running a server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid listen address '{0}': {1}")]
    BadListenAddr(String, String),
    #[error("cannot listen on {0}: {1}")]
    Bind(String, #[source] std::io::Error),
    #[error("another server is already listening on {0}")]
    InUse(String),
    #[error("final flush of the device failed: {0}")]
    Flush(#[source] std::io::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Errors connecting the NBD client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid NBD URI '{0}': {1}")]
    BadUri(String, String),
    #[error("cannot connect to NBD server at {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("NBD handshake failed: {0}")]
    Handshake(#[source] std::io::Error),
    #[error("NBD protocol error: {0}")]
    Protocol(String),
    #[error("NBD over TLS: {0}")]
    Tls(String),
    #[error("NBD server refused export '{export}' (error {code}): {message}")]
    Refused {
        export: String,
        code: u32,
        message: String,
    },
}

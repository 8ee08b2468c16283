//! Accepting connections and running each through handshake and transmission, with a graceful
//! shutdown that answers every request already read before the server exits.

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::deadline::DeadlineStream;
use crate::export::Export;
use crate::handshake::{self, Channel, Outcome};
use crate::limits::{now_ms, ConnState, Limits, Policy, Pressure, Reclaim};
use crate::net::{Listener, Stream};
use crate::tls::{ServerTls, TlsIo, TlsMode, TlsStream};
use crate::transmission;
use crate::ServerError;

/// Stack of a connection's thread: it runs the handshake (TLS included) and then serves
/// requests like any worker.
const CONNECTION_STACK: usize = 1024 * 1024;
/// Pressure reports closer together than this reclaim nothing more: the last victim's memory
/// and threads take a moment to come back.
const PRESSURE_INTERVAL_MS: u64 = 100;

/// Tunables of the server. The defaults suit a local database.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest READ/WRITE payload accepted and advertised (at least 32 MiB per our contract).
    pub max_payload: u32,
    /// Requests executing at once per connection.
    pub threads_per_connection: usize,
    /// A client that has not finished the handshake (TLS included) this long after it connected
    /// is dropped.
    pub handshake_timeout: Duration,
    /// Connections served at once. When all are taken, a new client gets the slot of one that
    /// [`Policy`] says may be reclaimed, else it is refused.
    pub max_connections: usize,
    /// Bytes of request payload (READ replies, WRITE data) in flight, server-wide.
    pub request_memory: u64,
    /// Bytes of request payload in flight per connection.
    pub request_memory_per_connection: u64,
    /// Threads beyond each connection's own, server-wide.
    pub worker_pool: usize,
    /// When a connection may be reclaimed to make room.
    pub reclaim: Policy,
    /// TLS credentials and mode; None: TLS off.
    pub tls: Option<Arc<ServerTls>>,
    /// On shutdown, how long to wait for clients to take the replies to requests already
    /// executed before closing their connections anyway.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_payload: 32 * 1024 * 1024,
            // As `flashtier serve --threads` (its config table in flashtier-control).
            threads_per_connection: 16,
            handshake_timeout: Duration::from_secs(10),
            max_connections: 256,
            request_memory: 1 << 30,
            request_memory_per_connection: 64 << 20,
            worker_pool: 512,
            reclaim: Policy::default(),
            tls: None,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// Serves one export until shut down.
pub struct Server {
    export: Arc<Export>,
    config: ServerConfig,
    state: Arc<State>,
}

struct State {
    shutting_down: AtomicBool,
    /// Wakes the accept loop: written on shutdown, polled beside the listener.
    wake: (std::os::fd::OwnedFd, std::os::fd::OwnedFd),
    connections: Mutex<HashMap<u64, Conn>>,
    idle: Condvar,
    next_id: AtomicU64,
    limits: Limits,
    policy: Policy,
    last_pressure_ms: AtomicU64,
}

/// A connection in the server's table.
struct Conn {
    /// A clone of the connection's socket, to shut it down from here.
    stream: Stream,
    state: Arc<ConnState>,
    peer: String,
    /// Reclaimed: its threads are winding down and its slot is free.
    reclaimed: bool,
}

impl State {
    /// Reclaims one connection that `policy` allows, preferring what `why` needs (None: a
    /// connection slot). Returns whether one was.
    fn reclaim(&self, conns: &mut HashMap<u64, Conn>, why: Option<Pressure>) -> bool {
        let now = now_ms();
        let live = conns
            .iter()
            .filter(|(_, c)| !c.reclaimed)
            .map(|(id, c)| (*id, c.state.view()));
        let Some((id, reason, age_ms)) = self.policy.victim(live, now, why) else {
            return false;
        };
        let c = conns.get_mut(&id).expect("victim is in the table");
        c.reclaimed = true;
        c.state.close();
        let _ = c.stream.shutdown(Shutdown::Both);
        let reason = match reason {
            Reclaim::Handshaking => "still in the handshake",
            Reclaim::NeverUsed => "connected but never sent a request",
            Reclaim::Stalled => "not reading its replies",
            Reclaim::Idle => "idle",
        };
        let needed = match why {
            None => "a connection slot",
            Some(Pressure::Memory) => "request memory",
            Some(Pressure::Threads) => "worker threads",
        };
        tracing::warn!(
            id,
            peer = %c.peer,
            reason,
            for_secs = age_ms as f64 / 1000.0,
            "reclaiming a connection: another client needs {needed}"
        );
        true
    }

    /// A budget or the worker pool ran dry: reclaim one stalled connection, at most every
    /// [`PRESSURE_INTERVAL_MS`].
    fn pressure(&self, why: Pressure) {
        let now = now_ms();
        let last = self.last_pressure_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) < PRESSURE_INTERVAL_MS
            || self
                .last_pressure_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let mut conns = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        self.reclaim(&mut conns, Some(why));
    }
}

/// Asks a running server to stop; cheap to clone and safe to use from a signal-handling thread.
#[derive(Clone)]
pub struct ShutdownHandle {
    state: Arc<State>,
}

impl ShutdownHandle {
    /// Stops accepting, stops reading new requests, lets in-flight requests finish and be
    /// answered; [`Server::serve`] then flushes the device and returns.
    pub fn shutdown(&self) {
        if self.state.shutting_down.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: writing one byte to a pipe we own.
        unsafe { libc::write(self.state.wake.1.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }

    pub fn is_shutting_down(&self) -> bool {
        self.state.shutting_down.load(Ordering::SeqCst)
    }
}

impl Server {
    pub fn new(export: Export, config: ServerConfig) -> Result<Server, ServerError> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the two fds we pass.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(ServerError::Io(io::Error::last_os_error()));
        }
        // SAFETY: both fds were just created and are owned by nobody else.
        let wake = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        let state = Arc::new_cyclic(|weak: &std::sync::Weak<State>| {
            let weak = weak.clone();
            State {
                shutting_down: AtomicBool::new(false),
                wake,
                connections: Mutex::new(HashMap::new()),
                idle: Condvar::new(),
                next_id: AtomicU64::new(1),
                limits: Limits::new(
                    config.request_memory,
                    config.request_memory_per_connection,
                    config.worker_pool,
                    Box::new(move |why| {
                        if let Some(state) = weak.upgrade() {
                            state.pressure(why);
                        }
                    }),
                ),
                policy: config.reclaim,
                last_pressure_ms: AtomicU64::new(0),
            }
        });
        Ok(Server {
            export: Arc::new(export),
            config,
            state,
        })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            state: self.state.clone(),
        }
    }

    pub fn export(&self) -> &Export {
        &self.export
    }

    /// Accepts and serves connections until [`ShutdownHandle::shutdown`]; then waits for every
    /// connection to finish its in-flight requests, flushes the device, and returns.
    pub fn serve(&self, listener: Listener) -> Result<(), ServerError> {
        tracing::info!(
            listen = %listener.addr(),
            export = %self.export.name,
            device = %self.export.dev.describe(),
            "serving"
        );
        while !self.state.shutting_down.load(Ordering::SeqCst) {
            if !wait_readable(listener.fd(), self.state.wake.0.as_raw_fd())? {
                continue;
            }
            match listener.accept() {
                Ok((stream, peer)) => self.spawn_connection(stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: keep serving the
                    // others, but do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }

        drop(listener);
        let mut conns = self
            .state
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !conns.is_empty() {
            tracing::info!(
                connections = conns.len(),
                "shutting down: finishing in-flight requests"
            );
        }
        for c in conns.values() {
            // Readers see end-of-stream; requests already read still run and get their replies.
            let _ = c.stream.shutdown(Shutdown::Read);
            if c.state.view().in_handshake {
                // Nothing to answer; a TLS handshake does not notice a read shutdown.
                c.state.close();
                let _ = c.stream.shutdown(Shutdown::Both);
            }
        }
        let deadline = Instant::now() + self.config.shutdown_grace;
        let mut forced = false;
        while !conns.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() && !forced {
                // A client that stopped reading its replies would block the workers writing them
                // forever; its requests have been executed, only their answers are lost.
                tracing::warn!(
                    connections = conns.len(),
                    "clients are not reading their replies; closing them"
                );
                for c in conns.values() {
                    c.state.close();
                    let _ = c.stream.shutdown(Shutdown::Both);
                }
                forced = true;
            }
            let wait = if forced { Duration::from_secs(1) } else { left };
            conns = self
                .state
                .idle
                .wait_timeout(conns, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(conns);
        if !self.export.read_only() {
            self.export.dev.flush().map_err(ServerError::Flush)?;
        }
        tracing::info!("shut down cleanly");
        Ok(())
    }

    fn spawn_connection(&self, stream: Stream, peer: String) {
        let mut conns = self
            .state
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let live = conns.values().filter(|c| !c.reclaimed).count();
        if live >= self.config.max_connections && !self.state.reclaim(&mut conns, None) {
            tracing::warn!(
                peer,
                limit = self.config.max_connections,
                "too many connections, none idle; refusing"
            );
            return;
        }
        let control = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot track connection; refusing");
                return;
            }
        };
        let id = self.state.next_id.fetch_add(1, Ordering::Relaxed);
        let conn_state = Arc::new(ConnState::new(self.config.request_memory_per_connection));
        conns.insert(
            id,
            Conn {
                stream: control,
                state: conn_state.clone(),
                peer: peer.clone(),
                reclaimed: false,
            },
        );
        drop(conns);

        let export = self.export.clone();
        let config = self.config.clone();
        let state = self.state.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .stack_size(CONNECTION_STACK)
            .spawn(move || {
                tracing::debug!(id, peer, "connection opened");
                if let Err(e) = run_connection(&stream, &export, &config, &state, &conn_state) {
                    tracing::info!(id, peer, error = %e, "connection ended with an error");
                }
                let _ = stream.shutdown(Shutdown::Both);
                tracing::debug!(id, "connection closed");
                let mut conns = state.connections.lock().unwrap_or_else(|e| e.into_inner());
                conns.remove(&id);
                state.idle.notify_all();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot spawn connection thread");
            let mut conns = self
                .state
                .connections
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            conns.remove(&id);
        }
    }
}

/// The handshake's channel: plain text under the handshake deadline, upgraded in place by
/// STARTTLS; the TLS handshake and everything after it run under the same deadline.
struct ServerChannel<'a> {
    plain: DeadlineStream<'a>,
    tls: Option<TlsStream>,
    credentials: Option<&'a ServerTls>,
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the TLS upgrade failed")
}

impl io::Read for ServerChannel<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.tls {
            Some(tls) => tls.read_until(buf, Some(self.plain.deadline())),
            None => self.plain.read(buf),
        }
    }
}

impl io::Write for ServerChannel<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.tls {
            Some(tls) => tls.write_until(buf, Some(self.plain.deadline())),
            None => self.plain.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Channel for ServerChannel<'_> {
    fn tls_active(&self) -> bool {
        self.tls.is_some()
    }

    fn start_tls(&mut self) -> io::Result<()> {
        let creds = self.credentials.ok_or_else(broken)?;
        // The ACK was written with blocking I/O; from here on the socket is TLS's.
        self.plain.remaining()?;
        let tls = creds.accept(self.plain.stream(), self.plain.deadline())?;
        tracing::info!(client = tls.peer(), "TLS session established");
        self.tls = Some(tls);
        Ok(())
    }
}

fn run_connection(
    stream: &Stream,
    export: &Export,
    config: &ServerConfig,
    state: &State,
    conn: &ConnState,
) -> io::Result<()> {
    let deadline = Instant::now() + config.handshake_timeout;
    let mut channel = ServerChannel {
        plain: DeadlineStream::new(stream, deadline),
        tls: None,
        credentials: config.tls.as_deref(),
    };
    let options = handshake::Options {
        max_payload: config.max_payload,
        tls: config.tls.as_ref().map_or(TlsMode::Off, |t| t.mode()),
    };
    let session = match handshake::negotiate(&mut channel, export, &options, &state.shutting_down)?
    {
        Outcome::Transmission(session) => session,
        Outcome::Closed => return Ok(()),
    };
    let ServerChannel { plain, tls, .. } = channel;
    plain.finish()?;
    conn.entered_transmission();
    tracing::debug!(?session, tls = tls.is_some(), "entering transmission");
    let plain_readable = |t: Duration| stream.wait_readable(t);
    let tls_readable = |t: Duration| tls.as_ref().is_some_and(|s| s.wait_readable(t));
    let params = transmission::Params {
        export,
        session,
        max_payload: config.max_payload,
        threads: config.threads_per_connection,
        limits: &state.limits,
        conn,
        wait_readable: if tls.is_some() {
            &tls_readable
        } else {
            &plain_readable
        },
    };
    let hangup = || {
        let _ = stream.shutdown(Shutdown::Both);
    };
    match &tls {
        None => transmission::serve(&params, stream, stream, &hangup),
        Some(tls) => {
            let reader = TlsIo {
                tls,
                deadline: None,
            };
            let writer = TlsIo {
                tls,
                deadline: None,
            };
            transmission::serve(&params, reader, writer, &hangup);
            tls.close();
        }
    }
    Ok(())
}

/// Blocks until the listener has a connection (true) or the wake pipe fires (false).
fn wait_readable(listener: libc::c_int, wake: libc::c_int) -> Result<bool, ServerError> {
    let mut fds = [
        libc::pollfd {
            fd: listener,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: fds is a valid array of two pollfd for the duration of the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(ServerError::Io(e));
    }
    Ok(fds[0].revents != 0 && fds[1].revents == 0)
}

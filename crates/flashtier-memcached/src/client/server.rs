//! One server of the pool: its idle connections, health and counters, and the request loop that
//! holds every request to its deadline.

use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::health::{Admission, Backoff, Health, HealthState, Transition};
use super::protocol::ReplyError;
use super::stats::{bump, Counters};
use super::ClientError;

/// What a server needs of the pool's options.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServerConfig {
    pub(crate) max_idle: usize,
    pub(crate) backoff: Backoff,
}

pub(crate) struct Server {
    /// As given when it was added: its name on the ring and in reports.
    pub(crate) addr: String,
    pub(crate) sockaddr: SocketAddr,
    pub(crate) stats: Counters,
    idle: Mutex<Idle>,
    health: Mutex<HealthState>,
    /// Mirrors `health.is_up()` so that requests to a healthy server take no lock.
    up: AtomicBool,
    config: ServerConfig,
}

struct Idle {
    conns: Vec<TcpStream>,
    /// Set when the server leaves the pool: requests still under way then must not park their
    /// connections on a server nobody will ask again.
    closed: bool,
}

/// Leave to send one request to a server; see [`Server::admit`].
pub(crate) struct Permit<'a> {
    server: &'a Server,
    probe: bool,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        // A probe dropped without an outcome (nothing was sent after all) must free the probe slot,
        // or the server would be skipped forever.
        if self.probe {
            self.server.health.lock().abandon_probe();
        }
    }
}

impl Server {
    pub(crate) fn new(addr: String, sockaddr: SocketAddr, config: ServerConfig) -> Server {
        Server {
            addr,
            sockaddr,
            stats: Counters::default(),
            idle: Mutex::new(Idle {
                conns: Vec::new(),
                closed: false,
            }),
            health: Mutex::new(HealthState::default()),
            up: AtomicBool::new(true),
            config,
        }
    }

    pub(crate) fn health(&self) -> Health {
        self.health.lock().report()
    }

    /// Whether a request may go to the server now: `None` while it is down, except for the one
    /// request that probes it once its backoff has passed.
    pub(crate) fn admit(&self) -> Option<Permit<'_>> {
        if self.up.load(Ordering::Acquire) {
            return Some(Permit {
                server: self,
                probe: false,
            });
        }
        let admission = self.health.lock().admit(Instant::now());
        match admission {
            Admission::Go => Some(Permit {
                server: self,
                probe: false,
            }),
            Admission::Probe => {
                debug!(server = %self.addr, "probing memcached server");
                Some(Permit {
                    server: self,
                    probe: true,
                })
            }
            Admission::Skip => None,
        }
    }

    /// Takes the server out of service: its idle connections close now, those of requests under
    /// way when they finish.
    pub(crate) fn close(&self) {
        let mut idle = self.idle.lock();
        idle.closed = true;
        idle.conns.clear();
    }

    /// Runs one request: `op` writes commands to the connection and reads every reply, and must
    /// leave nothing unread. Reads and writes fail with [`ClientError::Timeout`] at `deadline`.
    ///
    /// The connection goes back to the idle list only when `op` succeeded; after any error its
    /// stream may hold half a reply, so it is closed. A failure counts against the server and
    /// takes it down.
    pub(crate) fn run<T>(
        &self,
        mut permit: Permit<'_>,
        deadline: Instant,
        mut op: impl FnMut(&mut Wire<'_>) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let start = Instant::now();
        let mut fresh_only = false;
        let result = loop {
            let (stream, reused) = match self.checkout(deadline, fresh_only) {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            let mut wire = Wire {
                stream: &stream,
                deadline,
                read: 0,
                written: 0,
            };
            let result = op(&mut wire);
            bump(&self.stats.bytes_read, wire.read);
            bump(&self.stats.bytes_written, wire.written);
            match result {
                Ok(v) => {
                    self.checkin(stream);
                    break Ok(v);
                }
                // memcached closes idle connections only when it restarts (or is told to), and a
                // pooled connection finds out on its next request. That says nothing about the
                // server now, so the request gets one more go on a new connection (gets, sets and
                // deletes can all be repeated), and the other idle connections, as old, go too.
                Err(e)
                    if reused
                        && !fresh_only
                        && wire.read == 0
                        && e.is_closed_connection()
                        && Instant::now() < deadline =>
                {
                    debug!(server = %self.addr, error = %e, "idle connection was closed; retrying on a new one");
                    self.drop_idle();
                    fresh_only = true;
                }
                Err(e) => break Err(e),
            }
        };
        match &result {
            Ok(_) => {
                self.stats.latency.record(start.elapsed());
                self.succeeded(&mut permit);
            }
            Err(e) => self.failed(&mut permit, e),
        }
        result
    }

    fn checkout(
        &self,
        deadline: Instant,
        fresh_only: bool,
    ) -> Result<(TcpStream, bool), ClientError> {
        if !fresh_only {
            if let Some(stream) = self.idle.lock().conns.pop() {
                return Ok((stream, true));
            }
        }
        let remaining = remaining(deadline)?;
        let stream = TcpStream::connect_timeout(&self.sockaddr, remaining)?;
        stream.set_nodelay(true)?;
        Ok((stream, false))
    }

    fn checkin(&self, stream: TcpStream) {
        let mut idle = self.idle.lock();
        if !idle.closed && idle.conns.len() < self.config.max_idle {
            idle.conns.push(stream);
        }
    }

    fn drop_idle(&self) {
        let stale = std::mem::take(&mut self.idle.lock().conns);
        drop(stale); // closing sockets outside the lock
    }

    fn succeeded(&self, permit: &mut Permit<'_>) {
        if !permit.probe {
            return;
        }
        permit.probe = false;
        let transition = {
            let mut health = self.health.lock();
            let t = health.succeeded(Instant::now(), true);
            self.up.store(health.is_up(), Ordering::Release);
            t
        };
        if let Transition::CameUp { down_for } = transition {
            info!(server = %self.addr, down_for = ?down_for, "memcached server is back up");
        }
    }

    fn failed(&self, permit: &mut Permit<'_>, error: &ClientError) {
        let counter = match error {
            ClientError::Timeout => &self.stats.timeouts,
            _ => &self.stats.errors,
        };
        bump(counter, 1);
        let probe = std::mem::replace(&mut permit.probe, false);
        let transition = {
            let mut health = self.health.lock();
            let t = health.failed(
                Instant::now(),
                probe,
                error.to_string(),
                &self.config.backoff,
            );
            self.up.store(health.is_up(), Ordering::Release);
            t
        };
        // Connections opened before a failure are suspect (the server may have restarted or
        // be wedged); the probe starts afresh.
        self.drop_idle();
        match transition {
            Transition::WentDown { retry_in } => warn!(
                server = %self.addr,
                error = %error,
                retry_in = ?retry_in,
                "memcached server down; its keys miss until it answers again"
            ),
            Transition::ProbeFailed { retry_in } => debug!(
                server = %self.addr,
                error = %error,
                retry_in = ?retry_in,
                "memcached server still down"
            ),
            _ => debug!(server = %self.addr, error = %error, "memcached request failed"),
        }
    }
}

/// The time left before `deadline`, or [`ClientError::Timeout`].
fn remaining(deadline: Instant) -> Result<Duration, ClientError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(ClientError::Timeout)
    } else {
        Ok(left)
    }
}

/// A connection for the length of one request: every read and write first sets the socket's
/// timeout to the time left before the deadline, so however the request splits into system
/// calls, it cannot outlive the deadline by more than the kernel's timer slack. Counts bytes.
pub(crate) struct Wire<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
    read: usize,
    written: usize,
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "request deadline passed")
}

impl Wire<'_> {
    fn remaining(&self) -> io::Result<Duration> {
        remaining(self.deadline).map_err(|_| timed_out())
    }
}

/// Socket timeouts surface as `WouldBlock` on Unix; one kind for all timeouts.
fn timeout_kind(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timed_out(),
        _ => e,
    }
}

impl Read for Wire<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        let n = stream.read(buf).map_err(timeout_kind)?;
        self.read += n;
        Ok(n)
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_write_timeout(Some(left))?;
        let mut stream = self.stream;
        let n = stream.write(buf).map_err(timeout_kind)?;
        self.written += n;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(()) // nothing is buffered: TCP_NODELAY is on and writes go straight to the socket
    }
}

/// Checks that a request's replies were all consumed: anything more on the stream answers no
/// command sent, so the stream is out of step.
pub(crate) fn drained<R>(r: &BufReader<R>) -> Result<(), ClientError> {
    if r.buffer().is_empty() {
        Ok(())
    } else {
        Err(ClientError::Reply(ReplyError::Malformed(format!(
            "{} unexpected bytes after the last reply",
            r.buffer().len()
        ))))
    }
}

//! A synchronous client for a pool of memcached servers, shared by many threads.
//!
//! - Keys are placed on servers by a consistent-hash ring (ketama-style, 160 points per server):
//!   adding or removing a server moves only that server's share of the keys.
//! - Each call sends at most one request per server, pipelined: a multi-get is one
//!   `get k1 k2 ...` line, a multi-set writes its `set`s before reading the replies. Requests to
//!   different servers run in parallel, so one slow server does not eat the others' time.
//! - Every call finishes by its deadline ([`PoolOptions::timeout`], connecting included). A
//!   server that fails or times out is marked down and skipped (its keys miss, nothing is sent)
//!   until a single probe request succeeds after a backoff that doubles up to a cap. Keys of a
//!   down server are not rerouted to another one: the pool is a cache, a miss is cheap, and
//!   rerouting would fill the other servers with copies that go stale when it comes back.
//! - Per-server counters and a latency histogram ([`ServerStats`]) are kept with relaxed atomics.
//!
//! The wire format is memcached's classic text protocol (`get`, `set`, `delete`); its encoders
//! and parsers are in [`protocol`], pure functions over byte buffers.

mod health;
pub mod protocol;
pub(crate) mod ring;
mod server;
mod stats;

use std::fmt;
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tracing::{debug, info};

pub use health::Health;
pub use stats::{LatencySnapshot, ServerStats, LATENCY_BUCKETS};

use health::Backoff;
use protocol::{KeyError, ReplyError, StoreReply};
use ring::Ring;
use server::{drained, Permit, Server, ServerConfig};
use stats::bump;

/// How the pool talks to its servers.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// The deadline of a whole call, from connecting to reading the last reply. Default 5 ms:
    /// the pool stands in for a disk read, and a reply later than that is worth less than a miss.
    pub timeout: Duration,
    /// Idle connections kept per server for later requests. Default 8. A request that finds none
    /// connects anew, and a connection beyond this many is closed after its request.
    pub connections_per_server: usize,
    /// The backoff after a server's first failure. Default 100 ms.
    pub backoff_min: Duration,
    /// The cap of the backoff, which doubles with each failed probe. Default 5 s.
    pub backoff_max: Duration,
    /// The longest value stored or read. A longer value is not sent (the set fails and counts as
    /// an error), and a server announcing a longer one is treated as broken. Default
    /// [`protocol::DEFAULT_MAX_VALUE_LEN`] (1 MiB), memcached's default item size; raise both
    /// together.
    pub max_value_len: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            timeout: Duration::from_millis(5),
            connections_per_server: 8,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_value_len: protocol::DEFAULT_MAX_VALUE_LEN,
        }
    }
}

/// Errors of the pool: from managing its servers, and (internally, then counted in
/// [`ServerStats`]) from requests.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// A server address that is not `HOST:PORT` or does not resolve.
    #[error("bad server address {addr:?}: {reason}")]
    BadAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server (by name or resolved address) is in the pool already.
    #[error("server {0} is already in the pool")]
    DuplicateServer(String),
    /// No server of that name is in the pool.
    #[error("server {0} is not in the pool")]
    UnknownServer(String),
    /// A key memcached cannot take; it was not sent.
    #[error("invalid key: {0}")]
    InvalidKey(#[from] KeyError),
    /// A value over [`PoolOptions::max_value_len`]; it was not sent.
    #[error("value of {len} bytes is over the pool's limit of {max}")]
    ValueTooLarge {
        /// The value's length.
        len: usize,
        /// [`PoolOptions::max_value_len`].
        max: usize,
    },
    /// The request's deadline passed.
    #[error("timed out")]
    Timeout,
    /// Connecting, reading or writing failed.
    #[error("connection: {0}")]
    Io(io::Error),
    /// The server's reply did not parse, or was an error.
    #[error(transparent)]
    Reply(ReplyError),
}

impl From<io::Error> for ClientError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ClientError::Timeout,
            _ => ClientError::Io(e),
        }
    }
}

impl From<ReplyError> for ClientError {
    fn from(e: ReplyError) -> Self {
        match e {
            ReplyError::Io(e) => e.into(),
            e => ClientError::Reply(e),
        }
    }
}

impl ClientError {
    /// Whether the error is what a connection the server closed gives its next request.
    fn is_closed_connection(&self) -> bool {
        match self {
            ClientError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::UnexpectedEof
            ),
            ClientError::Reply(ReplyError::Truncated) => true,
            _ => false,
        }
    }
}

/// One server as [`Pool::servers`] reports it.
#[derive(Clone, Debug)]
pub struct ServerReport {
    /// The address as given to the pool.
    pub addr: String,
    /// Up, or down and why.
    pub health: Health,
    /// What the pool did with it.
    pub stats: ServerStats,
}

/// How many `set`s go out before their replies are read. Replies are small, so a batch's replies
/// fit in the socket buffers while the pool is still writing; a batch without bound could fill
/// them, and memcached stops reading commands while it cannot send replies: both sides would wait
/// on each other until the deadline.
const SET_BATCH: usize = 128;

/// A batch of `set`s also ends once its commands pass this many bytes (the batch is copied into
/// one buffer, to go out in few system calls).
const SET_BATCH_BYTES: usize = 1 << 20;

/// The read buffer of a multi-get: replies carrying many values then take few system calls
/// (each read also sets the socket's timeout).
const GET_READ_BUFFER: usize = 64 << 10;

/// A pool of memcached servers. All methods take `&self`; share it between threads with an
/// `Arc`.
pub struct Pool {
    opts: PoolOptions,
    /// Swapped whole on membership changes, so a request takes a cheap `Arc` clone and holds no
    /// lock while it talks to servers.
    members: RwLock<Arc<Members>>,
    /// Serialises membership changes, and keeps the counters of removed servers.
    retired: Mutex<Retired>,
}

struct Members {
    /// In the order added.
    servers: Vec<Arc<Server>>,
    ring: Ring,
}

impl Members {
    fn new(servers: Vec<Arc<Server>>) -> Members {
        let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
        Members {
            ring: Ring::new(&addrs),
            servers,
        }
    }

    fn route(&self, key: &[u8]) -> Option<&Arc<Server>> {
        let i = self.ring.lookup(ring::hash(key))?;
        Some(&self.servers[i])
    }
}

#[derive(Default)]
struct Retired {
    /// Counters of removed servers that no request can touch any more.
    folded: ServerStats,
    /// Removed servers that requests may still hold.
    pending: Vec<Arc<Server>>,
}

impl Retired {
    fn fold(&mut self) {
        let folded = &mut self.folded;
        self.pending.retain(|s| {
            // Only the pool held on to it, so no request can count anything more.
            if Arc::strong_count(s) == 1 {
                *folded = folded.add(&s.stats.snapshot());
                false
            } else {
                true
            }
        });
    }
}

/// A server's share of a call: which items go to it, and its leave to send them.
struct Job<'a> {
    server: &'a Server,
    permit: Permit<'a>,
    items: Vec<usize>,
}

impl Pool {
    /// A pool of `servers`, each `HOST:PORT`: an IPv4 address, a bracketed IPv6 address
    /// (`[::1]:11211`) or a host name, resolved once, here (to its first address). The servers
    /// need not be up. An empty list gives a pool where every get misses.
    pub fn new(servers: &[String], opts: PoolOptions) -> Result<Pool, ClientError> {
        let config = ServerConfig {
            max_idle: opts.connections_per_server,
            backoff: Backoff {
                min: opts.backoff_min,
                max: opts.backoff_max,
            },
        };
        let mut list: Vec<Arc<Server>> = Vec::with_capacity(servers.len());
        for addr in servers {
            let sockaddr = resolve(addr)?;
            check_unique(&list, addr, sockaddr)?;
            list.push(Arc::new(Server::new(addr.clone(), sockaddr, config)));
        }
        Ok(Pool {
            opts,
            members: RwLock::new(Arc::new(Members::new(list))),
            retired: Mutex::new(Retired::default()),
        })
    }

    fn members(&self) -> Arc<Members> {
        self.members.read().clone()
    }

    fn deadline(&self) -> Instant {
        health::later(Instant::now(), self.opts.timeout)
    }

    /// One result per key, in order: `Some(value)` for a hit. Keys are grouped by server and
    /// each group is one pipelined multi-get. A server that is down, fails or times out gives
    /// `None` for its keys (counted as skipped, errors or timeouts, not misses); so does an
    /// invalid key (counted as an error, never sent). Returns by the deadline.
    pub fn get_multi(&self, keys: &[&[u8]]) -> Vec<Option<Vec<u8>>> {
        let mut out = vec![None; keys.len()];
        let members = self.members();
        let deadline = self.deadline();
        let jobs = admit(split(
            &members,
            keys.len(),
            |i| keys[i],
            |i| check_key(keys[i]),
        ));
        let max_value_len = self.opts.max_value_len;
        let results = run_parallel(jobs, |job| {
            let asked: Vec<&[u8]> = job.items.iter().map(|&i| keys[i]).collect();
            bump(&job.server.stats.gets, asked.len());
            let mut command =
                Vec::with_capacity(8 + asked.iter().map(|k| k.len() + 1).sum::<usize>());
            protocol::encode_get(&asked, &mut command);
            let result = job.server.run(job.permit, deadline, |wire| {
                wire.write_all(&command)?;
                let mut r = BufReader::with_capacity(GET_READ_BUFFER, wire);
                let values = protocol::parse_get_reply(&mut r, &asked, max_value_len)?;
                drained(&r)?;
                Ok(values)
            });
            let values = result.ok().inspect(|values| {
                let hits = values.iter().filter(|v| v.is_some()).count();
                bump(&job.server.stats.hits, hits);
                bump(&job.server.stats.misses, values.len() - hits);
            });
            (job.items, values)
        });
        for (items, values) in results {
            if let Some(values) = values {
                for (i, value) in items.into_iter().zip(values) {
                    out[i] = value;
                }
            }
        }
        out
    }

    /// The value of `key`, if a server has it (see [`Pool::get_multi`]).
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.get_multi(&[key]).pop().flatten()
    }

    /// Stores `value` under `key`, best effort: true when the server answered `STORED`.
    pub fn set(&self, key: &[u8], value: &[u8]) -> bool {
        self.set_multi(&[(key, value)]) == 1
    }

    /// Stores each item, pipelined: all the sets to one server are written, then their replies
    /// read. Returns how many were `STORED`. Items with an invalid key or a value over
    /// [`PoolOptions::max_value_len`] are not sent (counted as errors).
    pub fn set_multi(&self, items: &[(&[u8], &[u8])]) -> usize {
        let members = self.members();
        let deadline = self.deadline();
        let max = self.opts.max_value_len;
        let jobs = admit(split(
            &members,
            items.len(),
            |i| items[i].0,
            |i| {
                let (key, value) = items[i];
                check_key(key)?;
                if value.len() > max {
                    return Err(ClientError::ValueTooLarge {
                        len: value.len(),
                        max,
                    });
                }
                Ok(())
            },
        ));
        let stored = run_parallel(jobs, |job| {
            let server = job.server;
            bump(&server.stats.sets, job.items.len());
            let result = server.run(job.permit, deadline, |wire| {
                let mut stored = 0;
                let mut rejected = 0;
                let mut rest = &job.items[..];
                while !rest.is_empty() {
                    let mut commands = Vec::new();
                    let mut n = 0;
                    while n < rest.len()
                        && n < SET_BATCH
                        && (n == 0 || commands.len() < SET_BATCH_BYTES)
                    {
                        let (key, value) = items[rest[n]];
                        protocol::encode_set(key, value, &mut commands);
                        n += 1;
                    }
                    let (batch, tail) = rest.split_at(n);
                    rest = tail;
                    wire.write_all(&commands)?;
                    let mut r = BufReader::new(&mut *wire);
                    for &i in batch {
                        match protocol::parse_store_reply(&mut r)? {
                            StoreReply::Stored => stored += 1,
                            reply => {
                                rejected += 1;
                                debug!(
                                    server = %server.addr,
                                    key = %String::from_utf8_lossy(items[i].0),
                                    len = items[i].1.len(),
                                    reply = ?reply,
                                    "memcached did not store an item"
                                );
                            }
                        }
                    }
                    drained(&r)?;
                }
                Ok((stored, rejected))
            });
            match result {
                Ok((stored, rejected)) => {
                    bump(&server.stats.errors, rejected);
                    stored
                }
                Err(_) => 0,
            }
        });
        stored.into_iter().sum()
    }

    /// Deletes `key`: true when the server answered `DELETED` or `NOT_FOUND`, i.e. the key is not
    /// there now (and in an empty pool, where nothing is). False when its server is down or failed,
    /// or the key is invalid.
    pub fn delete(&self, key: &[u8]) -> bool {
        self.delete_multi(&[key]) == 1
    }

    /// Deletes each key, pipelined as [`Pool::set_multi`] stores: returns how many are not
    /// there now (`DELETED` or `NOT_FOUND`; every key of an empty pool).
    pub fn delete_multi(&self, keys: &[&[u8]]) -> usize {
        let members = self.members();
        if members.servers.is_empty() {
            return keys.len();
        }
        let deadline = self.deadline();
        let jobs = admit(split(
            &members,
            keys.len(),
            |i| keys[i],
            |i| check_key(keys[i]),
        ));
        let gone = run_parallel(jobs, |job| {
            let server = job.server;
            bump(&server.stats.deletes, job.items.len());
            server
                .run(job.permit, deadline, |wire| {
                    let mut gone = 0;
                    for batch in job.items.chunks(SET_BATCH) {
                        let mut commands = Vec::new();
                        for &i in batch {
                            protocol::encode_delete(keys[i], &mut commands);
                        }
                        wire.write_all(&commands)?;
                        let mut r = BufReader::new(&mut *wire);
                        for _ in batch {
                            protocol::parse_delete_reply(&mut r)?;
                            gone += 1;
                        }
                        drained(&r)?;
                    }
                    Ok(gone)
                })
                .unwrap_or(0)
        });
        gone.into_iter().sum()
    }

    /// Adds a server (`HOST:PORT`, as for [`Pool::new`]); about `1/n` of the keys move to it.
    /// Fails if it is invalid or already in the pool (by name or resolved address).
    pub fn add_server(&self, addr: &str) -> Result<(), ClientError> {
        let sockaddr = resolve(addr)?;
        let _changing = self.retired.lock();
        let current = self.members();
        check_unique(&current.servers, addr, sockaddr)?;
        let config = ServerConfig {
            max_idle: self.opts.connections_per_server,
            backoff: Backoff {
                min: self.opts.backoff_min,
                max: self.opts.backoff_max,
            },
        };
        let mut servers = current.servers.clone();
        servers.push(Arc::new(Server::new(addr.to_string(), sockaddr, config)));
        *self.members.write() = Arc::new(Members::new(servers));
        info!(server = addr, resolved = %sockaddr, "memcached server added to the pool");
        Ok(())
    }

    /// Removes the server added as `addr` (the same string); its keys move to the others (which
    /// start out without them). Its idle connections close now; requests already under way finish
    /// normally. Its counters stay in [`Pool::totals`].
    pub fn remove_server(&self, addr: &str) -> Result<(), ClientError> {
        let mut retired = self.retired.lock();
        let current = self.members();
        let Some(gone) = current.servers.iter().find(|s| s.addr == addr).cloned() else {
            return Err(ClientError::UnknownServer(addr.to_string()));
        };
        let servers = current
            .servers
            .iter()
            .filter(|s| !Arc::ptr_eq(s, &gone))
            .cloned()
            .collect();
        *self.members.write() = Arc::new(Members::new(servers));
        drop(current);
        gone.close();
        retired.pending.push(gone);
        retired.fold();
        info!(server = addr, "memcached server removed from the pool");
        Ok(())
    }

    /// The servers, in the order added, with their health and counters.
    pub fn servers(&self) -> Vec<ServerReport> {
        self.members()
            .servers
            .iter()
            .map(|s| ServerReport {
                addr: s.addr.clone(),
                health: s.health(),
                stats: s.stats.snapshot(),
            })
            .collect()
    }

    /// The counters summed over the current servers and every server removed, so totals never go
    /// backwards.
    pub fn totals(&self) -> ServerStats {
        // Holding the membership lock keeps a server from moving between the lists while they are
        // summed (counted twice, or not at all).
        let mut retired = self.retired.lock();
        retired.fold();
        let members = self.members();
        members
            .servers
            .iter()
            .chain(&retired.pending)
            .fold(retired.folded.clone(), |sum, s| {
                sum.add(&s.stats.snapshot())
            })
    }

    /// Whether the pool has no servers.
    pub fn is_empty(&self) -> bool {
        self.members().servers.is_empty()
    }

    /// How many servers the pool has, up or down.
    pub fn len(&self) -> usize {
        self.members().servers.len()
    }

    /// The address of the server `key` belongs to (whether or not it is up), or `None` in an
    /// empty pool.
    pub fn server_for(&self, key: &[u8]) -> Option<String> {
        self.members().route(key).map(|s| s.addr.clone())
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let members = self.members();
        let servers: Vec<&str> = members.servers.iter().map(|s| s.addr.as_str()).collect();
        f.debug_struct("Pool")
            .field("servers", &servers)
            .field("options", &self.opts)
            .finish()
    }
}

fn check_key(key: &[u8]) -> Result<(), ClientError> {
    Ok(protocol::validate_key(key)?)
}

/// Counts an item refused before sending against the server it would have gone to.
fn refused(server: &Server, e: &ClientError) {
    bump(&server.stats.errors, 1);
    debug!(server = %server.addr, error = %e, "item not sent to memcached");
}

/// Groups items `0..n` by the server their key belongs to, in server order; items that fail
/// `check` are counted and left out.
fn split<'a, 'k>(
    members: &'a Members,
    n: usize,
    key: impl Fn(usize) -> &'k [u8],
    check: impl Fn(usize) -> Result<(), ClientError>,
) -> Vec<(&'a Server, Vec<usize>)> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new(); members.servers.len()];
    for i in 0..n {
        let Some(s) = members.ring.lookup(ring::hash(key(i))) else {
            break; // an empty pool
        };
        match check(i) {
            Ok(()) => groups[s].push(i),
            Err(e) => refused(&members.servers[s], &e),
        }
    }
    members
        .servers
        .iter()
        .zip(groups)
        .filter(|(_, items)| !items.is_empty())
        .map(|(s, items)| (&**s, items))
        .collect()
}

/// Turns groups into jobs for the servers that may be asked now; the others' items are skipped.
fn admit(groups: Vec<(&Server, Vec<usize>)>) -> Vec<Job<'_>> {
    groups
        .into_iter()
        .filter_map(|(server, items)| match server.admit() {
            Some(permit) => Some(Job {
                server,
                permit,
                items,
            }),
            None => {
                bump(&server.stats.skipped, items.len());
                None
            }
        })
        .collect()
}

/// Runs `work` on every job, the jobs in parallel: one on the calling thread, the others on
/// threads of their own. Each server's request then has the whole deadline, not what a slower
/// server before it left over. Results come back in the order of `jobs`.
fn run_parallel<J: Send, R: Send>(jobs: Vec<J>, work: impl Fn(J) -> R + Sync) -> Vec<R> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(work).collect();
    }
    let n = jobs.len();
    let jobs: Vec<Mutex<Option<J>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let results: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    // Each thread takes the next job not yet taken, so a thread that could not be started
    // leaves its jobs to the others instead of losing them.
    let worker = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(job) = jobs.get(i).and_then(|j| j.lock().take()) else {
            break;
        };
        let result = work(job);
        *results[i].lock() = Some(result);
    };
    thread::scope(|scope| {
        for _ in 1..n {
            let spawned = thread::Builder::new()
                .name("memcached-request".into())
                .spawn_scoped(scope, worker);
            if let Err(e) = spawned {
                debug!(error = %e, "no thread for a memcached request; running it inline");
                break;
            }
        }
        worker();
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .expect("every job runs before the scope ends")
        })
        .collect()
}

/// Resolves `HOST:PORT` once.
fn resolve(addr: &str) -> Result<SocketAddr, ClientError> {
    let bad = |reason: String| ClientError::BadAddress {
        addr: addr.to_string(),
        reason,
    };
    if let Ok(sockaddr) = addr.parse::<SocketAddr>() {
        if sockaddr.port() == 0 {
            return Err(bad("port 0".into()));
        }
        return Ok(sockaddr);
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(bad("expected HOST:PORT".into()));
    };
    if host.is_empty() {
        return Err(bad("no host".into()));
    }
    if host.contains(':') || host.starts_with('[') {
        return Err(bad(
            "an IPv6 address goes in brackets: [ADDRESS]:PORT".into()
        ));
    }
    if host.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(bad("whitespace or control characters in the host".into()));
    }
    let port = match port.parse::<u16>() {
        Ok(p) if p != 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
        _ => return Err(bad(format!("port {port:?} is not 1-65535"))),
    };
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(format!("cannot resolve {host:?}: {e}")))?;
    addrs
        .next()
        .ok_or_else(|| bad(format!("{host:?} resolves to no address")))
}

fn check_unique(
    servers: &[Arc<Server>],
    addr: &str,
    sockaddr: SocketAddr,
) -> Result<(), ClientError> {
    match servers
        .iter()
        .find(|s| s.addr == addr || s.sockaddr == sockaddr)
    {
        Some(s) if s.addr == addr => Err(ClientError::DuplicateServer(addr.to_string())),
        Some(s) => Err(ClientError::DuplicateServer(format!(
            "{addr} (as {}, both {sockaddr})",
            s.addr
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn pool_is_send_and_sync() {
        assert_send_sync::<Pool>();
        assert_send_sync::<ServerReport>();
        assert_send_sync::<ClientError>();
    }

    #[test]
    fn addresses_resolve_or_are_refused() {
        assert_eq!(
            resolve("127.0.0.1:11211").unwrap(),
            "127.0.0.1:11211".parse().unwrap()
        );
        assert_eq!(
            resolve("[::1]:11211").unwrap(),
            "[::1]:11211".parse().unwrap()
        );
        assert!(resolve("localhost:11211").unwrap().ip().is_loopback());
        for bad in [
            "",
            "11211",
            "127.0.0.1",
            "127.0.0.1:",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:+80",
            ":11211",
            "::1:11211",
            "[::1:11211",
            "local host:11211",
            "no-such-host.invalid:11211",
        ] {
            assert!(
                matches!(resolve(bad), Err(ClientError::BadAddress { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn membership_errors() {
        let servers = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let pool = Pool::new(&servers, PoolOptions::default()).unwrap();
        assert!(matches!(
            Pool::new(
                &[servers[0].clone(), servers[0].clone()],
                PoolOptions::default()
            ),
            Err(ClientError::DuplicateServer(_))
        ));
        assert!(matches!(
            pool.add_server("127.0.0.1:1"),
            Err(ClientError::DuplicateServer(_))
        ));
        assert!(matches!(
            pool.add_server("bogus"),
            Err(ClientError::BadAddress { .. })
        ));
        assert!(matches!(
            pool.remove_server("127.0.0.1:3"),
            Err(ClientError::UnknownServer(_))
        ));
        pool.add_server("127.0.0.1:3").unwrap();
        pool.remove_server("127.0.0.1:1").unwrap();
        let addrs: Vec<String> = pool.servers().into_iter().map(|s| s.addr).collect();
        assert_eq!(addrs, ["127.0.0.1:2", "127.0.0.1:3"]);
        pool.remove_server("127.0.0.1:2").unwrap();
        pool.remove_server("127.0.0.1:3").unwrap();
        assert!(pool.is_empty());
        assert_eq!(pool.server_for(b"k"), None);
    }

    #[test]
    fn an_empty_pool_misses() {
        let pool = Pool::new(&[], PoolOptions::default()).unwrap();
        assert!(pool.is_empty());
        assert_eq!(pool.get(b"k"), None);
        assert_eq!(pool.get_multi(&[b"a", b"b"]), vec![None, None]);
        assert!(!pool.set(b"k", b"v"));
        assert_eq!(pool.set_multi(&[(b"k", b"v")]), 0);
        assert!(pool.delete(b"k"));
        assert_eq!(pool.totals(), ServerStats::default());
    }

    #[test]
    fn invalid_items_count_as_errors_and_are_never_sent() {
        // Nothing listens on port 1: were anything sent, it would fail and take the server down.
        let pool = Pool::new(&["127.0.0.1:1".to_string()], PoolOptions::default()).unwrap();
        let long = [b'k'; 251];
        assert_eq!(
            pool.get_multi(&[b"a b", b"", &long]),
            vec![None, None, None]
        );
        assert!(!pool.set(b"a\r\nflush_all", b"v"));
        assert!(!pool.delete(b"a\0"));
        let opts = PoolOptions {
            max_value_len: 4,
            ..PoolOptions::default()
        };
        let small = Pool::new(&["127.0.0.1:1".to_string()], opts).unwrap();
        assert!(!small.set(b"k", b"12345"));
        let report = &pool.servers()[0];
        assert_eq!(report.health, Health::Up);
        assert_eq!(
            report.stats,
            ServerStats {
                errors: 5,
                ..Default::default()
            }
        );
        assert_eq!(small.totals().errors, 1);
        assert_eq!(small.totals().bytes_written, 0);
    }

    #[test]
    fn a_refused_connection_takes_the_server_down_and_later_calls_skip() {
        let opts = PoolOptions {
            timeout: Duration::from_secs(2),
            backoff_min: Duration::from_secs(60),
            backoff_max: Duration::from_secs(60),
            ..PoolOptions::default()
        };
        let pool = Pool::new(&["127.0.0.1:1".to_string()], opts).unwrap();
        assert_eq!(pool.get(b"k"), None);
        assert!(!pool.set(b"k", b"v"));
        assert!(!pool.delete(b"k"));
        let report = &pool.servers()[0];
        assert!(matches!(report.health, Health::Down { .. }), "{report:?}");
        assert_eq!(report.stats.errors, 1);
        assert_eq!(report.stats.gets, 1);
        assert_eq!(report.stats.skipped, 2);
        assert_eq!(report.stats.misses, 0);
    }

    #[test]
    fn removed_servers_stay_in_the_totals() {
        let pool = Pool::new(
            &["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()],
            PoolOptions::default(),
        )
        .unwrap();
        pool.get_multi(&[b"a b", b"c d", b"e f", b"g h"]);
        assert_eq!(pool.totals().errors, 4);
        pool.remove_server("127.0.0.1:1").unwrap();
        assert_eq!(pool.totals().errors, 4);
        pool.remove_server("127.0.0.1:2").unwrap();
        assert_eq!(pool.totals().errors, 4);
        assert!(pool.retired.lock().pending.is_empty());
    }

    #[test]
    fn parallel_jobs_all_run_in_order() {
        let out = run_parallel((0..5).collect(), |i: usize| i * 10);
        assert_eq!(out, [0, 10, 20, 30, 40]);
        assert_eq!(run_parallel(vec![7], |i: usize| i), [7]);
        assert!(run_parallel(Vec::<usize>::new(), |i| i).is_empty());
    }
}

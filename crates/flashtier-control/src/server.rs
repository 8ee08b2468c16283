//! The control socket: a unix socket (0600, removed on exit) speaking [`crate::protocol`].
//!
//! One thread accepts; each client gets a thread that answers its requests in order, so a
//! `stats --watch` left open never delays a `set`. A request that does not parse, names an
//! unknown operation or fails gets an error response and the connection stays usable; only a
//! line over 64 KiB (not a control request by any stretch) closes that one connection. The
//! server never exits because of what a client sent.
//!
//! **The operator always gets in.** Threads are bounded ([`Limits::max_clients`]), and clients
//! that hold a slot without using it lose it: a connection that has not completed a request for
//! [`Limits::idle`] is closed (measured from its last answer, so trickling bytes of a line that
//! never ends does not count as activity), and when every slot is taken a new connection
//! evicts the client idle longest. Only clients whose request is being executed are never
//! evicted, and requests are short. A closed client gets one last error line saying why, if
//! its socket has room for it.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::acceptor::{Acceptor, Job};
use crate::controller::{ControlError, Controller};
use crate::protocol::{NameValue, Request, Response};

/// Longest request line accepted.
const MAX_LINE: u64 = 64 << 10;

/// How many clients the control socket serves and for how long it keeps them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Clients served at once (each costs a thread).
    pub max_clients: usize,
    /// A client that completes no request for this long is closed.
    pub idle: Duration,
    /// A client that does not take an answer within this long is closed.
    pub write: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_clients: 64,
            // The CLI asks every second while it watches or waits; a minute is plenty.
            idle: Duration::from_secs(60),
            write: Duration::from_secs(10),
        }
    }
}

/// A connected client, as the accept thread sees it.
struct Conn {
    /// A handle to close it with.
    stream: UnixStream,
    /// When it last finished a request (or connected); `None` while one is executed.
    idle_since: Option<Instant>,
}

type Registry = Arc<Mutex<HashMap<u64, Conn>>>;

/// A client's place in the registry, given up when its work ends (or never starts).
struct Registered {
    id: u64,
    registry: Registry,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

/// Answers one request.
pub fn handle(c: &Controller, req: Request) -> Result<serde_json::Value, ControlError> {
    Ok(match req {
        Request::Report => json(&c.report()),
        Request::Get { name } => {
            let value = c.get(&name)?;
            json(&NameValue { name, value })
        }
        Request::Set {
            name,
            value,
            persist,
        } => {
            let value = c.set(&name, &value, persist)?;
            json(&NameValue { name, value })
        }
        Request::SetMany { settings, persist } => {
            let settings: Vec<(String, String)> =
                settings.into_iter().map(|s| (s.name, s.value)).collect();
            let set = c.set_many(&settings, persist)?;
            let set: Vec<NameValue> = set
                .into_iter()
                .map(|(name, value)| NameValue { name, value })
                .collect();
            json(&set)
        }
        Request::Params => json(&c.params()?),
        Request::Mode { mode } => serde_json::json!({ "mode": c.start_mode_switch(&mode)? }),
        Request::Flush => {
            c.start_flush()?;
            serde_json::Value::Null
        }
        Request::FlushCancel => {
            c.cancel_flush()?;
            serde_json::Value::Null
        }
        Request::ResetStats => {
            c.reset_stats();
            serde_json::Value::Null
        }
        Request::Detach { force } => {
            serde_json::json!({ "dirty_blocks": c.start_detach(force)? })
        }
        Request::Attach { cache, mode, force } => {
            json(&c.attach(cache.as_deref(), mode.as_deref(), force)?)
        }
        Request::Scrub { rate } => {
            c.start_scrub(rate)?;
            serde_json::Value::Null
        }
        Request::ScrubCancel => {
            c.cancel_scrub()?;
            serde_json::Value::Null
        }
        Request::TraceStart { path } => json(&c.start_trace(std::path::Path::new(&path))?),
        Request::TraceStop { path } => {
            json(&c.stop_trace(path.as_deref().map(std::path::Path::new))?)
        }
        Request::ForgetLost { offset, length } => {
            serde_json::json!({ "forgotten": c.forget_lost(offset, length)? })
        }
        Request::Memcached(req) => json(&c.memcached(req)?),
    })
}

fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    // Our types have string keys and finite numbers, so this cannot fail.
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// Answers one request line.
fn respond(c: &Controller, line: &str) -> Response {
    let req: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => {
            return Response::error(format!(
                "bad request ({e}); expected one JSON object per line with \"op\" one of \
                 report, get, set, set_many, params, mode, flush, flush_cancel, reset_stats, \
                 detach, attach, scrub, scrub_cancel, trace_start, trace_stop, forget_lost, \
                 memcached"
            ))
        }
    };
    match handle(c, req) {
        Ok(v) => Response::ok(v),
        Err(e) => Response::error(e.to_string()),
    }
}

/// A running control server; stops (and removes its socket) when dropped.
pub struct ControlServer {
    path: PathBuf,
    acceptor: Acceptor,
    /// Every connected client, to evict the idle and close them all on stop.
    clients: Registry,
}

impl ControlServer {
    /// Binds `path` and starts serving `controller`.
    pub fn start(path: &Path, controller: Arc<Controller>) -> Result<ControlServer, ControlError> {
        ControlServer::start_with(path, controller, Limits::default())
    }

    /// [`ControlServer::start`] with other limits.
    pub fn start_with(
        path: &Path,
        controller: Arc<Controller>,
        limits: Limits,
    ) -> Result<ControlServer, ControlError> {
        let listener = flashtier_nbd::bind_unix(path)?;
        let clients: Registry = Arc::default();
        let next_id = AtomicU64::new(0);
        let registry = clients.clone();
        // Registered on the accept thread, before the next connection may need an eviction;
        // idle from the moment it was accepted.
        let serve = move |stream: UnixStream| -> Job {
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            let registered = match stream.try_clone() {
                Ok(s) => {
                    let conn = Conn {
                        stream: s,
                        idle_since: Some(Instant::now()),
                    };
                    registry.lock().insert(id, conn);
                    Registered {
                        id,
                        registry: registry.clone(),
                    }
                }
                Err(e) => {
                    tracing::warn!("control socket: {e}");
                    return Box::new(|| {});
                }
            };
            let controller = controller.clone();
            Box::new(move || {
                let busy = |busy: bool| {
                    if let Some(c) = registered.registry.lock().get_mut(&registered.id) {
                        c.idle_since = (!busy).then(Instant::now);
                    }
                };
                if let Err(e) = serve_client(stream, &controller, &limits, &busy) {
                    tracing::debug!("control client: {e}");
                }
            })
        };
        let max = limits.max_clients;
        let refuse = move |mut stream: UnixStream| {
            let too_many = format!(
                "too many control clients (at most {max}, all executing a request); try again"
            );
            let _ = write_response(&mut stream, &Response::error(too_many));
        };
        let registry = clients.clone();
        let evict = move || evict_longest_idle(&registry);
        let acceptor = Acceptor::start(listener, "flashtier-control", max, serve, refuse, evict)?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            acceptor,
            clients,
        })
    }

    /// Where clients connect; the socket file is removed again at stop.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Clients connected now.
    pub fn clients(&self) -> usize {
        self.clients.lock().len()
    }

    /// Stops accepting, closes every client connection and removes the socket.
    pub fn stop(&mut self) {
        self.acceptor.stop();
        for (_, c) in self.clients.lock().drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Closes the client that has waited longest since its last answer, telling it why; false if
/// every client is executing a request.
fn evict_longest_idle(registry: &Registry) -> bool {
    let mut clients = registry.lock();
    let Some((&id, _)) = clients
        .iter()
        .filter_map(|(id, c)| c.idle_since.map(|t| (id, t)))
        .min_by_key(|&(_, t)| t)
    else {
        return false;
    };
    let conn = clients.remove(&id).expect("just found");
    drop(clients);
    let idle = conn.idle_since.map_or(Duration::ZERO, |t| t.elapsed());
    tracing::info!(
        idle_ms = idle.as_millis() as u64,
        "control socket full: closing the client idle longest"
    );
    say_goodbye(
        &conn.stream,
        &format!(
            "the server closed this control connection: every slot was taken and it was the \
             one idle longest ({:.1} s); connect again",
            idle.as_secs_f64()
        ),
    );
    true
}

/// Sends a last error line if the socket has room for it right now (never waits: the client may
/// not be reading), then closes the connection both ways.
fn say_goodbye(stream: &UnixStream, why: &str) {
    if let Ok(mut line) = serde_json::to_vec(&Response::error(why)) {
        line.push(b'\n');
        let _ = flashtier_io::sys::send_nonblocking(stream.as_fd(), &line);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads from the client until a deadline: each read waits only for the time left, so a
/// client trickling bytes cannot stretch it.
struct Deadline {
    stream: UnixStream,
    until: Instant,
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Answers one client's requests in order until it leaves or idles out. `busy(true)` as a
/// request starts executing, `busy(false)` when it is answered.
fn serve_client(
    stream: UnixStream,
    c: &Controller,
    limits: &Limits,
    busy: &dyn Fn(bool),
) -> io::Result<()> {
    stream.set_write_timeout(Some(limits.write))?;
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(Deadline {
        stream,
        until: Instant::now() + limits.idle,
    });
    let mut line = String::new();
    loop {
        line.clear();
        let n = match (&mut reader).take(MAX_LINE + 1).read_line(&mut line) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                // read_line consumed the whole line before finding it was not UTF-8.
                write_response(&mut out, &Response::error("bad request: not UTF-8"))?;
                reader.get_mut().until = Instant::now() + limits.idle;
                continue;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                let why = format!(
                    "the server closed this control connection: no request for {} s; connect \
                     again",
                    limits.idle.as_secs_f64()
                );
                say_goodbye(&out, &why);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(());
        }
        if n as u64 > MAX_LINE {
            write_response(
                &mut out,
                &Response::error(format!("request longer than {MAX_LINE} bytes")),
            )?;
            return Ok(());
        }
        if line.trim().is_empty() {
            continue;
        }
        busy(true);
        let response = respond(c, line.trim());
        busy(false);
        write_response(&mut out, &response)?;
        reader.get_mut().until = Instant::now() + limits.idle;
    }
}

fn write_response(out: &mut UnixStream, r: &Response) -> io::Result<()> {
    let mut bytes = serde_json::to_vec(r).map_err(io::Error::other)?;
    bytes.push(b'\n');
    out.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;
    use crate::controller::tests::{cached, passthrough};
    use flashtier_io::BlockDev;
    use std::os::unix::fs::PermissionsExt;

    fn raw(path: &Path, lines: &[&[u8]]) -> Vec<Response> {
        let mut s = UnixStream::connect(path).unwrap();
        for l in lines {
            s.write_all(l).unwrap();
        }
        s.shutdown(Shutdown::Write).unwrap();
        BufReader::new(s)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect()
    }

    #[test]
    fn round_trips_over_a_real_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let (c, dev) = cached(None);
        let mut server = ControlServer::start(&path, c).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        dev.write_at(&[5u8; 8192], 0, false).unwrap();
        let mut cl = Client::connect(&path).unwrap();
        let r = cl.report().unwrap();
        assert_eq!(r.counters.get("writes"), Some(&1));
        assert_eq!(cl.get("promotion").unwrap(), "auto");
        assert_eq!(cl.set("promotion", "NHIT", false).unwrap(), "nhit");
        let e = cl.set("promotion_nhit", "0", false).unwrap_err();
        assert!(e.to_string().contains("1..=255"), "{e}");
        assert_eq!(
            cl.params().unwrap().len(),
            flashtier_engine::PARAMS.len() + 1
        );
        cl.reset_stats().unwrap();
        assert_eq!(cl.report().unwrap().counters.get("writes"), Some(&0));
        assert_eq!(cl.mode("writearound").unwrap(), "writearound");
        // Many clients at once.
        let others: Vec<Client> = (0..5).map(|_| Client::connect(&path).unwrap()).collect();
        for mut o in others {
            assert!(o.report().is_ok());
        }

        server.stop();
        assert!(!path.exists(), "socket removed");
        assert!(cl.report().is_err(), "connections closed");
        let e = Client::connect(&path).err().expect("nobody answers");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    }

    #[test]
    fn bad_requests_get_errors_and_never_kill_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let (c, _) = passthrough();
        let _server = ControlServer::start(&path, c).unwrap();
        let got = raw(
            &path,
            &[
                b"not json\n",
                b"\n",
                b"{\"op\":\"explode\"}\n",
                b"{\"op\":\"get\",\"name\":\"mode\"}\n",
                b"\xff\xfe\n",
                b"[1,2,3]\n",
                b"{\"op\":\"report\"}\n",
            ],
        );
        assert_eq!(got.len(), 6, "{got:?}");
        assert!(
            got[..5].iter().all(|r| !r.ok && r.error.is_some()),
            "{got:?}"
        );
        assert!(got[2].error.as_ref().unwrap().contains("no cache"));
        assert!(got[5].ok);
        let huge = vec![b'x'; (MAX_LINE + 10) as usize];
        let got = raw(&path, &[&huge]);
        assert!(!got[0].ok);
        // Still serving.
        let got = raw(&path, &[b"{\"op\":\"report\"}\n"]);
        assert!(got[0].ok);
    }

    #[test]
    fn a_live_socket_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let _a = ControlServer::start(&path, passthrough().0).unwrap();
        let e = ControlServer::start(&path, passthrough().0).err().unwrap();
        assert!(e.to_string().contains("already listening"), "{e}");
    }

    /// Reads what the server sends until it closes the connection (or `within` passes).
    fn read_until_closed(s: &mut UnixStream, within: Duration) -> Option<String> {
        s.set_read_timeout(Some(within)).unwrap();
        let mut got = String::new();
        match s.read_to_string(&mut got) {
            Ok(_) => Some(got),
            Err(_) => None,
        }
    }

    fn wait_for(what: &str, within: Duration, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + within;
        while !cond() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn when_full_a_new_client_evicts_the_one_idle_longest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let limits = Limits {
            max_clients: 4,
            ..Limits::default()
        };
        let server = ControlServer::start_with(&path, passthrough().0, limits).unwrap();
        // The oldest sits silent; the others send part of a line (never finished).
        let mut held: Vec<UnixStream> = Vec::new();
        for i in 0..4 {
            let mut s = UnixStream::connect(&path).unwrap();
            if i > 0 {
                s.write_all(b"{\"op\":\"rep").unwrap();
            }
            held.push(s);
            wait_for(
                "the client to be registered",
                Duration::from_secs(5),
                || server.clients() == i + 1,
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for round in 0..12 {
            let started = Instant::now();
            let mut cl = Client::connect(&path).unwrap();
            assert!(cl.report().is_ok(), "round {round}");
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "round {round}: {:?}",
                started.elapsed()
            );
            drop(cl);
            wait_for("the client to leave", Duration::from_secs(5), || {
                server.clients() < 4
            });
            if round < 4 {
                // The one idle longest went, with a line saying why.
                let got = read_until_closed(&mut held[round], Duration::from_secs(5))
                    .expect("evicted connection closed");
                assert!(got.contains("idle longest"), "round {round}: {got:?}");
            }
            // Refill, so the next round finds the socket full again.
            held.push(UnixStream::connect(&path).unwrap());
            wait_for("refilled", Duration::from_secs(5), || server.clients() == 4);
        }
        // A client using its connection is never the one evicted while others idle.
        let mut active = Client::connect(&path).unwrap();
        for _ in 0..8 {
            assert!(active.report().is_ok());
            let mut other = Client::connect(&path).unwrap();
            assert!(other.report().is_ok());
        }
    }

    #[test]
    fn idle_and_trickling_clients_are_closed_after_the_idle_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let limits = Limits {
            idle: Duration::from_millis(300),
            ..Limits::default()
        };
        let server = ControlServer::start_with(&path, passthrough().0, limits).unwrap();
        let mut silent = UnixStream::connect(&path).unwrap();
        let mut trickle = UnixStream::connect(&path).unwrap();
        let mut busy = Client::connect(&path).unwrap();
        let started = Instant::now();
        // One byte every 50 ms of a line that never ends; a request every 100 ms.
        let mut trickle_w = trickle.try_clone().unwrap();
        let trickler = std::thread::spawn(move || {
            for _ in 0..40 {
                if trickle_w.write_all(b" ").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        for _ in 0..12 {
            assert!(busy.report().is_ok(), "a working client was closed");
            std::thread::sleep(Duration::from_millis(100));
        }
        for (name, s) in [("silent", &mut silent), ("trickling", &mut trickle)] {
            let got = read_until_closed(s, Duration::from_secs(5))
                .unwrap_or_else(|| panic!("the {name} client was not closed"));
            assert!(got.contains("no request for 0.3 s"), "{name}: {got:?}");
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        trickler.join().unwrap();
        wait_for(
            "only the working client left",
            Duration::from_secs(5),
            || server.clients() == 1,
        );
    }

    #[test]
    fn a_client_that_never_reads_its_answers_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let limits = Limits {
            write: Duration::from_millis(200),
            ..Limits::default()
        };
        let (c, _) = cached(None);
        let server = ControlServer::start_with(&path, c, limits).unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        // Requests until the server stops reading them (its answers fill both buffers).
        for _ in 0..10_000 {
            if s.write_all(b"{\"op\":\"report\"}\n").is_err() {
                break;
            }
        }
        wait_for(
            "the server to drop the client",
            Duration::from_secs(10),
            || server.clients() == 0,
        );
    }
}

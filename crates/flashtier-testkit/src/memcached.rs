//! memcached servers for tests: real ones ([`Memcached`]), one that lies ([`Replayer`]) and one
//! that never answers ([`BlackHole`]).
//!
//! The memcached tier promises that nothing a server does (lose values, restart empty, come
//! back with old ones, be shared with another host) makes a read return old data. Real servers
//! show the first two; a real server never returns a value older than the last one set, so
//! [`Replayer`] does exactly that on demand, the way a server restored from a snapshot or
//! healed from a partition would.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const MEMCACHED: &str = "/usr/bin/memcached";

/// A real memcached process on a loopback port, killed on drop.
pub struct Memcached {
    child: Option<Child>,
    port: u16,
    extra: Vec<String>,
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().unwrap().port()
}

impl Memcached {
    /// Starts memcached on a free port (64 MiB, one thread) with `extra` arguments, which may
    /// override those (e.g. `["-m", "16"]`).
    pub fn start(extra: &[&str]) -> Memcached {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        // Another process may take the port between our probe and memcached's bind: then
        // memcached exits at once and another port is tried.
        for _ in 0..20 {
            if let Some(m) = Memcached::try_start(free_port(), &extra) {
                return m;
            }
        }
        panic!("memcached did not start on any of 20 ports");
    }

    fn try_start(port: u16, extra: &[String]) -> Option<Memcached> {
        if !Path::new(MEMCACHED).exists() {
            panic!("memcached not installed: run scripts/install-deps.sh");
        }
        let mut cmd = Command::new(MEMCACHED);
        cmd.args(["-l", "127.0.0.1", "-p", &port.to_string()])
            .args(["-U", "0", "-m", "64", "-t", "1"]);
        // memcached refuses to run as root unless told which user to be.
        if flashtier_io::sys::effective_uid() == 0 {
            cmd.args(["-u", "root"]);
        }
        cmd.args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().expect("spawn memcached");
        let mut m = Memcached {
            child: Some(child),
            port,
            extra: extra.to_vec(),
        };
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            let exited = m.child.as_mut().unwrap().try_wait().unwrap().is_some();
            if exited {
                m.child = None;
                return None;
            }
            // The pid check tells our memcached from whatever else may hold the port.
            let pid = m.child.as_ref().unwrap().id().to_string();
            if m.try_stats().is_some_and(|s| s.get("pid") == Some(&pid)) {
                return Some(m);
            }
            thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL): its values are gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a fresh one (empty) on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if let Some(mut m) = Memcached::try_start(self.port, &self.extra) {
                self.child = m.child.take();
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!("memcached did not restart on port {}", self.port);
    }

    /// The server's own `stats`, over a connection of its own.
    pub fn stats(&self) -> HashMap<String, String> {
        self.try_stats().expect("memcached answers stats")
    }

    /// One of the server's own `stats` numbers.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats()[name].parse().unwrap()
    }

    fn try_stats(&self) -> Option<HashMap<String, String>> {
        let addr = self.addr().parse().unwrap();
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        (&stream).write_all(b"stats\r\n").ok()?;
        let mut stats = HashMap::new();
        for line in BufReader::new(&stream).lines() {
            let line = line.ok()?;
            if line == "END" {
                return Some(stats);
            }
            let mut fields = line.splitn(3, ' ');
            if fields.next() != Some("STAT") {
                return None;
            }
            let name = fields.next()?.to_owned();
            stats.insert(name, fields.next()?.to_owned());
        }
        None
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A server that accepts connections and never answers (a hung host).
pub struct BlackHole {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl BlackHole {
    /// Listens on a free loopback port and holds every connection without a word.
    pub fn start() -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let stop = stop.clone();
            move || {
                let mut held = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => held.push(stream),
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            }
        });
        BlackHole {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A memcached stand-in (text protocol: get, set, delete) that remembers every value ever set
/// for a key, and while [`Replayer::replay`] is on answers every get with the *oldest* of them:
/// a server come back from a partition or restored from a snapshot. Deletes are ignored (a lost
/// delete). [`Replayer::corrupt`] makes it flip a bit of what it answers (a bad DIMM, a bug).
/// It runs until dropped.
pub struct Replayer {
    addr: String,
    state: Arc<ReplayState>,
}

#[derive(Default)]
struct ReplayState {
    values: Mutex<HashMap<Vec<u8>, Vec<Vec<u8>>>>,
    replay: AtomicBool,
    corrupt: AtomicBool,
    stop: AtomicBool,
}

impl Replayer {
    /// A new stand-in on a free loopback port, answering honestly (newest value) until
    /// [`Replayer::replay`].
    pub fn start() -> Replayer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().unwrap().to_string();
        let state = Arc::new(ReplayState::default());
        let s = state.clone();
        listener.set_nonblocking(true).unwrap();
        thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        // Pipelined sets get one small reply each: without this, Nagle holds
                        // the second for the client's delayed ACK (40 ms).
                        conn.set_nodelay(true).unwrap();
                        let s = s.clone();
                        thread::spawn(move || {
                            let _ = serve(conn, &s);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Replayer { addr, state }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    /// From now on, answer gets with the oldest value ever set (or the newest, `false`).
    pub fn replay(&self, on: bool) {
        self.state.replay.store(on, Ordering::Relaxed);
    }

    /// From now on, flip one bit of every value answered (`false`: answer them intact).
    pub fn corrupt(&self, on: bool) {
        self.state.corrupt.store(on, Ordering::Relaxed);
    }

    /// How many values have been set, over all keys.
    pub fn values_set(&self) -> usize {
        self.state
            .values
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum()
    }
}

impl Drop for Replayer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(conn: TcpStream, s: &ReplayState) -> std::io::Result<()> {
    let mut out = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || s.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut reply = Vec::new();
        match words.as_slice() {
            ["get" | "gets", keys @ ..] => {
                let values = s.values.lock().unwrap();
                for k in keys {
                    let chosen = values.get(k.as_bytes()).and_then(|all| {
                        if s.replay.load(Ordering::Relaxed) {
                            all.first()
                        } else {
                            all.last()
                        }
                    });
                    if let Some(v) = chosen {
                        reply.extend_from_slice(format!("VALUE {k} 0 {}\r\n", v.len()).as_bytes());
                        let at = reply.len() + v.len().saturating_sub(1);
                        reply.extend_from_slice(v);
                        if s.corrupt.load(Ordering::Relaxed) && !v.is_empty() {
                            reply[at] ^= 0x10;
                        }
                        reply.extend_from_slice(b"\r\n");
                    }
                }
                reply.extend_from_slice(b"END\r\n");
            }
            ["set", key, _flags, _exp, len, rest @ ..] => {
                let len: usize = len.parse().unwrap_or(0);
                let mut data = vec![0; len + 2];
                r.read_exact(&mut data)?;
                data.truncate(len);
                s.values
                    .lock()
                    .unwrap()
                    .entry(key.as_bytes().to_vec())
                    .or_default()
                    .push(data);
                if rest.first() != Some(&"noreply") {
                    reply.extend_from_slice(b"STORED\r\n");
                }
            }
            ["delete", _key, rest @ ..] => {
                if rest.first() != Some(&"noreply") {
                    reply.extend_from_slice(b"DELETED\r\n");
                }
            }
            _ => reply.extend_from_slice(b"ERROR\r\n"),
        }
        out.write_all(&reply)?;
    }
}

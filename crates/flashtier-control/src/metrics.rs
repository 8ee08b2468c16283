//! Prometheus metrics over a tiny std-only HTTP/1.1 responder: `GET /metrics` answers the
//! report in the text exposition format 0.0.4; any other path is 404, any other method 405.
//! One short-lived thread per scrape, one response per connection (`Connection: close`): a
//! scraper comes every few seconds, so nothing more is worth its code. Off unless asked for;
//! `:PORT` listens on loopback only.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use flashtier_nbd::{ListenAddr, ServerError};

use crate::acceptor::{Acceptor, Job};
use crate::controller::{ControlError, Controller};

/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;
/// Scrapes answered at once; more are closed at once.
const MAX_CONNECTIONS: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(5);

/// The Prometheus listener: an accept thread answering `GET /metrics` from the controller's report.
pub(crate) struct MetricsServer {
    addr: SocketAddr,
    acceptor: Acceptor,
}

impl MetricsServer {
    /// Listens on `addr` (`HOST:PORT`, or `:PORT` for loopback).
    pub fn start(addr: &str, controller: Arc<Controller>) -> Result<MetricsServer, ControlError> {
        let sock = match ListenAddr::parse(addr)? {
            ListenAddr::Tcp(a) => a,
            ListenAddr::Unix(_) => {
                return Err(ServerError::BadListenAddr(
                    addr.into(),
                    "the metrics listener needs HOST:PORT or :PORT".into(),
                )
                .into())
            }
        };
        let listener = TcpListener::bind(sock).map_err(|e| ServerError::Bind(addr.into(), e))?;
        let addr = listener.local_addr()?;
        let serve = move |stream: TcpStream| -> Job {
            let controller = controller.clone();
            Box::new(move || {
                if let Err(e) = answer(stream, &controller) {
                    tracing::debug!("metrics request: {e}");
                }
            })
        };
        // A scraper that finds every slot busy for 2 s gets the connection closed, and retries
        // next interval.
        let acceptor = Acceptor::start(
            listener,
            "flashtier-metrics",
            MAX_CONNECTIONS,
            serve,
            drop,
            || false,
        )?;
        Ok(MetricsServer { addr, acceptor })
    }

    /// The address really bound (with the port chosen for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the listener and waits for its accept thread to end.
    pub fn stop(&mut self) {
        self.acceptor.stop();
    }
}

/// Reads the request head and writes one response.
fn answer(mut s: TcpStream, c: &Controller) -> io::Result<()> {
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return respond(
                &mut s,
                "431 Request Header Fields Too Large",
                "text/plain",
                b"",
            );
        }
    }
    let head = String::from_utf8_lossy(&head);
    let mut first = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let result = match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            let body = c.report().to_prometheus();
            let body = if method == "HEAD" { "" } else { &body };
            respond(
                &mut s,
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                body.as_bytes(),
            )
        }
        ("GET" | "HEAD", _) => respond(
            &mut s,
            "404 Not Found",
            "text/plain",
            b"not found: metrics are at /metrics\n",
        ),
        _ => respond(&mut s, "405 Method Not Allowed", "text/plain", b"use GET\n"),
    };
    let _ = s.shutdown(Shutdown::Both);
    result
}

fn respond(s: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::tests::cached;

    fn get(addr: SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_404s_the_rest() {
        let (c, _) = cached(None);
        let mut m = MetricsServer::start(":0", c).unwrap();
        assert!(m.addr().ip().is_loopback(), "{}", m.addr());
        let r = get(m.addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain; version=0.0.4"), "{r}");
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(body.len(), len);
        assert!(
            body.contains("# TYPE flashtier_reads_total counter"),
            "{body}"
        );
        assert!(get(m.addr(), "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(m.addr(), "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        assert!(get(m.addr(), "garbage\n\n").starts_with("HTTP/1.1 405"));
        m.stop();
        assert!(TcpStream::connect(m.addr()).is_err(), "stopped");
    }

    #[test]
    fn unix_paths_are_refused() {
        let (c, _) = cached(None);
        let e = MetricsServer::start("/tmp/x.sock", c).err().unwrap();
        assert!(e.to_string().contains("HOST:PORT"), "{e}");
    }
}

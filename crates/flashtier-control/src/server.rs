//! The control socket: a unix socket (0600, removed on exit) speaking [`crate::protocol`].
//!
//! One thread accepts; each client gets a thread that answers its requests in order, so a
//! `stats --watch` left open never delays a `set`. A request that does not parse, names an
//! unknown operation or fails gets an error response and the connection stays usable; only a
//! line over 64 KiB (not a control request by any stretch) closes that one connection. The
//! server never exits because of what a client sent.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::acceptor::Acceptor;
use crate::controller::{ControlError, Controller};
use crate::protocol::{NameValue, Request, Response};

/// Longest request line accepted.
const MAX_LINE: u64 = 64 << 10;
/// Clients served at once; more get an error and are closed (each costs a thread).
const MAX_CLIENTS: usize = 64;

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
                 detach, attach"
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
    /// Every connected client, to close them on stop.
    clients: Arc<Mutex<HashMap<u64, UnixStream>>>,
}

impl ControlServer {
    /// Binds `path` and starts serving `controller`.
    pub fn start(path: &Path, controller: Arc<Controller>) -> Result<ControlServer, ControlError> {
        let listener = flashtier_nbd::bind_unix(path)?;
        let clients: Arc<Mutex<HashMap<u64, UnixStream>>> = Arc::default();
        let next_id = AtomicU64::new(0);
        let registry = clients.clone();
        let serve = move |stream: UnixStream| {
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            match stream.try_clone() {
                Ok(s) => registry.lock().insert(id, s),
                Err(e) => return tracing::warn!("control socket: {e}"),
            };
            if let Err(e) = serve_client(stream, &controller) {
                tracing::debug!("control client: {e}");
            }
            registry.lock().remove(&id);
        };
        let refuse = |mut stream: UnixStream| {
            let too_many = format!("too many control clients (at most {MAX_CLIENTS})");
            let _ = write_response(&mut stream, &Response::error(too_many));
        };
        let acceptor = Acceptor::start(listener, "flashtier-control", MAX_CLIENTS, serve, refuse)?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            acceptor,
            clients,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, closes every client connection and removes the socket.
    pub fn stop(&mut self) {
        self.acceptor.stop();
        for (_, s) in self.clients.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve_client(stream: UnixStream, c: &Controller) -> io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        let n = match (&mut reader).take(MAX_LINE + 1).read_line(&mut line) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                // read_line consumed the whole line before finding it was not UTF-8.
                write_response(&mut out, &Response::error("bad request: not UTF-8"))?;
                continue;
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
        write_response(&mut out, &respond(c, line.trim()))?;
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
        assert_eq!(cl.get("promotion").unwrap(), "always");
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
}

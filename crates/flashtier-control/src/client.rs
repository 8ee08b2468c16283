//! [`Client`]: the CLI's side of the control socket.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::controller::{Attached, ParamRow};
use crate::protocol::{MemcachedRequest, NameValue, Request, Response, Setting};
use crate::report::{MemcachedReport, Report};
use crate::trace::TraceStatus;

/// A reply taking longer than this means the server is stuck; say so instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Why a control request did not get an answer, or got a refusal; the messages are written for
/// the operator at the terminal.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "no flashtier server answers on {} (is `flashtier serve` running? name its control \
         socket with --control or FLASHTIER_CONTROL)",
        path.display()
    )]
    /// Nothing accepted the connection: usually no server runs, or it uses another socket.
    Connect {
        /// The control socket tried.
        path: PathBuf,
        /// What `connect` reported (not found, refused, permission denied).
        #[source]
        source: io::Error,
    },
    #[error("control connection to {} failed", path.display())]
    /// The connection broke or timed out (60 s) after it was made.
    Io {
        /// The control socket in use.
        path: PathBuf,
        /// The read or write error, including the timeout and an early close.
        #[source]
        source: io::Error,
    },
    #[error("unexpected answer from the server on {}: {what}", path.display())]
    /// The server answered with something this client cannot read, e.g. another version.
    Protocol {
        /// The control socket in use.
        path: PathBuf,
        /// What was wrong with the answer.
        what: String,
    },
    /// The server refused the request; the message says why.
    #[error("{0}")]
    Refused(String),
}

/// One connection to a server's control socket, making one request at a time; each method is
/// one request of [`Request`].
pub struct Client {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    /// Connects to the control socket at `path`; replies are awaited at most 60 s each.
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let io_err = |source| ClientError::Io {
            path: path.to_path_buf(),
            source,
        };
        stream.set_read_timeout(Some(TIMEOUT)).map_err(io_err)?;
        let writer = stream.try_clone().map_err(io_err)?;
        Ok(Client {
            path: path.to_path_buf(),
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// The control socket this client is connected to, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one request and returns its `result`, or the server's error as [`ClientError::Refused`].
    pub fn call(&mut self, req: &Request) -> Result<serde_json::Value, ClientError> {
        let io_err = |source| ClientError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_vec(req).map_err(|e| io_err(io::Error::other(e)))?;
        line.push(b'\n');
        self.writer.write_all(&line).map_err(io_err)?;
        let mut answer = String::new();
        let n = self.reader.read_line(&mut answer).map_err(io_err)?;
        if n == 0 {
            return Err(io_err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            )));
        }
        let r: Response = serde_json::from_str(&answer).map_err(|e| self.protocol(e))?;
        match (r.ok, r.error) {
            (true, _) => Ok(r.result.unwrap_or(serde_json::Value::Null)),
            (false, e) => Err(ClientError::Refused(
                e.unwrap_or_else(|| "request failed".into()),
            )),
        }
    }

    fn protocol(&self, what: impl ToString) -> ClientError {
        ClientError::Protocol {
            path: self.path.clone(),
            what: what.to_string(),
        }
    }

    fn call_as<T: serde::de::DeserializeOwned>(&mut self, req: &Request) -> Result<T, ClientError> {
        let v = self.call(req)?;
        serde_json::from_value(v).map_err(|e| self.protocol(e))
    }

    /// Fetches the server's current [`Report`]: everything `status` and `stats` show.
    pub fn report(&mut self) -> Result<Report, ClientError> {
        self.call_as(&Request::Report)
    }

    /// The raw report, for `--json` (prints exactly what the server sent).
    pub fn report_json(&mut self) -> Result<serde_json::Value, ClientError> {
        self.call(&Request::Report)
    }

    /// Reads one live parameter's value, formatted as `set` would accept it.
    pub fn get(&mut self, name: &str) -> Result<String, ClientError> {
        let nv: NameValue = self.call_as(&Request::Get { name: name.into() })?;
        Ok(nv.value)
    }

    /// Sets `name`; returns the value as the server stored it.
    pub fn set(&mut self, name: &str, value: &str, persist: bool) -> Result<String, ClientError> {
        let nv: NameValue = self.call_as(&Request::Set {
            name: name.into(),
            value: value.into(),
            persist,
        })?;
        Ok(nv.value)
    }

    /// Sets several parameters together, all or none; returns `(name, value)` as stored.
    pub fn set_many(
        &mut self,
        settings: &[(String, String)],
        persist: bool,
    ) -> Result<Vec<(String, String)>, ClientError> {
        let settings = settings
            .iter()
            .map(|(name, value)| Setting {
                name: name.clone(),
                value: value.clone(),
            })
            .collect();
        let set: Vec<NameValue> = self.call_as(&Request::SetMany { settings, persist })?;
        Ok(set.into_iter().map(|nv| (nv.name, nv.value)).collect())
    }

    /// Lists every live parameter with its value, default, range and help (`get` without a name).
    pub fn params(&mut self) -> Result<Vec<ParamRow>, ClientError> {
        self.call_as(&Request::Params)
    }

    /// Starts a mode switch; returns the mode's canonical name.
    pub fn mode(&mut self, mode: &str) -> Result<String, ClientError> {
        let v = self.call(&Request::Mode { mode: mode.into() })?;
        v.get("mode")
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .ok_or_else(|| self.protocol("no mode in the answer"))
    }

    /// Starts a manual flush in the background.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.call(&Request::Flush).map(drop)
    }

    /// Asks the running flush to stop.
    pub fn flush_cancel(&mut self) -> Result<(), ClientError> {
        self.call(&Request::FlushCancel).map(drop)
    }

    /// Makes the server count statistics from now on; the engine's counters are not touched.
    pub fn reset_stats(&mut self) -> Result<(), ClientError> {
        self.call(&Request::ResetStats).map(drop)
    }

    /// Starts detaching the cache; returns its dirty blocks as it started.
    pub fn detach(&mut self, force: bool) -> Result<u64, ClientError> {
        let v = self.call(&Request::Detach { force })?;
        v.get("dirty_blocks")
            .and_then(|m| m.as_u64())
            .ok_or_else(|| self.protocol("no dirty_blocks in the answer"))
    }

    /// Attaches a cache (`cache`: a device; `None`: the one detached).
    pub fn attach(
        &mut self,
        cache: Option<&str>,
        mode: Option<&str>,
        force: bool,
    ) -> Result<Attached, ClientError> {
        self.call_as(&Request::Attach {
            cache: cache.map(str::to_string),
            mode: mode.map(str::to_string),
            force,
        })
    }

    /// Starts a scrub in the background, at most `rate` bytes per second.
    pub fn scrub(&mut self, rate: Option<u64>) -> Result<(), ClientError> {
        self.call(&Request::Scrub { rate }).map(drop)
    }

    /// Asks the running scrub to stop.
    pub fn scrub_cancel(&mut self) -> Result<(), ClientError> {
        self.call(&Request::ScrubCancel).map(drop)
    }

    /// Starts a trace of the clients' requests into a new file at `path` (absolute).
    pub fn trace_start(&mut self, path: &str) -> Result<TraceStatus, ClientError> {
        self.call_as(&Request::TraceStart {
            path: path.to_string(),
        })
    }

    /// Stops the trace (with `path`: only a trace into that file); returns what it recorded.
    pub fn trace_stop(&mut self, path: Option<&str>) -> Result<TraceStatus, ClientError> {
        self.call_as(&Request::TraceStop {
            path: path.map(str::to_string),
        })
    }

    /// Forgets lost blocks (all, or those bytes `offset`.. `length` touch); returns how many.
    pub fn forget_lost(
        &mut self,
        offset: Option<u64>,
        length: Option<u64>,
    ) -> Result<u64, ClientError> {
        let v = self.call(&Request::ForgetLost { offset, length })?;
        v.get("forgotten")
            .and_then(|m| m.as_u64())
            .ok_or_else(|| self.protocol("no forgotten in the answer"))
    }

    /// Operates the memcached tier (list, add or remove a server, change its mode, turn it on
    /// or off); returns the tier as it is afterwards.
    pub fn memcached(&mut self, req: MemcachedRequest) -> Result<MemcachedReport, ClientError> {
        self.call_as(&Request::Memcached(req))
    }
}

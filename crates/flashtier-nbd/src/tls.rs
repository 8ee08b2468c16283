//! TLS for NBD (`NBD_OPT_STARTTLS`), both ends, with the system's OpenSSL.
//!
//! Authentication is what nbdkit and qemu offer, with the same files, so existing credentials
//! work: X.509 certificates from a directory (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`
//! on a server; `ca-cert.pem` and optionally `client-cert.pem`, `client-key.pem` on a client),
//! optionally requiring client certificates signed by the CA, or pre-shared keys from a file of
//! `username:hexkey` lines. OpenSSL rather than rustls: rustls has no external-PSK support, and
//! qemu's and libnbd's PSK mode is exactly that.
//!
//! [`TlsStream`] makes one TLS session usable from a reader thread and writer threads at once: an
//! `SSL` object must never be used by two threads at the same time, and TLS reads may need to
//! write (and writes to read), so the socket is non-blocking, every OpenSSL call is made under one
//! mutex, and waiting for the socket (`poll`) happens outside it. A thread blocked reading never
//! holds the lock a writer needs.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::RawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use openssl::ssl::{
    self, ErrorCode, SslAcceptor, SslConnector, SslFiletype, SslMethod, SslStream, SslVerifyMode,
    SslVersion,
};
use parking_lot::Mutex;

use crate::net::Stream;

/// Whether the server offers or insists on TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// `NBD_OPT_STARTTLS` is refused.
    #[default]
    Off,
    /// Clients may upgrade with STARTTLS, or stay in plain text.
    On,
    /// Every option but STARTTLS and ABORT is refused with `NBD_REP_ERR_TLS_REQD` until TLS runs
    /// (the spec's FORCEDTLS mode): no data without authentication.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<TlsMode, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("'{s}' is not a TLS mode (off, on, require)")),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// Errors setting up TLS.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    PskFile {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    OpenSsl {
        what: String,
        source: openssl::error::ErrorStack,
    },
}

fn openssl_err(what: impl Into<String>) -> impl FnOnce(openssl::error::ErrorStack) -> TlsError {
    let what = what.into();
    move |source| TlsError::OpenSsl { what, source }
}

/// Pre-shared keys: `username:hexkey` per line, as nbdkit's `--tls-psk` and qemu's `keys.psk`.
#[derive(Clone)]
pub struct PskKeys {
    keys: HashMap<String, Vec<u8>>,
}

impl fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the keys themselves.
        write!(f, "PskKeys({} users)", self.keys.len())
    }
}

impl PskKeys {
    pub fn load(path: &Path) -> Result<PskKeys, TlsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        warn_if_readable_by_others(path);
        PskKeys::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<PskKeys, TlsError> {
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |message: &str| TlsError::PskFile {
                path: path.to_path_buf(),
                line: i + 1,
                message: message.to_string(),
            };
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let (user, hex) = line
                .split_once(':')
                .ok_or_else(|| bad("expected username:hexkey"))?;
            if user.is_empty() {
                return Err(bad("empty username"));
            }
            let key = decode_hex(hex.trim()).ok_or_else(|| bad("the key is not hexadecimal"))?;
            if key.is_empty() || key.len() > 256 {
                return Err(bad("the key must be 1 to 256 bytes"));
            }
            if keys.insert(user.to_string(), key).is_some() {
                return Err(bad("username listed twice"));
            }
        }
        if keys.is_empty() {
            return Err(TlsError::Config(format!(
                "{}: no keys (expected username:hexkey lines)",
                path.display()
            )));
        }
        Ok(PskKeys { keys })
    }

    pub fn get(&self, user: &str) -> Option<&[u8]> {
        self.keys.get(user).map(Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A private key or PSK file others can read is a secret already shared with them.
fn warn_if_readable_by_others(path: &Path) {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o044 != 0 {
            tracing::warn!(
                file = %path.display(),
                mode = format!("{:o}", meta.permissions().mode() & 0o777),
                "this secret is readable by other users; chmod 600 it"
            );
        }
    }
}

/// How a server authenticates its clients.
#[derive(Debug, Clone)]
pub struct ServerTlsOptions {
    pub mode: TlsMode,
    /// Directory with `server-cert.pem`, `server-key.pem` and (with `verify_peer`) `ca-cert.pem`.
    pub certificates: Option<PathBuf>,
    /// File of `username:hexkey` lines.
    pub psk: Option<PathBuf>,
    /// Require a client certificate signed by `ca-cert.pem`.
    pub verify_peer: bool,
}

/// A server's TLS configuration, loaded once at start.
pub struct ServerTls {
    mode: TlsMode,
    acceptor: SslAcceptor,
    description: String,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServerTls({}, {})", self.mode, self.description)
    }
}

impl ServerTls {
    /// Loads the credentials; `None` when TLS is off. Every mistake (missing file, bad key,
    /// certificate and key that do not match) is reported here, not at the first client.
    pub fn new(opts: &ServerTlsOptions) -> Result<Option<Arc<ServerTls>>, TlsError> {
        let creds = opts.certificates.is_some() || opts.psk.is_some();
        match opts.mode {
            TlsMode::Off if creds || opts.verify_peer => {
                return Err(TlsError::Config(
                    "TLS credentials were given but TLS is off: add --tls on or --tls require"
                        .into(),
                ))
            }
            TlsMode::Off => return Ok(None),
            _ if !creds => {
                return Err(TlsError::Config(format!(
                    "--tls {} needs credentials: --tls-certificates DIR (X.509) or --tls-psk \
                     FILE (pre-shared keys)",
                    opts.mode
                )))
            }
            _ => {}
        }
        if opts.certificates.is_some() && opts.psk.is_some() {
            return Err(TlsError::Config(
                "give either --tls-certificates or --tls-psk, not both".into(),
            ));
        }
        if opts.verify_peer && opts.certificates.is_none() {
            return Err(TlsError::Config(
                "--tls-verify-peer checks client certificates: it needs --tls-certificates (a \
                 PSK already authenticates the client)"
                    .into(),
            ));
        }
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
            .map_err(openssl_err("cannot set up OpenSSL"))?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(openssl_err("cannot require TLS 1.2"))?;
        // Sessions are not resumed (each NBD connection lives long): no tickets to send.
        b.set_num_tickets(0)
            .map_err(openssl_err("cannot disable session tickets"))?;
        let description;
        if let Some(dir) = &opts.certificates {
            let cert = dir.join("server-cert.pem");
            let key = dir.join("server-key.pem");
            for f in [&cert, &key] {
                if !f.is_file() {
                    return Err(TlsError::Config(format!(
                        "{} does not exist (the certificates directory holds ca-cert.pem, \
                         server-cert.pem and server-key.pem)",
                        f.display()
                    )));
                }
            }
            warn_if_readable_by_others(&key);
            b.set_certificate_chain_file(&cert)
                .map_err(openssl_err(format!("cannot load {}", cert.display())))?;
            b.set_private_key_file(&key, SslFiletype::PEM)
                .map_err(openssl_err(format!("cannot load {}", key.display())))?;
            b.check_private_key().map_err(openssl_err(format!(
                "{} does not match {}",
                key.display(),
                cert.display()
            )))?;
            if opts.verify_peer {
                let ca = dir.join("ca-cert.pem");
                b.set_ca_file(&ca)
                    .map_err(openssl_err(format!("cannot load {}", ca.display())))?;
                b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
            } else {
                b.set_verify(SslVerifyMode::NONE);
            }
            description = format!(
                "X.509 certificates from {}{}",
                dir.display(),
                if opts.verify_peer {
                    ", client certificates required"
                } else {
                    ""
                }
            );
        } else {
            let path = opts.psk.as_ref().expect("checked above");
            let keys = PskKeys::load(path)?;
            description = format!(
                "pre-shared keys from {} ({} users)",
                path.display(),
                keys.len()
            );
            // TLS 1.2 PSK suites (TLS 1.3 uses its own suites with the same callback).
            b.set_cipher_list("ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256")
                .map_err(openssl_err("cannot select PSK cipher suites"))?;
            b.set_verify(SslVerifyMode::NONE);
            let index = psk_user_index().map_err(openssl_err("OpenSSL ex_data"))?;
            b.set_psk_server_callback(move |ssl, identity, out| {
                let user = identity.and_then(|i| std::str::from_utf8(i).ok());
                match user.and_then(|u| keys.get(u).map(|k| (u, k))) {
                    Some((user, key)) if key.len() <= out.len() => {
                        out[..key.len()].copy_from_slice(key);
                        // TLS 1.3 does not keep the identity where SSL_get_psk_identity looks.
                        ssl.set_ex_data(index, user.to_string());
                        Ok(key.len())
                    }
                    // 0: unknown user; the handshake fails.
                    _ => Ok(0),
                }
            });
        }
        Ok(Some(Arc::new(ServerTls {
            mode: opts.mode,
            acceptor: b.build(),
            description,
        })))
    }

    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// What authenticates clients, for the log and the startup message.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Runs the server side of the TLS handshake on `stream`, failing once `deadline` passes.
    pub fn accept(&self, stream: &Stream, deadline: Instant) -> io::Result<TlsStream> {
        let ssl = ssl::Ssl::new(self.acceptor.context()).map_err(io::Error::other)?;
        TlsStream::handshake(ssl, stream, Some(deadline), true)
    }
}

/// Where the PSK callback leaves the user it authenticated, for the log.
fn psk_user_index() -> Result<openssl::ex_data::Index<ssl::Ssl, String>, openssl::error::ErrorStack>
{
    static INDEX: std::sync::OnceLock<openssl::ex_data::Index<ssl::Ssl, String>> =
        std::sync::OnceLock::new();
    if let Some(i) = INDEX.get() {
        return Ok(*i);
    }
    let i = ssl::Ssl::new_ex_index()?;
    Ok(*INDEX.get_or_init(|| i))
}

/// How a client authenticates itself and the server.
#[derive(Clone)]
pub enum ClientCredentials {
    /// Verify the server against `ca-cert.pem` in the directory (else the system's CAs); present
    /// `client-cert.pem` and `client-key.pem` if the directory has them.
    X509 {
        dir: Option<PathBuf>,
        verify_peer: bool,
        /// The name the server's certificate must carry; None: no name check.
        hostname: Option<String>,
    },
    Psk {
        username: String,
        keys: PskKeys,
    },
}

/// A client's TLS configuration.
pub struct ClientTls {
    connector: SslConnector,
    hostname: Option<String>,
    verify_hostname: bool,
}

impl ClientTls {
    pub fn new(creds: &ClientCredentials) -> Result<ClientTls, TlsError> {
        let mut b = SslConnector::builder(SslMethod::tls_client())
            .map_err(openssl_err("cannot set up OpenSSL"))?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(openssl_err("cannot require TLS 1.2"))?;
        let (hostname, verify_hostname) = match creds {
            ClientCredentials::X509 {
                dir,
                verify_peer,
                hostname,
            } => {
                if let Some(dir) = dir {
                    let ca = dir.join("ca-cert.pem");
                    if ca.is_file() {
                        b.set_ca_file(&ca)
                            .map_err(openssl_err(format!("cannot load {}", ca.display())))?;
                    }
                    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
                    if cert.is_file() && key.is_file() {
                        b.set_certificate_chain_file(&cert)
                            .map_err(openssl_err(format!("cannot load {}", cert.display())))?;
                        b.set_private_key_file(&key, SslFiletype::PEM)
                            .map_err(openssl_err(format!("cannot load {}", key.display())))?;
                    }
                }
                if !verify_peer {
                    b.set_verify(SslVerifyMode::NONE);
                }
                (hostname.clone(), *verify_peer && hostname.is_some())
            }
            ClientCredentials::Psk { username, keys } => {
                let key = keys
                    .get(username)
                    .ok_or_else(|| {
                        TlsError::Config(format!("the PSK file has no key for user '{username}'"))
                    })?
                    .to_vec();
                let identity = username.clone().into_bytes();
                b.set_verify(SslVerifyMode::NONE);
                b.set_cipher_list("ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256")
                    .map_err(openssl_err("cannot select PSK cipher suites"))?;
                b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
                    // The identity is written as a NUL-terminated string.
                    if identity.len() >= id_out.len() || key.len() > key_out.len() {
                        return Ok(0);
                    }
                    id_out[..identity.len()].copy_from_slice(&identity);
                    id_out[identity.len()] = 0;
                    key_out[..key.len()].copy_from_slice(&key);
                    Ok(key.len())
                });
                (None, false)
            }
        };
        Ok(ClientTls {
            connector: b.build(),
            hostname,
            verify_hostname,
        })
    }

    /// Runs the client side of the TLS handshake on `stream`.
    pub fn connect(&self, stream: &Stream, deadline: Option<Instant>) -> io::Result<TlsStream> {
        let mut config = self.connector.configure().map_err(io::Error::other)?;
        config.set_verify_hostname(self.verify_hostname);
        let ssl = match &self.hostname {
            Some(h) => config.into_ssl(h),
            None => {
                config.set_use_server_name_indication(false);
                config.into_ssl("")
            }
        }
        .map_err(io::Error::other)?;
        TlsStream::handshake(ssl, stream, deadline, false)
    }
}

/// The socket under OpenSSL: non-blocking reads and writes on our own duplicate of the fd.
struct Sock(Stream);

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.0).read(buf)
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&self.0).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A TLS session that a reader and writers on other threads may use at once (see the module
/// documentation).
pub struct TlsStream {
    ssl: Mutex<SslStream<Sock>>,
    fd: RawFd,
    peer: String,
}

/// Largest write that is first copied together with what precedes it, so that a reply header
/// and a small payload go out in one TLS record.
const COALESCE: usize = 16 * 1024;

impl TlsStream {
    fn handshake(
        ssl: ssl::Ssl,
        stream: &Stream,
        deadline: Option<Instant>,
        server: bool,
    ) -> io::Result<TlsStream> {
        let sock = stream.try_clone()?;
        sock.set_nonblocking(true)?;
        let fd = sock.fd();
        let ssl = SslStream::new(ssl, Sock(sock)).map_err(io::Error::other)?;
        let t = TlsStream {
            ssl: Mutex::new(ssl),
            fd,
            peer: String::new(),
        };
        t.call(deadline, |s| if server { s.accept() } else { s.connect() })
            .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake failed: {e}")))?;
        let peer = {
            let s = t.ssl.lock();
            let ssl = s.ssl();
            let version = ssl.version_str();
            let psk_user = psk_user_index().ok().and_then(|i| ssl.ex_data(i));
            let who = if let Some(user) = psk_user {
                format!("PSK user '{user}'")
            } else if let Some(cert) = ssl.peer_certificate() {
                let names: Vec<String> = cert
                    .subject_name()
                    .entries()
                    .filter_map(|e| e.data().to_string().ok())
                    .collect();
                format!("certificate '{}'", names.join(", "))
            } else {
                "no client certificate".to_string()
            };
            format!("{version}, {who}")
        };
        Ok(TlsStream { peer, ..t })
    }

    /// Who is on the other end and how (for the log).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Runs `op` under the lock until it no longer wants the socket, waiting for it outside the
    /// lock; `TimedOut` once `deadline` passes.
    fn call<T>(
        &self,
        deadline: Option<Instant>,
        mut op: impl FnMut(&mut SslStream<Sock>) -> Result<T, ssl::Error>,
    ) -> io::Result<T> {
        loop {
            let result = op(&mut self.ssl.lock());
            let e = match result {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let events = match e.code() {
                ErrorCode::WANT_READ => libc::POLLIN,
                ErrorCode::WANT_WRITE => libc::POLLOUT,
                ErrorCode::ZERO_RETURN => return Err(io::ErrorKind::UnexpectedEof.into()),
                ErrorCode::SYSCALL => {
                    return Err(match e.into_io_error() {
                        Ok(io) => io,
                        Err(_) => io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                _ => {
                    let msg = e
                        .ssl_error()
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| e.to_string());
                    return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
                }
            };
            wait_for(self.fd, events, deadline)?;
        }
    }

    pub fn read_until(&self, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.call(deadline, |s| s.ssl_read(buf)) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            r => r,
        }
    }

    pub fn write_until(&self, buf: &[u8], deadline: Option<Instant>) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.call(deadline, |s| s.ssl_write(buf))
    }

    /// Writes the first of `bufs` together with as much of the next as fits in one record.
    fn write_vectored_until(
        &self,
        bufs: &[io::IoSlice<'_>],
        deadline: Option<Instant>,
    ) -> io::Result<usize> {
        let mut nonempty = bufs.iter().filter(|b| !b.is_empty());
        let Some(first) = nonempty.next() else {
            return Ok(0);
        };
        if first.len() >= COALESCE {
            return self.write_until(first, deadline);
        }
        let mut joined = Vec::with_capacity(COALESCE);
        joined.extend_from_slice(first);
        for b in nonempty {
            let take = b.len().min(COALESCE - joined.len());
            joined.extend_from_slice(&b[..take]);
            if joined.len() == COALESCE {
                break;
            }
        }
        self.write_until(&joined, deadline)
    }

    /// Waits up to `timeout` for something to read: decrypted data OpenSSL holds already, or
    /// bytes (or end of stream) on the socket. False on timeout. Read-ahead is off, so OpenSSL
    /// holds no bytes beyond the record being read: `SSL_pending` plus the socket cover all.
    pub fn wait_readable(&self, timeout: std::time::Duration) -> bool {
        if self.ssl.lock().ssl().pending() > 0 {
            return true;
        }
        crate::net::poll_readable(self.fd, timeout)
    }

    /// Sends a TLS close_notify, best effort.
    pub fn close(&self) {
        let _ = self.ssl.lock().shutdown();
    }
}

/// Waits until `fd` is ready for `events` (or reports an error or hangup, which the next
/// OpenSSL call then sees).
fn wait_for(fd: RawFd, events: i16, deadline: Option<Instant>) -> io::Result<()> {
    loop {
        let timeout = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer did not finish the handshake in time",
                    ));
                }
                left.as_millis().clamp(1, i32::MAX as u128) as i32
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, timeout) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One side of a [`TlsStream`] as `Read`/`Write`, with an optional deadline.
pub struct TlsIo<'a> {
    pub tls: &'a TlsStream,
    pub deadline: Option<Instant>,
}

impl Read for TlsIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tls.read_until(buf, self.deadline)
    }
}

impl Write for TlsIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tls.write_until(buf, self.deadline)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.tls.write_vectored_until(bufs, self.deadline)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_like_nbdkits() {
        let p = Path::new("keys.psk");
        let k = PskKeys::parse(p, "alice:0123456789abcdefABCDEF\n\n# x\nbob:00ff\r\n").unwrap();
        assert_eq!(k.len(), 2);
        assert_eq!(
            k.get("alice").unwrap(),
            &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xab, 0xcd, 0xef]
        );
        assert_eq!(k.get("bob").unwrap(), &[0, 255]);
        assert!(k.get("carol").is_none());
        for (bad, why) in [
            ("alice", ":1: expected username:hexkey"),
            ("alice:xyz0", ":1: the key is not hexadecimal"),
            ("alice:123", ":1: the key is not hexadecimal"),
            (":00", ":1: empty username"),
            ("a:00\na:01", ":2: username listed twice"),
            ("a:", ":1: the key must be"),
            ("\n# nothing\n", "no keys"),
        ] {
            let e = PskKeys::parse(p, bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        // Debug output never shows a key.
        assert_eq!(format!("{k:?}"), "PskKeys(2 users)");
    }

    #[test]
    fn modes_parse_and_credentials_are_checked_at_start() {
        assert_eq!("require".parse::<TlsMode>().unwrap(), TlsMode::Require);
        assert!("yes".parse::<TlsMode>().is_err());
        let opts =
            |mode, certificates: Option<&str>, psk: Option<&str>, verify_peer| ServerTlsOptions {
                mode,
                certificates: certificates.map(PathBuf::from),
                psk: psk.map(PathBuf::from),
                verify_peer,
            };
        assert!(ServerTls::new(&opts(TlsMode::Off, None, None, false))
            .unwrap()
            .is_none());
        let err = |o| ServerTls::new(&o).unwrap_err().to_string();
        assert!(err(opts(TlsMode::Require, None, None, false)).contains("needs credentials"));
        assert!(err(opts(TlsMode::Off, Some("/x"), None, false)).contains("TLS is off"));
        assert!(err(opts(TlsMode::On, Some("/x"), Some("/y"), false)).contains("not both"));
        assert!(err(opts(TlsMode::On, None, Some("/y"), true)).contains("needs --tls-certificates"));
        assert!(err(opts(TlsMode::On, Some("/nonexistent"), None, false))
            .contains("/nonexistent/server-cert.pem does not exist"));
        assert!(
            err(opts(TlsMode::On, None, Some("/nonexistent.psk"), false))
                .contains("cannot read /nonexistent.psk")
        );
    }
}

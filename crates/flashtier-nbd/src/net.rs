//! Where the server listens: a unix socket (the default) or TCP, and the stream type both yield.

use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::ServerError;

/// The IANA port for NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// A listening address as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl ListenAddr {
    /// Parses `unix:PATH`, `tcp:HOST:PORT`, `HOST:PORT`, `:PORT` (loopback), or a socket path.
    ///
    /// TCP binds to loopback unless an address is named explicitly, so a forgotten host never
    /// exposes a disk to the network.
    pub fn parse(s: &str) -> Result<ListenAddr, ServerError> {
        let bad = |why: &str| ServerError::BadListenAddr(s.to_string(), why.to_string());
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("empty socket path"));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        let tcp = |hostport: &str| -> Result<ListenAddr, ServerError> {
            let (host, port) = hostport
                .rsplit_once(':')
                .ok_or_else(|| bad("expected HOST:PORT"))?;
            let port: u16 = port.parse().map_err(|_| bad("port is not a number"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let host = if host.is_empty() { "127.0.0.1" } else { host };
            let addr = (host, port)
                .to_socket_addrs()
                .map_err(|e| bad(&e.to_string()))?
                .next()
                .ok_or_else(|| bad("host has no address"))?;
            Ok(ListenAddr::Tcp(addr))
        };
        if let Some(rest) = s.strip_prefix("tcp:") {
            return tcp(rest);
        }
        if s.contains('/') {
            return Ok(ListenAddr::Unix(PathBuf::from(s)));
        }
        match s.rsplit_once(':') {
            Some((_, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                tcp(s)
            }
            _ if s.is_empty() => Err(bad("empty address")),
            _ => Ok(ListenAddr::Unix(PathBuf::from(s))),
        }
    }

    /// The NBD URI a client uses to reach this address.
    pub fn uri(&self) -> String {
        match self {
            ListenAddr::Unix(p) => format!("nbd+unix:///?socket={}", p.display()),
            ListenAddr::Tcp(a) => format!("nbd://{a}/"),
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// A bound, listening socket. A unix socket file is removed when this is dropped.
pub struct Listener {
    inner: ListenerInner,
    addr: ListenAddr,
}

enum ListenerInner {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub fn bind(addr: &ListenAddr) -> Result<Listener, ServerError> {
        let inner = match addr {
            ListenAddr::Unix(path) => ListenerInner::Unix(bind_unix(path)?),
            ListenAddr::Tcp(a) => ListenerInner::Tcp(
                TcpListener::bind(a).map_err(|e| ServerError::Bind(addr.to_string(), e))?,
            ),
        };
        let addr = match (&inner, addr) {
            // Report the real port when the caller asked for port 0.
            (ListenerInner::Tcp(l), _) => ListenAddr::Tcp(
                l.local_addr()
                    .map_err(|e| ServerError::Bind(addr.to_string(), e))?,
            ),
            (_, a) => a.clone(),
        };
        let listener = Listener { inner, addr };
        listener
            .set_nonblocking()
            .map_err(|e| ServerError::Bind(listener.addr.to_string(), e))?;
        Ok(listener)
    }

    pub fn addr(&self) -> &ListenAddr {
        &self.addr
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        match &self.inner {
            ListenerInner::Unix(l) => l.set_nonblocking(true),
            ListenerInner::Tcp(l) => l.set_nonblocking(true),
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        match &self.inner {
            ListenerInner::Unix(l) => l.as_raw_fd(),
            ListenerInner::Tcp(l) => l.as_raw_fd(),
        }
    }

    /// Accepts one connection; `WouldBlock` when none is pending.
    pub(crate) fn accept(&self) -> io::Result<(Stream, String)> {
        match &self.inner {
            ListenerInner::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok((Stream::Unix(s), "unix".to_string()))
            }
            ListenerInner::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                set_keepalive(s.as_raw_fd())?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let ListenAddr::Unix(path) = &self.addr {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Waits up to `timeout` until `fd` has something to read (or reports an error or hangup).
pub(crate) fn poll_readable(fd: RawFd, timeout: std::time::Duration) -> bool {
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r >= 0 {
            return r > 0;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // Let the read that follows report the error.
            return true;
        }
    }
}

/// TCP keepalive: a client whose machine vanished (no FIN, no RST: a half-open connection) is
/// noticed after [`KEEPALIVE_IDLE_SECS`] + [`KEEPALIVE_COUNT`] × [`KEEPALIVE_INTERVAL_SECS`]
/// seconds of silence, and its connection closed, instead of holding a slot forever.
pub const KEEPALIVE_IDLE_SECS: i32 = 60;
pub const KEEPALIVE_INTERVAL_SECS: i32 = 10;
pub const KEEPALIVE_COUNT: i32 = 6;

fn set_keepalive(fd: RawFd) -> io::Result<()> {
    let set = |level, name, value: i32| {
        // SAFETY: setsockopt reads one c_int from a valid pointer.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE_SECS)?;
    set(
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        KEEPALIVE_INTERVAL_SECS,
    )?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_COUNT)
}

/// Binds a unix socket only this user can use: mode 0600 from the moment it exists, whatever
/// the umask. A stale socket of ours from a crash is replaced; a live one is [`ServerError::InUse`];
/// anything else in the way is an error and stays untouched: a file that is not a socket, a
/// symlink (never followed or removed: in a directory others can write it may be a trap), or
/// a stale socket another user owns (not ours to delete). Missing parent directories are created
/// mode 0755 (never more). Also used by the control socket.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    let shown = path.display().to_string();
    let err = |e: io::Error| ServerError::Bind(shown.clone(), e);
    let refuse = |kind, why: String| err(io::Error::new(kind, why));
    let me = flashtier_io::sys::effective_uid();
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            // A live server answers; a stale socket from a crash refuses and can be replaced.
            if UnixStream::connect(path).is_ok() {
                return Err(ServerError::InUse(shown));
            }
            if meta.uid() != me {
                return Err(refuse(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "a stale socket owned by uid {} is in the way; it is not this server's \
                         (uid {me}) to remove",
                        meta.uid()
                    ),
                ));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(refuse(
                io::ErrorKind::AlreadyExists,
                "a symbolic link is in the way (a socket is never created through a link)".into(),
            ))
        }
        Ok(_) => {
            return Err(refuse(
                io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way".into(),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(err)?;
    }
    // bind(2) creates the file with 0777 & ~umask, and refuses (EADDRINUSE) if anything, a
    // symlink included, took the name meanwhile. A chmod afterwards would follow a symlink
    // swapped in after the bind (in a directory others can write), so the umask does the work.
    // It is process-wide: the lock keeps two binds from restoring each other's mask.
    let listener = {
        static UMASK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _umask = UMASK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: umask only swaps the process mask; restored right after bind.
        let old = unsafe { libc::umask(0o177) };
        let result = UnixListener::bind(path);
        unsafe { libc::umask(old) };
        result.map_err(err)?
    };
    // What we made, as a check on the above (never by a path that could be a link: lstat).
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() && m.uid() == me && m.mode() & 0o077 == 0 => {
            Ok(listener)
        }
        Ok(m) => Err(refuse(
            io::ErrorKind::PermissionDenied,
            format!(
                "the socket came out with mode {:o}, owner {}: something else is changing it",
                m.mode() & 0o7777,
                m.uid()
            ),
        )),
        Err(e) => Err(err(e)),
    }
}

/// A connected client.
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    pub fn set_nonblocking(&self, yes: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(yes),
            Stream::Tcp(s) => s.set_nonblocking(yes),
        }
    }

    pub fn fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }

    /// Waits up to `timeout` for data, end of stream or an error to read; false on timeout.
    pub fn wait_readable(&self, timeout: std::time::Duration) -> bool {
        poll_readable(self.fd(), timeout)
    }

    pub fn is_tcp(&self) -> bool {
        matches!(self, Stream::Tcp(_))
    }

    /// Connects to an address the way a client would (used by the NBD client and tests).
    pub fn connect(addr: &ListenAddr) -> io::Result<Stream> {
        match addr {
            ListenAddr::Unix(p) => Ok(Stream::Unix(UnixStream::connect(p)?)),
            ListenAddr::Tcp(a) => {
                let s = TcpStream::connect(a)?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write_vectored(bufs),
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes `bufs` whole, then flushes (a TLS stream holds back what it has not flushed).
pub(crate) fn write_all_vectored<W: Write + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectored_write_survives_short_writes() {
        struct Dribble(Vec<u8>);
        impl Write for Dribble {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                let n = b.len().min(3);
                self.0.extend_from_slice(&b[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut w = Dribble(Vec::new());
        write_all_vectored(
            &mut w,
            &mut [
                IoSlice::new(b"hello "),
                IoSlice::new(b""),
                IoSlice::new(b"world"),
            ],
        )
        .unwrap();
        assert_eq!(w.0, b"hello world");
    }
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn listen_address_forms() {
        let tcp = |s: &str| match ListenAddr::parse(s).unwrap() {
            ListenAddr::Tcp(a) => a,
            other => panic!("{s} parsed as {other:?}"),
        };
        let unix = |s: &str| match ListenAddr::parse(s).unwrap() {
            ListenAddr::Unix(p) => p,
            other => panic!("{s} parsed as {other:?}"),
        };
        assert_eq!(tcp(":10809").to_string(), "127.0.0.1:10809");
        assert_eq!(tcp("0.0.0.0:10809").to_string(), "0.0.0.0:10809");
        assert_eq!(tcp("[::1]:5000").to_string(), "[::1]:5000");
        assert_eq!(tcp("tcp::7").to_string(), "127.0.0.1:7");
        assert!(tcp("localhost:10809").ip().is_loopback());
        assert_eq!(
            unix("/run/flashtier/nbd.sock"),
            PathBuf::from("/run/flashtier/nbd.sock")
        );
        assert_eq!(unix("nbd.sock"), PathBuf::from("nbd.sock"));
        assert_eq!(unix("unix:x:1"), PathBuf::from("x:1"));
        assert!(ListenAddr::parse("").is_err());
        assert!(ListenAddr::parse("unix:").is_err());
        assert!(ListenAddr::parse("tcp:host").is_err());
        assert!(ListenAddr::parse(":99999").is_err());
    }

    #[test]
    fn unix_socket_is_private_and_stale_sockets_are_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/nbd.sock");
        let addr = ListenAddr::Unix(path.clone());
        let l = Listener::bind(&addr).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A second server on the same live socket is refused.
        assert!(matches!(Listener::bind(&addr), Err(ServerError::InUse(_))));
        // Simulate a crash: the socket file stays but nobody listens.
        std::mem::forget(l);
        // (the forgotten listener's fd is still open, so close it by rebinding after removal)
        let stale = UnixListener::bind(dir.path().join("stale.sock")).unwrap();
        drop(stale);
        let stale_addr = ListenAddr::Unix(dir.path().join("stale.sock"));
        let l2 = Listener::bind(&stale_addr).unwrap();
        drop(l2);
        assert!(!dir.path().join("stale.sock").exists());
        // A regular file in the way is never deleted.
        let file = dir.path().join("precious");
        std::fs::write(&file, b"data").unwrap();
        assert!(Listener::bind(&ListenAddr::Unix(file.clone())).is_err());
        assert_eq!(std::fs::read(&file).unwrap(), b"data");
    }

    #[test]
    fn a_symlink_in_the_way_is_never_followed_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
        for target in [victim.clone(), dir.path().join("nothing-here")] {
            let link = dir.path().join("nbd.sock");
            std::os::unix::fs::symlink(&target, &link).unwrap();
            let e = bind_unix(&link).unwrap_err().to_string();
            assert!(e.contains("symbolic link"), "{e}");
            assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
            std::fs::remove_file(&link).unwrap();
        }
        assert!(
            !dir.path().join("nothing-here").exists(),
            "nothing created through it"
        );
        let meta = std::fs::metadata(&victim).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o7777,
            0o644,
            "victim's mode untouched"
        );
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn another_users_stale_socket_is_not_ours_to_remove() {
        if flashtier_io::sys::effective_uid() != 0 {
            eprintln!("skipped: needs root to give a socket away");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        drop(UnixListener::bind(&path).unwrap());
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let e = bind_unix(&path).unwrap_err().to_string();
        assert!(
            e.contains("uid 65534") && e.contains("not this server"),
            "{e}"
        );
        assert_eq!(
            std::fs::symlink_metadata(&path).unwrap().uid(),
            65534,
            "left there"
        );
        // Our own stale socket is replaced, and the new one is ours and private.
        std::os::unix::fs::chown(&path, Some(0), Some(0)).unwrap();
        let _l = bind_unix(&path).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600));
    }
}

//! systemd's service notification protocol (sd_notify(3)), for `Type=notify` units: `serve`
//! says `READY=1` once its sockets accept connections, so units ordered after it (an
//! nbd-client, a mount) start only then, and `STOPPING=1` when a signal starts the clean
//! shutdown. Outside systemd (`NOTIFY_SOCKET` unset) nothing is sent.
//!
//! The protocol is one datagram of `KEY=VALUE` lines to the unix socket named by
//! `NOTIFY_SOCKET`: a path, or an abstract name when it starts with `@`.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` to the service manager, if there is one. A failure is logged, never fatal:
/// systemd then reports the unit as not started, which says more than exiting would.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&socket, state) {
        tracing::warn!(
            "cannot notify the service manager at NOTIFY_SOCKET={}: {e}",
            socket.to_string_lossy()
        );
    }
}

fn send(socket: &OsStr, state: &str) -> std::io::Result<()> {
    let addr = match socket.as_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)?
        }
        None => SocketAddr::from_pathname(socket)?,
    };
    let n = UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &addr)?;
    if n != state.len() {
        return Err(std::io::Error::other("short datagram"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::linux::net::SocketAddrExt;

    #[test]
    fn abstract_and_path_sockets_get_the_datagram() {
        let name = format!("flashtier-notify-test-{}", std::process::id());
        let abs = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        send(OsStr::new(&format!("@{name}")), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = abs.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "STOPPING=1").unwrap();
        let n = sock.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
        assert!(send(OsStr::new("/nonexistent/notify"), "READY=1").is_err());
    }
}

//! NBD URIs (the NBD project's `doc/uri.md`): `nbd://host[:port]/[export]` and
//! `nbd+unix:///[export]?socket=PATH`.

use std::net::ToSocketAddrs;
use std::path::PathBuf;

use crate::net::{ListenAddr, DEFAULT_PORT};
use crate::ClientError;

/// A parsed NBD URI: where to connect and which export to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub addr: ListenAddr,
    pub export: String,
}

impl NbdUri {
    /// True if `s` looks like an NBD URI rather than a path.
    pub fn is_uri(s: &str) -> bool {
        s.starts_with("nbd:")
            || s.starts_with("nbds:")
            || s.starts_with("nbd+")
            || s.starts_with("nbds+")
    }

    pub fn parse(s: &str) -> Result<NbdUri, ClientError> {
        let bad = |why: &str| ClientError::BadUri(s.to_string(), why.to_string());
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| bad("expected SCHEME://"))?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path).ok_or_else(|| bad("bad %-escape in export name"))?;
        let mut socket = None;
        for param in query.into_iter().flat_map(|q| q.split('&')) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            let value = percent_decode(value).ok_or_else(|| bad("bad %-escape in query"))?;
            match key {
                "socket" => socket = Some(value),
                k if k.starts_with("tls") => return Err(bad("TLS is not supported")),
                _ => tracing::warn!(
                    uri = s,
                    parameter = key,
                    "ignoring unknown NBD URI parameter"
                ),
            }
        }
        let addr = match scheme {
            "nbd" => {
                if socket.is_some() {
                    return Err(bad("socket= needs the nbd+unix scheme"));
                }
                let (host, port) =
                    split_host_port(authority).ok_or_else(|| bad("bad host:port"))?;
                let host = if host.is_empty() { "localhost" } else { host };
                let addr = (host, port)
                    .to_socket_addrs()
                    .map_err(|e| bad(&e.to_string()))?
                    .next()
                    .ok_or_else(|| bad("host has no address"))?;
                ListenAddr::Tcp(addr)
            }
            "nbd+unix" => {
                if !authority.is_empty() {
                    return Err(bad("nbd+unix URIs have no host"));
                }
                let path = socket.ok_or_else(|| bad("nbd+unix needs ?socket=PATH"))?;
                ListenAddr::Unix(PathBuf::from(path))
            }
            "nbds" | "nbds+unix" => return Err(bad("TLS is not supported")),
            _ => return Err(bad("unsupported scheme (use nbd:// or nbd+unix://)")),
        };
        Ok(NbdUri { addr, export })
    }
}

fn split_host_port(authority: &str) -> Option<(&str, u16)> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return match after.strip_prefix(':') {
            Some(port) => Some((host, port.parse().ok()?)),
            None if after.is_empty() => Some((host, DEFAULT_PORT)),
            None => None,
        };
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Some((host, port.parse().ok()?)),
        None => Some((authority, DEFAULT_PORT)),
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_uris() {
        let u = NbdUri::parse("nbd+unix:///?socket=/tmp/a%20b.sock").unwrap();
        assert_eq!(u.addr, ListenAddr::Unix(PathBuf::from("/tmp/a b.sock")));
        assert_eq!(u.export, "");
        let u = NbdUri::parse("nbd+unix:///disk?socket=/s").unwrap();
        assert_eq!(u.export, "disk");
        assert!(NbdUri::parse("nbd+unix:///").is_err());
        assert!(NbdUri::parse("nbd+unix://host/?socket=/s").is_err());
    }

    #[test]
    fn tcp_uris() {
        let u = NbdUri::parse("nbd://127.0.0.1:1234/exp").unwrap();
        assert_eq!(u.addr, ListenAddr::Tcp("127.0.0.1:1234".parse().unwrap()));
        assert_eq!(u.export, "exp");
        let u = NbdUri::parse("nbd://127.0.0.1").unwrap();
        assert_eq!(u.addr, ListenAddr::Tcp("127.0.0.1:10809".parse().unwrap()));
        let u = NbdUri::parse("nbd://[::1]:99/").unwrap();
        assert_eq!(u.addr, ListenAddr::Tcp("[::1]:99".parse().unwrap()));
        assert!(NbdUri::parse("nbd://h:notaport/").is_err());
    }

    #[test]
    fn refused_forms() {
        for s in [
            "nbds://h/",
            "nbds+unix:///?socket=/s",
            "nbd+vsock://1",
            "http://x/",
            "nbd:/x",
            "nbd://127.0.0.1/?tls-certificates=/x",
            "nbd://127.0.0.1/%zz",
        ] {
            assert!(NbdUri::parse(s).is_err(), "{s}");
        }
        assert!(NbdUri::is_uri("nbd://x"));
        assert!(NbdUri::is_uri("nbd+unix:///?socket=/s"));
        assert!(!NbdUri::is_uri("/var/lib/disk.img"));
        assert!(!NbdUri::is_uri("nbd.img"));
    }
}

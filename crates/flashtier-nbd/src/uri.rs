//! NBD URIs (the NBD project's `doc/uri.md`): `nbd://host[:port]/[export]`,
//! `nbd+unix:///[export]?socket=PATH`, and their TLS forms `nbds://[user@]host[:port]/[export]`
//! and `nbds+unix://[user@]/[export]?socket=PATH` with libnbd's query parameters:
//! `tls-certificates=DIR` (X.509: `ca-cert.pem`, optionally `client-cert.pem`/`client-key.pem`),
//! `tls-psk-file=FILE` (`username:hexkey` lines), `tls-username=NAME` (the PSK identity; also the
//! URI's user), `tls-verify-peer=false` (do not check the server's certificate) and
//! `tls-hostname=NAME` (the name the server's certificate must carry; default the URI's host).

use std::net::ToSocketAddrs;
use std::path::PathBuf;

use crate::net::{ListenAddr, DEFAULT_PORT};
use crate::ClientError;

/// A parsed NBD URI: where to connect and which export to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub addr: ListenAddr,
    pub export: String,
    /// Present for `nbds` schemes: TLS is then required.
    pub tls: Option<UriTls>,
}

/// The TLS parameters of an `nbds` URI.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UriTls {
    pub certificates: Option<PathBuf>,
    pub psk_file: Option<PathBuf>,
    pub username: Option<String>,
    pub verify_peer: bool,
    /// The name to check the server's certificate against (None: do not check a name).
    pub hostname: Option<String>,
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
        let (user, authority) = match authority.rsplit_once('@') {
            Some((u, a)) => (
                Some(percent_decode(u).ok_or_else(|| bad("bad %-escape in user"))?),
                a,
            ),
            None => (None, authority),
        };
        let export = percent_decode(path).ok_or_else(|| bad("bad %-escape in export name"))?;
        let secure = matches!(scheme, "nbds" | "nbds+unix");
        let mut socket = None;
        let mut tls = UriTls {
            username: user,
            verify_peer: true,
            ..UriTls::default()
        };
        let mut hostname = None;
        for param in query.into_iter().flat_map(|q| q.split('&')) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            let value = percent_decode(value).ok_or_else(|| bad("bad %-escape in query"))?;
            if key.starts_with("tls") && !secure {
                return Err(bad("tls-* parameters need an nbds:// or nbds+unix:// URI"));
            }
            match key {
                "socket" => socket = Some(value),
                "tls-certificates" => tls.certificates = Some(PathBuf::from(value)),
                "tls-psk-file" => tls.psk_file = Some(PathBuf::from(value)),
                "tls-username" => tls.username = Some(value),
                "tls-hostname" => hostname = Some(value),
                "tls-verify-peer" => {
                    tls.verify_peer = match value.as_str() {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        _ => return Err(bad("tls-verify-peer takes true or false")),
                    }
                }
                k if k.starts_with("tls") => {
                    return Err(bad(&format!("unknown TLS parameter '{k}'")))
                }
                _ => tracing::warn!(
                    uri = s,
                    parameter = key,
                    "ignoring unknown NBD URI parameter"
                ),
            }
        }
        if tls.certificates.is_some() && tls.psk_file.is_some() {
            return Err(bad("give tls-certificates or tls-psk-file, not both"));
        }
        if tls.username.is_some() && tls.psk_file.is_none() && secure {
            return Err(bad(
                "a TLS user name is a PSK identity: it needs tls-psk-file",
            ));
        }
        let scheme = match scheme {
            "nbds" => "nbd",
            "nbds+unix" => "nbd+unix",
            other => other,
        };
        let addr = match scheme {
            "nbd" => {
                if socket.is_some() {
                    return Err(bad("socket= needs the nbd+unix scheme"));
                }
                let (host, port) =
                    split_host_port(authority).ok_or_else(|| bad("bad host:port"))?;
                let host = if host.is_empty() { "localhost" } else { host };
                hostname.get_or_insert_with(|| host.to_string());
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
            _ => {
                return Err(bad(
                    "unsupported scheme (use nbd://, nbds://, nbd+unix:// or nbds+unix://)",
                ))
            }
        };
        tls.hostname = hostname;
        Ok(NbdUri {
            addr,
            export,
            tls: secure.then_some(tls),
        })
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
    fn tls_uris() {
        let u = NbdUri::parse("nbds://alice@127.0.0.1:99/disk?tls-psk-file=/k.psk").unwrap();
        assert_eq!(u.addr, ListenAddr::Tcp("127.0.0.1:99".parse().unwrap()));
        assert_eq!(u.export, "disk");
        let t = u.tls.unwrap();
        assert_eq!(t.username.as_deref(), Some("alice"));
        assert_eq!(t.psk_file, Some(PathBuf::from("/k.psk")));
        assert!(t.verify_peer);
        let u = NbdUri::parse(
            "nbds://127.0.0.1/?tls-certificates=/pki&tls-verify-peer=false&tls-hostname=srv",
        )
        .unwrap();
        let t = u.tls.unwrap();
        assert_eq!(t.certificates, Some(PathBuf::from("/pki")));
        assert!(!t.verify_peer);
        assert_eq!(t.hostname.as_deref(), Some("srv"));
        // The host is the name to check by default; a unix socket has none.
        let t = NbdUri::parse("nbds://127.0.0.1/").unwrap().tls.unwrap();
        assert_eq!(t.hostname.as_deref(), Some("127.0.0.1"));
        let u = NbdUri::parse("nbds+unix:///x?socket=/s&tls-psk-file=/k&tls-username=bob").unwrap();
        assert_eq!(u.addr, ListenAddr::Unix(PathBuf::from("/s")));
        let t = u.tls.unwrap();
        assert_eq!(t.username.as_deref(), Some("bob"));
        assert_eq!(t.hostname, None);
        assert_eq!(NbdUri::parse("nbd://127.0.0.1/").unwrap().tls, None);
    }

    #[test]
    fn refused_forms() {
        for s in [
            "nbds+unix:///",
            "nbd+vsock://1",
            "http://x/",
            "nbd:/x",
            "nbd://127.0.0.1/?tls-certificates=/x",
            "nbds://127.0.0.1/?tls-certificates=/x&tls-psk-file=/y",
            "nbds://127.0.0.1/?tls-frobnicate=1",
            "nbds://127.0.0.1/?tls-verify-peer=maybe",
            "nbds://alice@127.0.0.1/",
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

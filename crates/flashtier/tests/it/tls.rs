//! TLS against real clients and servers: nbdinfo, qemu-img, qemu-io and nbdcopy (GnuTLS) connect
//! to `flashtier serve --tls require` with X.509 certificates and with pre-shared keys; clients
//! without credentials, with the wrong key or without a required client certificate are refused;
//! and flashtier's own NBD client uses an `nbdkit --tls=require` server as its backing store.
//!
//! Certificates and keys are made for each test with the openssl command-line tool.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flashtier_nbd::wire::{self, handshake, opt, rep};

use crate::harness::{self, path_str, Scratch, Server};

const SIZE: u64 = 64 << 20;

/// Test credentials: a CA, a server certificate for 127.0.0.1/localhost, a client certificate,
/// all in the layouts nbdkit, qemu and libnbd expect, and a PSK file for user alice.
struct Pki {
    /// ca-cert.pem, server-cert.pem, server-key.pem.
    server: PathBuf,
    /// ca-cert.pem only.
    client_ca: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem.
    client_cert: PathBuf,
    /// A CA that signed nothing here.
    stranger_ca: PathBuf,
    /// keys.psk: `alice:<hex>`; its directory is what qemu's tls-creds-psk takes.
    psk: PathBuf,
    /// alice with another key.
    wrong_psk: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    harness::require("openssl");
    harness::run(Command::new("openssl").current_dir(dir).args(args));
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let sub = |name: &str| {
            let d = dir.join(name);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let (server, client_ca, client_cert, stranger_ca) = (
            sub("server"),
            sub("client-ca"),
            sub("client-cert"),
            sub("stranger"),
        );
        let ca = |name: &str| {
            let mut a = vec!["req", "-x509"];
            a.extend(ec);
            let (key, cert, subj) = (
                format!("{name}-key.pem"),
                format!("{name}-cert.pem"),
                format!("/CN={name}"),
            );
            a.extend([
                "-keyout",
                &key,
                "-out",
                &cert,
                "-days",
                "2",
                "-subj",
                &subj,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            openssl(dir, &a);
        };
        ca("ca");
        ca("stranger");
        let leaf = |name: &str, ext: &str| {
            std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
            let mut a = vec!["req"];
            a.extend(ec);
            let (key, csr, cert, extfile, subj) = (
                format!("{name}-key.pem"),
                format!("{name}.csr"),
                format!("{name}-cert.pem"),
                format!("{name}.ext"),
                format!("/CN={name}"),
            );
            a.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(dir, &a);
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca-cert.pem",
                    "-CAkey",
                    "ca-key.pem",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &cert,
                    "-extfile",
                    &extfile,
                ],
            );
        };
        leaf(
            "server",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        );
        leaf(
            "client",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=clientAuth\n",
        );
        let copy = |from: &str, to: &Path, name: &str| {
            std::fs::copy(dir.join(from), to.join(name)).unwrap();
        };
        for d in [&server, &client_ca, &client_cert] {
            copy("ca-cert.pem", d, "ca-cert.pem");
        }
        copy("server-cert.pem", &server, "server-cert.pem");
        copy("server-key.pem", &server, "server-key.pem");
        copy("client-cert.pem", &client_cert, "client-cert.pem");
        copy("client-key.pem", &client_cert, "client-key.pem");
        copy("stranger-cert.pem", &stranger_ca, "ca-cert.pem");
        let psk_file = |name: &str, key: &str| {
            let d = sub(name);
            let f = d.join("keys.psk");
            std::fs::write(&f, format!("alice:{key}\n")).unwrap();
            set_mode(&f, 0o600);
            f
        };
        let psk = psk_file("psk", &"5a".repeat(32));
        let wrong_psk = psk_file("wrong-psk", &"a5".repeat(32));
        for key in [
            server.join("server-key.pem"),
            client_cert.join("client-key.pem"),
        ] {
            set_mode(&key, 0o600);
        }
        Pki {
            server,
            client_ca,
            client_cert,
            stranger_ca,
            psk,
            wrong_psk,
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `flashtier serve` on 127.0.0.1 (a free port) over a 64 MiB file, with `args`.
fn serve_tcp(dir: &Path, args: &[&str]) -> (Server, u16) {
    let disk = dir.join("disk.img");
    harness::sparse_file(&disk, SIZE);
    let control = dir.join("control.sock");
    let stats = dir.join("stats");
    let mut all = vec![
        "--backing",
        path_str(&disk),
        "--listen",
        "127.0.0.1:0",
        "--control-socket",
        path_str(&control),
        "--stats-file",
        path_str(&stats),
    ];
    all.extend_from_slice(args);
    let server = Server::start(&all);
    let port = server
        .listen
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("TCP port");
    (server, port)
}

fn nbdinfo(uri: &str) -> (bool, String) {
    harness::require("nbdinfo");
    let out = harness::run_any(Command::new("nbdinfo").arg("--size").arg(uri));
    (
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == SIZE.to_string(),
        harness::text(&out),
    )
}

fn qemu_img_info(object: &str, port: u16) -> (bool, String) {
    harness::require("qemu-img");
    let mut cmd = Command::new("qemu-img");
    cmd.arg("info");
    if !object.is_empty() {
        cmd.args(["--object", object]);
    }
    let tls = if object.is_empty() {
        ""
    } else {
        ",tls-creds=tls0"
    };
    cmd.args([
        "--image-opts",
        &format!("driver=nbd,host=127.0.0.1,port={port}{tls}"),
    ]);
    let out = harness::run_any(&mut cmd);
    let text = harness::text(&out);
    (
        out.status.success() && text.contains("67108864 bytes"),
        text,
    )
}

/// qemu-io writes a pattern through TLS and reads it back.
fn qemu_io_roundtrip(object: &str, port: u16) {
    harness::require("qemu-io");
    let out = harness::run_stdout(Command::new("qemu-io").args([
        "--object",
        object,
        "--image-opts",
        &format!("driver=nbd,host=127.0.0.1,port={port},tls-creds=tls0"),
        "-c",
        "write -P 0x6b 2M 256k",
        "-c",
        "read -P 0x6b 2M 256k",
        "-c",
        "flush",
    ]));
    assert!(
        !out.to_lowercase().contains("fail"),
        "qemu-io over TLS:\n{out}"
    );
}

/// nbdcopy a 4 MiB random file into the export over TLS and back out; both copies match.
fn nbdcopy_roundtrip(dir: &Path, uri: &str) {
    harness::require("nbdcopy");
    let src = dir.join("src.bin");
    let back = dir.join("back.bin");
    harness::random_file(&src, 4 << 20, 7);
    harness::run(Command::new("nbdcopy").args([path_str(&src), uri]));
    harness::sparse_file(&back, SIZE);
    harness::run(Command::new("nbdcopy").args([uri, path_str(&back)]));
    let want = std::fs::read(&src).unwrap();
    let got = std::fs::read(&back).unwrap();
    assert!(
        got[..want.len()] == want[..],
        "nbdcopy over TLS: data differ"
    );
}

#[test]
fn x509_clients_nbdinfo_qemu_and_nbdcopy() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &[
            "--tls",
            "require",
            "--tls-certificates",
            path_str(&pki.server),
        ],
    );
    assert!(
        server.uri.starts_with("nbds://127.0.0.1:"),
        "serve prints an nbds:// URI: {}",
        server.uri
    );
    let uri = format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        path_str(&pki.client_ca)
    );
    let (ok, out) = nbdinfo(&uri);
    assert!(ok, "nbdinfo with X.509:\n{out}");
    let object = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        path_str(&pki.client_ca)
    );
    let (ok, out) = qemu_img_info(&object, port);
    assert!(ok, "qemu-img with X.509:\n{out}");
    qemu_io_roundtrip(&object, port);
    nbdcopy_roundtrip(dir.path(), &uri);

    // A client that trusts another CA refuses the server; one that does not use TLS at all is
    // refused by the server.
    let (ok, out) = nbdinfo(&format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        path_str(&pki.stranger_ca)
    ));
    assert!(!ok, "a client trusting another CA connected:\n{out}");
    let (ok, out) = nbdinfo(&format!("nbd://127.0.0.1:{port}/"));
    assert!(!ok, "a client without TLS connected:\n{out}");
    let (ok, out) = qemu_img_info("", port);
    assert!(!ok, "qemu-img without TLS connected:\n{out}");
    server.stop();
}

#[test]
fn psk_clients_nbdinfo_qemu_and_nbdcopy() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &["--tls", "require", "--tls-psk", path_str(&pki.psk)],
    );
    let uri = |psk: &Path, user: &str| {
        format!(
            "nbds://{user}@127.0.0.1:{port}/?tls-psk-file={}",
            path_str(psk)
        )
    };
    let (ok, out) = nbdinfo(&uri(&pki.psk, "alice"));
    assert!(ok, "nbdinfo with PSK:\n{out}");
    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        path_str(pki.psk.parent().unwrap())
    );
    let (ok, out) = qemu_img_info(&object, port);
    assert!(ok, "qemu-img with PSK:\n{out}");
    qemu_io_roundtrip(&object, port);
    nbdcopy_roundtrip(dir.path(), &uri(&pki.psk, "alice"));

    // The wrong key, an unknown user and no TLS at all are refused.
    let (ok, out) = nbdinfo(&uri(&pki.wrong_psk, "alice"));
    assert!(!ok, "the wrong key connected:\n{out}");
    let mallory = dir.path().join("mallory.psk");
    std::fs::write(&mallory, format!("mallory:{}\n", "5a".repeat(32))).unwrap();
    let (ok, out) = nbdinfo(&uri(&mallory, "mallory"));
    assert!(!ok, "an unknown user connected:\n{out}");
    let (ok, out) = nbdinfo(&format!("nbd://127.0.0.1:{port}/"));
    assert!(!ok, "a client without TLS connected:\n{out}");
    let wrong_object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        path_str(pki.wrong_psk.parent().unwrap())
    );
    let (ok, out) = qemu_img_info(&wrong_object, port);
    assert!(!ok, "qemu-img with the wrong key connected:\n{out}");
    assert!(
        server.log().contains("PSK user 'alice'"),
        "{}",
        server.log()
    );
    server.stop();
}

#[test]
fn verify_peer_requires_a_client_certificate_from_the_ca() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &[
            "--tls",
            "require",
            "--tls-certificates",
            path_str(&pki.server),
            "--tls-verify-peer",
        ],
    );
    let uri = |d: &Path| format!("nbds://127.0.0.1:{port}/?tls-certificates={}", path_str(d));
    let (ok, out) = nbdinfo(&uri(&pki.client_ca));
    assert!(!ok, "a client without a certificate connected:\n{out}");
    let (ok, out) = nbdinfo(&uri(&pki.client_cert));
    assert!(ok, "a client with a certificate from the CA:\n{out}");
    let object = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        path_str(&pki.client_cert)
    );
    let (ok, out) = qemu_img_info(&object, port);
    assert!(ok, "qemu-img with a client certificate:\n{out}");
    assert!(server.log().contains("CN=client") || server.log().contains("'client"));
    server.stop();
}

/// Raw protocol in FORCEDTLS mode: every option before STARTTLS but ABORT gets ERR_TLS_REQD,
/// EXPORT_NAME ends the connection, STARTTLS with data is invalid; in "on" mode plain clients are
/// served and TLS ones too.
#[test]
fn require_refuses_everything_before_starttls_and_on_allows_both() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &["--tls", "require", "--tls-psk", path_str(&pki.psk)],
    );
    let hello = || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).unwrap();
        let flags = handshake::C_FIXED_NEWSTYLE | handshake::C_NO_ZEROES;
        s.write_all(&flags.to_be_bytes()).unwrap();
        s
    };
    let option = |s: &mut TcpStream, o: u32, data: &[u8]| -> Option<u32> {
        let mut m = wire::IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&o.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m).unwrap();
        let mut h = [0u8; 20];
        s.read_exact(&mut h).ok()?;
        let mut rest = vec![0u8; wire::be32(&h[16..20]) as usize];
        s.read_exact(&mut rest).unwrap();
        assert_eq!(wire::be32(&h[8..12]), o);
        Some(wire::be32(&h[12..16]))
    };
    let mut s = hello();
    let go = [0u8, 0, 0, 0, 0, 0];
    for o in [opt::LIST, opt::INFO, opt::GO, opt::STRUCTURED_REPLY, 99] {
        let payload: &[u8] = if o == opt::INFO || o == opt::GO {
            &go
        } else {
            &[]
        };
        assert_eq!(
            option(&mut s, o, payload),
            Some(rep::ERR_TLS_REQD),
            "option {o}"
        );
    }
    assert_eq!(option(&mut s, opt::STARTTLS, b"x"), Some(rep::ERR_INVALID));
    assert_eq!(option(&mut s, opt::ABORT, &[]), Some(rep::ACK));
    let mut s = hello();
    assert_eq!(
        option(&mut s, opt::EXPORT_NAME, b""),
        None,
        "EXPORT_NAME must close"
    );
    server.stop();

    let (server, port) = serve_tcp(
        dir.path(),
        &["--tls", "on", "--tls-psk", path_str(&pki.psk)],
    );
    assert!(nbdinfo(&format!("nbd://127.0.0.1:{port}/")).0);
    let tls_uri = format!(
        "nbds://alice@127.0.0.1:{port}/?tls-psk-file={}",
        path_str(&pki.psk)
    );
    assert!(nbdinfo(&tls_uri).0);
    server.stop();
}

/// The handshake deadline covers the TLS handshake: a client that asks for TLS and then stalls
/// is cut off.
#[test]
fn a_stalled_tls_handshake_is_cut_off_at_the_deadline() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &[
            "--tls",
            "require",
            "--tls-psk",
            path_str(&pki.psk),
            "--handshake-timeout",
            "2",
        ],
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let started = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    let flags = handshake::C_FIXED_NEWSTYLE | handshake::C_NO_ZEROES;
    s.write_all(&flags.to_be_bytes()).unwrap();
    let mut m = wire::IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&opt::STARTTLS.to_be_bytes());
    m.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&m).unwrap();
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(wire::be32(&h[12..16]), rep::ACK);
    // Half a TLS ClientHello record header, then nothing.
    s.write_all(&[0x16, 0x03]).unwrap();
    let mut b = [0u8; 1];
    let r = s.read(&mut b);
    let took = started.elapsed();
    assert!(
        matches!(r, Ok(0)) || r.is_err(),
        "the server answered a stalled TLS handshake: {r:?}"
    );
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "cut off after {took:?} (deadline 2 s)"
    );
    server.stop();
}

#[test]
fn listening_beyond_loopback_without_tls_require_warns() {
    let dir = Scratch::new();
    let disk = dir.path().join("disk.img");
    harness::sparse_file(&disk, SIZE);
    let pki = Pki::new(&dir.path().join("pki"));
    let start = |extra: &[&str]| {
        let mut args = vec![
            "--backing",
            path_str(&disk),
            "--listen",
            "0.0.0.0:0",
            "--control-socket",
            "",
            "--stats-file",
            "",
        ];
        let control = dir.path().join("c.sock");
        let stats = dir.path().join("stats");
        args[5] = path_str(&control);
        args[7] = path_str(&stats);
        args.extend_from_slice(extra);
        let server = Server::start(&args);
        let log = server.log();
        server.stop();
        log
    };
    let log = start(&[]);
    assert!(
        log.contains("flashtier: WARNING: listening on 0.0.0.0:")
            && log.contains(" WARN ")
            && log.contains("without authentication"),
        "no loud warning (stderr and log) for 0.0.0.0 without TLS:\n{log}"
    );
    let log = start(&["--tls", "on", "--tls-psk", path_str(&pki.psk)]);
    assert!(log.contains("TLS is offered but not required"), "{log}");
    let log = start(&["--tls", "require", "--tls-psk", path_str(&pki.psk)]);
    assert!(!log.contains("WARNING"), "{log}");
}

/// A running `nbdkit --tls=require` over a file; killed when dropped.
struct Nbdkit {
    child: Child,
    port: u16,
    file: PathBuf,
}

impl Nbdkit {
    fn start(dir: &Path, tls_args: &[String]) -> Nbdkit {
        harness::require("nbdkit");
        let file = dir.join("nbdkit.img");
        harness::sparse_file(&file, SIZE);
        let port = free_port();
        let mut cmd = Command::new("nbdkit");
        cmd.args([
            "-f",
            "-i",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "--tls=require",
        ])
        .args(tls_args)
        .args(["file", path_str(&file)])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let child = cmd.spawn().expect("nbdkit");
        harness::wait_until(Duration::from_secs(10), "nbdkit listening", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Nbdkit { child, port, file }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// flashtier serves `backing_uri` (nbdkit over TLS); qemu-io writes through flashtier; the data
/// lands in nbdkit's file.
fn write_through_to_nbdkit(dir: &Path, kit: &Nbdkit, backing_uri: &str) {
    let server = Server::on_socket(dir, backing_uri, &[]);
    harness::wait_until(
        Duration::from_secs(5),
        "the backing described as TLS",
        || server.log().contains("over TLS"),
    );
    harness::qemu_io(
        &server.uri,
        &["write -P 0x77 1M 128k", "read -P 0x77 1M 128k", "flush"],
    );
    server.stop();
    let data = std::fs::read(&kit.file).unwrap();
    assert!(
        data[1 << 20..(1 << 20) + (128 << 10)]
            .iter()
            .all(|&b| b == 0x77),
        "the write did not reach nbdkit over TLS"
    );
}

#[test]
fn nbd_client_backing_speaks_tls_to_nbdkit() {
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    // X.509: nbdkit's certificates directory is the server layout.
    let kit = Nbdkit::start(
        dir.path(),
        &[format!("--tls-certificates={}", path_str(&pki.server))],
    );
    let uri = format!(
        "nbds://127.0.0.1:{}/?tls-certificates={}",
        kit.port,
        path_str(&pki.client_ca)
    );
    write_through_to_nbdkit(dir.path(), &kit, &uri);
    // Trusting another CA: refused with a clear error at start.
    let out = harness::run_any(Command::new(harness::BIN).args([
        "serve",
        "--backing",
        &format!(
            "nbds://127.0.0.1:{}/?tls-certificates={}",
            kit.port,
            path_str(&pki.stranger_ca)
        ),
        "--listen",
        path_str(&dir.path().join("refused.sock")),
    ]));
    assert!(!out.status.success());
    assert!(
        harness::text(&out).contains("certificate verify failed"),
        "{}",
        harness::text(&out)
    );
    drop(kit);

    // PSK.
    let kit = Nbdkit::start(dir.path(), &[format!("--tls-psk={}", path_str(&pki.psk))]);
    let uri = |psk: &Path| {
        format!(
            "nbds://alice@127.0.0.1:{}/?tls-psk-file={}",
            kit.port,
            path_str(psk)
        )
    };
    write_through_to_nbdkit(dir.path(), &kit, &uri(&pki.psk));
    let out = harness::run_any(Command::new(harness::BIN).args([
        "serve",
        "--backing",
        &uri(&pki.wrong_psk),
        "--listen",
        path_str(&dir.path().join("refused.sock")),
    ]));
    assert!(!out.status.success(), "{}", harness::text(&out));
    assert!(
        harness::text(&out).contains("TLS"),
        "{}",
        harness::text(&out)
    );
    // A plain nbd:// URI to a server that requires TLS fails too (no silent plain text).
    let out = harness::run_any(Command::new(harness::BIN).args([
        "serve",
        "--backing",
        &format!("nbd://127.0.0.1:{}/", kit.port),
        "--listen",
        path_str(&dir.path().join("refused.sock")),
    ]));
    assert!(!out.status.success(), "{}", harness::text(&out));
}

/// Many requests in flight on one TLS connection from many threads, every byte verified: the
/// TLS session is shared by the server's reader and writer threads of the connection, and by the
/// client's senders and reply reader (see `tls::TlsStream`). (fio's nbd engine cannot be used:
/// libnbd refuses the local files of tls-psk-file URIs to it.)
#[test]
fn concurrent_requests_over_one_tls_connection_are_all_correct() {
    use flashtier_io::BlockDev;
    let dir = Scratch::new();
    let pki = Pki::new(&dir.path().join("pki"));
    let (server, port) = serve_tcp(
        dir.path(),
        &["--tls", "require", "--tls-psk", path_str(&pki.psk)],
    );
    let client = flashtier_nbd::NbdClient::connect(&format!(
        "nbds://alice@127.0.0.1:{port}/?tls-psk-file={}",
        path_str(&pki.psk)
    ))
    .expect("TLS client");
    const THREADS: u64 = 8;
    const REGION: u64 = SIZE / THREADS;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let client = &client;
            s.spawn(move || {
                let mut rng = harness::Rng::new(t + 1);
                let base = t * REGION;
                let mut model = vec![0u8; REGION as usize];
                for i in 0..150u64 {
                    let len = 4096 * (1 + rng.below(64)) as usize;
                    let off = rng.below((REGION - len as u64) / 4096) * 4096;
                    let fill = (t * 31 + i) as u8;
                    let data = vec![fill; len];
                    client.write_at(&data, base + off, false).unwrap();
                    model[off as usize..off as usize + len].copy_from_slice(&data);
                    let roff = rng.below((REGION - 65536) / 4096) * 4096;
                    let mut got = vec![0u8; 65536];
                    client.read_at(&mut got, base + roff).unwrap();
                    assert!(
                        got[..] == model[roff as usize..roff as usize + 65536],
                        "thread {t}: wrong data at {roff} after {i} writes"
                    );
                }
                client.flush().unwrap();
            });
        }
    });
    drop(client);
    server.stop();
}

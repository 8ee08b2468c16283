//! Malformed and edge-case protocol input over raw sockets: every refusal is the spec's, and the
//! server keeps serving other clients.
//!
//! Each test starts its own `flashtier serve` on a 64 MiB sparse file and talks to it with the tiny
//! client below, byte by byte, so no client library can paper over a mistake on either side. Every
//! socket has a read timeout: a server that hangs fails the test instead of hanging it.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flashtier_nbd::wire::{
    self, be16, be32, be64, cmd, cmd_flag, errno, handshake, info, opt, rep, reply, state, tflag,
    RequestHeader,
};

use crate::harness::{self, Server};

const SIZE: u64 = 64 << 20;
const MIB: u64 = 1 << 20;
const MAX_PAYLOAD: u32 = 32 << 20;
const EXPORT: &str = "flashtier";
const TIMEOUT: Duration = Duration::from_secs(10);
const CLIENT_FLAGS: u32 = handshake::C_FIXED_NEWSTYLE | handshake::C_NO_ZEROES;

// ------------------------------------------------------------------------------------------------
// Fixture: one server per test.

/// A server on a fresh 64 MiB sparse file; killed when dropped.
struct Fixture {
    server: Server,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new(args: &[&str]) -> Fixture {
        let dir = harness::scratch();
        let disk = dir.path().join("disk.img");
        harness::sparse_file(&disk, SIZE);
        let server = Server::on_socket(dir.path(), disk.to_str().expect("utf-8 path"), args);
        Fixture { server, _dir: dir }
    }

    fn socket(&self) -> PathBuf {
        self.server
            .socket()
            .expect("server listens on a unix socket")
    }

    /// A connection that has checked the greeting and sent FIXED_NEWSTYLE | NO_ZEROES.
    fn hello(&self) -> Raw {
        let mut c = Raw::open(&self.socket());
        c.greeting();
        c.send(&CLIENT_FLAGS.to_be_bytes());
        c
    }

    /// A connection in transmission (simple replies) after GO on the default export.
    fn go(&self) -> Raw {
        let mut c = self.hello();
        c.go("");
        c
    }

    /// A connection in transmission with structured replies and, if `queries` is not empty, a
    /// SET_META_CONTEXT with them before GO.
    fn go_structured(&self, queries: &[&str]) -> Raw {
        let mut c = self.hello();
        c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
        if !queries.is_empty() {
            c.option(opt::SET_META_CONTEXT, &meta_payload("", queries));
            let replies = c.opt_replies(opt::SET_META_CONTEXT);
            assert_eq!(replies.last().unwrap().ty, rep::ACK, "{replies:?}");
            c.context = replies
                .iter()
                .find(|r| r.ty == rep::META_CONTEXT)
                .map(|r| be32(&r.data[0..4]));
        }
        c.go("");
        assert!(c.structured());
        c
    }

    /// The server survived whatever the test did: it still runs, never panicked, and a new client
    /// can write and read back.
    fn assert_healthy(&mut self) {
        assert!(
            self.server.is_running(),
            "server exited:\n{}",
            self.server.log()
        );
        let mut c = self.go();
        let data = pattern(0x77, 4096);
        c.write_ok(0x4EA1, 60 * MIB, &data);
        assert_eq!(c.read_ok(0x4EA2, 60 * MIB, 4096), data);
        let log = self.server.log();
        assert!(!log.contains("panicked"), "server panicked:\n{log}");
    }
}

// ------------------------------------------------------------------------------------------------
// A raw client.

struct OptReply {
    option: u32,
    ty: u32,
    data: Vec<u8>,
}

impl OptReply {
    /// The information type of an `NBD_REP_INFO` reply.
    fn info_type(&self) -> Option<u16> {
        (self.ty == rep::INFO).then(|| be16(&self.data[0..2]))
    }
}

impl fmt::Debug for OptReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "OptReply(option {}, type {:#x}, {:?})",
            self.option,
            self.ty,
            String::from_utf8_lossy(&self.data)
        )
    }
}

struct Chunk {
    flags: u16,
    ty: u16,
    handle: u64,
    payload: Vec<u8>,
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Chunk(flags {:#x}, type {:#x}, handle {:#x}, {} bytes",
            self.flags,
            self.ty,
            self.handle,
            self.payload.len()
        )?;
        if reply::is_error(self.ty) && self.payload.len() >= 6 {
            write!(
                f,
                ", error {}: {:?}",
                be32(&self.payload[0..4]),
                String::from_utf8_lossy(&self.payload[6..])
            )?;
        }
        write!(f, ")")
    }
}

impl Chunk {
    /// Error value and message of a `TYPE_ERROR` chunk, checking its framing.
    fn error(&self) -> (u32, String) {
        assert_eq!(
            self.ty,
            reply::TYPE_ERROR,
            "expected an error chunk: {self:?}"
        );
        assert!(self.payload.len() >= 6, "short error chunk: {self:?}");
        let code = be32(&self.payload[0..4]);
        let msg_len = be16(&self.payload[4..6]) as usize;
        assert_eq!(
            self.payload.len(),
            6 + msg_len,
            "error chunk length must be 6 + message length: {self:?}"
        );
        assert_ne!(code, 0, "error chunk with error 0");
        let msg = String::from_utf8(self.payload[6..].to_vec()).expect("message is UTF-8");
        (code, msg)
    }
}

enum Reply {
    Simple { error: u32, handle: u64 },
    Chunk(Chunk),
}

struct Raw {
    s: UnixStream,
    /// Set by [`Raw::go`].
    size: u64,
    flags: u16,
    /// The `base:allocation` context id the server gave us, if any.
    context: Option<u32>,
}

impl Raw {
    fn open(path: &Path) -> Raw {
        let s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", path.display()));
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.set_write_timeout(Some(TIMEOUT)).unwrap();
        Raw {
            s,
            size: 0,
            flags: 0,
            context: None,
        }
    }

    fn structured(&self) -> bool {
        self.flags & tflag::SEND_DF != 0
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s
            .write_all(bytes)
            .unwrap_or_else(|e| panic!("cannot send {} bytes to the server: {e}", bytes.len()));
    }

    fn recv(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s
            .read_exact(&mut b)
            .unwrap_or_else(|e| panic!("expected {n} bytes from the server: {e}"));
        b
    }

    /// Reads and checks the 18-byte greeting.
    fn greeting(&mut self) {
        let g = self.recv(18);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(
            be16(&g[16..18]),
            handshake::FIXED_NEWSTYLE | handshake::NO_ZEROES,
            "handshake flags"
        );
    }

    /// Asserts the server closes the connection without sending anything more.
    fn expect_closed(&mut self, why: &str) {
        let mut buf = [0u8; 4096];
        match self.s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Ok(n) => panic!(
                "{why}: expected the server to close the connection, got {n} bytes: {:02x?}",
                &buf[..n.min(64)]
            ),
            Err(e) => panic!("{why}: expected the server to close the connection: {e}"),
        }
    }

    // --- handshake ---

    fn option_header(&mut self, magic: u64, option: u32, len: u32) {
        let mut b = Vec::with_capacity(16);
        b.extend_from_slice(&magic.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.send(&b);
    }

    fn option(&mut self, option: u32, payload: &[u8]) {
        let mut b = Vec::with_capacity(16 + payload.len());
        b.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
        self.send(&b);
    }

    fn opt_reply(&mut self) -> OptReply {
        let h = self.recv(20);
        assert_eq!(
            be64(&h[0..8]),
            wire::OPTION_REPLY_MAGIC,
            "option reply magic"
        );
        let len = be32(&h[16..20]);
        assert!(len <= 64 * 1024, "implausible option reply length {len}");
        OptReply {
            option: be32(&h[8..12]),
            ty: be32(&h[12..16]),
            data: self.recv(len as usize),
        }
    }

    /// Every reply to `option` up to and including the final one (ACK or an error).
    fn opt_replies(&mut self, option: u32) -> Vec<OptReply> {
        let mut replies = Vec::new();
        loop {
            let r = self.opt_reply();
            assert_eq!(r.option, option, "reply to the wrong option: {r:?}");
            let last = r.ty == rep::ACK || rep::is_error(r.ty);
            replies.push(r);
            if last {
                return replies;
            }
            assert!(replies.len() < 64, "endless replies: {replies:?}");
        }
    }

    /// Sends `option` and expects exactly one reply, of type `ty`.
    fn expect_opt(&mut self, option: u32, payload: &[u8], ty: u32) -> OptReply {
        self.option(option, payload);
        let mut replies = self.opt_replies(option);
        assert_eq!(replies.len(), 1, "option {option}: {replies:?}");
        let r = replies.pop().unwrap();
        assert_eq!(r.ty, ty, "option {option}: {r:?}");
        if rep::is_error(ty) {
            assert!(
                std::str::from_utf8(&r.data).is_ok(),
                "error message is not UTF-8: {r:?}"
            );
        } else if ty == rep::ACK {
            assert!(r.data.is_empty(), "ACK with data: {r:?}");
        }
        r
    }

    /// GO on `name`; on success records the size and flags and enters transmission.
    fn go(&mut self, name: &str) {
        self.option(opt::GO, &info_payload(name, &[]));
        let replies = self.opt_replies(opt::GO);
        assert_eq!(
            replies.last().unwrap().ty,
            rep::ACK,
            "GO failed: {replies:?}"
        );
        (self.size, self.flags) = export_info(&replies);
        assert_eq!(self.size, SIZE);
    }

    // --- transmission ---

    fn request(&mut self, flags: u16, command: u16, handle: u64, offset: u64, length: u32) {
        self.send(&header(flags, command, handle, offset, length));
    }

    fn write_request(&mut self, flags: u16, handle: u64, offset: u64, data: &[u8]) {
        let mut b = header(flags, cmd::WRITE, handle, offset, data.len() as u32).to_vec();
        b.extend_from_slice(data);
        self.send(&b);
    }

    fn reply(&mut self) -> Reply {
        let magic = be32(&self.recv(4));
        match magic {
            wire::SIMPLE_REPLY_MAGIC => {
                let r = self.recv(12);
                Reply::Simple {
                    error: be32(&r[0..4]),
                    handle: be64(&r[4..12]),
                }
            }
            wire::STRUCTURED_REPLY_MAGIC => {
                let h = self.recv(16);
                let len = be32(&h[12..16]);
                assert!(
                    len <= MAX_PAYLOAD + 64,
                    "implausible structured reply length {len}"
                );
                Reply::Chunk(Chunk {
                    flags: be16(&h[0..2]),
                    ty: be16(&h[2..4]),
                    handle: be64(&h[4..12]),
                    payload: self.recv(len as usize),
                })
            }
            _ => panic!("bad reply magic {magic:#010x}"),
        }
    }

    /// A simple reply (which must be one) for `handle`; returns its error.
    fn simple(&mut self, handle: u64) -> u32 {
        match self.reply() {
            Reply::Simple { error, handle: h } => {
                assert_eq!(h, handle, "reply handle");
                error
            }
            Reply::Chunk(c) => panic!("expected a simple reply to {handle:#x}, got {c:?}"),
        }
    }

    /// A structured reply chunk (which must be one) for `handle`.
    fn chunk(&mut self, handle: u64) -> Chunk {
        match self.reply() {
            Reply::Chunk(c) => {
                assert_eq!(c.handle, handle, "chunk handle");
                c
            }
            Reply::Simple { error, handle: h } => panic!(
                "expected a structured reply to {handle:#x}, got a simple one (handle {h:#x}, \
                 error {error})"
            ),
        }
    }

    /// The outcome of a request whose reply carries no data: a simple reply, or (with structured
    /// replies) a single NONE or ERROR chunk with DONE.
    fn status(&mut self, handle: u64) -> u32 {
        match self.reply() {
            Reply::Simple { error, handle: h } => {
                assert_eq!(h, handle, "reply handle");
                error
            }
            Reply::Chunk(c) => {
                assert!(
                    self.structured(),
                    "structured reply without negotiation: {c:?}"
                );
                assert_eq!(c.handle, handle, "chunk handle");
                assert_eq!(
                    c.flags,
                    reply::FLAG_DONE,
                    "single chunk must be DONE: {c:?}"
                );
                if c.ty == reply::TYPE_NONE {
                    assert!(c.payload.is_empty(), "NONE chunk with payload: {c:?}");
                    0
                } else {
                    c.error().0
                }
            }
        }
    }

    /// Sends a data-less request and returns its error.
    fn call(&mut self, flags: u16, command: u16, handle: u64, offset: u64, length: u32) -> u32 {
        self.request(flags, command, handle, offset, length);
        self.status(handle)
    }

    fn write_ok(&mut self, handle: u64, offset: u64, data: &[u8]) {
        self.write_request(0, handle, offset, data);
        assert_eq!(self.status(handle), 0, "WRITE {}@{offset}", data.len());
    }

    /// READ that must succeed, with simple or structured replies.
    fn read_ok(&mut self, handle: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(0, cmd::READ, handle, offset, len);
        if !self.structured() {
            assert_eq!(self.simple(handle), 0, "READ {len}@{offset}");
            return self.recv(len as usize);
        }
        let c = self.chunk(handle);
        assert_eq!(c.flags, reply::FLAG_DONE, "{c:?}");
        if len == 0 {
            assert_eq!(c.ty, reply::TYPE_NONE, "{c:?}");
            assert!(c.payload.is_empty(), "{c:?}");
            return Vec::new();
        }
        assert_eq!(c.ty, reply::TYPE_OFFSET_DATA, "{c:?}");
        assert_eq!(c.payload.len(), 8 + len as usize, "{c:?}");
        assert_eq!(be64(&c.payload[0..8]), offset, "OFFSET_DATA offset");
        c.payload[8..].to_vec()
    }
}

// ------------------------------------------------------------------------------------------------
// Encoding helpers.

fn header(flags: u16, command: u16, handle: u64, offset: u64, length: u32) -> [u8; 28] {
    RequestHeader {
        flags,
        cmd: command,
        handle,
        offset,
        length,
    }
    .encode()
}

fn info_payload(name: &str, items: &[u16]) -> Vec<u8> {
    let mut p = (name.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&(items.len() as u16).to_be_bytes());
    for i in items {
        p.extend_from_slice(&i.to_be_bytes());
    }
    p
}

fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut p = (name.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        p.extend_from_slice(&(q.len() as u32).to_be_bytes());
        p.extend_from_slice(q.as_bytes());
    }
    p
}

/// Size and transmission flags from the single INFO_EXPORT among `replies`.
fn export_info(replies: &[OptReply]) -> (u64, u16) {
    let export: Vec<_> = replies
        .iter()
        .filter(|r| r.info_type() == Some(info::EXPORT))
        .collect();
    assert_eq!(export.len(), 1, "exactly one INFO_EXPORT: {replies:?}");
    let d = &export[0].data;
    assert_eq!(d.len(), 12, "INFO_EXPORT is type + size + flags");
    (be64(&d[2..10]), be16(&d[10..12]))
}

/// Deterministic non-repeating bytes.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9) >> 11) as u8 ^ seed)
        .collect()
}

/// A payload that parses as a valid READ request (handle 0xBAD): if the server failed to consume
/// it as data, the stream would desync and a reply for handle 0xBAD would show up.
fn decoy_payload(len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(len);
    while p.len() < len {
        p.extend_from_slice(&header(0, cmd::READ, 0xBAD, 0, 512));
    }
    p.truncate(len);
    p
}

/// The flags a read-write export advertises regardless of negotiation.
const RW_FLAGS: u16 = tflag::HAS_FLAGS
    | tflag::SEND_FLUSH
    | tflag::SEND_FUA
    | tflag::SEND_TRIM
    | tflag::SEND_WRITE_ZEROES
    | tflag::SEND_CACHE
    | tflag::SEND_FAST_ZERO
    | tflag::CAN_MULTI_CONN;

// ================================================================================================
// Handshake

#[test]
fn greeting_offers_fixed_newstyle_and_no_zeroes() {
    let fx = Fixture::new(&[]);
    let mut c = Raw::open(&fx.socket());
    let g = c.recv(18);
    assert_eq!(be64(&g[0..8]), wire::NBDMAGIC);
    assert_eq!(be64(&g[8..16]), wire::IHAVEOPT);
    assert_eq!(
        be16(&g[16..18]),
        0b11,
        "FIXED_NEWSTYLE | NO_ZEROES, nothing else"
    );
}

#[test]
fn unknown_client_flags_close_the_connection() {
    let mut fx = Fixture::new(&[]);
    for flags in [0x80, CLIENT_FLAGS | 1 << 2, 1 << 31] {
        let mut c = Raw::open(&fx.socket());
        c.greeting();
        // Flags and a LIST in one write: a server that accepted the flags would answer the LIST.
        let mut b = flags.to_be_bytes().to_vec();
        b.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&opt::LIST.to_be_bytes());
        b.extend_from_slice(&0u32.to_be_bytes());
        c.send(&b);
        c.expect_closed(&format!("client flags {flags:#x}"));
    }
    // Flags 0 (plain newstyle) and FIXED_NEWSTYLE alone are legal.
    for flags in [0, handshake::C_FIXED_NEWSTYLE] {
        let mut c = Raw::open(&fx.socket());
        c.greeting();
        c.send(&flags.to_be_bytes());
        c.go("");
    }
    fx.assert_healthy();
}

#[test]
fn bad_option_magic_closes_the_connection() {
    let mut fx = Fixture::new(&[]);
    for magic in [
        wire::IHAVEOPT ^ 1,
        wire::OPTION_REPLY_MAGIC,
        wire::NBDMAGIC,
        0,
    ] {
        let mut c = fx.hello();
        c.option_header(magic, opt::LIST, 0);
        c.expect_closed(&format!("option magic {magic:#x}"));
    }
    // Also after a valid option.
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.option_header(wire::IHAVEOPT << 8, opt::LIST, 0);
    c.expect_closed("bad magic after a good option");
    fx.assert_healthy();
}

#[test]
fn unknown_option_is_refused_and_its_payload_consumed() {
    let mut fx = Fixture::new(&[]);
    let mut c = fx.hello();
    // The payload looks like an ABORT: a server that did not skip it would ACK option 2.
    let mut payload = wire::IHAVEOPT.to_be_bytes().to_vec();
    payload.extend_from_slice(&opt::ABORT.to_be_bytes());
    payload.extend_from_slice(&0u32.to_be_bytes());
    payload.resize(100, 0x42);
    let r = c.expect_opt(99, &payload, rep::ERR_UNSUP);
    assert!(!r.data.is_empty(), "error replies should carry a message");
    for option in [0, 4, 12, 0x7fff_ffff, u32::MAX] {
        c.expect_opt(option, b"xyz", rep::ERR_UNSUP);
    }
    c.go("");
    let data = pattern(9, 4096);
    c.write_ok(1, 4096, &data);
    assert_eq!(c.read_ok(2, 4096, 4096), data);
    fx.assert_healthy();
}

#[test]
fn starttls_without_tls_and_extended_headers_are_refused() {
    let fx = Fixture::new(&[]);
    let mut c = fx.hello();
    // TLS is off: refused by policy (the spec's NOTLS mode), never ERR_TLS_REQD.
    c.expect_opt(opt::STARTTLS, &[], rep::ERR_POLICY);
    c.expect_opt(opt::EXTENDED_HEADERS, &[], rep::ERR_UNSUP);
    // Having refused extended headers, the server must keep using 28-byte requests and
    // 16-byte simple replies.
    c.go("");
    assert_eq!(c.read_ok(7, 0, 512), vec![0u8; 512]);
}

#[test]
fn oversized_option_is_drained_and_refused() {
    let mut fx = Fixture::new(&[]);
    let mut c = fx.hello();
    // Exactly the 64 KiB limit is still parsed (and refused as unknown).
    c.expect_opt(99, &vec![0x55; 64 * 1024], rep::ERR_UNSUP);
    // One byte more is drained unparsed and refused as too big.
    let mut big = decoy_payload(64 * 1024 + 1);
    c.expect_opt(99, &big, rep::ERR_TOO_BIG);
    big = decoy_payload(100 * 1024);
    c.expect_opt(99, &big, rep::ERR_TOO_BIG);
    // A real option that is too big is refused too, and does not end the handshake.
    c.expect_opt(opt::GO, &big, rep::ERR_TOO_BIG);
    c.expect_opt(opt::LIST, &big, rep::ERR_TOO_BIG);
    c.go("");
    assert_eq!(c.read_ok(3, 0, 4096), vec![0u8; 4096]);
    fx.assert_healthy();
}

#[test]
fn absurd_option_length_drops_only_that_client() {
    let mut fx = Fixture::new(&[]);
    // A bystander in the middle of its handshake.
    let mut bystander = fx.hello();
    for len in [u32::MAX, 16 * 1024 * 1024 + 1] {
        let mut c = fx.hello();
        // Only the header: a server that tried to drain the payload would wait forever.
        c.option_header(wire::IHAVEOPT, 99, len);
        c.expect_closed(&format!("option length {len:#x}"));
    }
    bystander.go(EXPORT);
    assert_eq!(bystander.read_ok(1, 0, 512), vec![0u8; 512]);
    fx.assert_healthy();
}

#[test]
fn list_names_the_export() {
    let fx = Fixture::new(&[]);
    let mut c = fx.hello();
    c.option(opt::LIST, &[]);
    let replies = c.opt_replies(opt::LIST);
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(replies[0].ty, rep::SERVER);
    let d = &replies[0].data;
    assert_eq!(be32(&d[0..4]) as usize, EXPORT.len(), "{replies:?}");
    assert_eq!(&d[4..4 + EXPORT.len()], EXPORT.as_bytes());
    assert_eq!(replies[1].ty, rep::ACK);
    assert!(replies[1].data.is_empty());

    c.expect_opt(opt::LIST, b"\0\0\0\0", rep::ERR_INVALID);
    // Still negotiating.
    c.option(opt::LIST, &[]);
    assert_eq!(c.opt_replies(opt::LIST).len(), 2);
    c.go("");
}

#[test]
fn custom_export_name_is_listed_and_enforced() {
    let fx = Fixture::new(&["--export-name", "disk0"]);
    let mut c = fx.hello();
    c.option(opt::LIST, &[]);
    let replies = c.opt_replies(opt::LIST);
    assert_eq!(replies[0].ty, rep::SERVER);
    assert_eq!(&replies[0].data[4..], b"disk0");
    c.expect_opt(opt::INFO, &info_payload(EXPORT, &[]), rep::ERR_UNKNOWN);
    c.option(opt::INFO, &info_payload("disk0", &[info::NAME]));
    let replies = c.opt_replies(opt::INFO);
    let name = replies.iter().find(|r| r.info_type() == Some(info::NAME));
    assert_eq!(&name.expect("INFO_NAME").data[2..], b"disk0");
    c.go("disk0");

    let mut c = fx.hello();
    c.option(opt::EXPORT_NAME, EXPORT.as_bytes());
    c.expect_closed("EXPORT_NAME for the default name of another server");
}

#[test]
fn info_and_go_for_an_unknown_export_are_refused() {
    let fx = Fixture::new(&[]);
    let mut c = fx.hello();
    let r = c.expect_opt(opt::INFO, &info_payload("nope", &[]), rep::ERR_UNKNOWN);
    assert!(!r.data.is_empty());
    c.expect_opt(
        opt::GO,
        &info_payload("nope", &[info::BLOCK_SIZE]),
        rep::ERR_UNKNOWN,
    );
    c.expect_opt(opt::GO, &info_payload("flashtier2", &[]), rep::ERR_UNKNOWN);
    c.expect_opt(opt::GO, &info_payload("flashtie", &[]), rep::ERR_UNKNOWN);
    c.go(EXPORT);
    assert_eq!(c.read_ok(1, SIZE - 512, 512), vec![0u8; 512]);
}

#[test]
fn info_describes_the_export_without_ending_negotiation() {
    let fx = Fixture::new(&[]);
    let mut c = fx.hello();
    for name in ["", EXPORT] {
        c.option(opt::INFO, &info_payload(name, &[]));
        let replies = c.opt_replies(opt::INFO);
        assert_eq!(replies.len(), 3, "EXPORT, BLOCK_SIZE, ACK: {replies:?}");
        let (size, flags) = export_info(&replies);
        assert_eq!(size, SIZE);
        assert_eq!(flags & RW_FLAGS, RW_FLAGS, "flags {flags:#x}");
        assert_eq!(flags & tflag::READ_ONLY, 0, "flags {flags:#x}");
        assert_eq!(flags & tflag::SEND_DF, 0, "DF without structured replies");
        let bs = &replies[1];
        assert_eq!(bs.info_type(), Some(info::BLOCK_SIZE), "{replies:?}");
        assert_eq!(bs.data.len(), 14);
        assert_eq!(be32(&bs.data[2..6]), 512, "minimum block");
        assert_eq!(be32(&bs.data[6..10]), 4096, "preferred block");
        assert_eq!(be32(&bs.data[10..14]), MAX_PAYLOAD, "maximum payload");
        assert_eq!(replies[2].ty, rep::ACK);
    }

    // NAME and DESCRIPTION on request (an unknown item is ignored, BLOCK_SIZE sent once).
    c.option(
        opt::INFO,
        &info_payload(
            "",
            &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE, 0x7777],
        ),
    );
    let replies = c.opt_replies(opt::INFO);
    assert_eq!(replies.last().unwrap().ty, rep::ACK);
    assert!(replies.iter().all(|r| r.option == opt::INFO));
    let of = |t: u16| -> Vec<&OptReply> {
        replies
            .iter()
            .filter(|r| r.info_type() == Some(t))
            .collect()
    };
    assert_eq!(of(info::EXPORT).len(), 1, "{replies:?}");
    assert_eq!(of(info::BLOCK_SIZE).len(), 1, "{replies:?}");
    assert_eq!(of(0x7777).len(), 0, "{replies:?}");
    let name = of(info::NAME);
    assert_eq!(name.len(), 1, "{replies:?}");
    assert_eq!(&name[0].data[2..], EXPORT.as_bytes(), "canonical name");
    let desc = of(info::DESCRIPTION);
    assert_eq!(desc.len(), 1, "{replies:?}");
    let desc = std::str::from_utf8(&desc[0].data[2..]).expect("UTF-8 description");
    assert!(desc.contains("flashtier"), "description {desc:?}");

    // INFO did not end negotiation: other options still work, and GO enters transmission.
    c.option(opt::LIST, &[]);
    assert_eq!(c.opt_replies(opt::LIST).len(), 2);
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.option(opt::INFO, &info_payload("", &[]));
    let (_, flags) = export_info(&c.opt_replies(opt::INFO));
    assert_ne!(
        flags & tflag::SEND_DF,
        0,
        "DF once structured replies are on"
    );
    c.go("");
    assert_eq!(c.read_ok(1, 0, 512), vec![0u8; 512]);
}

#[test]
fn malformed_info_and_go_are_invalid() {
    let mut fx = Fixture::new(&[]);
    let good = info_payload(EXPORT, &[info::NAME, info::BLOCK_SIZE]);
    let mut name_too_long = (5000u32).to_be_bytes().to_vec();
    name_too_long.extend_from_slice(&[b'a'; 5000]);
    name_too_long.extend_from_slice(&0u16.to_be_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("3 bytes", vec![0, 0, 0]),
        ("name runs past the end", {
            let mut p = 9u32.to_be_bytes().to_vec();
            p.extend_from_slice(b"flas");
            p
        }),
        ("no item count", {
            let mut p = (EXPORT.len() as u32).to_be_bytes().to_vec();
            p.extend_from_slice(EXPORT.as_bytes());
            p
        }),
        ("truncated item", good[..good.len() - 1].to_vec()),
        ("missing item", good[..good.len() - 2].to_vec()),
        ("trailing byte", {
            let mut p = good.clone();
            p.push(0);
            p
        }),
        ("name length u32::MAX", vec![0xff, 0xff, 0xff, 0xff, 0, 0]),
        ("name over 4096 bytes", name_too_long),
    ];
    let mut c = fx.hello();
    for (what, payload) in &cases {
        for option in [opt::INFO, opt::GO] {
            c.option(option, payload);
            let replies = c.opt_replies(option);
            assert_eq!(replies.len(), 1, "{what}: {replies:?}");
            assert_eq!(replies[0].ty, rep::ERR_INVALID, "{what}: {replies:?}");
        }
    }
    // Still negotiating after all that.
    c.go("");
    assert_eq!(c.read_ok(1, 0, 512), vec![0u8; 512]);
    fx.assert_healthy();
}

#[test]
fn structured_reply_and_meta_context_negotiation() {
    let fx = Fixture::new(&[]);
    let mut c = fx.hello();
    let base = [wire::BASE_ALLOCATION];
    // Meta contexts need structured replies first.
    c.expect_opt(
        opt::SET_META_CONTEXT,
        &meta_payload("", &base),
        rep::ERR_INVALID,
    );
    c.expect_opt(
        opt::LIST_META_CONTEXT,
        &meta_payload("", &[]),
        rep::ERR_INVALID,
    );
    // STRUCTURED_REPLY takes no data.
    c.expect_opt(opt::STRUCTURED_REPLY, b"x", rep::ERR_INVALID);
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);

    // LIST with no query lists everything: base:allocation.
    for queries in [&[][..], &["base:"][..], &base[..]] {
        c.option(opt::LIST_META_CONTEXT, &meta_payload("", queries));
        let replies = c.opt_replies(opt::LIST_META_CONTEXT);
        assert_eq!(replies.len(), 2, "{queries:?}: {replies:?}");
        assert_eq!(replies[0].ty, rep::META_CONTEXT);
        assert_eq!(&replies[0].data[4..], wire::BASE_ALLOCATION.as_bytes());
        assert_eq!(replies[1].ty, rep::ACK);
    }
    // Unknown namespaces select nothing: a bare ACK.
    c.expect_opt(
        opt::LIST_META_CONTEXT,
        &meta_payload("", &["x-foo:bar"]),
        rep::ACK,
    );
    c.expect_opt(
        opt::SET_META_CONTEXT,
        &meta_payload("", &["x-foo:bar"]),
        rep::ACK,
    );
    // Unknown export, malformed payloads.
    c.expect_opt(
        opt::SET_META_CONTEXT,
        &meta_payload("nope", &base),
        rep::ERR_UNKNOWN,
    );
    let good = meta_payload("", &base);
    c.expect_opt(
        opt::SET_META_CONTEXT,
        &good[..good.len() - 1],
        rep::ERR_INVALID,
    );
    let mut trailing = good.clone();
    trailing.push(0);
    c.expect_opt(opt::SET_META_CONTEXT, &trailing, rep::ERR_INVALID);
    c.expect_opt(
        opt::LIST_META_CONTEXT,
        &[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        rep::ERR_INVALID,
    );

    // SET selects base:allocation under an id, even among unknown queries.
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload(EXPORT, &["x-foo:bar", wire::BASE_ALLOCATION]),
    );
    let replies = c.opt_replies(opt::SET_META_CONTEXT);
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(replies[0].ty, rep::META_CONTEXT);
    assert_eq!(&replies[0].data[4..], wire::BASE_ALLOCATION.as_bytes());
    let id = be32(&replies[0].data[0..4]);
    assert_eq!(replies[1].ty, rep::ACK);

    c.go("");
    assert_ne!(c.flags & tflag::SEND_DF, 0);
    c.request(0, cmd::BLOCK_STATUS, 5, 0, 4096);
    let chunk = c.chunk(5);
    assert_eq!(chunk.ty, reply::TYPE_BLOCK_STATUS, "{chunk:?}");
    assert_eq!(
        be32(&chunk.payload[0..4]),
        id,
        "context id of the BLOCK_STATUS reply"
    );
}

#[test]
fn export_name_for_an_unknown_export_closes_the_connection() {
    let mut fx = Fixture::new(&[]);
    for name in ["nope", "flashtier/", "FLASHTIER"] {
        let mut c = fx.hello();
        c.option(opt::EXPORT_NAME, name.as_bytes());
        c.expect_closed(&format!("EXPORT_NAME {name:?}"));
    }
    // Even an oversized one.
    let mut c = fx.hello();
    c.option(opt::EXPORT_NAME, &vec![b'a'; 100 * 1024]);
    c.expect_closed("oversized EXPORT_NAME");
    fx.assert_healthy();
}

#[test]
fn export_name_sends_zeroes_unless_no_zeroes() {
    let fx = Fixture::new(&[]);
    for (client_flags, name) in [
        (CLIENT_FLAGS, ""),
        (CLIENT_FLAGS, EXPORT),
        (handshake::C_FIXED_NEWSTYLE, ""),
        (0, EXPORT),
    ] {
        let mut c = Raw::open(&fx.socket());
        c.greeting();
        c.send(&client_flags.to_be_bytes());
        c.option(opt::EXPORT_NAME, name.as_bytes());
        let r = c.recv(10);
        assert_eq!(be64(&r[0..8]), SIZE);
        let flags = be16(&r[8..10]);
        assert_eq!(flags & RW_FLAGS, RW_FLAGS, "flags {flags:#x}");
        assert_eq!(flags & tflag::SEND_DF, 0, "flags {flags:#x}");
        if client_flags & handshake::C_NO_ZEROES == 0 {
            assert_eq!(c.recv(124), vec![0u8; 124], "124 reserved zero bytes");
        }
        // The next bytes are the reply to our first request, not leftover zeroes.
        c.request(0, cmd::READ, 0xfeed, 0, 512);
        assert_eq!(
            c.simple(0xfeed),
            0,
            "flags {client_flags:#x}, name {name:?}"
        );
        assert_eq!(c.recv(512), vec![0u8; 512]);
    }
}

#[test]
fn abort_is_acked_then_the_connection_closes() {
    let mut fx = Fixture::new(&[]);
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.expect_opt(opt::ABORT, &[], rep::ACK);
    c.expect_closed("after ABORT");
    // Right away, too.
    let mut c = fx.hello();
    c.expect_opt(opt::ABORT, &[], rep::ACK);
    c.expect_closed("after ABORT");
    fx.assert_healthy();
}

#[test]
fn truncated_handshakes_do_not_disturb_the_server() {
    let mut fx = Fixture::new(&[]);
    let socket = fx.socket();
    // A client in transmission throughout.
    let mut steady = fx.go();
    let data = pattern(3, 8192);
    steady.write_ok(1, 0, &data);

    // Gone before the greeting was read.
    drop(Raw::open(&socket));
    // Half the client flags.
    let mut c = Raw::open(&socket);
    c.greeting();
    c.send(&[0, 0]);
    drop(c);
    // Half an option header.
    let mut c = fx.hello();
    c.send(&wire::IHAVEOPT.to_be_bytes()[..5]);
    drop(c);
    // Part of an option payload.
    let mut c = fx.hello();
    c.option_header(wire::IHAVEOPT, opt::GO, 100);
    c.send(&[0u8; 10]);
    drop(c);
    // Part of an oversized payload being drained.
    let mut c = fx.hello();
    c.option_header(wire::IHAVEOPT, 99, 1 << 20);
    c.send(&[0u8; 100_000]);
    drop(c);
    // A complete INFO whose replies are never read.
    let mut c = fx.hello();
    c.option(
        opt::INFO,
        &info_payload("", &[info::NAME, info::DESCRIPTION]),
    );
    drop(c);
    // Transmission entered, then half a request header.
    let mut c = fx.go();
    c.send(&header(0, cmd::READ, 1, 0, 512)[..13]);
    drop(c);
    // Transmission entered, then a WRITE whose payload never arrives in full.
    let mut c = fx.go();
    c.send(&header(0, cmd::WRITE, 1, 0, 4096));
    c.send(&[0xEE; 1000]);
    drop(c);

    assert_eq!(steady.read_ok(2, 0, 8192), data);
    fx.assert_healthy();
    // The half-sent WRITE must not have reached the disk.
    assert_eq!(fx.go().read_ok(3, 0, 8192), data);
}

#[test]
fn connections_beyond_the_limit_are_refused() {
    let fx = Fixture::new(&["--max-connections", "1"]);
    let mut first = fx.go();
    // In use, so not reclaimable for a newcomer (it would be after 10 s idle).
    assert_eq!(first.read_ok(1, 0, 512), vec![0u8; 512]);
    let mut extra = Raw::open(&fx.socket());
    extra.expect_closed("second connection with --max-connections 1");
    drop(first);
    // Once the first has gone, a new client is served (the server notices the close shortly).
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let mut c = Raw::open(&fx.socket());
        let mut g = [0u8; 18];
        if c.s.read_exact(&mut g).is_ok() {
            assert_eq!(&g[0..8], b"NBDMAGIC");
            c.send(&CLIENT_FLAGS.to_be_bytes());
            c.go("");
            assert_eq!(c.read_ok(1, 0, 512), vec![0u8; 512]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no connection accepted after the first closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ================================================================================================
// Transmission, simple replies

#[test]
fn read_write_roundtrip_echoes_handles() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    assert_eq!(c.flags & RW_FLAGS, RW_FLAGS);
    let data = pattern(1, 65536);
    for (handle, offset) in [
        (0u64, MIB),
        (u64::MAX, 2 * MIB + 512),
        (0xdead_beef_0123_4567, 3 * MIB + 4096),
    ] {
        c.write_request(cmd_flag::FUA, handle, offset, &data);
        assert_eq!(c.simple(handle), 0);
        c.request(0, cmd::READ, !handle, offset, data.len() as u32);
        assert_eq!(c.simple(!handle), 0);
        assert_eq!(c.recv(data.len()), data, "offset {offset}");
    }
    // Sub-sector I/O is served exactly.
    c.write_ok(10, 5 * MIB + 3, b"hello");
    let back = c.read_ok(11, 5 * MIB, 16);
    assert_eq!(&back[..3], &[0, 0, 0]);
    assert_eq!(&back[3..8], b"hello");
    assert_eq!(&back[8..], &[0u8; 8]);
    // Never-written space reads as zeroes; zero-length requests are fine.
    assert_eq!(c.read_ok(12, 40 * MIB, 4096), vec![0u8; 4096]);
    assert_eq!(c.read_ok(13, 40 * MIB, 0), Vec::<u8>::new());
    c.write_ok(14, 40 * MIB, &[]);
}

#[test]
fn out_of_range_requests_are_refused_and_the_stream_stays_in_sync() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    // The last sector and an empty read at the very end are in range.
    assert_eq!(c.read_ok(1, SIZE - 512, 512), vec![0u8; 512]);
    assert_eq!(c.read_ok(2, SIZE, 0), Vec::<u8>::new());

    for (offset, len) in [
        (SIZE - 512, 1024),
        (SIZE, 1),
        (SIZE + 1, 0),
        (u64::MAX - 100, 4096),
        (u64::MAX, 1),
    ] {
        assert_eq!(
            c.call(0, cmd::READ, 3, offset, len),
            errno::EINVAL,
            "READ {len}@{offset:#x}"
        );
        assert_eq!(
            c.call(0, cmd::CACHE, 4, offset, len),
            errno::EINVAL,
            "CACHE {len}@{offset:#x}"
        );
    }
    for (offset, len) in [(SIZE - 512, 1024u32), (SIZE, 512), (u64::MAX - 100, 4096)] {
        c.write_request(0, 5, offset, &decoy_payload(len as usize));
        assert_eq!(c.simple(5), errno::ENOSPC, "WRITE {len}@{offset:#x}");
        assert_eq!(
            c.call(0, cmd::TRIM, 6, offset, len),
            errno::ENOSPC,
            "TRIM {len}@{offset:#x}"
        );
        assert_eq!(
            c.call(0, cmd::WRITE_ZEROES, 7, offset, len),
            errno::ENOSPC,
            "WRITE_ZEROES {len}@{offset:#x}"
        );
    }
    // The refused write did not write its in-range part.
    assert_eq!(c.read_ok(8, SIZE - 512, 512), vec![0u8; 512]);
}

#[test]
fn invalid_commands_and_flags_get_einval() {
    let mut fx = Fixture::new(&[]);
    let mut c = fx.go();
    let mut handle = 100;
    let mut expect = |c: &mut Raw, flags: u16, command: u16, offset: u64, len: u32, what: &str| {
        handle += 1;
        if command == cmd::WRITE {
            c.write_request(flags, handle, offset, &decoy_payload(len as usize));
        } else {
            c.request(flags, command, handle, offset, len);
        }
        assert_eq!(c.simple(handle), errno::EINVAL, "{what}");
        // In sync: the next request is answered as itself, with no stray payload before it.
        assert_eq!(
            c.read_ok(handle + 1000, 0, 512),
            vec![0u8; 512],
            "after {what}"
        );
    };
    expect(&mut c, 0, 99, 0, 4096, "unknown command 99");
    expect(&mut c, 0, 8, 0, 0, "unknown command 8");
    expect(&mut c, 0, 0xffff, 0, 0, "unknown command 0xffff");
    expect(&mut c, 1 << 7, cmd::READ, 0, 512, "READ with flag bit 7");
    expect(&mut c, 1 << 15, cmd::READ, 0, 512, "READ with flag bit 15");
    expect(
        &mut c,
        cmd_flag::REQ_ONE,
        cmd::READ,
        0,
        512,
        "READ with REQ_ONE",
    );
    expect(
        &mut c,
        cmd_flag::DF,
        cmd::READ,
        0,
        512,
        "READ with DF, no structured replies",
    );
    expect(
        &mut c,
        cmd_flag::NO_HOLE,
        cmd::WRITE,
        0,
        4096,
        "WRITE with NO_HOLE",
    );
    expect(&mut c, 1 << 9, cmd::WRITE, 0, 512, "WRITE with flag bit 9");
    expect(
        &mut c,
        cmd_flag::FAST_ZERO,
        cmd::WRITE,
        0,
        512,
        "WRITE with FAST_ZERO",
    );
    expect(
        &mut c,
        cmd_flag::NO_HOLE,
        cmd::TRIM,
        0,
        4096,
        "TRIM with NO_HOLE",
    );
    expect(
        &mut c,
        cmd_flag::DF,
        cmd::WRITE_ZEROES,
        0,
        4096,
        "WRITE_ZEROES with DF",
    );
    expect(
        &mut c,
        cmd_flag::NO_HOLE,
        cmd::CACHE,
        0,
        4096,
        "CACHE with NO_HOLE",
    );
    expect(&mut c, 0, cmd::FLUSH, 4096, 0, "FLUSH with an offset");
    expect(&mut c, 0, cmd::FLUSH, 0, 4096, "FLUSH with a length");
    expect(
        &mut c,
        0,
        cmd::BLOCK_STATUS,
        0,
        4096,
        "BLOCK_STATUS without a context",
    );
    // None of the refused writes wrote anything.
    assert_eq!(c.read_ok(1, 0, 4096), vec![0u8; 4096]);
    assert_eq!(c.call(0, cmd::FLUSH, 2, 0, 0), 0);
    assert_eq!(c.call(cmd_flag::FUA, cmd::FLUSH, 3, 0, 0), 0);
    fx.assert_healthy();
}

#[test]
fn oversized_payloads_get_eoverflow() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    // 33 MiB WRITE: drained and refused.
    let big = vec![0xAB; 33 << 20];
    c.write_request(0, 1, 0, &big);
    assert_eq!(c.simple(1), errno::EOVERFLOW);
    assert_eq!(
        c.read_ok(2, 0, 4096),
        vec![0u8; 4096],
        "refused WRITE wrote"
    );
    for len in [MAX_PAYLOAD + 1, 33 << 20, u32::MAX] {
        assert_eq!(
            c.call(0, cmd::READ, 3, 0, len),
            errno::EOVERFLOW,
            "READ {len}"
        );
    }
    // Exactly the maximum is fine both ways.
    let max = pattern(5, MAX_PAYLOAD as usize);
    c.write_ok(4, MIB, &max);
    assert!(c.read_ok(5, MIB, MAX_PAYLOAD) == max, "32 MiB roundtrip");
}

#[test]
fn write_zeroes_trim_cache_and_fua() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    let region = 64 * 1024;
    let data = pattern(0x5A, region);
    // (flags, offset within the region, length) zeroed in region i.
    let cases = [
        (0, 8192, 16384),
        (cmd_flag::NO_HOLE, 8192, 16384),
        (cmd_flag::FAST_ZERO, 8192, 16384),
        (
            cmd_flag::NO_HOLE | cmd_flag::FAST_ZERO | cmd_flag::FUA,
            8192,
            16384,
        ),
        (cmd_flag::NO_HOLE, 100, 1000),
        (0, 4000, 5000),
    ];
    for (i, (flags, start, len)) in cases.into_iter().enumerate() {
        let base = (i as u64 + 1) * MIB;
        c.write_ok(10 + i as u64, base, &data);
        assert_eq!(
            c.call(flags, cmd::WRITE_ZEROES, 20 + i as u64, base + start, len),
            0,
            "WRITE_ZEROES flags {flags:#x}"
        );
        let mut want = data.clone();
        want[start as usize..(start + len as u64) as usize].fill(0);
        assert!(
            c.read_ok(30 + i as u64, base, region as u32) == want,
            "WRITE_ZEROES flags {flags:#x} {len}@{start}: wrong contents"
        );
    }

    // TRIM: accepted, and leaves data outside its range alone.
    let base = 20 * MIB;
    c.write_ok(40, base, &data);
    assert_eq!(c.call(0, cmd::TRIM, 41, base + 16384, 16384), 0);
    assert_eq!(c.call(cmd_flag::FUA, cmd::TRIM, 42, base + 49152, 4096), 0);
    let back = c.read_ok(43, base, region as u32);
    assert_eq!(&back[..16384], &data[..16384]);
    assert_eq!(&back[32768..49152], &data[32768..49152]);
    assert_eq!(&back[53248..], &data[53248..]);

    // CACHE, and FUA on commands that do not write.
    assert_eq!(c.call(0, cmd::CACHE, 50, 0, 1 << 20), 0);
    assert_eq!(c.call(cmd_flag::FUA, cmd::CACHE, 51, base, 4096), 0);
    assert_eq!(c.call(cmd_flag::FUA, cmd::FLUSH, 52, 0, 0), 0);
    c.request(cmd_flag::FUA, cmd::READ, 53, base, 4096);
    assert_eq!(c.simple(53), 0);
    assert_eq!(c.recv(4096), &data[..4096]);
}

#[test]
fn bad_request_magic_drops_only_that_connection() {
    let mut fx = Fixture::new(&[]);
    let mut a = fx.go();
    let mut b = fx.go();
    let data = pattern(0x21, 4096);
    a.write_ok(1, 0, &data);
    let mut bad = header(0, cmd::READ, 2, 0, 512);
    bad[0] ^= 0x80;
    a.send(&bad);
    a.expect_closed("bad request magic");
    // Simple reply magic as request magic.
    let mut c = fx.go();
    let mut bad = header(0, cmd::READ, 3, 0, 512);
    bad[0..4].copy_from_slice(&wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
    c.send(&bad);
    c.expect_closed("reply magic in a request");

    assert_eq!(b.read_ok(4, 0, 4096), data);
    b.write_ok(5, 4096, &data);
    assert_eq!(b.read_ok(6, 4096, 4096), data);
    fx.assert_healthy();
}

#[test]
fn many_requests_in_flight() {
    pipelined(&[]);
}

#[test]
fn many_requests_in_flight_on_one_worker_thread() {
    pipelined(&["--threads", "1"]);
}

fn pipelined(args: &[&str]) {
    let fx = Fixture::new(args);
    let mut c = fx.go();
    const N: u64 = 32;
    let len = |i: u64| 4096 * (1 + i as usize % 4);
    let read_at = |i: u64| i * 64 * 1024;
    let write_at = |i: u64| 8 * MIB + i * 64 * 1024;
    for i in 0..N {
        c.write_ok(i, read_at(i), &pattern(i as u8, len(i)));
    }

    // 64 requests, READs of what was just written interleaved with WRITEs elsewhere, sent by
    // another thread while this one collects the replies (replies may come in any order).
    let mut burst = Vec::new();
    let mut expected: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    for i in 0..N {
        let rh = 0x5EAD_0000_0000 + i;
        burst.extend_from_slice(&header(0, cmd::READ, rh, read_at(i), len(i) as u32));
        expected.insert(rh, Some(pattern(i as u8, len(i))));
        let wh = 0x3717_0000_0000 + i;
        let payload = pattern(0x80 | i as u8, len(i));
        burst.extend_from_slice(&header(0, cmd::WRITE, wh, write_at(i), len(i) as u32));
        burst.extend_from_slice(&payload);
        expected.insert(wh, None);
    }
    let mut writer = c.s.try_clone().unwrap();
    let sender = std::thread::spawn(move || writer.write_all(&burst));
    let mut seen = HashSet::new();
    for _ in 0..2 * N {
        let (error, handle) = match c.reply() {
            Reply::Simple { error, handle } => (error, handle),
            Reply::Chunk(ch) => panic!("structured reply without negotiation: {ch:?}"),
        };
        assert_eq!(error, 0, "handle {handle:#x}");
        assert!(seen.insert(handle), "handle {handle:#x} answered twice");
        match expected.get(&handle) {
            None => panic!("reply for a handle never sent: {handle:#x}"),
            Some(Some(want)) => {
                let got = c.recv(want.len());
                assert!(got == *want, "READ {handle:#x} returned wrong data");
            }
            Some(None) => {}
        }
    }
    sender.join().unwrap().expect("sending the burst");
    // Nothing more was queued: the next reply is for the next request.
    for i in 0..N {
        assert!(
            c.read_ok(0x1000 + i, write_at(i), len(i) as u32) == pattern(0x80 | i as u8, len(i)),
            "WRITE {i} did not land"
        );
    }
}

#[test]
fn disc_answers_requests_in_flight_then_closes() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    let first = pattern(1, 4096);
    c.write_ok(1, 0, &first);
    let second = pattern(2, 4096);
    let third = pattern(3, 16384);
    let mut burst = Vec::new();
    burst.extend_from_slice(&header(0, cmd::WRITE, 11, 8192, 4096));
    burst.extend_from_slice(&second);
    burst.extend_from_slice(&header(0, cmd::READ, 12, 0, 4096));
    burst.extend_from_slice(&header(cmd_flag::FUA, cmd::WRITE, 13, MIB, 16384));
    burst.extend_from_slice(&third);
    burst.extend_from_slice(&header(0, cmd::FLUSH, 14, 0, 0));
    burst.extend_from_slice(&header(0, cmd::DISC, 15, 0, 0));
    c.send(&burst);
    let mut pending: HashSet<u64> = [11, 12, 13, 14].into();
    while !pending.is_empty() {
        let Reply::Simple { error, handle } = c.reply() else {
            panic!("structured reply without negotiation");
        };
        assert_eq!(error, 0, "handle {handle}");
        assert!(pending.remove(&handle), "unexpected reply for {handle}");
        if handle == 12 {
            assert_eq!(c.recv(4096), first);
        }
    }
    c.expect_closed("after DISC");

    let mut c = fx.go();
    assert_eq!(c.read_ok(1, 8192, 4096), second);
    assert_eq!(c.read_ok(2, MIB, 16384), third);
    // DISC with nothing in flight.
    c.request(0, cmd::DISC, 3, 0, 0);
    c.expect_closed("after an idle DISC");
}

#[test]
fn client_eof_after_requests_gets_them_answered() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go();
    let data = pattern(4, 8192);
    let mut burst = header(0, cmd::WRITE, 1, 0, 8192).to_vec();
    burst.extend_from_slice(&data);
    burst.extend_from_slice(&header(0, cmd::FLUSH, 2, 0, 0));
    burst.extend_from_slice(&header(0, cmd::READ, 3, MIB, 4096));
    c.send(&burst);
    c.s.shutdown(Shutdown::Write).unwrap();
    let mut pending: HashSet<u64> = [1, 2, 3].into();
    while !pending.is_empty() {
        let Reply::Simple { error, handle } = c.reply() else {
            panic!("structured reply without negotiation");
        };
        assert_eq!(error, 0);
        assert!(pending.remove(&handle), "unexpected reply for {handle}");
        if handle == 3 {
            assert_eq!(c.recv(4096), vec![0u8; 4096]);
        }
    }
    c.expect_closed("after the client's EOF");
    assert_eq!(fx.go().read_ok(1, 0, 8192), data);
}

#[test]
fn shutdown_answers_requests_already_sent_then_closes() {
    let fx = Fixture::new(&[]);
    let mut t = fx.go();
    let old = pattern(0x31, 4096);
    t.write_ok(1, MIB, &old);
    let data = pattern(0x32, 65536);
    let mut burst = header(cmd_flag::FUA, cmd::WRITE, 2, 0, 65536).to_vec();
    burst.extend_from_slice(&data);
    burst.extend_from_slice(&header(0, cmd::READ, 3, MIB, 4096));
    burst.extend_from_slice(&header(0, cmd::FLUSH, 4, 0, 0));
    t.send(&burst);
    // A second client still negotiating.
    let mut h = fx.hello();
    h.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);

    let Fixture { server, _dir: dir } = fx;
    // SIGTERM, and the server must exit 0 (the replies fit in the socket buffer, so it never
    // waits on us).
    server.stop();
    let mut pending: HashSet<u64> = [2, 3, 4].into();
    while !pending.is_empty() {
        let Reply::Simple { error, handle } = t.reply() else {
            panic!("structured reply without negotiation");
        };
        assert_eq!(error, 0, "handle {handle}");
        assert!(pending.remove(&handle), "unexpected reply for {handle}");
        if handle == 3 {
            assert_eq!(t.recv(4096), old);
        }
    }
    t.expect_closed("transmission client after shutdown");
    h.expect_closed("negotiating client after shutdown");
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert!(
        disk[..65536] == data[..],
        "WRITE answered before shutdown is not on disk"
    );
}

/// A client that sends requests and then stops reading must not hold the shutdown forever: after
/// `--shutdown-grace` its connection is closed and the server still exits 0.
#[test]
fn shutdown_does_not_wait_forever_for_a_client_that_stopped_reading() {
    let fx = Fixture::new(&["--shutdown-grace", "1"]);
    let mut t = fx.go();
    // 64 MiB of READ replies: far more than the socket buffers hold, so workers block writing.
    let mut burst = Vec::new();
    for handle in 0..64u64 {
        burst.extend_from_slice(&header(
            0,
            cmd::READ,
            handle,
            handle * MIB % SIZE,
            MIB as u32,
        ));
    }
    t.send(&burst);
    std::thread::sleep(Duration::from_millis(300));
    let Fixture { server, _dir } = fx;
    let started = Instant::now();
    server.stop();
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?} with a client that does not read",
        started.elapsed()
    );
    drop(t);
}

#[test]
fn odd_sized_export_is_served_to_the_last_byte() {
    const ODD: usize = 4096 + 100;
    for args in [&[][..], &["--direct"][..]] {
        let dir = harness::scratch();
        let disk = dir.path().join("odd.img");
        harness::random_file(&disk, ODD, 42);
        let orig = std::fs::read(&disk).unwrap();
        let server = Server::on_socket(dir.path(), disk.to_str().unwrap(), args);
        let mut c = Raw::open(&server.socket().unwrap());
        c.greeting();
        c.send(&CLIENT_FLAGS.to_be_bytes());
        c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
        c.option(
            opt::SET_META_CONTEXT,
            &meta_payload("", &[wire::BASE_ALLOCATION]),
        );
        let ctx = be32(&c.opt_replies(opt::SET_META_CONTEXT)[0].data[0..4]);
        c.option(opt::GO, &info_payload("", &[info::BLOCK_SIZE]));
        let (size, flags) = export_info(&c.opt_replies(opt::GO));
        c.flags = flags;
        assert_eq!(size, ODD as u64, "{args:?}");
        let end = ODD as u64;
        assert!(c.read_ok(1, 0, ODD as u32) == orig, "{args:?}: full read");
        assert_eq!(c.read_ok(2, end - 8, 8), &orig[ODD - 8..], "{args:?}");
        assert_eq!(
            c.call(0, cmd::READ, 3, end - 8, 9),
            errno::EINVAL,
            "{args:?}"
        );
        c.write_ok(4, end - 4, b"abcd");
        assert_eq!(
            c.read_ok(5, end - 6, 6),
            [&orig[ODD - 6..ODD - 4], b"abcd"].concat()
        );
        assert_eq!(c.call(0, cmd::WRITE_ZEROES, 6, end - 10, 10), 0, "{args:?}");
        assert_eq!(c.read_ok(7, end - 10, 10), vec![0u8; 10], "{args:?}");
        c.request(0, cmd::BLOCK_STATUS, 8, 4096, 100);
        let descs = descriptors(&c.chunk(8), ctx, 100);
        assert_eq!(
            descs.iter().map(|d| d.0).sum::<u32>(),
            100,
            "{args:?}: {descs:?}"
        );
        assert_eq!(c.call(0, cmd::FLUSH, 9, 0, 0), 0);
        drop(c);
        server.stop();
        let mut want = orig.clone();
        want[ODD - 10..].fill(0);
        assert!(
            std::fs::read(&disk).unwrap() == want,
            "{args:?}: file contents"
        );
    }
}

#[test]
fn read_only_export_refuses_writes() {
    let mut fx = Fixture::new(&["--read-only"]);
    let mut c = fx.go();
    let flags = c.flags;
    assert_ne!(flags & tflag::READ_ONLY, 0, "flags {flags:#x}");
    assert_ne!(flags & tflag::HAS_FLAGS, 0, "flags {flags:#x}");
    assert_ne!(flags & tflag::SEND_FLUSH, 0, "flags {flags:#x}");
    for f in [
        tflag::SEND_TRIM,
        tflag::SEND_WRITE_ZEROES,
        tflag::SEND_FAST_ZERO,
    ] {
        assert_eq!(flags & f, 0, "flags {flags:#x} advertise {f:#x}");
    }
    for wflags in [0, cmd_flag::FUA] {
        c.write_request(wflags, 1, 0, &decoy_payload(4096));
        assert_eq!(c.simple(1), errno::EPERM, "WRITE flags {wflags:#x}");
    }
    assert_eq!(c.call(0, cmd::TRIM, 2, 0, 4096), errno::EPERM);
    assert_eq!(c.call(0, cmd::WRITE_ZEROES, 3, 0, 4096), errno::EPERM);
    assert_eq!(
        c.call(cmd_flag::NO_HOLE, cmd::WRITE_ZEROES, 4, 0, 4096),
        errno::EPERM
    );
    assert_eq!(c.read_ok(5, 0, 4096), vec![0u8; 4096]);
    assert_eq!(c.call(0, cmd::CACHE, 6, 0, 4096), 0);
    assert_eq!(c.call(0, cmd::FLUSH, 7, 0, 0), 0);
    assert!(fx.server.is_running());
    let log = fx.server.log();
    assert!(!log.contains("panicked"), "{log}");
    // INFO reports the same.
    let mut c = fx.hello();
    c.option(opt::INFO, &info_payload("", &[]));
    let (_, flags) = export_info(&c.opt_replies(opt::INFO));
    assert_ne!(flags & tflag::READ_ONLY, 0);
    assert_eq!(flags & tflag::SEND_TRIM, 0);
}

// ================================================================================================
// Structured replies

#[test]
fn structured_read_is_one_offset_data_chunk() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go_structured(&[]);
    let data = pattern(6, 8192);
    c.write_ok(1, MIB + 512, &data);
    for (handle, flags) in [(2, 0), (3, cmd_flag::DF), (4, cmd_flag::DF | cmd_flag::FUA)] {
        c.request(flags, cmd::READ, handle, MIB + 512, 8192);
        let ch = c.chunk(handle);
        assert_eq!(ch.flags, reply::FLAG_DONE, "{ch:?}");
        assert_eq!(ch.ty, reply::TYPE_OFFSET_DATA, "{ch:?}");
        assert_eq!(ch.payload.len(), 8 + 8192, "{ch:?}");
        assert_eq!(be64(&ch.payload[0..8]), MIB + 512);
        assert!(
            ch.payload[8..] == data[..],
            "READ flags {flags:#x}: wrong data"
        );
    }
    // Unwritten space, through the same path.
    assert_eq!(c.read_ok(5, 30 * MIB, 65536), vec![0u8; 65536]);
    // Commands without reply data may still get simple replies; FLUSH must succeed.
    assert_eq!(c.call(0, cmd::FLUSH, 6, 0, 0), 0);
}

#[test]
fn structured_errors_are_error_chunks() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go_structured(&[]);
    for (flags, offset, len, code, what) in [
        (0, SIZE - 512, 1024, errno::EINVAL, "READ past the end"),
        (0, u64::MAX, 1, errno::EINVAL, "READ overflowing u64"),
        (1 << 7, 0, 512, errno::EINVAL, "READ with flag bit 7"),
        (
            cmd_flag::REQ_ONE,
            0,
            512,
            errno::EINVAL,
            "READ with REQ_ONE",
        ),
        (0, 0, MAX_PAYLOAD + 1, errno::EOVERFLOW, "READ over 32 MiB"),
    ] {
        // A READ must never get a simple reply once structured replies are on, not even an error.
        c.request(flags, cmd::READ, 7, offset, len);
        let ch = c.chunk(7);
        assert_eq!(ch.flags, reply::FLAG_DONE, "{what}: {ch:?}");
        let (error, msg) = ch.error();
        assert_eq!(error, code, "{what}: {ch:?}");
        assert!(!msg.is_empty(), "{what}: error chunk without a message");
    }
    // Other commands: simple replies or error chunks, either carrying the right errno.
    c.write_request(0, 8, SIZE - 512, &decoy_payload(1024));
    assert_eq!(c.status(8), errno::ENOSPC);
    assert_eq!(c.call(0, cmd::FLUSH, 9, 1, 0), errno::EINVAL);
    assert_eq!(c.call(0, 99, 10, 0, 0), errno::EINVAL);
    assert_eq!(
        c.call(0, cmd::BLOCK_STATUS, 11, 0, 4096),
        errno::EINVAL,
        "BLOCK_STATUS with no context selected"
    );
    assert_eq!(c.read_ok(12, SIZE - 512, 512), vec![0u8; 512]);
}

#[test]
fn structured_zero_length_read_is_a_none_chunk() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go_structured(&[]);
    for offset in [0, SIZE] {
        c.request(0, cmd::READ, 0x0e, offset, 0);
        let ch = c.chunk(0x0e);
        assert_eq!(ch.ty, reply::TYPE_NONE, "{ch:?}");
        assert_eq!(ch.flags, reply::FLAG_DONE, "{ch:?}");
        assert!(ch.payload.is_empty(), "{ch:?}");
    }
}

/// Descriptors of a BLOCK_STATUS reply, checking the chunk's framing and the context id.
fn descriptors(ch: &Chunk, context: u32, request_len: u32) -> Vec<(u32, u32)> {
    assert_eq!(ch.ty, reply::TYPE_BLOCK_STATUS, "{ch:?}");
    assert_eq!(ch.flags, reply::FLAG_DONE, "{ch:?}");
    let p = &ch.payload;
    assert!(
        p.len() >= 12 && p.len() % 8 == 4,
        "BLOCK_STATUS length 4 + 8n, n > 0: {ch:?}"
    );
    assert_eq!(be32(&p[0..4]), context, "context id");
    let descs: Vec<(u32, u32)> = p[4..]
        .chunks_exact(8)
        .map(|d| (be32(&d[0..4]), be32(&d[4..8])))
        .collect();
    assert!(
        descs.iter().all(|d| d.0 > 0),
        "zero-length descriptor: {descs:?}"
    );
    let sum: u64 = descs.iter().map(|d| d.0 as u64).sum();
    assert!(
        sum <= request_len as u64,
        "descriptors cover {sum} bytes of a {request_len}-byte request: {descs:?}"
    );
    descs
}

/// The status flags at `at` bytes into the range `descs` describe (None: not covered).
fn status_at(descs: &[(u32, u32)], at: u64) -> Option<u32> {
    let mut start = 0u64;
    for (len, flags) in descs {
        if at < start + *len as u64 {
            return Some(*flags);
        }
        start += *len as u64;
    }
    None
}

#[test]
fn block_status_reports_holes_and_data() {
    let fx = Fixture::new(&[]);
    let mut c = fx.go_structured(&[wire::BASE_ALLOCATION]);
    let ctx = c.context.expect("base:allocation selected");
    let data = pattern(7, 65536);
    c.write_ok(1, MIB, &data);
    assert_eq!(c.call(0, cmd::FLUSH, 2, 0, 0), 0);
    let hole = state::HOLE | state::ZERO;

    let len = 4 * MIB as u32;
    c.request(0, cmd::BLOCK_STATUS, 3, 0, len);
    let descs = descriptors(&c.chunk(3), ctx, len);
    assert!(
        descs.windows(2).all(|w| w[0].1 != w[1].1),
        "neighbouring descriptors with the same status: {descs:?}"
    );
    for (at, want) in [
        (0, hole),
        (MIB - 1, hole),
        (MIB, 0),
        (MIB + 65535, 0),
        (MIB + 65536, hole),
        (4 * MIB - 1, hole),
    ] {
        assert_eq!(status_at(&descs, at), Some(want), "at {at}: {descs:?}");
    }

    // REQ_ONE: one descriptor, not reaching past the first change of status.
    for (handle, offset, want, limit) in [(4, 0, hole, MIB), (5, MIB, 0, 65536)] {
        c.request(cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, handle, offset, len);
        let descs = descriptors(&c.chunk(handle), ctx, len);
        assert_eq!(descs.len(), 1, "REQ_ONE at {offset}: {descs:?}");
        assert_eq!(descs[0].1, want, "REQ_ONE at {offset}: {descs:?}");
        assert!(descs[0].0 as u64 <= limit, "REQ_ONE at {offset}: {descs:?}");
    }

    // The whole export, the last sector, and FUA (allowed on every command).
    c.request(cmd_flag::FUA, cmd::BLOCK_STATUS, 6, 0, SIZE as u32);
    let descs = descriptors(&c.chunk(6), ctx, SIZE as u32);
    assert_eq!(status_at(&descs, MIB), Some(0), "{descs:?}");
    c.request(0, cmd::BLOCK_STATUS, 7, SIZE - 512, 512);
    assert_eq!(descriptors(&c.chunk(7), ctx, 512), vec![(512, hole)]);

    // Zeroing with holes allowed makes the data a hole again, readable as zeroes.
    assert_eq!(c.call(0, cmd::WRITE_ZEROES, 8, MIB, 65536), 0);
    c.request(0, cmd::BLOCK_STATUS, 9, MIB, 65536);
    let descs = descriptors(&c.chunk(9), ctx, 65536);
    assert_ne!(
        status_at(&descs, 0).unwrap() & state::ZERO,
        0,
        "zeroed range not reported as zero: {descs:?}"
    );

    // Refusals: past the end, zero length, flags not valid for BLOCK_STATUS.
    for (flags, offset, len, what) in [
        (0, SIZE - 512, 1024, "past the end"),
        (0, SIZE, 1, "at the end"),
        (0, u64::MAX, 4096, "overflowing u64"),
        (0, 0, 0, "zero length"),
        (cmd_flag::DF, 0, 4096, "DF"),
        (cmd_flag::NO_HOLE, 0, 4096, "NO_HOLE"),
    ] {
        assert_eq!(
            c.call(flags, cmd::BLOCK_STATUS, 10, offset, len),
            errno::EINVAL,
            "BLOCK_STATUS {what}"
        );
    }
    assert_eq!(c.read_ok(11, MIB, 4096), vec![0u8; 4096]);
}

#[test]
fn block_status_needs_a_selected_context() {
    let fx = Fixture::new(&[]);
    // LIST_META_CONTEXT lists but does not select.
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.option(opt::LIST_META_CONTEXT, &meta_payload("", &[]));
    assert_eq!(c.opt_replies(opt::LIST_META_CONTEXT).len(), 2);
    c.go("");
    assert_eq!(c.call(0, cmd::BLOCK_STATUS, 1, 0, 4096), errno::EINVAL);

    // A later SET replaces an earlier one.
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("", &[wire::BASE_ALLOCATION]),
    );
    assert_eq!(c.opt_replies(opt::SET_META_CONTEXT).len(), 2);
    c.expect_opt(
        opt::SET_META_CONTEXT,
        &meta_payload("", &["x-foo:bar"]),
        rep::ACK,
    );
    c.go("");
    assert_eq!(c.call(0, cmd::BLOCK_STATUS, 2, 0, 4096), errno::EINVAL);

    // SET with no queries selects nothing.
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.expect_opt(opt::SET_META_CONTEXT, &meta_payload("", &[]), rep::ACK);
    c.go("");
    assert_eq!(c.call(0, cmd::BLOCK_STATUS, 3, 0, 4096), errno::EINVAL);

    // And a selected context survives EXPORT_NAME as well as GO.
    let mut c = fx.hello();
    c.expect_opt(opt::STRUCTURED_REPLY, &[], rep::ACK);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("", &[wire::BASE_ALLOCATION]),
    );
    let replies = c.opt_replies(opt::SET_META_CONTEXT);
    let id = be32(&replies[0].data[0..4]);
    c.option(opt::EXPORT_NAME, &[]);
    let r = c.recv(10);
    c.flags = be16(&r[8..10]);
    assert_ne!(
        c.flags & tflag::SEND_DF,
        0,
        "structured replies after EXPORT_NAME"
    );
    c.request(0, cmd::BLOCK_STATUS, 4, 0, 4096);
    let descs = descriptors(&c.chunk(4), id, 4096);
    assert_eq!(descs, vec![(4096, state::HOLE | state::ZERO)]);
}

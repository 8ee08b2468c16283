//! An NBD client that is a [`BlockDev`]: flashtier's backing store can be any NBD server
//! (nbdkit and its plugins, qemu-nbd, another flashtier).
//!
//! One connection carries many requests at once: callers on any thread send their request under a
//! write lock and sleep on their own completion slot; a reader thread matches replies to slots by
//! handle. If the connection breaks, every waiting request fails with `EIO` and the next request
//! reconnects (and checks that the export is still the same size).
//!
//! With an `nbds://` or `nbds+unix://` URI the client sends `NBD_OPT_STARTTLS` first and refuses
//! to go on if the server does not upgrade (no downgrade to plain text); the TLS session is a
//! [`TlsStream`], which the senders and the reader thread share.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Condvar, Mutex, RwLock};

use flashtier_io::{write_zero_buffers, AlignedBuf, BlockDev, DevInfo, ZeroOpts};

use crate::errmap::io_error;
use crate::net::{write_all_vectored, Stream};
use crate::tls::{ClientCredentials, ClientTls, PskKeys, TlsIo, TlsStream};
use crate::uri::NbdUri;
use crate::wire::{self, cmd, cmd_flag, info, opt, rep, tflag, RequestHeader};
use crate::ClientError;

/// Largest single request we send, whatever the server allows.
const MAX_REQUEST: u32 = 32 * 1024 * 1024;
/// Largest range per TRIM / WRITE_ZEROES / CACHE request.
const MAX_RANGE_REQUEST: u64 = 1 << 30;

/// What the handshake told us about the export.
#[derive(Debug, Clone, Copy)]
struct Negotiated {
    size: u64,
    flags: u16,
    min_block: u32,
    max_payload: u32,
}

pub struct NbdClient {
    uri: NbdUri,
    tls: Option<Arc<ClientTls>>,
    info: DevInfo,
    flags: u16,
    max_payload: u32,
    conn: Mutex<Arc<Conn>>,
    /// Exclusive for read-modify-write of partial blocks, shared for aligned writes: see FileDev.
    rmw: RwLock<()>,
}

struct Conn {
    stream: Transport,
    /// Serialises request headers and payloads on the stream.
    send: Mutex<()>,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    next_handle: u64,
    slots: HashMap<u64, Arc<Slot>>,
    /// Set once the connection is unusable; requests fail fast with this reason.
    dead: Option<String>,
}

struct Slot {
    read_len: usize,
    result: Mutex<Option<io::Result<Vec<u8>>>>,
    ready: Condvar,
}

impl Slot {
    fn complete(&self, result: io::Result<Vec<u8>>) {
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        self.ready.notify_one();
    }

    fn wait(&self) -> io::Result<Vec<u8>> {
        let mut r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(result) = r.take() {
                return result;
            }
            r = self.ready.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl NbdClient {
    /// Connects to `uri` and negotiates the export.
    pub fn connect(uri: &str) -> Result<NbdClient, ClientError> {
        let uri = NbdUri::parse(uri)?;
        let tls = client_tls(&uri)?.map(Arc::new);
        let (conn, n) = Conn::open(&uri, tls.as_deref())?;
        let read_only = n.flags & tflag::READ_ONLY != 0;
        let info = DevInfo {
            size: n.size,
            read_only,
            min_block: n.min_block.max(1),
            can_flush: n.flags & tflag::SEND_FLUSH != 0,
            native_fua: n.flags & tflag::SEND_FUA != 0,
            can_trim: n.flags & tflag::SEND_TRIM != 0,
            can_fast_zero: n.flags & tflag::SEND_WRITE_ZEROES != 0
                && n.flags & tflag::SEND_FAST_ZERO != 0,
            can_extents: false,
            rotational: n.flags & tflag::ROTATIONAL != 0,
        };
        Ok(NbdClient {
            uri,
            tls,
            info,
            flags: n.flags,
            max_payload: n.max_payload.clamp(4096, MAX_REQUEST),
            conn: Mutex::new(conn),
            rmw: RwLock::new(()),
        })
    }

    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// The current connection, reconnecting if the last one broke.
    fn connection(&self) -> io::Result<Arc<Conn>> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let dead = conn
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dead
            .clone();
        if let Some(reason) = dead {
            tracing::warn!(uri = %self.uri.addr, %reason, "NBD backing connection lost; reconnecting");
            let (fresh, n) = Conn::open(&self.uri, self.tls.as_deref())
                .map_err(|e| io::Error::other(format!("reconnect to backing failed: {e}")))?;
            if n.size != self.info.size || n.flags != self.flags {
                fresh.close();
                return Err(io::Error::other(
                    "backing NBD export changed size or flags across reconnect",
                ));
            }
            *conn = fresh;
        }
        Ok(conn.clone())
    }

    /// Sends one request and waits for its reply; returns the data of a READ.
    fn call(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<Vec<u8>> {
        let conn = self.connection()?;
        let read_len = if command == cmd::READ {
            length as usize
        } else {
            0
        };
        let slot = Arc::new(Slot {
            read_len,
            result: Mutex::new(None),
            ready: Condvar::new(),
        });
        let handle = {
            let mut p = conn.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(reason) = &p.dead {
                return Err(io::Error::other(reason.clone()));
            }
            p.next_handle = p.next_handle.wrapping_add(1);
            let handle = p.next_handle;
            p.slots.insert(handle, slot.clone());
            handle
        };
        let header = RequestHeader {
            flags,
            cmd: command,
            handle,
            offset,
            length,
        }
        .encode();
        let sent = {
            let _send = conn.send.lock().unwrap_or_else(|e| e.into_inner());
            send_all(&conn.stream, &header, payload)
        };
        if let Err(e) = sent {
            conn.fail(format!("sending request failed: {e}"));
        }
        slot.wait()
    }

    fn read_aligned(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let step = self.max_payload as usize;
        for (i, chunk) in buf.chunks_mut(step).enumerate() {
            let data = self.call(
                cmd::READ,
                0,
                offset + (i * step) as u64,
                chunk.len() as u32,
                &[],
            )?;
            chunk.copy_from_slice(&data);
        }
        Ok(())
    }

    fn write_aligned(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let step = self.max_payload as usize;
        let native_fua = fua && self.has(tflag::SEND_FUA);
        let flags = if native_fua { cmd_flag::FUA } else { 0 };
        for (i, chunk) in buf.chunks(step).enumerate() {
            self.call(
                cmd::WRITE,
                flags,
                offset + (i * step) as u64,
                chunk.len() as u32,
                chunk,
            )?;
        }
        if fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn aligned_span(&self, offset: u64, len: usize) -> (u64, usize) {
        let a = self.info.min_block as u64;
        let start = offset / a * a;
        let end = (offset + len as u64).next_multiple_of(a);
        (start, (end - start) as usize)
    }

    fn ranged(&self, command: u16, flags: u16, offset: u64, len: u64) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_RANGE_REQUEST);
            self.call(command, flags, offset + done, n as u32, &[])?;
            done += n;
        }
        Ok(())
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.info.read_only {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        } else {
            Ok(())
        }
    }
}

impl BlockDev for NbdClient {
    fn info(&self) -> &DevInfo {
        &self.info
    }

    fn describe(&self) -> String {
        let export = if self.uri.export.is_empty() {
            String::new()
        } else {
            format!(" export '{}'", self.uri.export)
        };
        let tls = if self.tls.is_some() { " over TLS" } else { "" };
        format!("NBD server {}{export}{tls}", self.uri.addr)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        flashtier_io::check_range(self.info.size, offset, buf.len() as u64, false)?;
        let a = self.info.min_block as usize;
        if a <= 1 || is_aligned_range(offset, buf.len(), a) {
            return self.read_aligned(buf, offset);
        }
        let (start, span) = self.aligned_span(offset, buf.len());
        let mut bounce = AlignedBuf::zeroed(span);
        self.read_aligned(&mut bounce, start)?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.check_writable()?;
        flashtier_io::check_range(self.info.size, offset, buf.len() as u64, true)?;
        let a = self.info.min_block as usize;
        if a <= 1 {
            return self.write_aligned(buf, offset, fua);
        }
        if is_aligned_range(offset, buf.len(), a) {
            let _shared = self.rmw.read().unwrap_or_else(|e| e.into_inner());
            return self.write_aligned(buf, offset, fua);
        }
        // The server wants whole blocks: read them, patch, write back, excluding other writers.
        let _exclusive = self.rmw.write().unwrap_or_else(|e| e.into_inner());
        let (start, span) = self.aligned_span(offset, buf.len());
        let mut bounce = AlignedBuf::zeroed(span);
        self.read_aligned(&mut bounce, start)?;
        let skip = (offset - start) as usize;
        bounce[skip..skip + buf.len()].copy_from_slice(buf);
        self.write_aligned(&bounce, start, fua)
    }

    fn flush(&self) -> io::Result<()> {
        if !self.has(tflag::SEND_FLUSH) {
            // The server has no volatile cache to flush: its writes are durable when answered.
            return Ok(());
        }
        self.call(cmd::FLUSH, 0, 0, 0, &[]).map(drop)
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        flashtier_io::check_range(self.info.size, offset, len, true)?;
        if !self.has(tflag::SEND_TRIM) {
            return Ok(());
        }
        self.ranged(cmd::TRIM, 0, offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.check_writable()?;
        flashtier_io::check_range(self.info.size, offset, len, true)?;
        let can_zero = self.has(tflag::SEND_WRITE_ZEROES);
        if opts.fast_only && !(can_zero && self.has(tflag::SEND_FAST_ZERO)) {
            return Err(io::Error::from_raw_os_error(libc::ENOTSUP));
        }
        if !can_zero {
            return write_zero_buffers(self, offset, len, opts.fua);
        }
        let mut flags = 0;
        if !opts.may_trim {
            flags |= cmd_flag::NO_HOLE;
        }
        if opts.fast_only {
            flags |= cmd_flag::FAST_ZERO;
        }
        let native_fua = opts.fua && self.has(tflag::SEND_FUA);
        if native_fua {
            flags |= cmd_flag::FUA;
        }
        self.ranged(cmd::WRITE_ZEROES, flags, offset, len)?;
        if opts.fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        flashtier_io::check_range(self.info.size, offset, len, false)?;
        if !self.has(tflag::SEND_CACHE) {
            return Ok(());
        }
        self.ranged(cmd::CACHE, 0, offset, len)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        conn.close();
    }
}

fn is_aligned_range(offset: u64, len: usize, align: usize) -> bool {
    (offset | len as u64).is_multiple_of(align as u64)
}

/// The client's connection: plain, or TLS over the socket (kept to shut it down).
enum Transport {
    Plain(Stream),
    Tls(TlsStream, Stream),
}

impl Transport {
    fn socket(&self) -> &Stream {
        match self {
            Transport::Plain(s) | Transport::Tls(_, s) => s,
        }
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket().shutdown(how)
    }
}

impl Read for &Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => (&*s).read(buf),
            Transport::Tls(t, _) => t.read_until(buf, None),
        }
    }
}

impl Write for &Transport {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => (&*s).write(buf),
            Transport::Tls(t, _) => t.write_until(buf, None),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => (&*s).write_vectored(bufs),
            Transport::Tls(t, _) => TlsIo {
                tls: t,
                deadline: None,
            }
            .write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The TLS configuration an `nbds` URI asks for (None for plain `nbd` URIs).
fn client_tls(uri: &NbdUri) -> Result<Option<ClientTls>, ClientError> {
    let Some(t) = &uri.tls else { return Ok(None) };
    let creds = match &t.psk_file {
        Some(path) => {
            let keys = PskKeys::load(path).map_err(|e| ClientError::Tls(e.to_string()))?;
            let username = match &t.username {
                Some(u) => u.clone(),
                None => std::env::var("USER").map_err(|_| {
                    ClientError::Tls(
                        "no PSK user name: give tls-username= or user@ in the URI".into(),
                    )
                })?,
            };
            ClientCredentials::Psk { username, keys }
        }
        None => ClientCredentials::X509 {
            dir: t.certificates.clone(),
            verify_peer: t.verify_peer,
            hostname: t.hostname.clone(),
        },
    };
    ClientTls::new(&creds)
        .map(Some)
        .map_err(|e| ClientError::Tls(e.to_string()))
}

fn send_all(mut stream: &Transport, header: &[u8], payload: &[u8]) -> io::Result<()> {
    write_all_vectored(
        &mut stream,
        &mut [IoSlice::new(header), IoSlice::new(payload)],
    )
}

impl Conn {
    fn open(uri: &NbdUri, tls: Option<&ClientTls>) -> Result<(Arc<Conn>, Negotiated), ClientError> {
        let connect_err = |e: io::Error| ClientError::Connect(uri.addr.to_string(), e);
        let socket = Stream::connect(&uri.addr).map_err(connect_err)?;
        let mut stream = Transport::Plain(socket);
        let negotiated = handshake(&mut stream, &uri.export, tls)?;
        let conn = Arc::new(Conn {
            stream,
            send: Mutex::new(()),
            pending: Mutex::new(Pending::default()),
        });
        let reader = conn.clone();
        std::thread::Builder::new()
            .name("nbd-client-rx".into())
            .spawn(move || reader.receive_loop())
            .map_err(connect_err)?;
        Ok((conn, negotiated))
    }

    fn receive_loop(&self) {
        let reason = match self.receive_replies() {
            Ok(()) => "connection closed".to_string(),
            Err(e) => e.to_string(),
        };
        self.fail(reason);
    }

    fn receive_replies(&self) -> io::Result<()> {
        let mut stream = &self.stream;
        loop {
            let mut hdr = [0u8; wire::SIMPLE_REPLY_LEN];
            match stream.read_exact(&mut hdr) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                other => other?,
            }
            if wire::be32(&hdr[0..4]) != wire::SIMPLE_REPLY_MAGIC {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bad reply magic",
                ));
            }
            let error = wire::be32(&hdr[4..8]);
            let handle = wire::be64(&hdr[8..16]);
            let slot = self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .slots
                .remove(&handle)
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, "reply for an unknown handle")
                })?;
            if error != 0 {
                slot.complete(Err(io_error(error)));
                continue;
            }
            let mut data = vec![0u8; slot.read_len];
            // The request is no longer pending: if the connection dies in the middle of its
            // data, fail it here, or its caller would wait forever.
            if let Err(e) = stream.read_exact(&mut data) {
                slot.complete(Err(io::Error::new(
                    e.kind(),
                    format!("NBD backing connection failed during a read reply: {e}"),
                )));
                return Err(e);
            }
            slot.complete(Ok(data));
        }
    }

    /// Marks the connection dead and fails every waiting request.
    fn fail(&self, reason: String) {
        let slots = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.dead.get_or_insert(reason.clone());
            std::mem::take(&mut p.slots)
        };
        let _ = self.stream.shutdown(Shutdown::Both);
        for slot in slots.into_values() {
            slot.complete(Err(io::Error::other(format!(
                "NBD backing connection failed: {reason}"
            ))));
        }
    }

    /// Polite disconnect: NBD_CMD_DISC, then close.
    fn close(&self) {
        let disc = RequestHeader {
            flags: 0,
            cmd: cmd::DISC,
            handle: 0,
            offset: 0,
            length: 0,
        }
        .encode();
        {
            let _send = self.send.lock().unwrap_or_else(|e| e.into_inner());
            let _ = send_all(&self.stream, &disc, &[]);
        }
        self.fail("client closed".to_string());
    }
}

/// Client side of the fixed-newstyle handshake: NBD_OPT_STARTTLS first when `tls` is given, then
/// NBD_OPT_GO, or NBD_OPT_EXPORT_NAME for servers too old to know GO.
fn handshake(
    transport: &mut Transport,
    export: &str,
    tls: Option<&ClientTls>,
) -> Result<Negotiated, ClientError> {
    let io = ClientError::Handshake;
    let Transport::Plain(stream) = &*transport else {
        return Err(ClientError::Protocol("handshake on a TLS transport".into()));
    };
    let mut stream = stream;
    let mut b = [0u8; 18];
    stream.read_exact(&mut b).map_err(io)?;
    if wire::be64(&b[0..8]) != wire::NBDMAGIC {
        return Err(ClientError::Protocol("not an NBD server".into()));
    }
    if wire::be64(&b[8..16]) != wire::IHAVEOPT {
        return Err(ClientError::Protocol(
            "oldstyle NBD servers are not supported".into(),
        ));
    }
    let server_flags = wire::be16(&b[16..18]);
    if server_flags & wire::handshake::FIXED_NEWSTYLE == 0 {
        return Err(ClientError::Protocol(
            "server does not support fixed newstyle".into(),
        ));
    }
    let no_zeroes = server_flags & wire::handshake::NO_ZEROES != 0;
    let mut client_flags = wire::handshake::C_FIXED_NEWSTYLE;
    if no_zeroes {
        client_flags |= wire::handshake::C_NO_ZEROES;
    }
    stream.write_all(&client_flags.to_be_bytes()).map_err(io)?;
    if let Some(tls) = tls {
        starttls(&mut stream)?;
        let socket = stream.try_clone().map_err(io)?;
        let session = tls
            .connect(&socket, None)
            .map_err(|e| ClientError::Tls(e.to_string()))?;
        tracing::debug!(server = session.peer(), "TLS session established");
        *transport = Transport::Tls(session, socket);
    }
    let mut stream = &*transport;

    let mut go = Vec::new();
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    send_option(&mut stream, opt::GO, &go).map_err(io)?;

    let mut n = Negotiated {
        size: 0,
        flags: 0,
        min_block: 1,
        max_payload: MAX_REQUEST,
    };
    let mut have_export = false;
    loop {
        let (reply_type, data) = read_option_reply(&mut stream, opt::GO)?;
        match reply_type {
            rep::ACK if have_export => return Ok(n),
            rep::ACK => {
                return Err(ClientError::Protocol(
                    "GO acknowledged without export info".into(),
                ))
            }
            rep::INFO if data.len() >= 2 => match wire::be16(&data[0..2]) {
                info::EXPORT if data.len() >= 12 => {
                    n.size = wire::be64(&data[2..10]);
                    n.flags = wire::be16(&data[10..12]);
                    have_export = true;
                }
                info::BLOCK_SIZE if data.len() >= 14 => {
                    n.min_block = wire::be32(&data[2..6]);
                    n.max_payload = wire::be32(&data[10..14]);
                }
                _ => {}
            },
            rep::ERR_UNSUP => return export_name_fallback(&mut stream, export, no_zeroes),
            t if rep::is_error(t) => {
                return Err(ClientError::Refused {
                    export: export.to_string(),
                    code: t & !(1 << 31),
                    message: String::from_utf8_lossy(&data).into_owned(),
                })
            }
            _ => {}
        }
    }
}

/// Asks for TLS; anything but an ACK is a refusal (never a reason to go on in plain text).
fn starttls(stream: &mut &Stream) -> Result<(), ClientError> {
    send_option(stream, opt::STARTTLS, &[]).map_err(ClientError::Handshake)?;
    let (reply_type, data) = read_option_reply(stream, opt::STARTTLS)?;
    if reply_type == rep::ACK {
        return Ok(());
    }
    Err(ClientError::Tls(format!(
        "the server refused TLS (reply {:#x}: {})",
        reply_type,
        String::from_utf8_lossy(&data)
    )))
}

/// Reads one reply to `option`: its type and data.
fn read_option_reply(stream: &mut impl Read, option: u32) -> Result<(u32, Vec<u8>), ClientError> {
    let mut h = [0u8; 20];
    stream.read_exact(&mut h).map_err(ClientError::Handshake)?;
    if wire::be64(&h[0..8]) != wire::OPTION_REPLY_MAGIC || wire::be32(&h[8..12]) != option {
        return Err(ClientError::Protocol("malformed option reply".into()));
    }
    let reply_type = wire::be32(&h[12..16]);
    let len = wire::be32(&h[16..20]);
    if len > 64 * 1024 {
        return Err(ClientError::Protocol("oversized option reply".into()));
    }
    let mut data = vec![0u8; len as usize];
    stream
        .read_exact(&mut data)
        .map_err(ClientError::Handshake)?;
    Ok((reply_type, data))
}

fn export_name_fallback(
    stream: &mut &Transport,
    export: &str,
    no_zeroes: bool,
) -> Result<Negotiated, ClientError> {
    let io = ClientError::Handshake;
    send_option(stream, opt::EXPORT_NAME, export.as_bytes()).map_err(io)?;
    let mut b = vec![0u8; if no_zeroes { 10 } else { 134 }];
    stream.read_exact(&mut b).map_err(io)?;
    Ok(Negotiated {
        size: wire::be64(&b[0..8]),
        flags: wire::be16(&b[8..10]),
        min_block: 1,
        max_payload: MAX_REQUEST,
    })
}

fn send_option<W: Write>(stream: &mut W, option: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    stream.write_all(&m)
}

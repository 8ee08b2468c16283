//! The transmission phase: requests in, replies out, many in flight.
//!
//! Each connection runs a small pool of threads in a leader/followers pattern: a thread takes the
//! inbound lock, reads one request (and its payload) from a shared buffered reader, releases the
//! lock, executes the request on the device, then takes the outbound lock and writes its own reply
//! with a single vectored write. There is no hand-off between threads per request, a burst of
//! pipelined requests costs one `recv` for many of them, and replies go out in completion order.
//!
//! Every request is validated here, once, before the device sees it: unknown commands and flags,
//! out-of-range offsets, oversized payloads and writes to a read-only export get the spec's errno,
//! and the stream stays in sync (a refused WRITE still has its payload consumed).

use parking_lot::Mutex;
use std::io::{self, BufReader, IoSlice, Read, Write};

use flashtier_io::{AlignedBuf, BlockDev, Extent, ZeroOpts};

use crate::errmap::nbd_error;
use crate::export::Export;
use crate::handshake::Session;
use crate::wire::{self, cmd, cmd_flag, errno, reply, state, RequestHeader};

/// Read buffer per connection: enough for a deep queue of small requests in one `recv`.
const INBOUND_BUFFER: usize = 256 * 1024;
/// A thread keeps a payload buffer up to this size between requests; larger ones are freed.
const KEEP_BUFFER: usize = 4 * 1024 * 1024;
/// Extents reported per BLOCK_STATUS reply when the client did not ask for just one.
const MAX_EXTENTS: usize = 1024;

/// Per-connection parameters of the transmission phase.
pub struct Params<'a> {
    pub export: &'a Export,
    pub session: Session,
    pub max_payload: u32,
    /// Threads serving this connection (requests executing at once).
    pub threads: usize,
}

struct Inbound<R> {
    reader: BufReader<R>,
    closed: bool,
}

struct Shared<'a, R, W> {
    params: &'a Params<'a>,
    dev: &'a dyn BlockDev,
    read_only: bool,
    inbound: Mutex<Inbound<R>>,
    outbound: Mutex<W>,
    /// Breaks the connection so threads blocked in I/O on it return (e.g. shuts the socket down).
    hangup: &'a (dyn Fn() + Sync),
}

/// A request read off the wire, its payload (if any) in the thread's buffer.
struct Request {
    hdr: RequestHeader,
    /// A WRITE payload larger than the maximum was read and discarded.
    payload_dropped: bool,
}

/// A successful result, before it is put on the wire.
enum Done {
    /// No payload in the reply.
    Ack,
    /// READ: the thread's buffer holds the data.
    Data,
    /// BLOCK_STATUS: the thread's extent list holds the descriptors.
    Extents,
}

struct Failure {
    error: u32,
    message: String,
}

/// Serves requests from `reader` and answers on `writer` until the client disconnects, the stream
/// breaks or `hangup` is called from elsewhere. Returns once every request read has been answered.
pub fn serve<R: Read + Send, W: Write + Send>(
    params: &Params<'_>,
    reader: R,
    writer: W,
    hangup: &(dyn Fn() + Sync),
) {
    let shared = Shared {
        params,
        dev: &*params.export.dev,
        read_only: params.export.read_only(),
        inbound: Mutex::new(Inbound {
            reader: BufReader::with_capacity(INBOUND_BUFFER, reader),
            closed: false,
        }),
        outbound: Mutex::new(writer),
        hangup,
    };
    let threads = params.threads.max(1);
    if threads == 1 {
        shared.worker();
        return;
    }
    std::thread::scope(|scope| {
        for i in 0..threads {
            let shared = &shared;
            std::thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || shared.worker())
                .expect("cannot spawn NBD worker thread");
        }
    });
}

impl<R: Read, W: Write> Shared<'_, R, W> {
    fn worker(&self) {
        let mut buf = AlignedBuf::new();
        let mut extents = Vec::new();
        loop {
            let Some(req) = self.next_request(&mut buf) else {
                return;
            };
            let result = self.execute(&req, &mut buf, &mut extents);
            if let Err(e) = self.send_reply(&req.hdr, result, &buf, &extents) {
                tracing::debug!(error = %e, "cannot send reply; closing connection");
                self.close();
                return;
            }
            buf.shrink_to(KEEP_BUFFER);
        }
    }

    fn close(&self) {
        self.inbound.lock().closed = true;
        (self.hangup)();
    }

    /// Reads the next request; `None` once the connection is closing.
    fn next_request(&self, buf: &mut AlignedBuf) -> Option<Request> {
        let mut inbound = self.inbound.lock();
        if inbound.closed {
            return None;
        }
        match read_request(&mut inbound.reader, buf, self.params.max_payload) {
            Ok(Some(req)) => Some(req),
            Ok(None) => {
                tracing::debug!("client disconnected (NBD_CMD_DISC)");
                inbound.closed = true;
                None
            }
            Err(e) => {
                inbound.closed = true;
                drop(inbound);
                if e.kind() == io::ErrorKind::UnexpectedEof {
                    tracing::debug!("client closed the connection");
                } else {
                    tracing::info!(error = %e, "dropping connection");
                    (self.hangup)();
                }
                None
            }
        }
    }

    fn execute(
        &self,
        req: &Request,
        buf: &mut AlignedBuf,
        extents: &mut Vec<(u32, u32)>,
    ) -> Result<Done, Failure> {
        let h = &req.hdr;
        self.validate(req).map_err(|(error, why)| Failure {
            error,
            message: format!("{} refused: {why}", cmd::name(h.cmd)),
        })?;
        let fua = h.flags & cmd_flag::FUA != 0;
        let (offset, len) = (h.offset, h.length as u64);
        let dev = self.dev;
        let result = match h.cmd {
            cmd::READ => {
                buf.resize(h.length as usize);
                dev.read_at(buf, offset).map(|()| Done::Data)
            }
            cmd::WRITE => dev.write_at(buf, offset, fua).map(|()| Done::Ack),
            cmd::FLUSH => dev.flush().map(|()| Done::Ack),
            cmd::TRIM => dev
                .trim(offset, len)
                .and_then(|()| if fua { dev.flush() } else { Ok(()) })
                .map(|()| Done::Ack),
            cmd::WRITE_ZEROES => {
                let opts = ZeroOpts {
                    may_trim: h.flags & cmd_flag::NO_HOLE == 0,
                    fast_only: h.flags & cmd_flag::FAST_ZERO != 0,
                    fua,
                };
                dev.write_zeroes(offset, len, opts).map(|()| Done::Ack)
            }
            cmd::CACHE => dev.prefetch(offset, len).map(|()| Done::Ack),
            cmd::BLOCK_STATUS => {
                let max = if h.flags & cmd_flag::REQ_ONE != 0 {
                    1
                } else {
                    MAX_EXTENTS
                };
                let mut raw = Vec::new();
                dev.extents(offset, len, max, &mut raw)
                    .map(|()| encode_extents(&raw, h.length, max, extents))
                    .map(|()| Done::Extents)
            }
            _ => unreachable!("validate() admits only known commands"),
        };
        result.map_err(|e| {
            let error = nbd_error(&e);
            if error == errno::EIO {
                tracing::warn!(cmd = cmd::name(h.cmd), offset, len, error = %e, "device error");
            }
            Failure {
                error,
                message: format!(
                    "{} of {len} bytes at offset {offset}: {e}",
                    cmd::name(h.cmd)
                ),
            }
        })
    }

    /// The spec's checks, in the order that gives the most useful error.
    fn validate(&self, req: &Request) -> Result<(), (u32, &'static str)> {
        let h = &req.hdr;
        let session = &self.params.session;
        let allowed_flags = match h.cmd {
            cmd::READ if session.structured_replies => cmd_flag::FUA | cmd_flag::DF,
            cmd::READ | cmd::WRITE | cmd::FLUSH | cmd::TRIM | cmd::CACHE => cmd_flag::FUA,
            cmd::WRITE_ZEROES => cmd_flag::FUA | cmd_flag::NO_HOLE | cmd_flag::FAST_ZERO,
            cmd::BLOCK_STATUS => cmd_flag::FUA | cmd_flag::REQ_ONE,
            _ => return Err((errno::EINVAL, "unknown command")),
        };
        if h.flags & !allowed_flags != 0 {
            return Err((errno::EINVAL, "flag not valid for this command"));
        }
        let writes = matches!(h.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
        if writes && self.read_only {
            return Err((errno::EPERM, "export is read-only"));
        }
        if req.payload_dropped || (h.cmd == cmd::READ && h.length > self.params.max_payload) {
            return Err((errno::EOVERFLOW, "length exceeds the maximum payload"));
        }
        if h.cmd == cmd::FLUSH {
            return if h.offset == 0 && h.length == 0 {
                Ok(())
            } else {
                Err((errno::EINVAL, "offset and length must be zero"))
            };
        }
        if h.cmd == cmd::BLOCK_STATUS {
            if session.base_allocation.is_none() {
                return Err((errno::EINVAL, "no metadata context was negotiated"));
            }
            if h.length == 0 {
                return Err((errno::EINVAL, "zero length"));
            }
        }
        let in_range = h
            .offset
            .checked_add(h.length as u64)
            .is_some_and(|end| end <= session.size);
        if !in_range {
            return Err(if writes {
                (errno::ENOSPC, "range extends beyond the end of the export")
            } else {
                (errno::EINVAL, "range extends beyond the end of the export")
            });
        }
        Ok(())
    }

    fn send_reply(
        &self,
        h: &RequestHeader,
        result: Result<Done, Failure>,
        buf: &[u8],
        extents: &[(u32, u32)],
    ) -> io::Result<()> {
        let structured = self.params.session.structured_replies;
        let mut header = [0u8; wire::STRUCTURED_HEADER_LEN + 8];
        let mut tail = Vec::new();
        let (head_len, body): (usize, &[u8]) = match (&result, structured) {
            (Ok(Done::Data), false) => {
                header[..16].copy_from_slice(&wire::simple_reply(0, h.handle));
                (16, buf)
            }
            (Ok(Done::Data), true) if buf.is_empty() => {
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_NONE,
                    h.handle,
                    0,
                ));
                (20, &[])
            }
            (Ok(Done::Data), true) => {
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_OFFSET_DATA,
                    h.handle,
                    8 + buf.len() as u32,
                ));
                header[20..28].copy_from_slice(&h.offset.to_be_bytes());
                (28, buf)
            }
            (Ok(Done::Extents), _) => {
                let id = self.params.session.base_allocation.unwrap_or(0);
                tail.reserve(4 + extents.len() * 8);
                tail.extend_from_slice(&id.to_be_bytes());
                for (len, flags) in extents {
                    tail.extend_from_slice(&len.to_be_bytes());
                    tail.extend_from_slice(&flags.to_be_bytes());
                }
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_BLOCK_STATUS,
                    h.handle,
                    tail.len() as u32,
                ));
                (20, &tail)
            }
            (Ok(Done::Ack), _) => {
                header[..16].copy_from_slice(&wire::simple_reply(0, h.handle));
                (16, &[])
            }
            (Err(f), false) => {
                tracing::debug!(handle = h.handle, error = f.error, message = %f.message, "request failed");
                header[..16].copy_from_slice(&wire::simple_reply(f.error, h.handle));
                (16, &[])
            }
            (Err(f), true) => {
                tracing::debug!(handle = h.handle, error = f.error, message = %f.message, "request failed");
                let msg = &f.message.as_bytes()[..f.message.len().min(wire::MAX_STRING)];
                tail.extend_from_slice(&f.error.to_be_bytes());
                tail.extend_from_slice(&(msg.len() as u16).to_be_bytes());
                tail.extend_from_slice(msg);
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_ERROR,
                    h.handle,
                    tail.len() as u32,
                ));
                (20, &tail)
            }
        };
        let mut out = self.outbound.lock();
        write_all_vectored(
            &mut *out,
            &mut [IoSlice::new(&header[..head_len]), IoSlice::new(body)],
        )
    }
}

/// Reads one request header and, for WRITE, its payload into `buf`. `Ok(None)` is NBD_CMD_DISC.
fn read_request<R: Read>(
    reader: &mut R,
    buf: &mut AlignedBuf,
    max_payload: u32,
) -> io::Result<Option<Request>> {
    let mut raw = [0u8; RequestHeader::LEN];
    reader.read_exact(&mut raw)?;
    let hdr = RequestHeader::decode(&raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad request magic"))?;
    if hdr.cmd == cmd::DISC {
        return Ok(None);
    }
    let mut payload_dropped = false;
    if hdr.cmd == cmd::WRITE {
        if hdr.length > max_payload {
            let len = hdr.length as u64;
            if io::copy(&mut reader.take(len), &mut io::sink())? < len {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            payload_dropped = true;
        } else {
            buf.resize(hdr.length as usize);
            reader.read_exact(buf)?;
        }
    }
    Ok(Some(Request {
        hdr,
        payload_dropped,
    }))
}

/// Turns a device's allocation map into NBD descriptors: merged, non-empty, within `request_len`,
/// at most `max` of them, and never none.
fn encode_extents(raw: &[Extent], request_len: u32, max: usize, out: &mut Vec<(u32, u32)>) {
    out.clear();
    let mut remaining = request_len as u64;
    for e in raw {
        if remaining == 0 {
            break;
        }
        let len = e.len.min(remaining);
        if len == 0 {
            continue;
        }
        remaining -= len;
        let flags = if e.hole { state::HOLE } else { 0 } | if e.zero { state::ZERO } else { 0 };
        let full = out.len() == max;
        match out.last_mut() {
            Some((last_len, last_flags)) if *last_flags == flags => *last_len += len as u32,
            _ if full => break,
            _ => out.push((len as u32, flags)),
        }
    }
    if out.is_empty() {
        out.push((request_len, 0));
    }
}

fn write_all_vectored<W: Write + ?Sized>(
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
    fn extents_are_merged_clipped_and_limited() {
        let raw = [
            Extent::data(4096),
            Extent::data(4096),
            Extent {
                len: 8192,
                hole: true,
                zero: true,
            },
            Extent::data(1 << 20),
        ];
        let mut out = Vec::new();
        encode_extents(&raw, 20_000, 16, &mut out);
        assert_eq!(
            out,
            vec![(8192, 0), (8192, state::HOLE | state::ZERO), (3616, 0)]
        );
        encode_extents(&raw, 20_000, 1, &mut out);
        assert_eq!(out, vec![(8192, 0)]);
        encode_extents(&[], 512, 16, &mut out);
        assert_eq!(out, vec![(512, 0)]);
        encode_extents(&[Extent::data(0), Extent::data(100)], 512, 16, &mut out);
        assert_eq!(out, vec![(100, 0)]);
    }

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
}

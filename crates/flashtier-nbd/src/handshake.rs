//! Server side of the fixed-newstyle handshake: option haggling until the client picks the export.
//!
//! Every option gets an answer: unknown ones `ERR_UNSUP` with their payload consumed, malformed
//! ones `ERR_INVALID`, so a confused client learns what went wrong instead of seeing the socket
//! close. Only a broken framing (bad magic, unknown client flags) or `EXPORT_NAME` for a name we do
//! not serve ends the connection, as the spec requires.
//!
//! TLS follows the spec and nbdkit: with [`TlsMode::Require`] (the spec's FORCEDTLS) every option
//! but `STARTTLS` and `ABORT` gets `ERR_TLS_REQD` until TLS runs, and `EXPORT_NAME` (which cannot
//! be refused) ends the connection; with [`TlsMode::On`] a client may upgrade or not; with
//! [`TlsMode::Off`] `STARTTLS` gets `ERR_POLICY`. After `STARTTLS` the meta context chosen before
//! it is forgotten, as the spec requires.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::export::Export;
use crate::tls::TlsMode;
use crate::wire::{self, info, opt, rep, tflag};

/// The connection the handshake runs on: a byte stream that can be upgraded to TLS in place.
pub trait Channel: Read + Write {
    /// Whether TLS runs on this channel.
    fn tls_active(&self) -> bool;
    /// Runs the server side of the TLS handshake; called right after the ACK to `STARTTLS`.
    /// An error ends the connection (there is no way back to plain text).
    fn start_tls(&mut self) -> io::Result<()>;
}

/// A channel without TLS (tests, fuzzing, unix sockets of a server with TLS off).
pub struct Plain<S>(pub S);

impl<S: Read> Read for Plain<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<S: Write> Write for Plain<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl<S: Read + Write> Channel for Plain<S> {
    fn tls_active(&self) -> bool {
        false
    }
    fn start_tls(&mut self) -> io::Result<()> {
        Err(io::Error::other("this channel cannot run TLS"))
    }
}

/// What the server offers in the handshake.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Largest READ/WRITE payload advertised.
    pub max_payload: u32,
    pub tls: TlsMode,
}

/// Payloads up to this size are read and parsed; larger ones are drained and refused with
/// `ERR_TOO_BIG`. Real options are a few hundred bytes at most.
const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Beyond this a payload is not even drained: the client is sending garbage or attacking us.
const MAX_DRAIN_LEN: u32 = 16 * 1024 * 1024;

/// Metadata context id we hand out for `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// What the client and server agreed on, carried into the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    pub structured_replies: bool,
    /// Context id of `base:allocation` if the client selected it.
    pub base_allocation: Option<u32>,
    /// Transmission flags as sent to the client.
    pub flags: u16,
    pub size: u64,
}

pub enum Outcome {
    Transmission(Session),
    /// The client aborted or the connection must be closed; nothing more to do.
    Closed,
}

struct Haggle<'a, S> {
    stream: &'a mut S,
    export: &'a Export,
    max_payload: u32,
    no_zeroes: bool,
    structured: bool,
    base_allocation: Option<u32>,
    out: Vec<u8>,
}

/// Runs the handshake on `stream` until the client enters transmission or leaves.
pub fn negotiate<S: Channel>(
    stream: &mut S,
    export: &Export,
    options: &Options,
    shutting_down: &AtomicBool,
) -> io::Result<Outcome> {
    let max_payload = options.max_payload;
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&wire::NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(
        &(wire::handshake::FIXED_NEWSTYLE | wire::handshake::NO_ZEROES).to_be_bytes(),
    );
    stream.write_all(&greeting)?;

    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    let client_flags = u32::from_be_bytes(b);
    let known = wire::handshake::C_FIXED_NEWSTYLE | wire::handshake::C_NO_ZEROES;
    if client_flags & !known != 0 {
        return Err(protocol_error(format!(
            "client sent unknown handshake flags {client_flags:#x}"
        )));
    }

    let mut h = Haggle {
        stream,
        export,
        max_payload,
        no_zeroes: client_flags & wire::handshake::C_NO_ZEROES != 0,
        structured: false,
        base_allocation: None,
        out: Vec::with_capacity(256),
    };
    loop {
        let mut hdr = [0u8; 16];
        h.stream.read_exact(&mut hdr)?;
        if wire::be64(&hdr[0..8]) != wire::IHAVEOPT {
            return Err(protocol_error("bad option magic".into()));
        }
        let option = wire::be32(&hdr[8..12]);
        let len = wire::be32(&hdr[12..16]);

        if len > MAX_OPTION_LEN {
            if len > MAX_DRAIN_LEN {
                return Err(protocol_error(format!(
                    "option {option} has a {len}-byte payload"
                )));
            }
            drain(h.stream, len as u64)?;
            if option == opt::EXPORT_NAME {
                return Ok(Outcome::Closed);
            }
            h.reply_error(option, rep::ERR_TOO_BIG, "option payload too large")?;
            continue;
        }
        let mut payload = vec![0u8; len as usize];
        h.stream.read_exact(&mut payload)?;

        let tls_required = options.tls == TlsMode::Require && !h.stream.tls_active();
        if tls_required && option != opt::STARTTLS && option != opt::ABORT {
            if option == opt::EXPORT_NAME {
                tracing::info!("client asked for the export without TLS, which is required");
                return Ok(Outcome::Closed);
            }
            h.reply_error(option, rep::ERR_TLS_REQD, "TLS is required: use STARTTLS")?;
            continue;
        }

        if shutting_down.load(Ordering::Relaxed) && option != opt::ABORT {
            if option == opt::EXPORT_NAME {
                return Ok(Outcome::Closed);
            }
            h.reply_error(option, rep::ERR_SHUTDOWN, "server is shutting down")?;
            continue;
        }

        match option {
            opt::EXPORT_NAME => return h.export_name(&payload),
            opt::ABORT => {
                // The client may already have closed; a failed ACK changes nothing.
                let _ = h.reply(option, rep::ACK, &[]);
                return Ok(Outcome::Closed);
            }
            opt::LIST => h.list(&payload)?,
            opt::STARTTLS => h.starttls(options.tls, &payload)?,
            opt::INFO | opt::GO => {
                if let Some(session) = h.info_or_go(option, &payload)? {
                    return Ok(Outcome::Transmission(session));
                }
            }
            opt::STRUCTURED_REPLY => {
                if payload.is_empty() {
                    h.structured = true;
                    h.reply(option, rep::ACK, &[])?;
                } else {
                    h.reply_error(option, rep::ERR_INVALID, "STRUCTURED_REPLY takes no data")?;
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => h.meta_context(option, &payload)?,
            _ => h.reply_error(option, rep::ERR_UNSUP, "option not supported")?,
        }
    }
}

impl<S: Channel> Haggle<'_, S> {
    fn starttls(&mut self, mode: TlsMode, payload: &[u8]) -> io::Result<()> {
        let option = opt::STARTTLS;
        if !payload.is_empty() {
            return self.reply_error(option, rep::ERR_INVALID, "STARTTLS takes no data");
        }
        if mode == TlsMode::Off {
            return self.reply_error(option, rep::ERR_POLICY, "TLS is not enabled on this server");
        }
        if self.stream.tls_active() {
            return self.reply_error(option, rep::ERR_INVALID, "TLS is already running");
        }
        self.reply(option, rep::ACK, &[])?;
        self.stream.start_tls()?;
        // Per-export state negotiated in plain text must not carry over (the spec).
        self.base_allocation = None;
        Ok(())
    }

    fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) -> io::Result<()> {
        self.out.clear();
        self.out
            .extend_from_slice(&wire::OPTION_REPLY_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&option.to_be_bytes());
        self.out.extend_from_slice(&reply_type.to_be_bytes());
        self.out
            .extend_from_slice(&(data.len() as u32).to_be_bytes());
        self.out.extend_from_slice(data);
        self.stream.write_all(&self.out)
    }

    fn reply_error(&mut self, option: u32, reply_type: u32, message: &str) -> io::Result<()> {
        tracing::debug!(option, reply_type, message, "refusing option");
        self.reply(option, reply_type, message.as_bytes())
    }

    fn transmission_flags(&self) -> u16 {
        let e = self.export;
        let dev = e.dev.info();
        let mut flags = tflag::HAS_FLAGS | tflag::SEND_FLUSH | tflag::SEND_FUA | tflag::SEND_CACHE;
        if e.read_only() {
            flags |= tflag::READ_ONLY;
        } else {
            flags |= tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES | tflag::SEND_FAST_ZERO;
        }
        if e.multi_conn {
            flags |= tflag::CAN_MULTI_CONN;
        }
        if dev.rotational {
            flags |= tflag::ROTATIONAL;
        }
        if self.structured {
            // Reads are always answered in a single chunk, so DF costs nothing.
            flags |= tflag::SEND_DF;
        }
        flags
    }

    fn session(&self) -> Session {
        Session {
            structured_replies: self.structured,
            base_allocation: self.base_allocation,
            flags: self.transmission_flags(),
            size: self.export.dev.info().size,
        }
    }

    fn export_name(&mut self, name: &[u8]) -> io::Result<Outcome> {
        if !self.export.answers_to(name) {
            tracing::info!(
                name = %String::from_utf8_lossy(name),
                "client asked for an unknown export; closing as the spec requires"
            );
            return Ok(Outcome::Closed);
        }
        let session = self.session();
        self.out.clear();
        self.out.extend_from_slice(&session.size.to_be_bytes());
        self.out.extend_from_slice(&session.flags.to_be_bytes());
        if !self.no_zeroes {
            self.out.extend_from_slice(&[0u8; 124]);
        }
        self.stream.write_all(&self.out)?;
        Ok(Outcome::Transmission(session))
    }

    fn list(&mut self, payload: &[u8]) -> io::Result<()> {
        if !payload.is_empty() {
            return self.reply_error(opt::LIST, rep::ERR_INVALID, "LIST takes no data");
        }
        let name = self.export.name.as_bytes();
        let mut data = Vec::with_capacity(4 + name.len());
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name);
        self.reply(opt::LIST, rep::SERVER, &data)?;
        self.reply(opt::LIST, rep::ACK, &[])
    }

    /// Answers INFO or GO; returns the session when GO succeeds.
    fn info_or_go(&mut self, option: u32, payload: &[u8]) -> io::Result<Option<Session>> {
        let Some((name, requests)) = parse_info_request(payload) else {
            self.reply_error(option, rep::ERR_INVALID, "malformed INFO/GO request")?;
            return Ok(None);
        };
        if !self.export.answers_to(name) {
            let msg = format!("no export named '{}'", String::from_utf8_lossy(name));
            self.reply_error(option, rep::ERR_UNKNOWN, &msg)?;
            return Ok(None);
        }
        let session = self.session();
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&info::EXPORT.to_be_bytes());
        data.extend_from_slice(&session.size.to_be_bytes());
        data.extend_from_slice(&session.flags.to_be_bytes());
        self.reply(option, rep::INFO, &data)?;

        for request in requests {
            data.clear();
            data.extend_from_slice(&request.to_be_bytes());
            match request {
                info::NAME => data.extend_from_slice(self.export.name.as_bytes()),
                info::DESCRIPTION => data.extend_from_slice(self.export.description.as_bytes()),
                _ => continue,
            }
            self.reply(option, rep::INFO, &data)?;
        }
        // Block sizes are sent whether or not they were asked for: a client that did not ask may
        // ignore them, and we accept any alignment anyway.
        let (min, preferred) = self.export.block_sizes();
        data.clear();
        data.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        data.extend_from_slice(&min.to_be_bytes());
        data.extend_from_slice(&preferred.to_be_bytes());
        data.extend_from_slice(&self.max_payload.to_be_bytes());
        self.reply(option, rep::INFO, &data)?;
        self.reply(option, rep::ACK, &[])?;
        Ok((option == opt::GO).then_some(session))
    }

    fn meta_context(&mut self, option: u32, payload: &[u8]) -> io::Result<()> {
        let Some((name, queries)) = parse_meta_context_request(payload) else {
            return self.reply_error(option, rep::ERR_INVALID, "malformed meta context request");
        };
        if !self.structured {
            return self.reply_error(
                option,
                rep::ERR_INVALID,
                "structured replies must be negotiated first",
            );
        }
        if !self.export.answers_to(name) {
            let msg = format!("no export named '{}'", String::from_utf8_lossy(name));
            return self.reply_error(option, rep::ERR_UNKNOWN, &msg);
        }
        let listing = option == opt::LIST_META_CONTEXT;
        let selected = if listing && queries.is_empty() {
            true
        } else {
            queries
                .iter()
                .any(|q| *q == wire::BASE_ALLOCATION.as_bytes() || (listing && *q == b"base:"))
        };
        if !listing {
            self.base_allocation = selected.then_some(BASE_ALLOCATION_ID);
        }
        if selected {
            let id = if listing { 0 } else { BASE_ALLOCATION_ID };
            let mut data = Vec::with_capacity(4 + wire::BASE_ALLOCATION.len());
            data.extend_from_slice(&id.to_be_bytes());
            data.extend_from_slice(wire::BASE_ALLOCATION.as_bytes());
            self.reply(option, rep::META_CONTEXT, &data)?;
        }
        self.reply(option, rep::ACK, &[])
    }
}

/// Splits an INFO/GO payload into the export name and the requested information items.
pub fn parse_info_request(p: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = wire::be32(p.get(0..4)?) as usize;
    if name_len > wire::MAX_STRING {
        return None;
    }
    let name = p.get(4..4 + name_len)?;
    let rest = &p[4 + name_len..];
    let count = wire::be16(rest.get(0..2)?) as usize;
    let items = &rest[2..];
    if items.len() != count * 2 {
        return None;
    }
    Some((name, items.chunks_exact(2).map(wire::be16).collect()))
}

/// Splits a LIST/SET_META_CONTEXT payload into the export name and the queries.
pub fn parse_meta_context_request(p: &[u8]) -> Option<(&[u8], Vec<&[u8]>)> {
    let name_len = wire::be32(p.get(0..4)?) as usize;
    if name_len > wire::MAX_STRING {
        return None;
    }
    let name = p.get(4..4 + name_len)?;
    let mut rest = &p[4 + name_len..];
    let count = wire::be32(rest.get(0..4)?) as usize;
    rest = &rest[4..];
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = wire::be32(rest.get(0..4)?) as usize;
        if len > wire::MAX_STRING {
            return None;
        }
        queries.push(rest.get(4..4 + len)?);
        rest = &rest[4 + len..];
    }
    rest.is_empty().then_some((name, queries))
}

fn drain<S: Read>(stream: &mut S, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut stream.take(len), &mut io::sink())?;
    if copied < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn protocol_error(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info_payload(name: &[u8], items: &[u16]) -> Vec<u8> {
        let mut p = (name.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(name);
        p.extend_from_slice(&(items.len() as u16).to_be_bytes());
        for i in items {
            p.extend_from_slice(&i.to_be_bytes());
        }
        p
    }

    #[test]
    fn info_request_parsing() {
        let p = info_payload(b"disk", &[info::BLOCK_SIZE, info::NAME]);
        let (name, items) = parse_info_request(&p).unwrap();
        assert_eq!(name, b"disk");
        assert_eq!(items, vec![info::BLOCK_SIZE, info::NAME]);
        assert!(parse_info_request(&p[..p.len() - 1]).is_none());
        let mut extra = p.clone();
        extra.push(0);
        assert!(parse_info_request(&extra).is_none());
        assert!(parse_info_request(&[0, 0, 0, 9, 1]).is_none());
        assert!(parse_info_request(&[0xff, 0xff, 0xff, 0xff]).is_none());
        assert!(parse_info_request(&[]).is_none());
    }

    #[test]
    fn meta_context_request_parsing() {
        let mut p = 0u32.to_be_bytes().to_vec();
        p.extend_from_slice(&2u32.to_be_bytes());
        for q in [&b"base:allocation"[..], b"qemu:dirty-bitmap:x"] {
            p.extend_from_slice(&(q.len() as u32).to_be_bytes());
            p.extend_from_slice(q);
        }
        let (name, queries) = parse_meta_context_request(&p).unwrap();
        assert!(name.is_empty());
        assert_eq!(
            queries,
            vec![&b"base:allocation"[..], b"qemu:dirty-bitmap:x"]
        );
        assert!(parse_meta_context_request(&p[..p.len() - 1]).is_none());
        // A count far larger than the payload must fail cleanly, not allocate.
        let mut huge = 0u32.to_be_bytes().to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_context_request(&huge).is_none());
    }
}

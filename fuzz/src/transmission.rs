//! The `transmission` target: a request stream served by `transmission::serve` on one thread, and
//! the reply stream checked against a model of the device.
//!
//! Input: one configuration byte, then the client's request stream.
//!
//! | bit | meaning                                                           |
//! | --- | ----------------------------------------------------------------- |
//! | 0   | structured replies negotiated                                     |
//! | 1   | `base:allocation` selected (only with bit 0, as the handshake allows) |
//! | 2   | export forced read-only (`Export::force_read_only`)               |
//! | 3   | device read-only (`MemDev::read_only`)                            |
//! | 4   | maximum payload 4 KiB instead of 64 KiB                           |
//! | 5   | the reply writer accepts at most 7 bytes per call (short writes)  |
//! | 6   | the reply writer fails once 256 bytes were written (broken connection) |
//! | 7   | the device is [`Quirky`](quirky::Quirky): fragmented allocation map, EIO in a bad region, fast zeroing only when aligned |
//!
//! The device is a `MemDev` serving batches of reads and writes, or, with bit 7, a quirky one that
//! serves none ([`Config::batching`]), so both the server's one-request paths and its batches
//! (`transmission/batch.rs`: small READs, and small WRITEs without flags, in a row) are fuzzed.
//! With one thread the server carries requests out in the order it reads them, and answers them
//! in that order too, except within a batch, whose refusals and device errors are sent before its
//! other replies: so a reply answers one of the next 8 requests not answered yet, by its handle
//! (with the quirky device, exactly the next one). Checked for every request:
//! - the reply is framed correctly (simple or structured magic, the request's handle, a sane
//!   length, `DONE` on the single chunk), and READ data follows a successful simple reply;
//! - it succeeds exactly when the request is valid by the NBD spec's rules (known command, flags
//!   allowed for it, not writing a read-only export, payload within the maximum, FLUSH with zero
//!   offset and length, BLOCK_STATUS only with a negotiated context and a non-zero length, range
//!   inside the export) and the device does not fail it, and a failure carries an errno the spec
//!   gives for one of the rules broken, or else the device's own error (EIO, ENOTSUP);
//! - READ returns what the model says the device holds (writes applied, zeroed ranges zero) and
//!   BLOCK_STATUS returns one or more non-empty extents within the requested length (exactly one
//!   with REQ_ONE), under the negotiated context id, each with the flags the device has over all
//!   of its range;
//! - nothing follows the last reply, the device ends up holding what the model holds, and the
//!   connection was hung up exactly when the stream went out of sync (bad magic) or a reply could
//!   not be sent; in the latter case the server carried out the requests it read up to one of
//!   those not answered, the first of them at least (all of a batch's valid writes are carried out
//!   before its first reply is sent), and none after.
//!
//! Model detail: TRIM on a `MemDev` zeroes the range (the spec leaves trimmed data unspecified;
//! this target's device is known to zero it).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, Cursor, Write};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use flashtier_io::BlockDev;
use flashtier_nbd::handshake::{Session, BASE_ALLOCATION_ID};
use flashtier_nbd::limits::{ConnState, Limits};
use flashtier_nbd::transmission::{serve, Params};
use flashtier_nbd::wire::{cmd, cmd_flag, errno, reply, tflag};
use flashtier_nbd::wire::{REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC};

use crate::quirky;
use crate::{Bytes, DEV_SIZE};

pub const MAX_PAYLOAD_LARGE: u32 = 64 * 1024;
pub const MAX_PAYLOAD_SMALL: u32 = 4 * 1024;
/// With a broken writer, replies fail after this many bytes.
pub const REPLY_BUDGET: usize = 256;

#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub structured: bool,
    pub base_allocation: bool,
    pub force_read_only: bool,
    pub dev_read_only: bool,
    pub max_payload: u32,
    pub short_writes: bool,
    pub broken_writer: bool,
    pub quirky: bool,
}

impl Config {
    pub fn from_byte(b: u8) -> Config {
        let structured = b & 1 != 0;
        Config {
            structured,
            base_allocation: structured && b & 2 != 0,
            force_read_only: b & 4 != 0,
            dev_read_only: b & 8 != 0,
            max_payload: if b & 16 != 0 {
                MAX_PAYLOAD_SMALL
            } else {
                MAX_PAYLOAD_LARGE
            },
            short_writes: b & 32 != 0,
            broken_writer: b & 64 != 0,
            quirky: b & 128 != 0,
        }
    }

    pub fn read_only(&self) -> bool {
        self.force_read_only || self.dev_read_only
    }

    /// Whether the device serves batches (`read_batch`, `write_batch`): the plain `MemDev` does
    /// ([`crate::export`]), the quirky one does not, so both of the server's paths are fuzzed.
    pub fn batching(&self) -> bool {
        !self.quirky
    }

    /// The session the handshake would have produced for this configuration.
    pub fn session(&self) -> Session {
        let mut flags = tflag::HAS_FLAGS
            | tflag::SEND_FLUSH
            | tflag::SEND_FUA
            | tflag::SEND_CACHE
            | tflag::CAN_MULTI_CONN;
        if self.read_only() {
            flags |= tflag::READ_ONLY;
        } else {
            flags |= tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES | tflag::SEND_FAST_ZERO;
        }
        if self.structured {
            flags |= tflag::SEND_DF;
        }
        Session {
            structured_replies: self.structured,
            base_allocation: self.base_allocation.then_some(BASE_ALLOCATION_ID),
            flags,
            size: DEV_SIZE as u64,
        }
    }
}

/// A request as the model reads it off the input (independently of `RequestHeader::decode`).
#[derive(Debug, Clone, Copy)]
pub struct Req {
    pub flags: u16,
    pub cmd: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

/// What happened to each request that was answered, in order: its command and `Ok` or the errno.
pub type Answers = Vec<(u16, Result<(), u32>)>;

/// Runs the target on `data`; panics on any broken invariant.
pub fn run(data: &[u8]) -> Answers {
    let Some((&cfg_byte, stream)) = data.split_first() else {
        return Vec::new();
    };
    let cfg = Config::from_byte(cfg_byte);
    let (export, mem) = crate::export(cfg.dev_read_only, cfg.force_read_only, cfg.quirky);
    // Budgets smaller than most requests: with one thread each is admitted alone.
    let limits = Limits::new(8192, 4096, 0, Box::new(|_| {}));
    let conn = ConnState::new(limits.memory_per_connection);
    let params = Params {
        export: &export,
        session: cfg.session(),
        max_payload: cfg.max_payload,
        threads: 1,
        limits: &limits,
        conn: &conn,
        wait_readable: &|_| true,
    };
    let mut out = Vec::new();
    let hung_up = AtomicBool::new(false);
    let mut writer_failed = false;
    serve(
        &params,
        Cursor::new(stream),
        Sink {
            out: &mut out,
            max_write: if cfg.short_writes { 7 } else { usize::MAX },
            budget: if cfg.broken_writer {
                REPLY_BUDGET
            } else {
                usize::MAX
            },
            failed: &mut writer_failed,
        },
        &|| hung_up.store(true, Ordering::Relaxed),
    );
    let hung_up = hung_up.load(Ordering::Relaxed);
    SCRATCH.with_borrow_mut(|scratch| {
        let (shadow, readback) = (&mut scratch.shadow, &mut scratch.readback);
        let Checked {
            answers,
            dirty,
            cut,
        } = check(&cfg, stream, &out, shadow, hung_up, writer_failed);
        if let Some(dirty) = dirty {
            check_device_after_cut(&cfg, &*mem, shadow, readback, &cut);
            // Both are all zeroes again outside `dirty` (just checked), so only it is reset.
            shadow[dirty.clone()].fill(0);
            crate::reset(&mem, dirty);
        }
        answers
    })
}

/// Buffers reused across runs (the device model and a copy of the device) and kept zeroed between
/// runs: a fresh 1 MiB per run costs more in page faults than the rest of the run together.
struct Scratch {
    shadow: Vec<u8>,
    readback: Vec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch {
        shadow: vec![0; DEV_SIZE],
        readback: vec![0; DEV_SIZE],
    });
}

/// [`check_device`], where a reply was cut short: the server carried out the requests it had read
/// (`cut`, in the order read) up to one of them, the first at least, before it gave up on the
/// connection. One at a time unless it batched them (up to [`BATCH_WINDOW`] in a row).
fn check_device_after_cut(
    cfg: &Config,
    dev: &dyn BlockDev,
    shadow: &mut [u8],
    readback: &mut [u8],
    cut: &[Unanswered],
) {
    let carried_out = |u: &Unanswered, shadow: &mut [u8]| {
        if violations(cfg, &u.req).is_empty() && device_error(cfg, &u.req).is_none() {
            apply(&u.req, u.payload, shadow);
        }
    };
    let Some((first, later)) = cut.split_first() else {
        return check_device(dev, shadow, readback);
    };
    carried_out(first, shadow);
    dev.read_at(readback, 0).expect("reading the device back");
    for u in later {
        if readback[..] == shadow[..] {
            break;
        }
        carried_out(u, shadow);
    }
    check_device(dev, shadow, readback);
}

/// The whole device must hold what the model holds (so a write that lands in the wrong place is
/// caught even if nothing reads it back).
fn check_device(dev: &dyn BlockDev, shadow: &[u8], readback: &mut [u8]) {
    dev.read_at(readback, 0).expect("reading the device back");
    // Slice equality is one memcmp; a byte loop here would be instrumented per byte.
    if readback != shadow {
        let at = readback
            .iter()
            .zip(shadow)
            .position(|(a, b)| a != b)
            .unwrap();
        panic!(
            "after the requests, the device holds {:#04x} at offset {at}, the model {:#04x}",
            readback[at], shadow[at]
        );
    }
}

/// Where replies go: a Vec, optionally taking only a few bytes per write call, or failing once
/// `budget` bytes were written.
struct Sink<'a> {
    out: &'a mut Vec<u8>,
    max_write: usize,
    budget: usize,
    failed: &'a mut bool,
}

impl Write for Sink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.budget - self.out.len();
        if room == 0 && !buf.is_empty() {
            *self.failed = true;
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let n = buf.len().min(self.max_write).min(room);
        self.out.extend_from_slice(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A request read off the input that has not been answered yet, with its WRITE payload.
struct Unanswered<'a> {
    /// Its place in the input (the answers are given in this order).
    number: usize,
    req: Req,
    payload: &'a [u8],
}

/// How many requests in a row the server may answer in another order than it read them: those
/// of one batch (`transmission/batch.rs`, up to 8), whose refusals and device errors go out
/// before the rest. Only a device that batches ([`Config::batching`]) makes batches.
const BATCH_WINDOW: usize = 8;

/// What [`check`] found: the answers (in request order), the smallest range of the device that
/// holds every range a request that may change the device named (clamped to the device), if any,
/// and, when a reply was cut short, the requests the server may have carried out before it gave up
/// on the connection.
struct Checked<'a> {
    answers: Answers,
    dirty: Option<Range<usize>>,
    cut: Vec<Unanswered<'a>>,
}

/// Walks the requests and their replies. Each reply answers one of the first [`BATCH_WINDOW`]
/// requests not answered yet (with a device that does not batch, the first one): the first of
/// them with the reply's handle whose expected outcome (refused or failed by the device, or not)
/// is the reply's, else the first with its handle, so that a fuzzer's repeated handles still pair
/// each reply with a request it can answer.
fn check<'a>(
    cfg: &Config,
    stream: &'a [u8],
    out: &[u8],
    shadow: &mut [u8],
    hung_up: bool,
    writer_failed: bool,
) -> Checked<'a> {
    let window = if cfg.batching() { BATCH_WINDOW } else { 1 };
    let mut input = Bytes::new(stream);
    let mut output = Bytes::new(out);
    let mut answered: Vec<Option<(u16, Result<(), u32>)>> = Vec::new();
    let mut unanswered: VecDeque<Unanswered<'a>> = VecDeque::new();
    let mut bad_magic = false;
    let mut input_done = false;
    let mut reply_cut = false;
    let mut dirty: Option<Range<usize>> = None;
    let mut cut = Vec::new();
    loop {
        // A request the server cannot read in full gets no reply: the connection just ends.
        while !input_done && unanswered.len() < window {
            match next_request(&mut input, &mut bad_magic) {
                Some((req, payload)) => {
                    // Refused writes must not have touched the device either.
                    if matches!(req.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES) {
                        let start = req.offset.min(DEV_SIZE as u64) as usize;
                        let end = (req.offset as u128 + req.length as u128).min(DEV_SIZE as u128)
                            as usize;
                        dirty = Some(match dirty {
                            None => start..end,
                            Some(d) => d.start.min(start)..d.end.max(end),
                        });
                    }
                    unanswered.push_back(Unanswered {
                        number: answered.len(),
                        req,
                        payload,
                    });
                    answered.push(None);
                }
                None => input_done = true,
            }
        }
        if unanswered.is_empty() {
            break;
        }
        let at = which_request(cfg, &output, &unanswered);
        let broken = violations(cfg, &unanswered[at].req);
        let Some(got) = next_reply(cfg, &unanswered[at].req, &mut output, shadow) else {
            // Only a broken connection may cut a reply short. The requests read were still
            // carried out, the first one not answered at least; then the server gave up on the
            // connection.
            assert!(
                writer_failed,
                "reply to {:?} missing or truncated",
                unanswered[at].req
            );
            reply_cut = true;
            output.pos = output.buf.len();
            cut = unanswered.into();
            break;
        };
        let Unanswered {
            number,
            req,
            payload,
        } = unanswered.remove(at).expect("in the window");
        let dev_error = device_error(cfg, &req);
        match (&got, broken.is_empty()) {
            (Ok(()), false) => {
                panic!("{req:?} succeeded but breaks a rule (expected one of errno {broken:?})")
            }
            (Err(e), false) => assert!(
                broken.contains(e),
                "{req:?} failed with errno {e}, expected one of {broken:?}"
            ),
            (_, true) => {
                let want = dev_error.map_or(Ok(()), Err);
                assert_eq!(
                    got, want,
                    "{req:?} is valid; the device's answer must be passed on"
                );
                if got.is_ok() {
                    apply(&req, payload, shadow);
                }
            }
        }
        answered[number] = Some((req.cmd, got));
    }
    assert_eq!(
        output.remaining(),
        0,
        "{} unexpected bytes after the last reply: {:02x?}",
        output.remaining(),
        &output.rest()[..output.remaining().min(64)]
    );
    assert_eq!(
        writer_failed, reply_cut,
        "the server wrote more replies than there were requests to answer"
    );
    assert_eq!(
        hung_up,
        bad_magic || writer_failed,
        "the connection must be hung up exactly when a request has a bad magic or a reply fails"
    );
    Checked {
        answers: answered.into_iter().flatten().collect(),
        dirty,
        cut,
    }
}

/// The next request on the input and its WRITE payload; `None` at the end of what the server
/// answers: the input ends (a request not whole), a DISC, or a bad magic (`bad_magic` then says
/// whether a whole request header was there, which the server hangs up on).
fn next_request<'a>(input: &mut Bytes<'a>, bad_magic: &mut bool) -> Option<(Req, &'a [u8])> {
    let magic = input.u32()?;
    if magic != REQUEST_MAGIC {
        *bad_magic = input.remaining() >= 24;
        return None;
    }
    let (flags, cmd, handle, offset, length) = (
        input.u16()?,
        input.u16()?,
        input.u64()?,
        input.u64()?,
        input.u32()?,
    );
    let req = Req {
        flags,
        cmd,
        handle,
        offset,
        length,
    };
    if cmd == cmd::DISC {
        return None;
    }
    // Read in full, or (beyond the maximum payload) read and discarded; either way all of it
    // must be there for the request to be answered.
    let payload = if cmd == cmd::WRITE {
        input.take(length as usize)?
    } else {
        &[]
    };
    Some((req, payload))
}

/// Which of `unanswered` the next reply on `out` answers, by its handle (see [`check`]); the
/// first one when the output ends before a reply's handle or does not hold a reply at all (its
/// parser then says what is wrong).
fn which_request(cfg: &Config, out: &Bytes, unanswered: &VecDeque<Unanswered>) -> usize {
    let mut peek = Bytes::new(out.buf);
    peek.pos = out.pos;
    let found = match peek.u32() {
        Some(SIMPLE_REPLY_MAGIC) => peek.u32().zip(peek.u64()).map(|(e, h)| (h, e != 0)),
        Some(STRUCTURED_REPLY_MAGIC) => {
            let ty = peek.u16().and(peek.u16());
            ty.zip(peek.u64()).map(|(t, h)| (h, reply::is_error(t)))
        }
        _ => None,
    };
    let Some((handle, error)) = found else {
        return 0;
    };
    let fails = |r: &Req| !violations(cfg, r).is_empty() || device_error(cfg, r).is_some();
    unanswered
        .iter()
        .position(|u| u.req.handle == handle && fails(&u.req) == error)
        .or_else(|| unanswered.iter().position(|u| u.req.handle == handle))
        // A handle no request in flight has: the first request's parser reports it.
        .unwrap_or(0)
}

/// The errno values the spec allows for each rule the request breaks; empty if it is valid.
pub fn violations(cfg: &Config, r: &Req) -> Vec<u32> {
    let allowed = match r.cmd {
        cmd::READ if cfg.structured => cmd_flag::FUA | cmd_flag::DF,
        cmd::READ | cmd::WRITE | cmd::FLUSH | cmd::TRIM | cmd::CACHE => cmd_flag::FUA,
        cmd::WRITE_ZEROES => cmd_flag::FUA | cmd_flag::NO_HOLE | cmd_flag::FAST_ZERO,
        cmd::BLOCK_STATUS => cmd_flag::FUA | cmd_flag::REQ_ONE,
        _ => return vec![errno::EINVAL],
    };
    let mut v = Vec::new();
    if r.flags & !allowed != 0 {
        v.push(errno::EINVAL);
    }
    let writes = matches!(r.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    if writes && cfg.read_only() {
        v.push(errno::EPERM);
    }
    if matches!(r.cmd, cmd::READ | cmd::WRITE) && r.length > cfg.max_payload {
        v.push(errno::EOVERFLOW);
    }
    if r.cmd == cmd::FLUSH && (r.offset != 0 || r.length != 0) {
        v.push(errno::EINVAL);
    }
    if r.cmd == cmd::BLOCK_STATUS && (!cfg.base_allocation || r.length == 0) {
        v.push(errno::EINVAL);
    }
    let end = r.offset as u128 + r.length as u128;
    if end > DEV_SIZE as u128 {
        v.push(if writes { errno::ENOSPC } else { errno::EINVAL });
    }
    v
}

/// How the device fails a valid request, if it does (only a [`Quirky`](quirky::Quirky) one does).
fn device_error(cfg: &Config, r: &Req) -> Option<u32> {
    if !cfg.quirky {
        return None;
    }
    let io = matches!(
        r.cmd,
        cmd::READ | cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE
    );
    if io && quirky::touches_bad(r.offset, r.length as u64) {
        return Some(errno::EIO);
    }
    let fast_zero = r.cmd == cmd::WRITE_ZEROES && r.flags & cmd_flag::FAST_ZERO != 0;
    if fast_zero && !(r.offset | r.length as u64).is_multiple_of(quirky::FAST_ZERO_ALIGN) {
        return Some(errno::ENOTSUP);
    }
    None
}

/// `base:allocation` flags the device has at `offset`.
fn allocation_at(cfg: &Config, offset: u64) -> u32 {
    if cfg.quirky {
        quirky::flags_at(offset)
    } else {
        0 // a MemDev reports everything as data
    }
}

fn range(r: &Req) -> std::ops::Range<usize> {
    r.offset as usize..r.offset as usize + r.length as usize
}

/// Applies a successful request to the model.
fn apply(r: &Req, payload: &[u8], shadow: &mut [u8]) {
    match r.cmd {
        cmd::WRITE => shadow[range(r)].copy_from_slice(payload),
        cmd::TRIM | cmd::WRITE_ZEROES => shadow[range(r)].fill(0),
        _ => {}
    }
}

fn check_read_data(r: &Req, data: &[u8], shadow: &[u8]) {
    if data != &shadow[range(r)] {
        let at = data
            .iter()
            .zip(&shadow[range(r)])
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "{r:?} returned wrong data: byte {at} is {:#04x}, the device should hold {:#04x}",
            data[at],
            shadow[range(r)][at]
        );
    }
}

/// Parses the reply to `r` off `out`: `Err(errno)` for an error reply, `None` if the output ends
/// before the reply does.
fn next_reply(cfg: &Config, r: &Req, out: &mut Bytes, shadow: &[u8]) -> Option<Result<(), u32>> {
    let magic = out.u32()?;
    match magic {
        SIMPLE_REPLY_MAGIC => {
            let (error, handle) = (out.u32()?, out.u64()?);
            assert_eq!(
                handle, r.handle,
                "simple reply to {r:?} has the wrong handle"
            );
            if error != 0 {
                assert!(
                    !cfg.structured,
                    "{r:?} failed with a simple reply although structured replies were negotiated"
                );
                return Some(Err(error));
            }
            match r.cmd {
                cmd::READ => {
                    assert!(
                        !cfg.structured,
                        "READ answered with a simple reply although structured replies were negotiated"
                    );
                    let data = out.take(r.length as usize)?;
                    check_read_data(r, data, shadow);
                }
                cmd::BLOCK_STATUS => panic!("BLOCK_STATUS answered with a simple reply: {r:?}"),
                _ => {}
            }
            Some(Ok(()))
        }
        STRUCTURED_REPLY_MAGIC => {
            assert!(
                cfg.structured,
                "structured reply to {r:?} although structured replies were not negotiated"
            );
            let (flags, ty, handle, length) = (out.u16()?, out.u16()?, out.u64()?, out.u32()?);
            assert_eq!(
                handle, r.handle,
                "structured reply to {r:?} has the wrong handle"
            );
            assert_eq!(
                flags,
                reply::FLAG_DONE,
                "the only chunk answering {r:?} must carry exactly DONE"
            );
            let sane = (8 + cfg.max_payload).max(4 + 8 * 1024).max(6 + 4096);
            assert!(
                length <= sane,
                "structured chunk of {length} bytes answering {r:?}"
            );
            let body = out.take(length as usize)?;
            let mut b = Bytes::new(body);
            match ty {
                reply::TYPE_NONE => {
                    assert!(
                        r.cmd == cmd::READ && r.length == 0 && body.is_empty(),
                        "NONE chunk (length {length}) answering {r:?}"
                    );
                    Some(Ok(()))
                }
                reply::TYPE_OFFSET_DATA => {
                    assert_eq!(r.cmd, cmd::READ, "OFFSET_DATA answering {r:?}");
                    assert_eq!(
                        length as u64,
                        8 + r.length as u64,
                        "OFFSET_DATA length answering {r:?}"
                    );
                    let offset = b.u64().expect("length checked");
                    assert_eq!(offset, r.offset, "OFFSET_DATA offset answering {r:?}");
                    check_read_data(r, b.rest(), shadow);
                    Some(Ok(()))
                }
                reply::TYPE_BLOCK_STATUS => {
                    assert_eq!(
                        r.cmd,
                        cmd::BLOCK_STATUS,
                        "BLOCK_STATUS chunk answering {r:?}"
                    );
                    assert!(
                        body.len() >= 12 && (body.len() - 4) % 8 == 0,
                        "BLOCK_STATUS chunk of {length} bytes answering {r:?}"
                    );
                    let id = b.u32().expect("length checked");
                    assert_eq!(
                        Some(id),
                        cfg.session().base_allocation,
                        "BLOCK_STATUS context id answering {r:?}"
                    );
                    let n = (body.len() - 4) / 8;
                    if r.flags & cmd_flag::REQ_ONE != 0 {
                        assert_eq!(n, 1, "{n} extents answering {r:?} with REQ_ONE");
                    }
                    let mut total = 0u64;
                    for _ in 0..n {
                        let (len, fl) = (b.u32().unwrap(), b.u32().unwrap());
                        assert!(len > 0, "empty extent answering {r:?}");
                        let start = r.offset + total;
                        total += len as u64;
                        assert!(
                            total <= r.length as u64,
                            "extents of {total} bytes answering {r:?}"
                        );
                        // The granules of the allocation map this extent covers all have its flags.
                        let mut pos = start;
                        while pos < start + len as u64 {
                            let have = allocation_at(cfg, pos);
                            assert_eq!(
                                fl, have,
                                "extent [{start}, +{len}) answering {r:?} has flags {fl:#x}, \
                                 but at {pos} the device has {have:#x}"
                            );
                            pos = (pos / quirky::GRANULE + 1) * quirky::GRANULE;
                        }
                    }
                    assert!(
                        total <= r.length as u64,
                        "extents of {total} bytes answering {r:?}"
                    );
                    Some(Ok(()))
                }
                reply::TYPE_ERROR => {
                    let (Some(error), Some(msg_len)) = (b.u32(), b.u16()) else {
                        panic!("ERROR chunk of {length} bytes answering {r:?}");
                    };
                    assert_eq!(
                        b.remaining(),
                        msg_len as usize,
                        "ERROR chunk answering {r:?}: message length {msg_len}, chunk {length}"
                    );
                    assert!(
                        std::str::from_utf8(b.rest()).is_ok(),
                        "ERROR chunk message is not UTF-8"
                    );
                    assert_ne!(error, 0, "ERROR chunk with error 0 answering {r:?}");
                    Some(Err(error))
                }
                _ => panic!("chunk type {ty:#x} answering {r:?}"),
            }
        }
        _ => panic!("reply magic {magic:#010x} answering {r:?}"),
    }
}

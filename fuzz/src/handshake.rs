//! The `handshake` target: the input is everything the client sends, fed to `handshake::negotiate`
//! over an in-memory stream; what the server wrote is then checked against a model of the
//! fixed-newstyle handshake, option by option:
//! - the greeting, then for each option the client sent in full exactly the replies it calls for,
//!   all framed correctly and echoing the option, the last one ACK or an error;
//! - each option's outcome (ACK or which errors) follows the spec from the payload: LIST and
//!   STRUCTURED_REPLY take no data, INFO/GO and the meta context options parse exactly and name
//!   this export (or the default, empty name), meta contexts need structured replies first,
//!   `base:allocation` is selected exactly when asked for, STARTTLS gets ERR_POLICY (TLS is off
//!   here; TLS is tested against real clients), unknown options get ERR_UNSUP and
//!   payloads over 64 KiB ERR_TOO_BIG;
//! - INFO/GO report the export's size and flags (`SEND_DF` exactly when structured replies were
//!   negotiated) and valid block sizes, and NAME/DESCRIPTION when asked;
//! - `negotiate` ends the way the input says (an error for broken framing or a short stream,
//!   `Closed` for ABORT or an unknown EXPORT_NAME, `Transmission` after GO or EXPORT_NAME) and the
//!   session it returns matches what was negotiated; EXPORT_NAME's reply honours NO_ZEROES.
//!
//! After a successful handshake the rest of the input is served by `transmission::serve` (one
//! thread), which only has to not panic here; the `transmission` target checks that phase.

use std::io::{self, Cursor, Read, Write};
use std::sync::atomic::AtomicBool;

use flashtier_nbd::handshake::{negotiate, Options, Outcome, Plain, Session};
use flashtier_nbd::limits::{ConnState, Limits};
use flashtier_nbd::tls::TlsMode;
use flashtier_nbd::transmission::{serve, Params};
use flashtier_nbd::wire::{self, handshake as hflag, info, opt, rep, tflag};

use crate::{Bytes, DEV_SIZE, EXPORT_NAME};

/// Maximum payload advertised in INFO_BLOCK_SIZE and used after the handshake.
pub const MAX_PAYLOAD: u32 = 64 * 1024;
const MAX_OPTION_LEN: u32 = 64 * 1024;
const MAX_DRAIN_LEN: u32 = 16 * 1024 * 1024;

/// How the handshake ended, for the seed generator's checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Error,
    Closed,
    Transmission(Session),
}

/// The client's side of the connection: reads come from the input, writes collect in `out`.
struct Conn<'a> {
    input: Cursor<&'a [u8]>,
    out: Vec<u8>,
}

impl Read for Conn<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Conn<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs the target on `data`; panics on any broken invariant.
pub fn run(data: &[u8]) -> Ended {
    let (export, mem) = crate::export(false, false, false);
    let mut conn = Conn {
        input: Cursor::new(data),
        out: Vec::new(),
    };
    let options = Options {
        max_payload: MAX_PAYLOAD,
        tls: TlsMode::Off,
    };
    let result = negotiate(
        &mut Plain(&mut conn),
        &export,
        &options,
        &AtomicBool::new(false),
    );
    let ended = match &result {
        Ok(Outcome::Transmission(s)) => Ended::Transmission(*s),
        Ok(Outcome::Closed) => Ended::Closed,
        Err(_) => Ended::Error,
    };
    let consumed = conn.input.position() as usize;
    let expected_consumed = check(data, &conn.out, ended);
    if let Ended::Transmission(session) = ended {
        assert_eq!(
            consumed, expected_consumed,
            "the handshake consumed {consumed} bytes, but the options end at {expected_consumed}"
        );
        // Budgets smaller than most requests: with one thread each is admitted alone.
        let limits = Limits::new(8192, 4096, 0, Box::new(|_| {}));
        let conn = ConnState::new(limits.memory_per_connection);
        let params = Params {
            export: &export,
            session,
            max_payload: MAX_PAYLOAD,
            threads: 1,
            limits: &limits,
            conn: &conn,
            wait_readable: &|_| true,
        };
        serve(&params, &data[consumed..], io::sink(), &|| {});
        crate::reset(&mem, 0..DEV_SIZE);
    }
    ended
}

struct OptReply<'a> {
    ty: u32,
    data: &'a [u8],
}

/// State the model tracks across options.
#[derive(Default)]
struct Negotiated {
    structured: bool,
    base_allocation: Option<u32>,
}

/// Checks the server's output against the client's input; returns where the options ended.
fn check(input: &[u8], out: &[u8], ended: Ended) -> usize {
    let mut inp = Bytes::new(input);
    let mut out = Bytes::new(out);
    let expect_end = |out: &Bytes, want: Ended, why: &str| {
        assert_eq!(ended, want, "handshake should have ended: {why}");
        assert_eq!(
            out.remaining(),
            0,
            "{} unexpected bytes after the last reply ({why}): {:02x?}",
            out.remaining(),
            &out.rest()[..out.remaining().min(64)]
        );
    };

    let mut greeting = wire::NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(hflag::FIXED_NEWSTYLE | hflag::NO_ZEROES).to_be_bytes());
    assert_eq!(
        out.take(greeting.len()),
        Some(&greeting[..]),
        "bad server greeting"
    );

    let Some(client_flags) = inp.u32() else {
        expect_end(&out, Ended::Error, "no client flags");
        return inp.pos;
    };
    if client_flags & !(hflag::C_FIXED_NEWSTYLE | hflag::C_NO_ZEROES) != 0 {
        expect_end(&out, Ended::Error, "unknown client flags");
        return inp.pos;
    }
    let no_zeroes = client_flags & hflag::C_NO_ZEROES != 0;
    let mut st = Negotiated::default();

    loop {
        if inp.remaining() < 16 {
            expect_end(&out, Ended::Error, "stream ends inside an option header");
            return inp.pos;
        }
        if inp.u64() != Some(wire::IHAVEOPT) {
            expect_end(&out, Ended::Error, "bad option magic");
            return inp.pos;
        }
        let option = inp.u32().unwrap();
        let len = inp.u32().unwrap();
        if len > MAX_DRAIN_LEN {
            expect_end(&out, Ended::Error, "option payload beyond the drain limit");
            return inp.pos;
        }
        let Some(payload) = inp.take(len as usize) else {
            expect_end(&out, Ended::Error, "stream ends inside an option payload");
            return inp.pos;
        };
        if len > MAX_OPTION_LEN {
            if option == opt::EXPORT_NAME {
                expect_end(&out, Ended::Closed, "EXPORT_NAME too long");
                return inp.pos;
            }
            let r = replies(&mut out, option);
            assert_one_error(&r, option, &[rep::ERR_TOO_BIG]);
            continue;
        }
        match option {
            opt::EXPORT_NAME => {
                if !answers_to(payload) {
                    expect_end(&out, Ended::Closed, "EXPORT_NAME of an unknown export");
                    return inp.pos;
                }
                let Ended::Transmission(s) = ended else {
                    panic!("EXPORT_NAME of this export must enter transmission, got {ended:?}");
                };
                check_session(&s, &st);
                assert_eq!(out.u64(), Some(s.size), "EXPORT_NAME reply: size");
                assert_eq!(out.u16(), Some(s.flags), "EXPORT_NAME reply: flags");
                if !no_zeroes {
                    assert_eq!(
                        out.take(124),
                        Some(&[0u8; 124][..]),
                        "EXPORT_NAME reply: 124 zeroes without NO_ZEROES"
                    );
                }
                expect_end(&out, ended, "EXPORT_NAME");
                return inp.pos;
            }
            opt::ABORT => {
                let r = replies(&mut out, option);
                assert!(
                    r.len() == 1 && r[0].ty == rep::ACK && r[0].data.is_empty(),
                    "ABORT must get a bare ACK"
                );
                expect_end(&out, Ended::Closed, "ABORT");
                return inp.pos;
            }
            opt::LIST => {
                let r = replies(&mut out, option);
                if payload.is_empty() {
                    let mut server = (EXPORT_NAME.len() as u32).to_be_bytes().to_vec();
                    server.extend_from_slice(EXPORT_NAME.as_bytes());
                    assert!(
                        r.len() == 2
                            && r[0].ty == rep::SERVER
                            && r[0].data == &server[..]
                            && r[1].ty == rep::ACK
                            && r[1].data.is_empty(),
                        "LIST must name the export, then ACK"
                    );
                } else {
                    assert_one_error(&r, option, &[rep::ERR_INVALID]);
                }
            }
            opt::INFO | opt::GO => {
                let r = replies(&mut out, option);
                match parse_info(payload) {
                    None => assert_one_error(&r, option, &[rep::ERR_INVALID]),
                    Some((name, _)) if !answers_to(name) => {
                        assert_one_error(&r, option, &[rep::ERR_UNKNOWN])
                    }
                    Some((_, requests)) => {
                        let flags = check_info(&r, &requests, &st);
                        if option == opt::GO {
                            let Ended::Transmission(s) = ended else {
                                panic!("GO must enter transmission, got {ended:?}");
                            };
                            check_session(&s, &st);
                            assert_eq!(s.flags, flags, "session flags differ from INFO_EXPORT's");
                            expect_end(&out, ended, "GO");
                            return inp.pos;
                        }
                    }
                }
            }
            opt::STRUCTURED_REPLY => {
                let r = replies(&mut out, option);
                if payload.is_empty() {
                    assert!(
                        r.len() == 1 && r[0].ty == rep::ACK && r[0].data.is_empty(),
                        "STRUCTURED_REPLY without data must get a bare ACK"
                    );
                    st.structured = true;
                } else {
                    assert_one_error(&r, option, &[rep::ERR_INVALID]);
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                let r = replies(&mut out, option);
                let Some((name, queries)) = parse_meta(payload) else {
                    assert_one_error(&r, option, &[rep::ERR_INVALID]);
                    continue;
                };
                let mut errors = Vec::new();
                if !st.structured {
                    errors.push(rep::ERR_INVALID);
                }
                if !answers_to(name) {
                    errors.push(rep::ERR_UNKNOWN);
                }
                if !errors.is_empty() {
                    assert_one_error(&r, option, &errors);
                    continue;
                }
                let listing = option == opt::LIST_META_CONTEXT;
                let selected = if listing {
                    queries.is_empty()
                        || queries
                            .iter()
                            .any(|q| *q == b"base:" || *q == wire::BASE_ALLOCATION.as_bytes())
                } else {
                    queries
                        .iter()
                        .any(|q| *q == wire::BASE_ALLOCATION.as_bytes())
                };
                let last = r.last().expect("at least one reply");
                assert!(
                    last.ty == rep::ACK && last.data.is_empty(),
                    "meta context option {option} must end with a bare ACK"
                );
                let contexts = &r[..r.len() - 1];
                assert_eq!(
                    contexts.len(),
                    selected as usize,
                    "meta context option {option}: base:allocation selected = {selected}"
                );
                let mut id = None;
                for c in contexts {
                    let mut b = Bytes::new(c.data);
                    assert_eq!(c.ty, rep::META_CONTEXT, "meta context reply type");
                    id = b.u32();
                    assert!(id.is_some(), "META_CONTEXT reply without an id");
                    assert_eq!(b.rest(), wire::BASE_ALLOCATION.as_bytes(), "context name");
                }
                if !listing {
                    st.base_allocation = id;
                }
            }
            // TLS is off in this target: refused by policy, with or without (invalid) data.
            opt::STARTTLS => {
                let r = replies(&mut out, option);
                assert_one_error(&r, option, &[rep::ERR_POLICY, rep::ERR_INVALID]);
            }
            _ => {
                let r = replies(&mut out, option);
                assert_one_error(&r, option, &[rep::ERR_UNSUP]);
            }
        }
    }
}

fn answers_to(name: &[u8]) -> bool {
    name.is_empty() || name == EXPORT_NAME.as_bytes()
}

/// The replies to one option, up to and including the final ACK or error.
fn replies<'a>(out: &mut Bytes<'a>, option: u32) -> Vec<OptReply<'a>> {
    let mut r = Vec::new();
    loop {
        let (Some(magic), Some(echo), Some(ty), Some(len)) =
            (out.u64(), out.u32(), out.u32(), out.u32())
        else {
            panic!("option {option}: reply missing or truncated");
        };
        assert_eq!(
            magic,
            wire::OPTION_REPLY_MAGIC,
            "option {option}: reply magic"
        );
        assert_eq!(echo, option, "option {option}: reply names option {echo}");
        assert!(len <= 64 * 1024, "option {option}: {len}-byte reply");
        let data = out
            .take(len as usize)
            .unwrap_or_else(|| panic!("option {option}: reply data truncated"));
        let last = ty == rep::ACK || rep::is_error(ty);
        r.push(OptReply { ty, data });
        if last {
            return r;
        }
    }
}

fn assert_one_error(r: &[OptReply], option: u32, allowed: &[u32]) {
    assert!(
        r.len() == 1 && allowed.contains(&r[0].ty),
        "option {option}: expected a single error reply of type {allowed:#x?}, got types {:#x?}",
        r.iter().map(|r| r.ty).collect::<Vec<_>>()
    );
    assert!(
        r[0].data.len() <= wire::MAX_STRING && std::str::from_utf8(r[0].data).is_ok(),
        "option {option}: error message must be UTF-8 of at most 4096 bytes"
    );
}

/// Checks INFO/GO's successful replies; returns the transmission flags they report.
fn check_info(r: &[OptReply], requests: &[u16], st: &Negotiated) -> u16 {
    let (last, infos) = r.split_last().expect("at least one reply");
    assert!(
        last.ty == rep::ACK && last.data.is_empty(),
        "INFO/GO of this export must end with a bare ACK, got type {:#x}",
        last.ty
    );
    assert!(infos.iter().all(|i| i.ty == rep::INFO && i.data.len() >= 2));
    let item = |i: &OptReply| wire::be16(i.data);
    let first = infos.first().expect("INFO/GO must send INFO_EXPORT");
    assert_eq!(item(first), info::EXPORT, "INFO_EXPORT must come first");
    let mut b = Bytes::new(&first.data[2..]);
    let (Some(size), Some(flags)) = (b.u64(), b.u16()) else {
        panic!("INFO_EXPORT too short");
    };
    assert_eq!(b.remaining(), 0, "INFO_EXPORT too long");
    assert_eq!(size, DEV_SIZE as u64, "INFO_EXPORT size");
    check_flags(flags, st);
    let mut block_size = false;
    for i in &infos[1..] {
        let data = &i.data[2..];
        match item(i) {
            info::NAME => {
                assert!(requests.contains(&info::NAME), "INFO_NAME not asked for");
                assert_eq!(data, EXPORT_NAME.as_bytes(), "INFO_NAME");
            }
            info::DESCRIPTION => {
                assert!(
                    requests.contains(&info::DESCRIPTION),
                    "INFO_DESCRIPTION not asked for"
                );
                assert!(data.len() <= wire::MAX_STRING && std::str::from_utf8(data).is_ok());
            }
            info::BLOCK_SIZE => {
                assert!(!block_size, "INFO_BLOCK_SIZE sent twice");
                block_size = true;
                let mut b = Bytes::new(data);
                let (Some(min), Some(pref), Some(max)) = (b.u32(), b.u32(), b.u32()) else {
                    panic!("INFO_BLOCK_SIZE too short");
                };
                assert_eq!(b.remaining(), 0, "INFO_BLOCK_SIZE too long");
                assert!(
                    min.is_power_of_two() && min <= 64 * 1024,
                    "minimum block size {min}"
                );
                assert!(
                    pref.is_power_of_two() && pref >= min.max(512),
                    "preferred block size {pref}"
                );
                assert!(
                    max == u32::MAX || (max % min == 0 && max >= min),
                    "maximum payload {max}"
                );
                assert_eq!(max, MAX_PAYLOAD, "maximum payload");
            }
            other => panic!("INFO reply for item {other}, which the server does not know"),
        }
    }
    if requests.contains(&info::BLOCK_SIZE) {
        assert!(block_size, "INFO_BLOCK_SIZE asked for but not sent");
    }
    for want in [info::NAME, info::DESCRIPTION] {
        if requests.contains(&want) {
            assert!(
                infos[1..].iter().any(|i| item(i) == want),
                "information item {want} asked for but not sent"
            );
        }
    }
    flags
}

fn check_flags(flags: u16, st: &Negotiated) {
    assert!(flags & tflag::HAS_FLAGS != 0, "HAS_FLAGS missing");
    assert!(
        flags & tflag::READ_ONLY == 0,
        "writable export advertised read-only"
    );
    assert_eq!(
        flags & tflag::SEND_DF != 0,
        st.structured,
        "SEND_DF must be advertised exactly when structured replies were negotiated"
    );
}

fn check_session(s: &Session, st: &Negotiated) {
    assert_eq!(s.size, DEV_SIZE as u64, "session size");
    check_flags(s.flags, st);
    assert_eq!(
        s.structured_replies, st.structured,
        "session structured_replies"
    );
    assert_eq!(
        s.base_allocation, st.base_allocation,
        "session base_allocation"
    );
}

/// INFO/GO payload, parsed independently of the server: name, then exactly the item list.
fn parse_info(p: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let mut b = Bytes::new(p);
    let name_len = b.u32()? as usize;
    if name_len > wire::MAX_STRING {
        return None;
    }
    let name = b.take(name_len)?;
    let n = b.u16()?;
    let items = (0..n).map(|_| b.u16()).collect::<Option<Vec<_>>>()?;
    (b.remaining() == 0).then_some((name, items))
}

/// LIST/SET_META_CONTEXT payload, parsed independently of the server.
fn parse_meta(p: &[u8]) -> Option<(&[u8], Vec<&[u8]>)> {
    let mut b = Bytes::new(p);
    let name_len = b.u32()? as usize;
    if name_len > wire::MAX_STRING {
        return None;
    }
    let name = b.take(name_len)?;
    let n = b.u32()?;
    let mut queries = Vec::new();
    for _ in 0..n {
        let len = b.u32()? as usize;
        if len > wire::MAX_STRING {
            return None;
        }
        queries.push(b.take(len)?);
    }
    (b.remaining() == 0).then_some((name, queries))
}

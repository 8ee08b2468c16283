//! memcached's classic text protocol, as far as the pool speaks it: `get`, `set` and `delete`.
//!
//! Everything here is pure: commands are encoded into a `Vec<u8>`, replies are parsed from any
//! [`BufRead`] (a `&[u8]` in tests and fuzzing, a buffered socket in the pool). A parser never
//! reads past the reply it was asked for, so several pipelined replies can be parsed one after
//! the other from the same reader.
//!
//! The parsers are strict on purpose: memcached's replies are fully specified
//! (`doc/protocol.txt`), and anything else on the wire means the stream is out of step with the
//! commands sent (or is not memcached at all). The pool then drops the connection rather than
//! guess where the next reply starts.

use std::fmt;
use std::io::{self, BufRead, Read};

/// The longest key memcached accepts.
pub const MAX_KEY_LEN: usize = 250;

/// The longest reply line the parsers accept (not counting a value's data). A `VALUE` line is at
/// most about 320 bytes and memcached's error messages are short, so anything longer is junk;
/// the bound keeps a stream of junk without a newline from growing a buffer without limit.
pub const MAX_LINE_LEN: usize = 1024;

/// The default limit on the length of a value, stored or read: memcached's default item size
/// (`-I 1m`). A default server cannot hold a value this long (the item's header counts too), so
/// the limit itself is the slack over the longest value a server can return.
pub const DEFAULT_MAX_VALUE_LEN: usize = 1 << 20;

/// Why a key cannot be sent to memcached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// memcached has no empty key: `get \r\n` is a malformed command.
    #[error("empty key")]
    Empty,
    /// Longer than [`MAX_KEY_LEN`].
    #[error("key of {0} bytes is longer than memcached's limit of {MAX_KEY_LEN}")]
    TooLong(usize),
    /// Whitespace or a control character would split or end the command line.
    #[error("key has byte {byte:#04x} at offset {at}: keys may not hold whitespace or control characters")]
    BadByte {
        /// The offending byte.
        byte: u8,
        /// Where it is in the key.
        at: usize,
    },
}

/// Checks that `key` can be sent in a text-protocol command: 1 to 250 bytes, none of them
/// whitespace or control characters (bytes ≤ 0x20 and 0x7f; bytes ≥ 0x80 are fine).
pub fn validate_key(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(key.len()));
    }
    match key.iter().position(|&b| b <= b' ' || b == 0x7f) {
        Some(at) => Err(KeyError::BadByte { byte: key[at], at }),
        None => Ok(()),
    }
}

/// Appends `get <k1> <k2> ...\r\n` to `out`. The keys must have passed [`validate_key`].
pub fn encode_get<K: AsRef<[u8]>>(keys: &[K], out: &mut Vec<u8>) {
    out.extend_from_slice(b"get");
    for key in keys {
        out.push(b' ');
        out.extend_from_slice(key.as_ref());
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends `set <key> 0 0 <len>\r\n<value>\r\n` to `out` (flags 0, no expiry). The key must have
/// passed [`validate_key`].
pub fn encode_set(key: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.reserve(key.len() + value.len() + 32);
    out.extend_from_slice(b"set ");
    out.extend_from_slice(key);
    out.extend_from_slice(format!(" 0 0 {}\r\n", value.len()).as_bytes());
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `delete <key>\r\n` to `out`. The key must have passed [`validate_key`].
pub fn encode_delete(key: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(b"delete ");
    out.extend_from_slice(key);
    out.extend_from_slice(b"\r\n");
}

/// One of memcached's three error replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorReply {
    /// `ERROR`: the server did not know the command.
    Error,
    /// `CLIENT_ERROR <message>`: the command was malformed.
    ClientError(String),
    /// `SERVER_ERROR <message>`: the server could not carry the command out.
    ServerError(String),
}

impl fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorReply::Error => f.write_str("ERROR"),
            ErrorReply::ClientError(m) => write!(f, "CLIENT_ERROR {m}"),
            ErrorReply::ServerError(m) => write!(f, "SERVER_ERROR {m}"),
        }
    }
}

/// Why a reply could not be parsed. Apart from [`ReplyError::Io`] with a timeout, each means the
/// stream can no longer be trusted to be in step with the commands sent.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    /// The reader failed (a timeout shows up here as `TimedOut` or `WouldBlock`).
    #[error("reading the reply: {0}")]
    Io(#[from] io::Error),
    /// The stream ended in the middle of a reply.
    #[error("reply truncated: the connection closed in the middle of it")]
    Truncated,
    /// A line that is not a reply memcached sends here.
    #[error("malformed reply: {0}")]
    Malformed(String),
    /// A reply line longer than [`MAX_LINE_LEN`].
    #[error("reply line longer than {MAX_LINE_LEN} bytes")]
    LineTooLong,
    /// A `VALUE` for a key not asked for, or out of the order asked.
    #[error("VALUE for key {0:?}, which was not asked for at that point")]
    UnexpectedKey(String),
    /// A `VALUE` longer than the limit the caller set.
    #[error("VALUE of {len} bytes is over the limit of {max}")]
    ValueTooLong {
        /// The length the server announced.
        len: u64,
        /// The caller's limit.
        max: usize,
    },
    /// The server answered with an error line.
    #[error("server replied {0}")]
    Server(ErrorReply),
}

/// The reply to one `set`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreReply {
    /// `STORED`.
    Stored,
    /// `NOT_STORED` (an `add`/`replace` condition failed; not expected for `set`).
    NotStored,
    /// `EXISTS` (a `cas` conflict; not expected for `set`).
    Exists,
    /// `NOT_FOUND` (a `cas` on a missing key; not expected for `set`).
    NotFound,
    /// A `SERVER_ERROR` about this item alone (`object too large for cache`, `out of memory
    /// storing object`): memcached skips the item's data and the connection stays in step, so the
    /// set failed but the server did not.
    Rejected(String),
}

/// The reply to one `delete`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteReply {
    /// `DELETED`.
    Deleted,
    /// `NOT_FOUND`.
    NotFound,
}

/// `SERVER_ERROR` messages after which memcached has consumed the rejected item's data and
/// carries on with the next command (proto_text.c, `process_update_command`: `conn_swallow`).
const ITEM_REJECTIONS: &[&str] = &["object too large for cache", "out of memory storing object"];

/// Parses the reply to `get <keys...>`: zero or more
/// `VALUE <key> <flags> <bytes>[ <cas>]\r\n<data>\r\n`, in the order the keys were asked, then
/// `END\r\n`. Returns one entry per key of `keys`, `Some(data)` for each key that had a `VALUE`.
///
/// `keys` may repeat a key (memcached answers each occurrence). A value longer than
/// `max_value_len`, a `VALUE` for a key not asked (or answered out of order), a truncated stream
/// or an error line is an error; the reader is then left at an unspecified position.
pub fn parse_get_reply<R: BufRead + ?Sized>(
    r: &mut R,
    keys: &[&[u8]],
    max_value_len: usize,
) -> Result<Vec<Option<Vec<u8>>>, ReplyError> {
    let mut values: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    // Replies come in the order asked, so each VALUE is matched from just after the previous
    // one: that catches a reply to some other command as well as a reordered one.
    let mut next = 0;
    let mut line = Vec::new();
    loop {
        read_line(r, &mut line)?;
        if line == b"END" {
            return Ok(values);
        }
        let header = parse_value_line(&line)?;
        let Some(offset) = keys[next..].iter().position(|k| *k == header.key) else {
            return Err(ReplyError::UnexpectedKey(
                String::from_utf8_lossy(header.key).into_owned(),
            ));
        };
        if header.len > max_value_len as u64 {
            return Err(ReplyError::ValueTooLong {
                len: header.len,
                max: max_value_len,
            });
        }
        let len = header.len as usize; // ≤ max_value_len, a usize
        let index = next + offset;
        values[index] = Some(read_data(r, len)?);
        next = index + 1;
    }
}

/// Parses the reply to one `set`. Error lines other than the item-level rejections in
/// [`StoreReply::Rejected`] are errors.
pub fn parse_store_reply<R: BufRead + ?Sized>(r: &mut R) -> Result<StoreReply, ReplyError> {
    let mut line = Vec::new();
    read_line(r, &mut line)?;
    match line.as_slice() {
        b"STORED" => Ok(StoreReply::Stored),
        b"NOT_STORED" => Ok(StoreReply::NotStored),
        b"EXISTS" => Ok(StoreReply::Exists),
        b"NOT_FOUND" => Ok(StoreReply::NotFound),
        _ => match error_line(&line) {
            Some(ErrorReply::ServerError(m)) if ITEM_REJECTIONS.contains(&m.as_str()) => {
                Ok(StoreReply::Rejected(m))
            }
            Some(e) => Err(ReplyError::Server(e)),
            None => Err(malformed("a reply to set", &line)),
        },
    }
}

/// Parses the reply to one `delete`.
pub fn parse_delete_reply<R: BufRead + ?Sized>(r: &mut R) -> Result<DeleteReply, ReplyError> {
    let mut line = Vec::new();
    read_line(r, &mut line)?;
    match line.as_slice() {
        b"DELETED" => Ok(DeleteReply::Deleted),
        b"NOT_FOUND" => Ok(DeleteReply::NotFound),
        _ => match error_line(&line) {
            Some(e) => Err(ReplyError::Server(e)),
            None => Err(malformed("a reply to delete", &line)),
        },
    }
}

struct ValueHeader<'a> {
    key: &'a [u8],
    len: u64,
}

fn parse_value_line(line: &[u8]) -> Result<ValueHeader<'_>, ReplyError> {
    if let Some(e) = error_line(line) {
        return Err(ReplyError::Server(e));
    }
    let mut fields = line.split(|&b| b == b' ');
    let (Some(b"VALUE"), Some(key), Some(flags), Some(len)) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return Err(malformed("a VALUE line", line));
    };
    let cas_ok = match fields.next() {
        Some(cas) => decimal(cas).is_some(),
        None => true,
    };
    let well_formed = validate_key(key).is_ok()
        && decimal(flags).is_some_and(|f| f <= u64::from(u32::MAX))
        && cas_ok
        && fields.next().is_none();
    match decimal(len) {
        Some(len) if well_formed => Ok(ValueHeader { key, len }),
        _ => Err(malformed("a VALUE line", line)),
    }
}

/// A plain decimal: digits only (`str::parse` would also take a sign), no overflow.
fn decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    s.iter().try_fold(0u64, |n, &b| {
        let d = (b as char).to_digit(10)?;
        n.checked_mul(10)?.checked_add(u64::from(d))
    })
}

fn error_line(line: &[u8]) -> Option<ErrorReply> {
    let text = |rest: &[u8]| String::from_utf8_lossy(rest).into_owned();
    if line == b"ERROR" {
        Some(ErrorReply::Error)
    } else if let Some(rest) = line.strip_prefix(b"CLIENT_ERROR") {
        Some(ErrorReply::ClientError(text(rest.strip_prefix(b" ")?)))
    } else if let Some(rest) = line.strip_prefix(b"SERVER_ERROR") {
        Some(ErrorReply::ServerError(text(rest.strip_prefix(b" ")?)))
    } else {
        None
    }
}

fn malformed(expected: &str, line: &[u8]) -> ReplyError {
    const SHOWN: usize = 80;
    let shown = &line[..line.len().min(SHOWN)];
    let more = if line.len() > SHOWN { "..." } else { "" };
    ReplyError::Malformed(format!(
        "expected {expected}, got {:?}{more}",
        String::from_utf8_lossy(shown)
    ))
}

/// Reads one `\r\n`-terminated line into `line`, without the terminator.
fn read_line<R: BufRead + ?Sized>(r: &mut R, line: &mut Vec<u8>) -> Result<(), ReplyError> {
    line.clear();
    loop {
        let available = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if available.is_empty() {
            return Err(ReplyError::Truncated);
        }
        let (chunk, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..=i], true),
            None => (available, false),
        };
        if line.len() + chunk.len() > MAX_LINE_LEN + 2 {
            return Err(ReplyError::LineTooLong);
        }
        line.extend_from_slice(chunk);
        let used = chunk.len();
        r.consume(used);
        if done {
            break;
        }
    }
    line.pop(); // the '\n'
    if line.pop() != Some(b'\r') {
        return Err(malformed("a line ending in \\r\\n", line));
    }
    Ok(())
}

/// Reads a value's `len` bytes of data and the `\r\n` after them.
fn read_data<R: BufRead + ?Sized>(r: &mut R, len: usize) -> Result<Vec<u8>, ReplyError> {
    let total = len.checked_add(2).ok_or(ReplyError::ValueTooLong {
        len: len as u64,
        max: usize::MAX - 2,
    })?;
    // The buffer grows as data arrives rather than to the announced length at once: a caller's
    // limit may be generous, and a lying length should not cost more memory than was sent.
    let mut data = Vec::with_capacity(total.min(64 << 10));
    (&mut *r).take(total as u64).read_to_end(&mut data)?;
    if data.len() < total {
        return Err(ReplyError::Truncated);
    }
    if !data.ends_with(b"\r\n") {
        return Err(ReplyError::Malformed(
            "a value's data is not followed by \\r\\n".into(),
        ));
    }
    data.truncate(len);
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(reply: &[u8], keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>, ReplyError> {
        let keys: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let mut r = reply;
        let out = parse_get_reply(&mut r, &keys, 1 << 20)?;
        assert!(r.is_empty(), "the parser must consume exactly the reply");
        Ok(out)
    }

    fn v(s: &str) -> Option<Vec<u8>> {
        Some(s.as_bytes().to_vec())
    }

    #[test]
    fn keys_are_validated() {
        assert_eq!(validate_key(b"a"), Ok(()));
        assert_eq!(validate_key(&[b'k'; 250]), Ok(()));
        assert_eq!(validate_key("clé/ünï".as_bytes()), Ok(()));
        assert_eq!(validate_key(b""), Err(KeyError::Empty));
        assert_eq!(validate_key(&[b'k'; 251]), Err(KeyError::TooLong(251)));
        for (key, byte, at) in [
            (&b"a b"[..], b' ', 1),
            (b"\tab", b'\t', 0),
            (b"ab\r\n", b'\r', 2),
            (b"a\nb", b'\n', 1),
            (b"a\0", 0, 1),
            (b"a\x7f", 0x7f, 1),
            (b"a\x1b", 0x1b, 1),
        ] {
            assert_eq!(validate_key(key), Err(KeyError::BadByte { byte, at }));
        }
    }

    #[test]
    fn commands_are_encoded() {
        let mut out = Vec::new();
        encode_get(&[&b"a"[..], b"bb"], &mut out);
        encode_set(b"k", b"xyz", &mut out);
        encode_set(b"e", b"", &mut out);
        encode_delete(b"k", &mut out);
        assert_eq!(
            out,
            b"get a bb\r\nset k 0 0 3\r\nxyz\r\nset e 0 0 0\r\n\r\ndelete k\r\n"
        );
    }

    #[test]
    fn get_hits_misses_and_partial_multi_get() {
        assert_eq!(get(b"END\r\n", &["a"]).unwrap(), vec![None]);
        assert_eq!(
            get(b"VALUE a 0 3\r\nxyz\r\nEND\r\n", &["a"]).unwrap(),
            vec![v("xyz")]
        );
        assert_eq!(
            get(
                b"VALUE a 5 2 77\r\nAA\r\nVALUE c 4294967295 0\r\n\r\nEND\r\n",
                &["a", "b", "c", "d"]
            )
            .unwrap(),
            vec![v("AA"), None, v(""), None]
        );
        // Data may hold anything, including what looks like protocol.
        assert_eq!(
            get(b"VALUE k 0 7\r\nEND\r\n\0\xff\r\nEND\r\n", &["k"]).unwrap(),
            vec![Some(b"END\r\n\0\xff".to_vec())]
        );
    }

    #[test]
    fn repeated_keys_are_answered_in_place() {
        assert_eq!(
            get(
                b"VALUE a 0 1\r\n1\r\nVALUE a 0 1\r\n2\r\nEND\r\n",
                &["a", "b", "a"]
            )
            .unwrap(),
            vec![v("1"), None, v("2")]
        );
    }

    #[test]
    fn pipelined_replies_parse_one_after_another() {
        let mut r: &[u8] = b"STORED\r\nSERVER_ERROR object too large for cache\r\nNOT_STORED\r\nEXISTS\r\nNOT_FOUND\r\nDELETED\r\nNOT_FOUND\r\nVALUE x 0 1\r\n!\r\nEND\r\n";
        assert_eq!(parse_store_reply(&mut r).unwrap(), StoreReply::Stored);
        assert_eq!(
            parse_store_reply(&mut r).unwrap(),
            StoreReply::Rejected("object too large for cache".into())
        );
        assert_eq!(parse_store_reply(&mut r).unwrap(), StoreReply::NotStored);
        assert_eq!(parse_store_reply(&mut r).unwrap(), StoreReply::Exists);
        assert_eq!(parse_store_reply(&mut r).unwrap(), StoreReply::NotFound);
        assert_eq!(parse_delete_reply(&mut r).unwrap(), DeleteReply::Deleted);
        assert_eq!(parse_delete_reply(&mut r).unwrap(), DeleteReply::NotFound);
        assert_eq!(
            parse_get_reply(&mut r, &[b"x"], 10).unwrap(),
            vec![Some(b"!".to_vec())]
        );
        assert!(r.is_empty());
    }

    #[test]
    fn error_lines_are_errors() {
        for (reply, expected) in [
            (&b"ERROR\r\n"[..], ErrorReply::Error),
            (
                b"CLIENT_ERROR bad command line format\r\n",
                ErrorReply::ClientError("bad command line format".into()),
            ),
            (
                b"SERVER_ERROR out of memory\r\n",
                ErrorReply::ServerError("out of memory".into()),
            ),
        ] {
            let server = |e| matches!(e, ReplyError::Server(got) if got == expected);
            assert!(server(get(reply, &["a"]).unwrap_err()));
            assert!(server(parse_store_reply(&mut &reply[..]).unwrap_err()));
            assert!(server(parse_delete_reply(&mut &reply[..]).unwrap_err()));
        }
        // An error after some values still fails the whole reply.
        assert!(matches!(
            get(b"VALUE a 0 1\r\nx\r\nSERVER_ERROR busy\r\n", &["a", "b"]).unwrap_err(),
            ReplyError::Server(ErrorReply::ServerError(_))
        ));
        // Only item-level SERVER_ERRORs leave a set's connection usable.
        assert!(matches!(
            parse_store_reply(&mut &b"SERVER_ERROR out of memory storing object\r\n"[..]),
            Ok(StoreReply::Rejected(_))
        ));
        assert!(matches!(
            parse_store_reply(&mut &b"SERVER_ERROR out of memory reading request\r\n"[..]),
            Err(ReplyError::Server(_))
        ));
    }

    #[test]
    fn junk_is_malformed() {
        for reply in [
            &b"HELLO\r\n"[..],
            b"END \r\n",
            b"end\r\n",
            b"VALUE a\r\n",
            b"VALUE a 0\r\n",
            b"VALUE a 0 x\r\n",
            b"VALUE a 0 +1\r\nx\r\nEND\r\n",
            b"VALUE a -1 1\r\nx\r\nEND\r\n",
            b"VALUE a 4294967296 1\r\nx\r\nEND\r\n",
            b"VALUE a 0 1 2 3\r\nx\r\nEND\r\n",
            b"VALUE a 0 1 cas\r\nx\r\nEND\r\n",
            b"VALUE  a 0 1\r\nx\r\nEND\r\n",
            b"VALUE a 0 99999999999999999999999\r\n",
            b"VALUE a 0 1\r\nxy\r\nEND\r\n",
            b"VALUE a 0 1\r\nx\n\nEND\r\n",
            b"END\n",
            b"SERVER_ERRORx\r\n",
            b"CLIENT_ERROR\r\n",
        ] {
            let err = get(reply, &["a"]).unwrap_err();
            assert!(matches!(err, ReplyError::Malformed(_)), "{reply:?}: {err}");
        }
        for reply in [&b"OK\r\n"[..], b"STORED \r\n", b"\r\n"] {
            assert!(matches!(
                parse_store_reply(&mut &reply[..]),
                Err(ReplyError::Malformed(_))
            ));
            assert!(matches!(
                parse_delete_reply(&mut &reply[..]),
                Err(ReplyError::Malformed(_))
            ));
        }
    }

    #[test]
    fn values_for_keys_not_asked_or_out_of_order_are_rejected() {
        for (reply, keys) in [
            (&b"VALUE z 0 1\r\nx\r\nEND\r\n"[..], &["a", "b"][..]),
            (
                b"VALUE b 0 1\r\nx\r\nVALUE a 0 1\r\ny\r\nEND\r\n",
                &["a", "b"],
            ),
            (
                b"VALUE a 0 1\r\nx\r\nVALUE a 0 1\r\ny\r\nEND\r\n",
                &["a", "b"],
            ),
        ] {
            assert!(matches!(
                get(reply, keys).unwrap_err(),
                ReplyError::UnexpectedKey(_)
            ));
        }
    }

    #[test]
    fn truncated_replies_are_truncated() {
        let full = b"VALUE a 0 3\r\nxyz\r\nVALUE b 0 2\r\nhi\r\nEND\r\n";
        for cut in 0..full.len() {
            let err = get(&full[..cut], &["a", "b"]).unwrap_err();
            assert!(matches!(err, ReplyError::Truncated), "cut at {cut}: {err}");
        }
        assert!(matches!(
            parse_store_reply(&mut &b"STOR"[..]),
            Err(ReplyError::Truncated)
        ));
    }

    #[test]
    fn oversized_lengths_and_lines_are_rejected() {
        let keys: [&[u8]; 1] = [b"a"];
        let mut r: &[u8] = b"VALUE a 0 11\r\n";
        assert!(matches!(
            parse_get_reply(&mut r, &keys, 10),
            Err(ReplyError::ValueTooLong { len: 11, max: 10 })
        ));
        let mut r: &[u8] = b"VALUE a 0 10\r\n0123456789\r\nEND\r\n";
        assert!(parse_get_reply(&mut r, &keys, 10).is_ok());
        let mut r: &[u8] = b"VALUE a 0 18446744073709551615\r\n";
        assert!(matches!(
            parse_get_reply(&mut r, &keys, usize::MAX),
            Err(ReplyError::ValueTooLong { .. }) | Err(ReplyError::Truncated)
        ));

        let long = [b'x'; MAX_LINE_LEN + 3];
        assert!(matches!(
            parse_store_reply(&mut &long[..]),
            Err(ReplyError::LineTooLong)
        ));
        let mut ok_line = vec![b'x'; MAX_LINE_LEN];
        ok_line.extend_from_slice(b"\r\n");
        assert!(matches!(
            parse_store_reply(&mut &ok_line[..]),
            Err(ReplyError::Malformed(_))
        ));
    }

    /// A reader that hands out one byte at a time, so lines and values straddle refills.
    struct Trickle<'a>(&'a [u8]);

    impl io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(1).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn replies_split_across_reads_parse() {
        let reply = b"VALUE a 0 3 9\r\nxyz\r\nVALUE b 0 2\r\nhi\r\nEND\r\n";
        let mut r = io::BufReader::with_capacity(3, Trickle(reply));
        let keys: [&[u8]; 3] = [b"a", b"q", b"b"];
        assert_eq!(
            parse_get_reply(&mut r, &keys, 100).unwrap(),
            vec![v("xyz"), None, v("hi")]
        );
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn never_panics_and_never_overreads(
                data in proptest::collection::vec(any::<u8>(), 0..300),
                max in 0usize..64,
            ) {
                let keys: [&[u8]; 3] = [b"a", b"b", b"a"];
                let mut r = &data[..];
                if let Ok(values) = parse_get_reply(&mut r, &keys, max) {
                    prop_assert_eq!(values.len(), 3);
                    prop_assert!(values.iter().flatten().all(|v| v.len() <= max));
                }
                let _ = parse_store_reply(&mut &data[..]);
                let _ = parse_delete_reply(&mut &data[..]);
            }

            #[test]
            fn encoded_values_parse_back(
                values in proptest::collection::vec(
                    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)), 1..6),
            ) {
                let keys: Vec<Vec<u8>> = (0..values.len()).map(|i| format!("k{i}").into_bytes()).collect();
                let mut reply = Vec::new();
                for (key, value) in keys.iter().zip(&values) {
                    if let Some(value) = value {
                        reply.extend_from_slice(format!("VALUE {} 0 {}\r\n", String::from_utf8_lossy(key), value.len()).as_bytes());
                        reply.extend_from_slice(value);
                        reply.extend_from_slice(b"\r\n");
                    }
                }
                reply.extend_from_slice(b"END\r\n");
                let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                let mut r = &reply[..];
                prop_assert_eq!(parse_get_reply(&mut r, &key_refs, 64).unwrap(), values);
                prop_assert!(r.is_empty());
            }
        }
    }
}

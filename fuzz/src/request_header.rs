//! The `request_header` target: the small parsers on their own, cheap enough for millions of runs.
//! - `RequestHeader::decode` on the first 28 bytes (zero-padded): `Some` exactly when the magic is
//!   right, with every field read big-endian from its place, and `encode` gives the bytes back;
//!   `decode(encode(h)) == h` for a header built from the same bytes;
//! - `handshake::parse_info_request` and `parse_meta_context_request` on the whole input never
//!   panic, and what they accept is well-formed: a name of at most 4096 bytes, and re-encoding the
//!   result gives exactly the input (nothing skipped, nothing left over).

use flashtier_nbd::handshake::{parse_info_request, parse_meta_context_request};
use flashtier_nbd::wire::{self, RequestHeader, REQUEST_MAGIC};

pub fn run(data: &[u8]) {
    let mut raw = [0u8; RequestHeader::LEN];
    let n = data.len().min(RequestHeader::LEN);
    raw[..n].copy_from_slice(&data[..n]);

    let decoded = RequestHeader::decode(&raw);
    assert_eq!(
        decoded.is_some(),
        wire::be32(&raw[0..4]) == REQUEST_MAGIC,
        "decode must accept exactly the request magic"
    );
    if let Some(h) = decoded {
        assert_eq!(h.flags, wire::be16(&raw[4..6]));
        assert_eq!(h.cmd, wire::be16(&raw[6..8]));
        assert_eq!(h.handle, u64::from_be_bytes(raw[8..16].try_into().unwrap()));
        assert_eq!(
            h.offset,
            u64::from_be_bytes(raw[16..24].try_into().unwrap())
        );
        assert_eq!(h.length, wire::be32(&raw[24..28]));
        assert_eq!(h.encode(), raw, "encode(decode(b)) != b");
    }
    // Any header (whatever the magic bytes were) survives encode then decode.
    let h = RequestHeader {
        flags: wire::be16(&raw[4..6]),
        cmd: wire::be16(&raw[6..8]),
        handle: u64::from_be_bytes(raw[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(raw[16..24].try_into().unwrap()),
        length: wire::be32(&raw[24..28]),
    };
    assert_eq!(RequestHeader::decode(&h.encode()), Some(h));

    if let Some((name, items)) = parse_info_request(data) {
        assert!(name.len() <= wire::MAX_STRING);
        let mut again = (name.len() as u32).to_be_bytes().to_vec();
        again.extend_from_slice(name);
        again.extend_from_slice(&(items.len() as u16).to_be_bytes());
        for i in &items {
            again.extend_from_slice(&i.to_be_bytes());
        }
        assert_eq!(
            again, data,
            "parse_info_request accepted something it does not describe exactly"
        );
    }

    if let Some((name, queries)) = parse_meta_context_request(data) {
        assert!(name.len() <= wire::MAX_STRING);
        assert!(queries.iter().all(|q| q.len() <= wire::MAX_STRING));
        let mut again = (name.len() as u32).to_be_bytes().to_vec();
        again.extend_from_slice(name);
        again.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in &queries {
            again.extend_from_slice(&(q.len() as u32).to_be_bytes());
            again.extend_from_slice(q);
        }
        assert_eq!(
            again, data,
            "parse_meta_context_request accepted something it does not describe exactly"
        );
    }
}

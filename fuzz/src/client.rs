//! What a client puts on the wire, for building seeds: handshake options and requests.

use flashtier_nbd::wire::{self, RequestHeader};

/// The client flags sent after the server's greeting.
pub fn client_flags(flags: u32) -> Vec<u8> {
    flags.to_be_bytes().to_vec()
}

/// One option: IHAVEOPT, option code, payload length, payload.
pub fn option(code: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = wire::IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&code.to_be_bytes());
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload);
    b
}

/// INFO/GO payload: name length, name, count of information requests, the requests.
pub fn info_payload(name: &str, items: &[u16]) -> Vec<u8> {
    let mut p = (name.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&(items.len() as u16).to_be_bytes());
    for i in items {
        p.extend_from_slice(&i.to_be_bytes());
    }
    p
}

/// LIST/SET_META_CONTEXT payload: name length, name, count of queries, each length + query.
pub fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut p = (name.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        p.extend_from_slice(&(q.len() as u32).to_be_bytes());
        p.extend_from_slice(q.as_bytes());
    }
    p
}

/// A 28-byte transmission request header.
pub fn request(flags: u16, cmd: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    RequestHeader {
        flags,
        cmd,
        handle,
        offset,
        length,
    }
    .encode()
    .to_vec()
}

/// A WRITE request with its payload.
pub fn write(flags: u16, handle: u64, offset: u64, payload: &[u8]) -> Vec<u8> {
    let mut b = request(
        flags,
        wire::cmd::WRITE,
        handle,
        offset,
        payload.len() as u32,
    );
    b.extend_from_slice(payload);
    b
}

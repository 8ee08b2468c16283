//! What a block looks like in memcached: its key and its value.
//!
//! Key: `ft1:<namespace>:<generation>:<block>` in hex. The namespace is the cache's identity (a
//! hash of the backing store's identity), so two flashtier hosts sharing a pool for different
//! stores never meet; the generation is drawn at random when the tier starts, so nothing stored
//! by an earlier run of this process, which had other versions (see `versions`), can be asked
//! for at all.
//!
//! Value: a 28-byte header, then the block.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `FTM1` |
//! | 4..12 | block number, little-endian |
//! | 12..20 | version tag (`versions::Tag`) |
//! | 20..24 | data length |
//! | 24..28 | CRC32C of bytes 0..24 and the data |
//!
//! [`decode`] checks all of it, so a truncated, corrupted or misplaced value (a server bug, a
//! bit flip in its RAM, a value written under another key) is a miss, never data.

use std::fmt::Write as _;

use crate::versions::Tag;

/// The header's size.
pub const HEADER: usize = 28;
const MAGIC: &[u8; 4] = b"FTM1";

/// The namespace of a cache whose identity is `identity` (e.g. the backing store's identity as
/// text): the ring's stable hash, the same on every host and build.
pub fn namespace_of(identity: &[u8]) -> u64 {
    crate::client::ring::hash(identity)
}

/// The key prefix of one tier instance (namespace and generation).
#[derive(Clone, Debug)]
pub struct KeySpace {
    prefix: String,
    /// CRC32C of `prefix`: where every value's checksum starts.
    seed: u32,
}

impl KeySpace {
    /// The keys of the cache `namespace` in this run, `generation`.
    pub fn new(namespace: u64, generation: u64) -> KeySpace {
        let prefix = format!("ft1:{namespace:016x}:{generation:016x}:");
        KeySpace {
            seed: crc32c::crc32c(prefix.as_bytes()),
            prefix,
        }
    }

    /// The key of `block`, written into `out` (cleared first).
    pub fn key(&self, block: u64, out: &mut String) {
        out.clear();
        out.push_str(&self.prefix);
        let _ = write!(out, "{block:x}");
    }
}

/// `block`'s value in `keys`: header then `data`, in `out` (cleared first).
pub fn encode(keys: &KeySpace, block: u64, tag: Tag, data: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&block.to_le_bytes());
    out.extend_from_slice(&tag.0.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c_append(keys.seed, &out[..24]), data);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(data);
}

/// Why a value was not used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    /// Too short, wrong magic, wrong length or a checksum mismatch.
    #[error("corrupt value")]
    Corrupt,
    /// Intact, but of another block (stored under the wrong key).
    #[error("value of block {0}")]
    OtherBlock(u64),
}

/// The tag and the data of a value fetched for `block` in `keys`, `len` bytes of data expected.
pub fn decode<'v>(
    keys: &KeySpace,
    value: &'v [u8],
    block: u64,
    len: usize,
) -> Result<(Tag, &'v [u8]), BadValue> {
    if value.len() != HEADER + len || &value[..4] != MAGIC {
        return Err(BadValue::Corrupt);
    }
    let u64_at = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().unwrap());
    let stored_len = u32::from_le_bytes(value[20..24].try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(value[24..28].try_into().unwrap());
    let data = &value[HEADER..];
    let computed = crc32c::crc32c_append(crc32c::crc32c_append(keys.seed, &value[..24]), data);
    if stored_len != len || computed != crc {
        return Err(BadValue::Corrupt);
    }
    match u64_at(4) {
        b if b == block => Ok((Tag(u64_at(12)), data)),
        other => Err(BadValue::OtherBlock(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_decodes_to_what_was_encoded() {
        let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let keys = KeySpace::new(1, 2);
        let mut v = Vec::new();
        encode(&keys, 77, Tag(0x1234), &data, &mut v);
        assert_eq!(v.len(), HEADER + 4096);
        assert_eq!(decode(&keys, &v, 77, 4096), Ok((Tag(0x1234), &data[..])));
        assert_eq!(decode(&keys, &v, 78, 4096), Err(BadValue::OtherBlock(77)));
        assert_eq!(decode(&keys, &v, 77, 512), Err(BadValue::Corrupt));
        assert_eq!(decode(&keys, &v[..100], 77, 4096), Err(BadValue::Corrupt));
        // Another generation's or cache's value, answered under this key, does not check.
        let other_start = KeySpace::new(1, 3);
        assert_eq!(decode(&other_start, &v, 77, 4096), Err(BadValue::Corrupt));
        assert_eq!(
            decode(&KeySpace::new(9, 2), &v, 77, 4096),
            Err(BadValue::Corrupt)
        );
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let data = vec![0xa5u8; 64];
        let keys = KeySpace::new(1, 2);
        let mut v = Vec::new();
        encode(&keys, 3, Tag(9), &data, &mut v);
        for bit in 0..v.len() * 8 {
            let mut w = v.clone();
            w[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&keys, &w, 3, 64).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn keys_name_namespace_generation_and_block() {
        let mut k = String::new();
        KeySpace::new(0xabc, 7).key(0x10, &mut k);
        assert_eq!(k, "ft1:0000000000000abc:0000000000000007:10");
        assert!(k.len() <= 250 && !k.contains(' '));
    }
}

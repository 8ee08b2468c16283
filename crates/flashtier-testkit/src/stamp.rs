//! Stamped 4 KiB blocks for verifying workloads: every 8 bytes of a block say which block and
//! which version it is, so a read that returns another block's data, an old version or a torn
//! block is seen at once.

/// The block size the stamps are made for.
pub const BLOCK: usize = 4096;

/// Block `block`'s content at version `v` (below 2^32).
pub fn content(block: u64, v: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(BLOCK);
    while b.len() < BLOCK {
        b.extend_from_slice(&(block << 32 | v).to_le_bytes());
    }
    b
}

/// The version `buf` holds for `block`: 0 for a block never written (all zeros). Panics if it
/// is torn or holds another block's data.
pub fn version_of(buf: &[u8], block: u64) -> u64 {
    if buf.iter().all(|&b| b == 0) {
        return 0;
    }
    let word = u64::from_le_bytes(buf[..8].try_into().unwrap());
    assert!(
        buf.chunks(8).all(|c| c == &word.to_le_bytes()[..]),
        "block {block} is torn"
    );
    assert_eq!(
        word >> 32,
        block,
        "block {block} holds another block's data"
    );
    word & 0xffff_ffff
}

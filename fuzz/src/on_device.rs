//! The `on_device` target: the engine's decoders of the on-device format (ARCHITECTURE.md, "On-device
//! format"), fed bytes a damaged or hostile cache device could hold.
//!
//! Input: one selector byte, then the bytes to decode.
//!
//! | selector bits | meaning |
//! | ------------- | ------- |
//! | 0..=1 | 0: `Superblock::decode` of one 4 KiB copy; 1: `Superblock::choose` of two copies (the first and the next 4 KiB); 2: `BatchHeader::decode` and `decode_prev` of one header block (its own half and the copy of the previous header it carries; at least 4 KiB; longer input is a larger cache block); 3: `Checkpoint::decode_header` of the first 4 KiB, then `Checkpoint::decode_body` of the rest |
//! | 7 | fix the checksums: before decoding, the harness writes the right CRC32C into every checksum field (for a checkpoint, the body's first, over the body length the header claims, as far as the input goes), so mutations get past them to the field checks |
//!
//! Bits 2..=6 are ignored. Short input is zero-padded to the sizes above.
//!
//! Checked, besides "never panics" (which includes arithmetic overflow: cargo-fuzz builds with
//! overflow checks):
//! - a decoded value re-encodes to the same value (`decode(encode(x)) == x`), and, byte for byte,
//!   to the input with only the bytes the format leaves free normalised (reserved fields and
//!   flag bits zeroed, unused space after the identity or the entries zeroed, checksums
//!   recomputed, an older version this build reads set to the one it writes): the decoder read
//!   every field from its place and dropped nothing;
//! - a decoded superblock obeys the geometry rules the decoder promises to enforce (computed
//!   without overflow); a decoded checkpoint header's body length is exactly what its counts
//!   say (without overflow); a decoded checkpoint body has exactly the counted free segments
//!   and entries;
//! - `decode_body` refuses a body only when it is shorter than the header says or its checksum
//!   is wrong;
//! - `choose` gives what its documented rule gives for the two copies' own decodes: an unknown
//!   version in either copy refuses (the first copy's version if both), otherwise the valid copy
//!   with the higher generation (the first on a tie), otherwise an error, `NotACache` only if
//!   neither copy has the magic.

use flashtier_engine::internals::batch::{self, BatchHeader};
use flashtier_engine::internals::checkpoint::{self, Checkpoint};
use flashtier_engine::internals::superblock::{self, Superblock};
use flashtier_engine::internals::{FORMAT_VERSION, META_BLOCK, OLDEST_READABLE_VERSION};
use flashtier_engine::FormatError;

pub const SUPERBLOCK: u8 = 0;
pub const CHOOSE: u8 = 1;
pub const BATCH: u8 = 2;
pub const CHECKPOINT: u8 = 3;
pub const FIX_CRC: u8 = 0x80;

/// Where a run ended: whether the selected decoder accepted the input (for `choose`, whether a
/// copy was chosen), with the error otherwise. The seed generator checks its seeds with this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    Empty,
    Accepted,
    Rejected(String),
}

pub fn run(data: &[u8]) -> Ended {
    let Some((&selector, rest)) = data.split_first() else {
        return Ended::Empty;
    };
    let fix = selector & FIX_CRC != 0;
    match selector & 3 {
        SUPERBLOCK => superblock_one(&padded(rest, superblock::LEN, superblock::LEN), fix),
        CHOOSE => {
            let a = padded(rest, superblock::LEN, superblock::LEN);
            let b = padded(
                rest.get(superblock::LEN..).unwrap_or(&[]),
                superblock::LEN,
                superblock::LEN,
            );
            choose(a, b, fix)
        }
        BATCH => batch_header(padded(rest, batch::HEADER_FIELDS, usize::MAX), fix),
        _ => checkpoint(padded(rest, checkpoint::HEADER_LEN, usize::MAX), fix),
    }
}

/// `b` truncated to `max` bytes and zero-padded to at least `min`.
fn padded(b: &[u8], min: usize, max: usize) -> Vec<u8> {
    let mut v = b[..b.len().min(max)].to_vec();
    if v.len() < min {
        v.resize(min, 0);
    }
    v
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Writes the CRC32C of `b[..at]` at `at`.
fn seal_crc(b: &mut [u8], at: usize) {
    let crc = crc32c::crc32c(&b[..at]);
    b[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

fn rejected(e: impl std::fmt::Display) -> Ended {
    Ended::Rejected(e.to_string())
}

// ---- superblock ----

const SB_CRC_AT: usize = superblock::LEN - 4;
/// Where the backing fingerprint starts (superblock.rs).
const FINGERPRINT_AT: usize = 1152;

fn superblock_one(b: &[u8], fix: bool) -> Ended {
    let mut b = b.to_vec();
    if fix {
        seal_crc(&mut b, SB_CRC_AT);
    }
    match Superblock::decode(&b) {
        Ok(sb) => {
            check_superblock(&b, &sb);
            Ended::Accepted
        }
        Err(e) => rejected(e),
    }
}

/// The checks on a superblock `decode` accepted from `b`.
fn check_superblock(b: &[u8], sb: &Superblock) {
    // The geometry rules decode enforces (superblock.rs, ARCHITECTURE.md), in exact arithmetic.
    let g = &sb.geometry;
    let bs = g.block_size as u128;
    let used = g.data_offset as u128 + g.segment_count as u128 * g.segment_size as u128;
    assert!(
        g.block_size.is_power_of_two()
            && (4096..=65536).contains(&g.block_size)
            && (g.segment_size as u128).is_multiple_of(bs)
            && g.segment_size as u128 >= 16 * bs
            && g.segment_count >= 4
            && g.checkpoint_offset as u128 >= 2 * META_BLOCK as u128
            && g.data_offset as u128
                >= g.checkpoint_offset as u128 + 2 * g.checkpoint_slot_size as u128
            && used <= sb.device_size as u128,
        "decode accepted an impossible geometry: {g:?}, device size {}",
        sb.device_size
    );
    assert!(sb.backing.name.len() <= 1024);
    let fp = &sb.backing.fingerprint;
    assert!(fp.len() <= 64, "decode accepted {} fingerprint fields", fp.len());
    for (i, f) in fp.iter().enumerate() {
        assert!(
            (1..=32).contains(&f.key.len())
                && f.key
                    .bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
                && f.value.len() <= 1024
                && !fp[..i].iter().any(|g| g.key == f.key),
            "decode accepted a bad fingerprint field {f:?}"
        );
    }

    let again = sb.encode().expect("a decoded superblock encodes");
    assert_eq!(
        Superblock::decode(&again).expect("a re-encoded superblock decodes"),
        *sb,
        "superblock: decode(encode(x)) != x"
    );
    // The input with what the format leaves free normalised.
    let mut want = b[..superblock::LEN].to_vec();
    assert!((OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&le32(&want, 8)));
    want[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    let flags = le32(&want, 12) & 1;
    want[12..16].copy_from_slice(&flags.to_le_bytes());
    want[52..56].fill(0);
    want[114..120].fill(0);
    let id_len = le16(&want, 120) as usize;
    want[122 + id_len..FINGERPRINT_AT].fill(0);
    let mut end = FINGERPRINT_AT + 2;
    for _ in 0..le16(&want, FINGERPRINT_AT) {
        end += 4 + want[end + 1] as usize + le16(&want, end + 2) as usize;
    }
    want[end..SB_CRC_AT].fill(0);
    seal_crc(&mut want, SB_CRC_AT);
    assert!(
        again[..] == want[..],
        "superblock: encode(decode(b)) differs from b (normalised) at bytes {:?}",
        diff(&again, &want)
    );
}

fn choose(mut a: Vec<u8>, mut b: Vec<u8>, fix: bool) -> Ended {
    if fix {
        seal_crc(&mut a, SB_CRC_AT);
        seal_crc(&mut b, SB_CRC_AT);
    }
    let da = Superblock::decode(&a);
    let db = Superblock::decode(&b);
    for (copy, d) in [(&a, &da), (&b, &db)] {
        if let Ok(sb) = d {
            check_superblock(copy, sb);
        }
    }
    let got = Superblock::choose(&a, &b);
    let version = |d: &Result<Superblock, FormatError>| match d {
        Err(FormatError::UnsupportedVersion(v)) => Some(*v),
        _ => None,
    };
    if let Some(v) = version(&da).or(version(&db)) {
        assert!(
            matches!(got, Err(FormatError::UnsupportedVersion(w)) if w == v),
            "choose: a copy of version {v} must refuse the device, got {got:?}"
        );
        return rejected(got.unwrap_err());
    }
    match (&da, &db) {
        (Ok(x), Ok(y)) => {
            let want = if y.generation > x.generation { y } else { x };
            assert_eq!(
                got.as_ref().ok(),
                Some(want),
                "choose: not the newest valid copy"
            );
            Ended::Accepted
        }
        (Ok(x), Err(_)) | (Err(_), Ok(x)) => {
            assert_eq!(
                got.as_ref().ok(),
                Some(x),
                "choose: not the only valid copy"
            );
            Ended::Accepted
        }
        (Err(ea), Err(eb)) => {
            let e = got.expect_err("choose: accepted two invalid copies");
            let both_foreign =
                matches!(ea, FormatError::NotACache) && matches!(eb, FormatError::NotACache);
            assert_eq!(
                matches!(e, FormatError::NotACache),
                both_foreign,
                "choose: says NotACache for {ea:?} and {eb:?}: {e:?}"
            );
            assert!(
                e.to_string() == ea.to_string() || e.to_string() == eb.to_string(),
                "choose: error {e:?} is neither copy's ({ea:?}, {eb:?})"
            );
            rejected(e)
        }
    }
}

// ---- batch header ----

const OWN: usize = batch::OWN_LEN;
const BATCH_CRC_AT: usize = OWN - 4;
const ENTRIES_AT: usize = 48;
const ENTRY_LEN: usize = 32;

/// A header block: its own half, and the copy of the previous header it carries, each decoded
/// and checked on its own.
fn batch_header(mut b: Vec<u8>, fix: bool) -> Ended {
    if fix {
        seal_crc(&mut b[..OWN], BATCH_CRC_AT);
        seal_crc(&mut b[OWN..2 * OWN], BATCH_CRC_AT);
    }
    if let Ok(prev) = BatchHeader::decode_prev(&b) {
        check_own(&b[OWN..2 * OWN], &prev);
    }
    let h = match BatchHeader::decode(&b) {
        Ok(h) => h,
        Err(e) => return rejected(format!("{e:?}")),
    };
    check_own(&b[..OWN], &h);
    // The whole block re-encodes with the copy carried as it is, and zeroes after the fields.
    let mut again = vec![0xa5; b.len()];
    h.encode(&b[OWN..2 * OWN], &mut again);
    assert!(again[batch::HEADER_FIELDS..].iter().all(|&x| x == 0));
    assert!(again[OWN..2 * OWN] == b[OWN..2 * OWN], "batch: the copy was not kept");
    Ended::Accepted
}

/// The checks on a header half `b` that decoded to `h`.
fn check_own(b: &[u8], h: &BatchHeader) {
    assert!(h.entries.len() <= batch::MAX_ENTRIES);
    assert!(
        h.kind == batch::HeaderKind::Batch || h.entries.is_empty(),
        "a seal or note with records"
    );
    for e in &h.entries {
        assert!(e.nblocks > 0, "an empty record: {e:?}");
        assert!(
            e.lba.checked_add(e.nblocks as u64).is_some(),
            "a record range that overflows: {e:?}"
        );
    }
    assert!(h.seq_first.checked_add(h.entries.len() as u64).is_some());
    let total: u64 = h.entries.iter().map(|e| e.data_blocks() as u64).sum();
    assert_eq!(
        total,
        le32(b, 28) as u64,
        "the data block count disagrees with the entries"
    );
    let mut again = vec![0xa5; OWN];
    h.encode_own(&mut again);
    assert_eq!(
        BatchHeader::decode_own(&again).expect("a re-encoded batch header decodes"),
        *h,
        "batch: decode(encode(x)) != x"
    );
    let mut want = b[..OWN].to_vec();
    for i in 0..h.entries.len() {
        let at = ENTRIES_AT + i * ENTRY_LEN;
        want[at + 21] &= 1;
        want[at + 28..at + 32].fill(0);
    }
    // A header of no records keeps its ordinal (4 bytes where the first entry would be).
    let kept = if h.entries.is_empty() {
        ENTRIES_AT + 4
    } else {
        ENTRIES_AT + h.entries.len() * ENTRY_LEN
    };
    want[kept..BATCH_CRC_AT].fill(0);
    seal_crc(&mut want, BATCH_CRC_AT);
    assert!(
        again[..] == want[..],
        "batch: encode(decode(b)) differs from b (normalised) at bytes {:?}",
        diff(&again, &want)
    );
}

// ---- checkpoint ----

const CKPT_CRC_AT: usize = checkpoint::HEADER_LEN - 4;

fn checkpoint(mut b: Vec<u8>, fix: bool) -> Ended {
    let hl = checkpoint::HEADER_LEN;
    if fix {
        let claimed = le64(&b, 64);
        let end = (hl as u64).saturating_add(claimed).min(b.len() as u64) as usize;
        let body_crc = crc32c::crc32c(&b[hl..end]);
        b[72..76].copy_from_slice(&body_crc.to_le_bytes());
        seal_crc(&mut b, CKPT_CRC_AT);
    }
    let (head, body) = b.split_at(hl);
    let h = match Checkpoint::decode_header(head) {
        Ok(h) => h,
        Err(e) => return rejected(e),
    };
    assert_eq!(
        h.body_len as u128,
        h.free_count as u128 * 4 + (h.entry_count as u128 + h.lost_count as u128) * 16,
        "checkpoint: the body length disagrees with the counts: {h:?}"
    );
    let c = match Checkpoint::decode_body(&h, body) {
        Ok(c) => c,
        Err(e) => {
            let whole = (body.len() as u64) >= h.body_len;
            assert!(
                !whole || crc32c::crc32c(&body[..h.body_len as usize]) != h.body_crc,
                "checkpoint: decode_body refused a whole body with the right checksum: {e}"
            );
            return rejected(e);
        }
    };
    assert_eq!(
        c.free.len() as u64,
        h.free_count as u64,
        "checkpoint: free list length"
    );
    assert_eq!(
        c.entries.len() as u64,
        h.entry_count,
        "checkpoint: entry count"
    );
    assert_eq!(c.lost.len() as u64, h.lost_count as u64, "checkpoint: lost ranges");
    assert_eq!(
        (c.number, c.next_seq, c.epoch, c.open),
        (h.number, h.next_seq, h.epoch, h.open),
        "checkpoint: the body's checkpoint does not carry the header's fields"
    );

    let again = c.encode();
    let len = hl + h.body_len as usize;
    assert!(again.len() >= len && again[len..].iter().all(|&x| x == 0));
    let h2 = Checkpoint::decode_header(&again).expect("a re-encoded checkpoint header decodes");
    let c2 = Checkpoint::decode_body(&h2, &again[hl..]).expect("a re-encoded checkpoint decodes");
    assert_eq!(c2, c, "checkpoint: decode(encode(x)) != x");

    let mut want = b[..len].to_vec();
    assert!((OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&le32(&want, 8)));
    want[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    want[12..16].fill(0);
    if le32(&want, 40) == u32::MAX {
        want[44..48].fill(0); // no open segment: its block count means nothing
    }
    want[76..CKPT_CRC_AT].fill(0);
    let body_crc = crc32c::crc32c(&want[hl..len]);
    want[72..76].copy_from_slice(&body_crc.to_le_bytes());
    seal_crc(&mut want, CKPT_CRC_AT);
    assert!(
        again[..len] == want[..],
        "checkpoint: encode(decode(b)) differs from b (normalised) at bytes {:?}",
        diff(&again, &want)
    );
    Ended::Accepted
}

/// The first few offsets where `a` and `b` differ, for assertion messages.
fn diff(a: &[u8], b: &[u8]) -> Vec<usize> {
    a.iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .take(8)
        .collect()
}

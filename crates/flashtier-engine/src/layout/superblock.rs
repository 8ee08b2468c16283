//! The superblock: identity, geometry and state of a cache device, kept in two copies.
//!
//! ```text
//! off  len  field
//!   0    8  magic "FLASHTR\0"
//!   8    4  format version
//!  12    4  flags (bit 0: clean shutdown)
//!  16    8  generation (each write increments it; the valid copy with the highest wins)
//!  24   16  uuid of this cache
//!  40    4  block size
//!  44    4  segment size
//!  48    4  segment count
//!  52    4  reserved (0)
//!  56    8  checkpoint offset
//!  64    8  checkpoint slot size
//!  72    8  data offset
//!  80    8  device size at format time
//!  88    8  backing store size
//!  96    8  log epoch (incremented at every open; batches of older epochs end the log)
//! 104    8  format time (seconds since the epoch)
//! 112    1  default mode, 113 1 reclaim policy, 114..120 reserved
//! 120    2  backing store name length, 122.. name (UTF-8, at most 1024 bytes)
//! 1152   2  backing fingerprint field count (at most 64), then from 1154 each field:
//!           flags u8 (bit 0 required) | key length u8 | value length u16 | key | value
//!           (keys: 1..=32 bytes of [a-z0-9_], unique; values: UTF-8, at most 1024 bytes;
//!           every field ends before 4092)
//! 4092   4  CRC32C of bytes 0..4092
//! ```
//!
//! Copies alternate: generation g is written to copy g % 2, so a torn write leaves the previous
//! generation intact in the other copy.

pub use flashtier_io::identity::IdentityField;

use super::{le, readable_version, Corruption, Geometry, Structure, FORMAT_VERSION, META_BLOCK};
use crate::policy::{Mode, ReclaimPolicy};
use crate::FormatError;

/// The first 8 bytes of each superblock copy.
pub const MAGIC: &[u8; 8] = b"FLASHTR\0";
/// Bytes of one superblock copy.
pub const LEN: usize = META_BLOCK as usize;
const MAX_IDENTITY: usize = 1024;
const FLAG_CLEAN: u32 = 1;
const FINGERPRINT_AT: usize = 1152;
const MAX_FIELDS: usize = 64;
const MAX_KEY: usize = 32;
const FIELD_REQUIRED: u8 = 1;

/// What identifies the backing store a cache belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingIdentity {
    /// Its size in bytes.
    pub size: u64,
    /// Canonical path or NBD URI, as given to `format`: for people. It identifies the backing
    /// store only when the fingerprint has no required field.
    pub name: String,
    /// Facts that tell this backing store from others (`flashtier_io::identity`: inode and
    /// birth time of a file, WWN or serial of a disk, server and export of NBD).
    pub fingerprint: Vec<IdentityField>,
}

/// One way a backing store differs from the one a cache belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDiff {
    /// Which fact (a fingerprint key, or the size).
    pub key: String,
    /// What the cache recorded, if it did.
    pub expected: Option<String>,
    /// What the backing store says now, if it tells.
    pub found: Option<String>,
}

impl std::fmt::Display for FieldDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(unknown)".into());
        write!(
            f,
            "{}: expected {}, found {}",
            self.key,
            show(&self.expected),
            show(&self.found)
        )
    }
}

/// How a backing store compares with the one a cache belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityCheck {
    /// Required facts that differ: another backing store.
    pub mismatches: Vec<FieldDiff>,
    /// Facts that changed without making it another backing store (a path, a device number).
    pub changes: Vec<FieldDiff>,
}

impl BackingIdentity {
    /// Compares `found` (what is there now) with this identity (the cache's). The size and every
    /// required field must match; a required field `found` cannot tell (a birth time the
    /// filesystem no longer reports) is a mismatch too. Without any required field, the name
    /// must match.
    pub fn check(&self, found: &BackingIdentity) -> IdentityCheck {
        let mut out = IdentityCheck::default();
        if self.size != found.size {
            out.mismatches.push(FieldDiff {
                key: "size".into(),
                expected: Some(self.size.to_string()),
                found: Some(found.size.to_string()),
            });
        }
        let value = |key: &str| {
            found
                .fingerprint
                .iter()
                .find(|f| f.key == key)
                .map(|f| f.value.clone())
        };
        for f in &self.fingerprint {
            let now = value(&f.key);
            if now.as_deref() == Some(f.value.as_str()) {
                continue;
            }
            let diff = FieldDiff {
                key: f.key.clone(),
                expected: Some(f.value.clone()),
                found: now,
            };
            if f.required {
                out.mismatches.push(diff);
            } else {
                out.changes.push(diff);
            }
        }
        if self.name != found.name {
            let diff = FieldDiff {
                key: "name".into(),
                expected: Some(self.name.clone()),
                found: Some(found.name.clone()),
            };
            if self.fingerprint.iter().any(|f| f.required) {
                out.changes.push(diff);
            } else {
                out.mismatches.push(diff);
            }
        }
        out
    }
}

fn encode_fingerprint(fields: &[IdentityField], b: &mut [u8; LEN]) -> Result<(), FormatError> {
    let bad = |why: String| Err(FormatError::Invalid(format!("backing fingerprint: {why}")));
    if fields.len() > MAX_FIELDS {
        return bad(format!("more than {MAX_FIELDS} fields"));
    }
    le::put_u16(b, FINGERPRINT_AT, fields.len() as u16);
    let mut at = FINGERPRINT_AT + 2;
    for (i, f) in fields.iter().enumerate() {
        let (k, v) = (f.key.as_bytes(), f.value.as_bytes());
        if !valid_key(k) || fields[..i].iter().any(|g| g.key == f.key) {
            return bad(format!("bad or repeated key '{}'", f.key));
        }
        if v.len() > MAX_IDENTITY {
            return bad(format!("value of '{}' is too long", f.key));
        }
        let end = at + 4 + k.len() + v.len();
        if end > LEN - 4 {
            return bad("does not fit the superblock".into());
        }
        b[at] = if f.required { FIELD_REQUIRED } else { 0 };
        b[at + 1] = k.len() as u8;
        le::put_u16(b, at + 2, v.len() as u16);
        b[at + 4..at + 4 + k.len()].copy_from_slice(k);
        b[at + 4 + k.len()..end].copy_from_slice(v);
        at = end;
    }
    Ok(())
}

fn valid_key(k: &[u8]) -> bool {
    (1..=MAX_KEY).contains(&k.len())
        && k.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

fn decode_fingerprint(b: &[u8]) -> Result<Vec<IdentityField>, FormatError> {
    let bad = |why| Err(FormatError::Corrupt(Corruption::Fingerprint(why)));
    let count = le::u16(b, FINGERPRINT_AT) as usize;
    if count > MAX_FIELDS {
        return bad("too many fields");
    }
    let mut fields: Vec<IdentityField> = Vec::with_capacity(count);
    let mut at = FINGERPRINT_AT + 2;
    for _ in 0..count {
        if at + 4 > LEN - 4 {
            return bad("truncated");
        }
        let flags = b[at];
        let (klen, vlen) = (b[at + 1] as usize, le::u16(b, at + 2) as usize);
        let end = at + 4 + klen + vlen;
        if flags & !FIELD_REQUIRED != 0 || vlen > MAX_IDENTITY || end > LEN - 4 {
            return bad("malformed field");
        }
        let key = &b[at + 4..at + 4 + klen];
        if !valid_key(key) {
            return bad("bad key");
        }
        let key = String::from_utf8(key.to_vec()).expect("ASCII");
        if fields.iter().any(|f| f.key == key) {
            return bad("repeated key");
        }
        let Ok(value) = std::str::from_utf8(&b[at + 4 + klen..end]) else {
            return bad("value is not UTF-8");
        };
        fields.push(IdentityField {
            key,
            value: value.to_string(),
            required: flags & FIELD_REQUIRED != 0,
        });
        at = end;
    }
    Ok(fields)
}

/// The cache's identity and geometry, kept in two alternating copies at the start of the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Each write increments it; the valid copy with the highest wins.
    pub generation: u64,
    /// Identifies this cache (and, by its first 8 bytes, its log).
    pub uuid: [u8; 16],
    /// Where things are on the device.
    pub geometry: Geometry,
    /// Size of the cache device it was formatted for, in bytes.
    pub device_size: u64,
    /// The backing store the cache belongs to.
    pub backing: BackingIdentity,
    /// Log epoch, incremented at every open: batches of older epochs end the log.
    pub epoch: u64,
    /// Format time, in seconds since the Unix epoch.
    pub created: u64,
    /// The mode the cache opens in unless told otherwise.
    pub default_mode: Mode,
    /// Which segment reclaim empties first.
    pub reclaim: ReclaimPolicy,
    /// The cache was closed cleanly: nothing to replay past the last checkpoint.
    pub clean_shutdown: bool,
}

impl Superblock {
    /// The on-device bytes of one copy (checksummed); fails if the identity does not fit.
    pub fn encode(&self) -> Result<[u8; LEN], FormatError> {
        let id = self.backing.name.as_bytes();
        if id.len() > MAX_IDENTITY {
            return Err(FormatError::Invalid(format!(
                "backing store name is longer than {MAX_IDENTITY} bytes"
            )));
        }
        let g = &self.geometry;
        let mut b = [0u8; LEN];
        b[0..8].copy_from_slice(MAGIC);
        le::put_u32(&mut b, 8, FORMAT_VERSION);
        le::put_u32(&mut b, 12, if self.clean_shutdown { FLAG_CLEAN } else { 0 });
        le::put_u64(&mut b, 16, self.generation);
        b[24..40].copy_from_slice(&self.uuid);
        le::put_u32(&mut b, 40, g.block_size);
        le::put_u32(&mut b, 44, g.segment_size);
        le::put_u32(&mut b, 48, g.segment_count);
        le::put_u64(&mut b, 56, g.checkpoint_offset);
        le::put_u64(&mut b, 64, g.checkpoint_slot_size);
        le::put_u64(&mut b, 72, g.data_offset);
        le::put_u64(&mut b, 80, self.device_size);
        le::put_u64(&mut b, 88, self.backing.size);
        le::put_u64(&mut b, 96, self.epoch);
        le::put_u64(&mut b, 104, self.created);
        b[112] = self.default_mode as u8;
        b[113] = self.reclaim as u8;
        le::put_u16(&mut b, 120, id.len() as u16);
        b[122..122 + id.len()].copy_from_slice(id);
        encode_fingerprint(&self.backing.fingerprint, &mut b)?;
        let crc = crc32c::crc32c(&b[..LEN - 4]);
        le::put_u32(&mut b, LEN - 4, crc);
        Ok(b)
    }

    /// Checks and decodes one copy.
    pub fn decode(b: &[u8]) -> Result<Superblock, FormatError> {
        if b.len() < LEN {
            return Err(FormatError::Corrupt(Corruption::Truncated(
                Structure::Superblock,
            )));
        }
        if &b[0..8] != MAGIC {
            return Err(FormatError::NotACache);
        }
        let version = le::u32(b, 8);
        let crc_ok = crc32c::crc32c(&b[..LEN - 4]) == le::u32(b, LEN - 4);
        // Every version keeps the magic, the version here and this checksum at the end: a copy
        // naming another version is believed only if it checks out. Otherwise it is a damaged
        // copy (a flipped byte in the version field refused the whole device, found by the
        // corruption campaign), and the other copy is used.
        if !readable_version(version) && crc_ok {
            return Err(FormatError::UnsupportedVersion(version));
        }
        if !crc_ok {
            return Err(FormatError::Corrupt(Corruption::Checksum(
                Structure::Superblock,
            )));
        }
        let id_len = le::u16(b, 120) as usize;
        if id_len > MAX_IDENTITY {
            return Err(FormatError::Corrupt(Corruption::IdentityTooLong));
        }
        let name = std::str::from_utf8(&b[122..122 + id_len])
            .map_err(|_| FormatError::Corrupt(Corruption::IdentityNotUtf8))?
            .to_string();
        let fingerprint = decode_fingerprint(b)?;
        let geometry = Geometry {
            block_size: le::u32(b, 40),
            segment_size: le::u32(b, 44),
            segment_count: le::u32(b, 48),
            checkpoint_offset: le::u64(b, 56),
            checkpoint_slot_size: le::u64(b, 64),
            data_offset: le::u64(b, 72),
        };
        let device_size = le::u64(b, 80);
        // A checksummed superblock with an impossible geometry was written by a buggy or hostile
        // tool: refuse it rather than index out of bounds later.
        let sane = geometry.block_size.is_power_of_two()
            && (4096..=65536).contains(&geometry.block_size)
            && geometry.segment_size.is_multiple_of(geometry.block_size)
            && geometry.segment_size >= 16 * geometry.block_size
            && geometry.segment_count >= 4
            && geometry.checkpoint_offset >= 2 * META_BLOCK
            && geometry
                .checkpoint_slot_size
                .checked_mul(2)
                .and_then(|slots| geometry.checkpoint_offset.checked_add(slots))
                .is_some_and(|end| geometry.data_offset >= end)
            && geometry
                .checked_used_size()
                .is_some_and(|used| used <= device_size);
        if !sane {
            return Err(FormatError::Corrupt(Corruption::Geometry(geometry)));
        }
        Ok(Superblock {
            generation: le::u64(b, 16),
            uuid: b[24..40].try_into().expect("16 bytes"),
            geometry,
            device_size,
            backing: BackingIdentity {
                size: le::u64(b, 88),
                name,
                fingerprint,
            },
            epoch: le::u64(b, 96),
            created: le::u64(b, 104),
            default_mode: Mode::from_u8(b[112])
                .ok_or(FormatError::Corrupt(Corruption::UnknownMode(b[112])))?,
            reclaim: ReclaimPolicy::from_u8(b[113]).ok_or(FormatError::Corrupt(
                Corruption::UnknownReclaimPolicy(b[113]),
            ))?,
            clean_shutdown: le::u32(b, 12) & FLAG_CLEAN != 0,
        })
    }

    /// Which copy (0 or 1) this generation is written to.
    pub fn copy_index(&self) -> u64 {
        self.generation % 2
    }

    /// Picks the newest valid of the two copies. A copy of an unknown version refuses the device
    /// even if the other copy is fine: a newer flashtier wrote it, and opening the older copy
    /// would write over what it knows nothing about. If neither decodes, the more telling error
    /// wins (an unknown version says more than a checksum mismatch).
    pub fn choose(a: &[u8], b: &[u8]) -> Result<Superblock, FormatError> {
        match (Superblock::decode(a), Superblock::decode(b)) {
            (Err(e @ FormatError::UnsupportedVersion(_)), _)
            | (_, Err(e @ FormatError::UnsupportedVersion(_))) => Err(e),
            (Ok(x), Ok(y)) => Ok(if y.generation > x.generation { y } else { x }),
            (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
            (Err(e1), Err(e2)) => Err(match (&e1, &e2) {
                (FormatError::UnsupportedVersion(_), _) => e1,
                (_, FormatError::UnsupportedVersion(_)) => e2,
                (FormatError::NotACache, FormatError::NotACache) => e1,
                (FormatError::NotACache, _) => e2,
                _ => e1,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: geometry fields whose sums wrap around to something that looks sane.
    #[test]
    fn geometry_that_overflows_is_corrupt() {
        let good = sample().encode().unwrap();
        let patch = |at: usize, value: u64| {
            let mut b = good;
            le::put_u64(&mut b, at, value);
            let crc = crc32c::crc32c(&b[..LEN - 4]);
            le::put_u32(&mut b, LEN - 4, crc);
            b
        };
        for (what, b) in [
            ("checkpoint slot size", patch(64, 1 << 63)),
            ("checkpoint offset", patch(56, u64::MAX - 4096)),
            ("data offset", patch(72, u64::MAX - (15 << 20))),
        ] {
            assert!(
                matches!(Superblock::decode(&b), Err(FormatError::Corrupt(_))),
                "{what}"
            );
        }
    }

    pub(crate) fn sample() -> Superblock {
        Superblock {
            generation: 7,
            uuid: [9; 16],
            // Literal, not computed: the layout test below spells these bytes out.
            geometry: Geometry {
                block_size: 4096,
                segment_size: 1 << 20,
                segment_count: 253,
                checkpoint_offset: 8192,
                checkpoint_slot_size: 1_044_480,
                data_offset: 2_097_152,
            },
            device_size: 256 << 20,
            backing: BackingIdentity {
                size: 1 << 30,
                name: "/var/lib/backing.img".into(),
                fingerprint: vec![
                    IdentityField::required("kind", "file"),
                    IdentityField::required("ino", "42"),
                    IdentityField::info("dev", "8:1"),
                ],
            },
            epoch: 3,
            created: 1_790_000_000,
            default_mode: Mode::WriteBack,
            reclaim: ReclaimPolicy::Lru,
            clean_shutdown: true,
        }
    }

    #[test]
    fn roundtrip() {
        let sb = sample();
        let bytes = sb.encode().unwrap();
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
    }

    /// Version-2 superblock bytes laid out by hand, field by field, must decode to `sample()`
    /// and `sample()` must encode to exactly them: a change to the format that breaks this
    /// needs a new FORMAT_VERSION.
    #[test]
    fn decodes_the_version_2_layout() {
        let mut b = [0u8; LEN];
        let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, b"FLASHTR\0");
        put(8, &2u32.to_le_bytes());
        put(12, &1u32.to_le_bytes()); // clean
        put(16, &7u64.to_le_bytes()); // generation
        put(24, &[9; 16]); // uuid
        put(40, &4096u32.to_le_bytes());
        put(44, &(1u32 << 20).to_le_bytes());
        put(48, &253u32.to_le_bytes()); // segments
        put(56, &8192u64.to_le_bytes()); // checkpoint offset
        put(64, &1_044_480u64.to_le_bytes()); // checkpoint slot size
        put(72, &2_097_152u64.to_le_bytes()); // data offset
        put(80, &(256u64 << 20).to_le_bytes()); // device size
        put(88, &(1u64 << 30).to_le_bytes()); // backing size
        put(96, &3u64.to_le_bytes()); // epoch
        put(104, &1_790_000_000u64.to_le_bytes()); // created
        put(112, &[1, 2]); // write-back, lru
        put(120, &20u16.to_le_bytes());
        put(122, b"/var/lib/backing.img");
        put(1152, &3u16.to_le_bytes()); // fingerprint fields
        put(1154, &[1, 4, 4, 0]);
        put(1158, b"kindfile");
        put(1166, &[1, 3, 2, 0]);
        put(1170, b"ino42");
        put(1175, &[0, 3, 3, 0]);
        put(1179, b"dev8:1");
        let crc = crc32c::crc32c(&b[..4092]);
        b[4092..].copy_from_slice(&crc.to_le_bytes());
        let expected = sample();
        assert_eq!(Superblock::decode(&b).unwrap(), expected);
        // Written back as version 3, the layout otherwise the same (see `FORMAT_VERSION`).
        assert_eq!(expected.encode().unwrap(), with_version(&b, 3));
    }

    fn with_fingerprint(bytes: &[u8], at: usize, patch: &[u8]) -> Result<Superblock, FormatError> {
        let mut b: [u8; LEN] = bytes.try_into().unwrap();
        b[at..at + patch.len()].copy_from_slice(patch);
        let crc = crc32c::crc32c(&b[..LEN - 4]);
        le::put_u32(&mut b, LEN - 4, crc);
        Superblock::decode(&b)
    }

    #[test]
    fn malformed_fingerprints_are_corrupt_and_unencodable_ones_refused() {
        let good = sample().encode().unwrap();
        for (what, at, patch) in [
            ("too many fields", 1152, &65u16.to_le_bytes()[..]),
            ("more fields than bytes", 1152, &64u16.to_le_bytes()[..]),
            ("unknown flag", 1154, &[3][..]),
            ("empty key", 1155, &[0][..]),
            ("upper-case key", 1158, b"K"),
            ("repeated key", 1179, b"ino"),
            ("value past the end", 1156, &0xfff0u16.to_le_bytes()[..]),
            ("value not UTF-8", 1162, &[0xff][..]),
        ] {
            assert!(
                matches!(
                    with_fingerprint(&good, at, patch),
                    Err(FormatError::Corrupt(_))
                ),
                "{what}"
            );
        }
        let mut sb = sample();
        sb.backing.fingerprint.push(IdentityField::info("ino", "1"));
        assert!(sb.encode().is_err(), "repeated key encoded");
        let mut sb = sample();
        sb.backing.fingerprint = (0..40)
            .map(|i| IdentityField::info(&format!("k{i}"), "x".repeat(100)))
            .collect();
        assert!(sb.encode().is_err(), "oversized fingerprint encoded");
    }

    fn ident(fields: &[(&str, &str, bool)]) -> BackingIdentity {
        BackingIdentity {
            size: 1 << 30,
            name: "/b.img".into(),
            fingerprint: fields
                .iter()
                .map(|&(k, v, required)| IdentityField {
                    key: k.into(),
                    value: v.into(),
                    required,
                })
                .collect(),
        }
    }

    #[test]
    fn identity_check_names_each_required_difference_and_notes_the_rest() {
        let cache = ident(&[
            ("kind", "file", true),
            ("ino", "12", true),
            ("btime", "1.5", true),
            ("dev", "8:1", false),
        ]);
        assert_eq!(cache.check(&cache), IdentityCheck::default());
        // Renamed, and the device number changed after a reboot: the same file.
        let mut moved = ident(&[
            ("kind", "file", true),
            ("ino", "12", true),
            ("btime", "1.5", true),
            ("dev", "0:44", false),
        ]);
        moved.name = "/elsewhere.img".into();
        let c = cache.check(&moved);
        assert!(c.mismatches.is_empty(), "{c:?}");
        assert_eq!(c.changes.len(), 2);
        // Another file at the same path, same size: the inode number may even be reused.
        let mut other = ident(&[
            ("kind", "file", true),
            ("ino", "12", true),
            ("btime", "9.1", true),
        ]);
        other.size = 1 << 30;
        let c = cache.check(&other);
        assert_eq!(
            c.mismatches,
            vec![FieldDiff {
                key: "btime".into(),
                expected: Some("1.5".into()),
                found: Some("9.1".into()),
            }]
        );
        assert_eq!(
            c.mismatches[0].to_string(),
            "btime: expected 1.5, found 9.1"
        );
        // A fact that cannot be told now is not taken as a match; nor is another size.
        let mut unknown = ident(&[("kind", "file", true), ("ino", "12", true)]);
        unknown.size = 4096;
        let keys: Vec<_> = cache
            .check(&unknown)
            .mismatches
            .into_iter()
            .map(|d| d.key)
            .collect();
        assert_eq!(keys, ["size", "btime"]);
        // Without a fingerprint, the name is what identifies.
        let (a, mut b) = (ident(&[]), ident(&[]));
        b.name = "/other".into();
        assert_eq!(a.check(&b).mismatches[0].key, "name");
    }

    #[test]
    fn refuses_damage_foreign_data_and_other_versions() {
        let good = sample().encode().unwrap();
        let mut flipped = good;
        flipped[200] ^= 1;
        assert!(matches!(
            Superblock::decode(&flipped),
            Err(FormatError::Corrupt(_))
        ));
        assert!(matches!(
            Superblock::decode(&[0u8; LEN]),
            Err(FormatError::NotACache)
        ));
        // Version 2 (before FREE records) is read as it is.
        let v2 = with_version(&good, 2);
        assert_eq!(Superblock::decode(&v2).unwrap(), sample());
        for old_or_new in [1u32, FORMAT_VERSION + 1] {
            let other = with_version(&good, old_or_new);
            assert!(matches!(
                Superblock::decode(&other),
                Err(FormatError::UnsupportedVersion(v)) if v == old_or_new
            ));
            // The same bytes without a matching checksum: a damaged copy.
            let mut damaged = good;
            damaged[8..12].copy_from_slice(&old_or_new.to_le_bytes());
            assert!(matches!(
                Superblock::decode(&damaged),
                Err(FormatError::Corrupt(_))
            ));
        }
        // Consistent checksum, impossible geometry.
        let mut bad = sample();
        bad.geometry.segment_count = 1 << 30;
        let bytes = bad.encode().unwrap();
        assert!(matches!(
            Superblock::decode(&bytes),
            Err(FormatError::Corrupt(_))
        ));
    }

    #[test]
    fn choose_prefers_the_newest_valid_copy() {
        let mut old = sample();
        old.generation = 4;
        let mut new = sample();
        new.generation = 5;
        new.clean_shutdown = false;
        let (a, b) = (old.encode().unwrap(), new.encode().unwrap());
        assert_eq!(Superblock::choose(&a, &b).unwrap(), new);
        let mut torn = b;
        torn[3000] ^= 0xff;
        assert_eq!(Superblock::choose(&a, &torn).unwrap(), old);
        let v9 = with_version(&a, 9);
        assert!(matches!(
            Superblock::choose(&v9, &[0u8; LEN]),
            Err(FormatError::UnsupportedVersion(9))
        ));
    }

    #[test]
    fn one_copy_of_an_unknown_version_refuses_the_device() {
        let mut newer = sample();
        newer.generation = 8;
        let unknown = FORMAT_VERSION + 1;
        let newer = with_version(&newer.encode().unwrap(), unknown);
        let ours = sample().encode().unwrap();
        for (a, b) in [(&newer, &ours), (&ours, &newer)] {
            assert!(matches!(
                Superblock::choose(a, b),
                Err(FormatError::UnsupportedVersion(v)) if v == unknown
            ));
        }
        // A version field damaged in one copy (checksum wrong) is not another version.
        let mut flipped = ours;
        flipped[9] ^= 0x40;
        assert_eq!(Superblock::choose(&flipped, &ours).unwrap(), sample());
    }

    /// `b` as another version would write it (the checksum matches).
    fn with_version(b: &[u8; LEN], version: u32) -> [u8; LEN] {
        let mut out = *b;
        out[8..12].copy_from_slice(&version.to_le_bytes());
        let crc = crc32c::crc32c(&out[..LEN - 4]);
        le::put_u32(&mut out, LEN - 4, crc);
        out
    }
}

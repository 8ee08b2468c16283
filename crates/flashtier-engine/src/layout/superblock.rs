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
//! 120    2  backing identity length, 122.. identity (UTF-8, at most 1024 bytes)
//! 4092   4  CRC32C of bytes 0..4092
//! ```
//!
//! Copies alternate: generation g is written to copy g % 2, so a torn write leaves the previous
//! generation intact in the other copy.

use super::{le, Geometry, FORMAT_VERSION, META_BLOCK};
use crate::policy::{Mode, ReclaimPolicy};
use crate::FormatError;

pub const MAGIC: &[u8; 8] = b"FLASHTR\0";
pub const LEN: usize = META_BLOCK as usize;
const MAX_IDENTITY: usize = 1024;
const FLAG_CLEAN: u32 = 1;

/// What identifies the backing store a cache belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingIdentity {
    pub size: u64,
    /// Canonical path or NBD URI, as given to `format`.
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub generation: u64,
    pub uuid: [u8; 16],
    pub geometry: Geometry,
    pub device_size: u64,
    pub backing: BackingIdentity,
    pub epoch: u64,
    pub created: u64,
    pub default_mode: Mode,
    pub reclaim: ReclaimPolicy,
    pub clean_shutdown: bool,
}

impl Superblock {
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
        let crc = crc32c::crc32c(&b[..LEN - 4]);
        le::put_u32(&mut b, LEN - 4, crc);
        Ok(b)
    }

    pub fn decode(b: &[u8]) -> Result<Superblock, FormatError> {
        if b.len() < LEN {
            return Err(FormatError::Corrupt("superblock is truncated".into()));
        }
        if &b[0..8] != MAGIC {
            return Err(FormatError::NotACache);
        }
        let version = le::u32(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        if crc32c::crc32c(&b[..LEN - 4]) != le::u32(b, LEN - 4) {
            return Err(FormatError::Corrupt("superblock checksum mismatch".into()));
        }
        let id_len = le::u16(b, 120) as usize;
        if id_len > MAX_IDENTITY {
            return Err(FormatError::Corrupt("backing identity too long".into()));
        }
        let name = std::str::from_utf8(&b[122..122 + id_len])
            .map_err(|_| FormatError::Corrupt("backing identity is not UTF-8".into()))?
            .to_string();
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
            return Err(FormatError::Corrupt(format!(
                "superblock geometry is inconsistent: {geometry:?}"
            )));
        }
        Ok(Superblock {
            generation: le::u64(b, 16),
            uuid: b[24..40].try_into().expect("16 bytes"),
            geometry,
            device_size,
            backing: BackingIdentity {
                size: le::u64(b, 88),
                name,
            },
            epoch: le::u64(b, 96),
            created: le::u64(b, 104),
            default_mode: Mode::from_u8(b[112])
                .ok_or_else(|| FormatError::Corrupt(format!("unknown mode {}", b[112])))?,
            reclaim: ReclaimPolicy::from_u8(b[113]).ok_or_else(|| {
                FormatError::Corrupt(format!("unknown reclaim policy {}", b[113]))
            })?,
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
            geometry: Geometry::compute(256 << 20, 4096, 1 << 20).unwrap(),
            device_size: 256 << 20,
            backing: BackingIdentity {
                size: 1 << 30,
                name: "/var/lib/backing.img".into(),
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

    /// The committed bytes of a version-1 superblock must keep decoding: a change to the format
    /// that breaks this needs a new FORMAT_VERSION.
    #[test]
    fn decodes_the_version_1_layout() {
        let bytes = sample().encode().unwrap();
        assert_eq!(&bytes[0..8], b"FLASHTR\0");
        assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
        assert_eq!(&bytes[12..16], &1u32.to_le_bytes(), "clean flag");
        assert_eq!(&bytes[16..24], &7u64.to_le_bytes(), "generation");
        assert_eq!(&bytes[40..44], &4096u32.to_le_bytes(), "block size");
        assert_eq!(&bytes[44..48], &(1u32 << 20).to_le_bytes(), "segment size");
        assert_eq!(&bytes[88..96], &(1u64 << 30).to_le_bytes(), "backing size");
        assert_eq!(&bytes[96..104], &3u64.to_le_bytes(), "epoch");
        assert_eq!(bytes[112], Mode::WriteBack as u8);
        assert_eq!(&bytes[120..122], &20u16.to_le_bytes());
        assert_eq!(&bytes[122..142], b"/var/lib/backing.img");
        assert_eq!(
            &bytes[4092..4096],
            &crc32c::crc32c(&bytes[..4092]).to_le_bytes()
        );
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
        let mut v3 = good;
        v3[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert!(matches!(
            Superblock::decode(&v3),
            Err(FormatError::UnsupportedVersion(3))
        ));
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
        let mut v9 = a;
        v9[8] = 9;
        assert!(matches!(
            Superblock::choose(&v9, &[0u8; LEN]),
            Err(FormatError::UnsupportedVersion(9))
        ));
    }

    #[test]
    fn one_copy_of_an_unknown_version_refuses_the_device() {
        let mut newer = sample();
        newer.generation = 8;
        let mut v3 = newer.encode().unwrap();
        v3[8] = 3;
        let v2 = sample().encode().unwrap();
        for (a, b) in [(&v3, &v2), (&v2, &v3)] {
            assert!(matches!(
                Superblock::choose(a, b),
                Err(FormatError::UnsupportedVersion(3))
            ));
        }
    }
}

//! NBD wire format: magic numbers, flag bits, option/command codes and the fixed-size headers.
//!
//! Names and values follow the NBD protocol specification (NetworkBlockDevice/nbd
//! `doc/proto.md`). Everything on the wire is big-endian.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server) and client flags.
pub mod handshake {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
    pub const C_FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const C_NO_ZEROES: u32 = 1 << 1;
}

/// Transmission flags.
pub mod tflag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option codes (client → server during the handshake).
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERR | 1;
    pub const ERR_POLICY: u32 = ERR | 2;
    pub const ERR_INVALID: u32 = ERR | 3;
    pub const ERR_PLATFORM: u32 = ERR | 4;
    pub const ERR_TLS_REQD: u32 = ERR | 5;
    pub const ERR_UNKNOWN: u32 = ERR | 6;
    pub const ERR_SHUTDOWN: u32 = ERR | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR | 8;
    pub const ERR_TOO_BIG: u32 = ERR | 9;

    pub const fn is_error(reply: u32) -> bool {
        reply & ERR != 0
    }
}

/// Information items of `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;

    pub fn name(cmd: u16) -> &'static str {
        match cmd {
            READ => "READ",
            WRITE => "WRITE",
            DISC => "DISC",
            FLUSH => "FLUSH",
            TRIM => "TRIM",
            CACHE => "CACHE",
            WRITE_ZEROES => "WRITE_ZEROES",
            BLOCK_STATUS => "BLOCK_STATUS",
            _ => "unknown",
        }
    }
}

/// Command flags.
pub mod cmd_flag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types and flags.
pub mod reply {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const TYPE_NONE: u16 = 0;
    pub const TYPE_OFFSET_DATA: u16 = 1;
    pub const TYPE_OFFSET_HOLE: u16 = 2;
    pub const TYPE_BLOCK_STATUS: u16 = 5;
    pub const TYPE_ERROR: u16 = (1 << 15) | 1;
    pub const TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

    pub const fn is_error(ty: u16) -> bool {
        ty & (1 << 15) != 0
    }
}

/// `base:allocation` status flags.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// Error values of replies. The spec defines these numbers; they happen to match Linux errno.
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const ENOMEM: u32 = 12;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;
}

pub const BASE_ALLOCATION: &str = "base:allocation";

/// Longest string (export name, query, message) the spec allows.
pub const MAX_STRING: usize = 4096;

/// A transmission-phase request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub cmd: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub const LEN: usize = 28;

    /// Decodes a header; `None` when the magic is wrong (the stream is out of sync and the
    /// connection must be dropped).
    pub fn decode(b: &[u8; Self::LEN]) -> Option<Self> {
        if be32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(RequestHeader {
            flags: be16(&b[4..6]),
            cmd: be16(&b[6..8]),
            handle: be64(&b[8..16]),
            offset: be64(&b[16..24]),
            length: be32(&b[24..28]),
        })
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.cmd.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_HEADER_LEN: usize = 20;

pub fn simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

pub fn structured_header(
    flags: u16,
    ty: u16,
    handle: u64,
    length: u32,
) -> [u8; STRUCTURED_HEADER_LEN] {
    let mut b = [0u8; STRUCTURED_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&ty.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_roundtrip() {
        let h = RequestHeader {
            flags: cmd_flag::FUA,
            cmd: cmd::WRITE,
            handle: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            length: 65536,
        };
        let bytes = h.encode();
        assert_eq!(&bytes[..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(RequestHeader::decode(&bytes), Some(h));
        let mut bad = bytes;
        bad[0] ^= 1;
        assert_eq!(RequestHeader::decode(&bad), None);
    }

    #[test]
    fn magic_values_spell_their_names() {
        assert_eq!(&NBDMAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    }

    #[test]
    fn error_bits() {
        assert!(rep::is_error(rep::ERR_UNSUP));
        assert!(!rep::is_error(rep::ACK));
        assert_eq!(rep::ERR_UNSUP, 0x8000_0001);
        assert!(reply::is_error(reply::TYPE_ERROR));
        assert_eq!(reply::TYPE_ERROR, 32769);
    }
}

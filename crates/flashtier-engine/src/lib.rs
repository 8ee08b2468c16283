//! # flashtier-engine: the persistent SSD cache
//!
//! (Design essay: written with the engine; see ARCHITECTURE.md meanwhile.)

pub mod index;
pub mod layout;
pub mod policy;

/// Errors reading or writing the on-device format.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("not a flashtier cache (no flashtier superblock)")]
    NotACache,
    #[error("cache format version {0} is not supported by this flashtier (it reads version {v})", v = layout::FORMAT_VERSION)]
    UnsupportedVersion(u32),
    #[error("cache metadata is damaged: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Invalid(String),
}

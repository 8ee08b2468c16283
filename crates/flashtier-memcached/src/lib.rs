//! The remote memory tier: clean blocks kept in a pool of memcached servers (WaffleGrid's idea,
//! below any database rather than inside InnoDB).
//!
//! - [`client`]: the pool: servers placed on a consistent-hash ring, pipelined multi-gets,
//!   per-request deadlines, health with backoff, per-server statistics.
//! - [`tier`]: [`MemcachedTier`], a [`flashtier_io::BlockDev`] in front of the backing store
//!   that answers reads from the pool when it can prove the value is the newest data.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use flashtier_io::versions;

pub mod client;
pub mod tier;
pub mod value;

pub use client::{Pool, PoolOptions};
pub use tier::{MemcachedMode, MemcachedTier, TierStats};

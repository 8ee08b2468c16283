//! The RAM tier: the hottest clean blocks in process memory, in front of the SSD tier (or of
//! the memcached tier and the backing store when there is no SSD tier).
//!
//! - [`store`]: a fixed number of 4 KiB slots in shards, each shard an LRU or FIFO list (the
//!   SSD tier's two eviction orders), its memory allocated once and bounded.
//! - [`tier`]: [`RamTier`], a [`flashtier_io::BlockDev`] that answers whole-block reads from
//!   the store when the per-block write record ([`flashtier_io::versions`]) proves the copy is
//!   current, and hands what it evicts to an [`EvictionSink`] (the memcached tier's `victim`
//!   mode).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod store;
pub mod tier;

pub use store::RamPolicy;
pub use tier::{EvictionSink, RamStats, RamTier};

//! Handing the clean blocks reclaim evicts to a slower tier that keeps victims (the memcached
//! tier's `victim` mode), through a narrow handle, [`VictimSink`].
//!
//! The sink stores a block only with a version it took *before* the block was read from the
//! cache device, and uses the value later only while that version is still current. What makes
//! the pair (version, data) right is one rule every write path of the engine already keeps for
//! its own crash safety: **a path that writes the backing store drops or replaces the block's
//! mapping before its backing write begins** (write-around and pass-through apply their
//! INVALIDATE first; write-through maps the new data before writing the backing store; a trim
//! invalidates its whole blocks first; write-back writes reach the backing store only by
//! cleaning, which writes dirty blocks, never a clean mapping's). So when reclaim unmaps a clean
//! block under the state lock and finds it still in the slot it read, no backing write of that
//! block began since the mapping existed, in particular none since the version was taken: the
//! data is what the backing store held then. A write after that bumps the version, and the
//! value is old before anyone can use it.
//!
//! What it costs reclaim: one read of the span of the victim's clean blocks from the cache
//! device, and the sink's send (for memcached, one pipelined batch per server, bounded by
//! `memcached_timeout_ms`), per victim segment. It takes no lock a writer waits on beyond the
//! state lock's usual moments, so it delays freeing space but cannot block it. (A first version
//! skipped it while free segments were at the reserve; in a cache under read-miss churn,
//! reclaim's victims are nearly always taken there, and nothing was ever handed down.) A failed
//! read or a block failing its checksum is simply not offered.

use flashtier_io::versions::Tag;

/// A tier that keeps what the SSD tier evicts.
pub trait VictimSink: Send + Sync {
    /// Whether the sink takes victims now; asked once per victim segment, before anything is
    /// read for it.
    fn wants(&self) -> bool;
    /// Appends to `out` the versions of the sink's blocks covering `[offset, offset + len)` of
    /// the backing store, as they are now; false (the caller then offers nothing of this range)
    /// if a write to any of them is in flight or the range is not whole blocks of the sink's.
    fn tags(&self, offset: u64, len: usize, out: &mut Vec<Tag>) -> bool;
    /// Offers `data`, the content of `[offset, offset + data.len())`, with the versions `tags`
    /// took before it was read. Only queues: called right after reclaim unmapped the blocks.
    fn offer(&self, offset: u64, tags: &[Tag], data: &[u8]);
    /// Sends what was offered (outside the engine's locks).
    fn ship(&self);
}

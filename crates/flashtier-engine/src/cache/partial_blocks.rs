//! The blocks that partial writes ended in, kept in memory so that the next partial write of the
//! same block needs no read of it.
//!
//! A write smaller than a block is a read-modify-write: the block is read (from the cache device
//! on a hit), patched and written whole. A database's redo log writes that way all the time: it
//! appends in 512-byte steps, each write rewriting the block the previous one ended in (recorded
//! under MariaDB + sysbench: 40,065 of 465,623 writes were below 4 KiB, 512 to 2,048 bytes, each
//! followed by a FLUSH that the commit waits for). The read is a cache hit of a block written a
//! moment ago, and it is close to half of such a write's time (measured at QD1: 1,536-byte
//! sequential writes took a write p50 of 122 µs, 4 KiB ones 79 µs).
//!
//! An entry is a block's content together with where the cache put it: the slot and that slot's
//! segment generation ([`crate::segments::Segments::generation`], which changes whenever the
//! segment is reused). It is used only while the index still maps the block to that slot, the
//! segment's generation is the same, and the block is not lost. So whatever changed the block
//! since makes the entry unusable, because each of those remaps or unmaps the block: a write of
//! any kind, trim, write-zeroes, an invalidation, eviction, a move by reclaim, a LOST record; and
//! a slot reused for other data is a new generation. A block that is mapped to the entry's slot
//! holds what the entry holds; reclaim may move or evict it after the check, but neither changes
//! what the block reads as, and a client write of it cannot land meanwhile: the caller holds the
//! block's range exclusively from the lookup until its own write is applied (see `write`).
//!
//! Lock order: taken alone (the state lock is released before this one is taken).

use parking_lot::Mutex;

use flashtier_io::AlignedBuf;

use crate::layout::Geometry;
use crate::state::State;

/// Blocks remembered: a few writers appending to their own logs at once.
const ENTRIES: usize = 8;

/// Where a block's content was put in the cache, which is what makes a remembered copy valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Placed {
    lba: u64,
    slot: u32,
    generation: u64,
}

impl Placed {
    /// Where `lba` is cached now, if it is cached and not lost.
    fn now(st: &State, geo: &Geometry, lba: u64) -> Option<Placed> {
        if st.lost.overlaps(lba, 1) {
            return None;
        }
        let slot = st.index.get(lba)?;
        Some(Placed {
            lba,
            slot,
            generation: st.segs.generation(geo.segment_of(slot)),
        })
    }
}

struct Entry {
    placed: Option<Placed>,
    /// When it was last stored or used, in the table's own count: the oldest is replaced.
    used: u64,
    data: AlignedBuf,
}

struct Table {
    entries: Vec<Entry>,
    clock: u64,
}

/// The last blocks partial writes left behind (see the module's essay).
pub(super) struct RecentPartials {
    table: Mutex<Table>,
}

impl RecentPartials {
    /// Room for [`ENTRIES`] blocks of `block_size` bytes, allocated here once.
    pub(super) fn new(block_size: usize) -> RecentPartials {
        let entries = (0..ENTRIES)
            .map(|_| Entry {
                placed: None,
                used: 0,
                data: AlignedBuf::zeroed(block_size),
            })
            .collect();
        RecentPartials {
            table: Mutex::new(Table { entries, clock: 0 }),
        }
    }

    /// Copies block `lba` into `out` if a remembered copy is still what the block holds.
    pub(super) fn fill(
        &self,
        st: &parking_lot::RwLock<State>,
        geo: &Geometry,
        lba: u64,
        out: &mut [u8],
    ) -> bool {
        let Some(placed) = Placed::now(&st.read(), geo, lba) else {
            return false;
        };
        let mut t = self.table.lock();
        t.clock += 1;
        let clock = t.clock;
        let Some(e) = t.entries.iter_mut().find(|e| e.placed == Some(placed)) else {
            return false;
        };
        e.used = clock;
        out.copy_from_slice(&e.data);
        true
    }

    /// Remembers `data` as block `lba`'s content, which the caller has just written and still
    /// holds exclusively; nothing is remembered if the block is not cached (written around).
    pub(super) fn remember(
        &self,
        st: &parking_lot::RwLock<State>,
        geo: &Geometry,
        lba: u64,
        data: &[u8],
    ) {
        let Some(placed) = Placed::now(&st.read(), geo, lba) else {
            self.forget(lba);
            return;
        };
        let mut t = self.table.lock();
        t.clock += 1;
        let clock = t.clock;
        let at = t
            .entries
            .iter()
            .position(|e| e.placed.is_some_and(|p| p.lba == lba))
            .or_else(|| {
                (0..t.entries.len())
                    .min_by_key(|&i| (t.entries[i].placed.is_some(), t.entries[i].used))
            })
            .expect("the table has entries");
        let e = &mut t.entries[at];
        e.placed = Some(placed);
        e.used = clock;
        e.data.copy_from_slice(data);
    }

    /// Drops what is remembered of `lba` (it is not needed for correctness, only to free room).
    fn forget(&self, lba: u64) {
        let mut t = self.table.lock();
        for e in &mut t.entries {
            if e.placed.is_some_and(|p| p.lba == lba) {
                e.placed = None;
            }
        }
    }
}

//! The in-memory index: which cache slot holds which block of the backing store.
//!
//! The index is exact (a lookup never answers "may contain") and compact: about 13 bytes of RAM
//! per cache slot, so a 1 TiB cache of 4 KiB blocks (2^28 slots) costs about 3.3 GiB. It is
//! sized for the fixed slot count of the device and never grows; the table is allocated at once,
//! the slot words chunk by chunk as slots are first used (until then they share one chunk of
//! zeroes, see `cow`).
//!
//! # Structure
//!
//! * `slots`: one 64-bit word per cache slot (in copy-on-write chunks), saying what it holds:
//!
//!   ```text
//!   bits  0..48  LBA + 1 (0: the slot holds no live block)
//!   bit   48     DIRTY: newer than the backing store
//!   bit   49     REFERENCED: read since it was written or last examined by reclaim
//!   bits 50..64  reserved (0)
//!   ```
//!
//! * `table`: an open-addressing hash table with linear probing, about `slot_count / 0.8` cells
//!   of 32 bits. A cell holds `slot + 1` (0: empty) in its low bits; the key (the LBA) of an
//!   occupied cell is not stored there but read from `slots[slot]`. Each LBA maps to at most one
//!   slot and each slot holds at most one LBA, so at most `slot_count` cells are ever occupied
//!   and the load factor never exceeds 0.8; there is always an empty cell, so probes terminate.
//!
//!   Reading a key is a random memory access, so the bits of a cell above those `slot + 1` needs
//!   (any cache below 2^31 slots has some) are put to work, at no memory cost:
//!
//!   ```text
//!   bits 0..s        slot + 1, s = bits needed for slot_count
//!   next d bits      displacement: how far the cell is past its key's home cell, saturating at
//!                    2^d - 1 ("that far or farther: read the key"); d = min(spare bits, 5)
//!   remaining bits   fingerprint: bits of the key's hash
//!   ```
//!
//!   A probe reads `slots[slot]` only for cells whose displacement and fingerprint match the
//!   key's, and deletion knows the home of a following cell without reading its key (unless its
//!   displacement saturated). A 1 TiB cache of 4 KiB blocks (just under 2^28 slots) leaves 4
//!   bits, all displacement; 2^22 slots leave 5 + 4 bits. From 2^31 slots on there are no spare
//!   bits and every cell examined costs a key read (correct, only slower).
//!
//! The home cell of an LBA is `fastrange(hash(lba), table.len())` (the table size is not a power
//! of two), where the hash is the splitmix64 finalizer, so sequential LBAs scatter uniformly.
//! Deletion shifts the following cells of the cluster back (no tombstones), so lookups never
//! degrade with churn: a cell at position `j` with home `h` moves into the hole `i` iff `h` is
//! cyclically not in `(i, j]`, that is iff its displacement `j - h` is at least `j - i`.
//!
//! # Concurrency and memory ordering
//!
//! The index is meant to live behind a reader-writer lock. Every mutation except
//! [`Index::touch`] takes `&mut self`, that is the exclusive lock; lookups ([`Index::get`],
//! [`Index::slot`], [`Index::slots_in`]) and [`Index::touch`] take `&self`. The only concurrent
//! writes are therefore `touch`es setting REFERENCED, which `fetch_or` commutes with; all other
//! ordering is provided by the lock (releasing the exclusive lock happens-before the next shared
//! acquisition, and releasing a shared lock happens-before the next exclusive acquisition, so a
//! writer sees every REFERENCED bit set before it). Hence every atomic access here is `Relaxed`,
//! and the `&mut self` paths use plain (non-atomic) access through [`AtomicU64::get_mut`].
//! Do not expose the slot words to code that can run without the lock, with one exception: a
//! [`SlotsSnapshot`] ([`Index::snapshot`], taken under the lock) is read by the checkpoint thread
//! without it. The slot words live in copy-on-write chunks (`cow::CowVec`), so no `&mut self`
//! path ever writes a chunk a snapshot shares (it copies the chunk first); only `touch` may still
//! OR REFERENCED into one, which snapshots ignore. The snapshot's contents reach the checkpoint
//! thread through the lock release and the thread's spawn, both of which order them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::cow::CowVec;

/// Bits of a slot word holding `lba + 1`.
const LBA_MASK: u64 = (1 << 48) - 1;
const DIRTY: u64 = 1 << 48;
const REFERENCED: u64 = 1 << 49;
/// Transient mark inside [`Index::remove_range`]: set and cleared within one `&mut self` call,
/// so no caller ever sees it.
const DOOMED: u64 = 1 << 50;

/// Table cells per slot, as a fraction: 5/4 cells per slot is a load factor of at most 0.8.
const CELLS_PER_SLOT: (usize, usize) = (5, 4);

/// Most bits of a table cell given to the displacement.
const MAX_DISPLACEMENT_BITS: u32 = 5;

/// Roughly how many slot words a sequential scan reads in the time one hash probe takes (about
/// 100 ns against 0.3 ns): above `slot_count / PROBE_COST_IN_SLOTS` LBAs,
/// [`Index::remove_range`] scans the slots instead of probing every LBA of the range.
const PROBE_COST_IN_SLOTS: u64 = 256;

/// What a cache slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotInfo {
    /// The backing-store block (in cache blocks) the slot holds.
    pub lba: u64,
    /// The slot is newer than the backing store: it must be written back before it is dropped.
    pub dirty: bool,
    /// The block was read (see [`Index::touch`]) since it was written or last examined.
    pub referenced: bool,
}

/// The LBA → slot map of the cache and its inverse. See the [module documentation](self).
pub struct Index {
    /// In copy-on-write chunks, so a checkpoint can snapshot them in O(chunks) under the state
    /// lock ([`Index::snapshot`]).
    slots: CowVec<AtomicU64>,
    table: Box<[u32]>,
    /// Mapped LBAs (= occupied table cells = live slots).
    len: usize,
    /// Bits of a table cell holding `slot + 1`.
    slot_mask: u32,
    /// Where the displacement starts in a cell (the bits of `slot_mask`, mod 32).
    disp_shift: u32,
    /// Largest displacement value (after the shift), meaning "this or more": 2^d - 1.
    disp_max: u32,
    /// Bits of a cell holding the fingerprint (bits of the hash at the same positions).
    fp_mask: u32,
}

/// How a table cell is divided, for a given slot count (see the module documentation).
#[derive(Debug, PartialEq, Eq)]
struct CellLayout {
    slot_mask: u32,
    disp_shift: u32,
    disp_max: u32,
    fp_mask: u32,
}

impl CellLayout {
    /// The layout for `slot_count` slots, with at most the given numbers of displacement and
    /// fingerprint bits (tests restrict them to exercise saturation and collisions).
    fn new(slot_count: u32, max_disp_bits: u32, max_fp_bits: u32) -> CellLayout {
        // Cells hold slot + 1 <= slot_count: keep the bits that needs, then the displacement,
        // then the fingerprint.
        let slot_bits = u32::BITS - slot_count.leading_zeros();
        let low_bits = |bits: u32| u32::MAX.checked_shr(u32::BITS - bits).unwrap_or(0);
        let disp_bits = (u32::BITS - slot_bits).min(max_disp_bits);
        let fp_bits = (u32::BITS - slot_bits - disp_bits).min(max_fp_bits);
        CellLayout {
            slot_mask: low_bits(slot_bits),
            disp_shift: slot_bits % u32::BITS,
            disp_max: low_bits(disp_bits),
            fp_mask: low_bits(slot_bits + disp_bits + fp_bits) & !low_bits(slot_bits + disp_bits),
        }
    }
}

/// Where a probe for an LBA ended.
enum Probe {
    /// The LBA lives in `slot`, referenced by table cell `pos`.
    Found { pos: usize, slot: u32 },
    /// The LBA is unmapped; `pos` is the empty cell where it would go, `disp` cells past its
    /// home.
    Vacant { pos: usize, disp: usize },
}

/// The splitmix64 finalizer: a bijective mixer after which every output bit depends on every
/// input bit, so sequential LBAs land on unrelated home cells.
#[inline]
fn hash(lba: u64) -> u64 {
    let mut z = lba;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Lemire's fastrange: maps a hash uniformly onto `0..len` (using its high bits).
#[inline]
fn home(h: u64, len: usize) -> usize {
    ((h as u128 * len as u128) >> 64) as usize
}

/// How far position `to` is past position `from` in a cyclic table of `n` cells.
#[inline]
fn distance(from: usize, to: usize, n: usize) -> usize {
    if to >= from {
        to - from
    } else {
        to + n - from
    }
}

#[inline]
fn decode(word: u64) -> Option<SlotInfo> {
    (word & LBA_MASK != 0).then(|| SlotInfo {
        lba: (word & LBA_MASK) - 1,
        dirty: word & DIRTY != 0,
        referenced: word & REFERENCED != 0,
    })
}

#[inline]
fn encode(lba: u64, dirty: bool) -> u64 {
    (lba + 1) | if dirty { DIRTY } else { 0 }
}

impl Index {
    /// The largest LBA (in cache blocks) the index can map: 2^48 - 2, that is 1 EiB of backing
    /// store in 4 KiB blocks. Inserting a larger one panics; the engine must refuse backing
    /// stores with more blocks than `MAX_LBA + 1`.
    pub const MAX_LBA: u64 = LBA_MASK - 1;

    /// An empty index for a cache of `slot_count` slots (numbered `0..slot_count`). Allocates all
    /// its memory now (see [`Index::memory_bytes`]).
    pub fn new(slot_count: u32) -> Index {
        Self::with_layout(slot_count, MAX_DISPLACEMENT_BITS, u32::BITS)
    }

    fn with_layout(slot_count: u32, max_disp_bits: u32, max_fp_bits: u32) -> Index {
        let n = slot_count as usize;
        let cells = n * CELLS_PER_SLOT.0 / CELLS_PER_SLOT.1 + 1;
        let CellLayout {
            slot_mask,
            disp_shift,
            disp_max,
            fp_mask,
        } = CellLayout::new(slot_count, max_disp_bits, max_fp_bits);
        Index {
            slots: CowVec::new(n),
            table: vec![0u32; cells].into_boxed_slice(),
            len: 0,
            slot_mask,
            disp_shift,
            disp_max,
            fp_mask,
        }
    }

    /// Number of slots the index was built for.
    pub fn slot_count(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Number of mapped LBAs, which is also the number of live slots.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no LBA is mapped.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot holding `lba`, if it is cached.
    pub fn get(&self, lba: u64) -> Option<u32> {
        if lba > Self::MAX_LBA {
            return None;
        }
        match self.probe(lba, hash(lba)) {
            Probe::Found { slot, .. } => Some(slot),
            Probe::Vacant { .. } => None,
        }
    }

    /// What `slot` holds, or `None` if it holds no live block (or is out of range).
    pub fn slot(&self, slot: u32) -> Option<SlotInfo> {
        decode(self.slots.get(slot as usize)?.load(Relaxed))
    }

    /// Maps `lba` to `slot` (a Write record), with REFERENCED clear. Any previous mapping of
    /// `lba` is replaced and its slot returned: that slot is now free, unless it is `slot` itself
    /// (re-inserting an LBA into the slot it already lives in just sets its flags). Callers
    /// keeping per-segment live counts can thus always count +1 for `slot` and -1 for the
    /// returned slot.
    ///
    /// `slot` must be free or already hold `lba`. Inserting into a slot holding another LBA is a
    /// bug: it panics in debug builds; release builds unmap the other LBA first (the slot's old
    /// contents are being overwritten anyway) so the index stays consistent.
    ///
    /// Panics if `lba > MAX_LBA` or `slot >= slot_count`.
    pub fn insert(&mut self, lba: u64, slot: u32, dirty: bool) -> Option<u32> {
        Self::check_lba(lba);
        self.make_room(slot, lba);
        let h = hash(lba);
        let old = match self.probe(lba, h) {
            Probe::Found { pos, slot: old } => {
                self.table[pos] = self.with_slot(self.table[pos], slot);
                *self.slots[old as usize].get_mut() = 0;
                Some(old)
            }
            Probe::Vacant { pos, disp } => {
                self.table[pos] = self.new_cell(slot, disp, h);
                self.len += 1;
                None
            }
        };
        *self.slots[slot as usize].get_mut() = encode(lba, dirty);
        old
    }

    /// Maps `lba` to `slot` only if `lba` is currently unmapped (a Promote record: a block read
    /// from the backing store must never hide a newer write); returns whether it did. The same
    /// rules on `slot` as for [`Index::insert`] apply when it does.
    pub fn insert_if_absent(&mut self, lba: u64, slot: u32, dirty: bool) -> bool {
        Self::check_lba(lba);
        let h = hash(lba);
        let mut probe = self.probe(lba, h);
        if let Probe::Found { .. } = probe {
            return false;
        }
        if self.make_room(slot, lba) {
            // Unmapping the slot's occupant may have shifted the table.
            probe = self.probe(lba, h);
        }
        let Probe::Vacant { pos, disp } = probe else {
            unreachable!("lba {lba} appeared while unmapping another one");
        };
        self.table[pos] = self.new_cell(slot, disp, h);
        *self.slots[slot as usize].get_mut() = encode(lba, dirty);
        self.len += 1;
        true
    }

    /// Moves `lba` from slot `from` to slot `to` only if it currently lives in `from` (a Move
    /// record: reclaim copied it forward and no newer write replaced it meanwhile); returns
    /// whether it did. DIRTY is kept and REFERENCED cleared; `from` becomes free (if `to ==
    /// from`, the move only clears REFERENCED). `to` must be free, with the same rules as for
    /// [`Index::insert`]; panics if it is out of range (and the move happens).
    pub fn move_if(&mut self, lba: u64, from: u32, to: u32) -> bool {
        let Some(word) = self.word_if(lba, from) else {
            return false;
        };
        if to == from {
            *self.slots[from as usize].get_mut() &= !REFERENCED;
            return true;
        }
        let h = hash(lba);
        self.make_room(to, lba);
        let Probe::Found { pos, slot } = self.probe(lba, h) else {
            unreachable!("lba {lba} lives in slot {from} but is not in the table");
        };
        debug_assert_eq!(slot, from);
        self.table[pos] = self.with_slot(self.table[pos], to);
        *self.slots[from as usize].get_mut() = 0;
        *self.slots[to as usize].get_mut() = word & (LBA_MASK | DIRTY);
        true
    }

    /// Unmaps `lba`; returns the slot it lived in, which is now free.
    pub fn remove(&mut self, lba: u64) -> Option<u32> {
        if lba > Self::MAX_LBA {
            return None;
        }
        match self.probe(lba, hash(lba)) {
            Probe::Found { pos, slot } => {
                self.unmap_at(pos, slot);
                Some(slot)
            }
            Probe::Vacant { .. } => None,
        }
    }

    /// Unmaps `lba` only if it lives in `slot`; returns whether it did.
    pub fn remove_if(&mut self, lba: u64, slot: u32) -> bool {
        if self.word_if(lba, slot).is_none() {
            return false;
        }
        let Probe::Found { pos, .. } = self.probe(lba, hash(lba)) else {
            unreachable!("lba {lba} lives in slot {slot} but is not in the table");
        };
        self.unmap_at(pos, slot);
        true
    }

    /// Unmaps every LBA in `[first, first + count)` (an Invalidate record: write-around, trim,
    /// zeroing), calling `on_removed(lba, slot, dirty)` for each mapping removed, in no
    /// particular order. The range may extend past `MAX_LBA` (it is clipped).
    ///
    /// Small ranges probe each LBA (~100 ns each); ranges larger than `slot_count / 256` blocks
    /// (a trim of the whole disk, say) scan the slot words instead (~0.3 ns per slot), and
    /// rebuild the table when they unmap a large part of it, so the cost is at most about two
    /// passes over the index's memory (~10 ms per 2^22 slots).
    pub fn remove_range(&mut self, first: u64, count: u64, on_removed: impl FnMut(u64, u32, bool)) {
        if first > Self::MAX_LBA || count == 0 || self.len == 0 {
            return;
        }
        let end = first.saturating_add(count).min(Self::MAX_LBA + 1);
        if (end - first).saturating_mul(PROBE_COST_IN_SLOTS) <= self.slots.len() as u64 {
            self.remove_range_probing(first, end, on_removed);
        } else {
            self.remove_range_scanning(first, end, None, on_removed);
        }
    }

    /// Clears DIRTY if `lba` lives in `slot` (a Cleaned record: the backing store now holds it);
    /// returns whether it did (also when the slot was already clean).
    pub fn set_clean_if(&mut self, lba: u64, slot: u32) -> bool {
        if self.word_if(lba, slot).is_none() {
            return false;
        }
        *self.slots[slot as usize].get_mut() &= !DIRTY;
        true
    }

    /// Sets REFERENCED on `slot` if it holds a live block (a read hit). Needs only shared access:
    /// call it under the same shared lock as the [`Index::get`] that found the slot. Does not
    /// write (so does not bounce the cache line between readers) if the bit is already set.
    ///
    /// Panics if `slot >= slot_count`.
    pub fn touch(&self, slot: u32) {
        let w = &self.slots[slot as usize];
        let word = w.load(Relaxed);
        if word & LBA_MASK != 0 && word & REFERENCED == 0 {
            // No exclusive writer can run concurrently, so the slot is still live here.
            w.fetch_or(REFERENCED, Relaxed);
        }
    }

    /// Clears REFERENCED on `slot` (reclaim examined it). No effect on a free slot.
    #[cfg(test)]
    pub fn clear_referenced(&mut self, slot: u32) {
        *self.slots[slot as usize].get_mut() &= !REFERENCED;
    }

    /// The live slots in `[first_slot, first_slot + n)` (clipped to the slot count) and what they
    /// hold, in slot order: reclaim walks a segment with it.
    pub fn slots_in(&self, first_slot: u32, n: u32) -> impl Iterator<Item = (u32, SlotInfo)> + '_ {
        let start = (first_slot as usize).min(self.slots.len());
        let end = (first_slot as usize)
            .saturating_add(n as usize)
            .min(self.slots.len());
        (start..end).filter_map(move |s| Some((s as u32, decode(self.slots[s].load(Relaxed))?)))
    }

    /// What every slot holds now, for a checkpoint: O(slot count / `cow::CHUNK_LEN`), so the log
    /// writer can take it under the state lock at an exact log position and encode it elsewhere.
    /// Later changes to the index do not show in it (their chunks are copied first).
    pub fn snapshot(&self) -> SlotsSnapshot {
        SlotsSnapshot {
            slots: self.slots.clone(),
            len: self.len,
        }
    }

    /// Bytes of RAM the index uses with every slot in use: `slot_count * 8 + table cells * 4`,
    /// about 13 per slot. (The slot words of slots never used since the cache was opened share
    /// one chunk of zeroes, so a mostly empty cache takes less.)
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.slots.nominal_bytes()
            + std::mem::size_of_val::<[u32]>(&self.table)
    }

    // ---- internals ----

    fn check_lba(lba: u64) {
        assert!(
            lba <= Self::MAX_LBA,
            "lba {lba} exceeds the index's limit {}",
            Self::MAX_LBA
        );
    }

    /// The table cell referencing `slot` for a key of hash `h` placed `disp` cells past its home.
    #[inline]
    fn new_cell(&self, slot: u32, disp: usize, h: u64) -> u32 {
        (slot + 1) | self.disp_bits(disp) | (h as u32 & self.fp_mask)
    }

    /// `disp` (saturated) at its place in a cell.
    #[inline]
    fn disp_bits(&self, disp: usize) -> u32 {
        (disp.min(self.disp_max as usize) as u32) << self.disp_shift
    }

    /// `cell` referencing `slot` instead (same key, same place).
    #[inline]
    fn with_slot(&self, cell: u32, slot: u32) -> u32 {
        (cell & !self.slot_mask) | (slot + 1)
    }

    /// The slot a (non-empty) cell references.
    #[inline]
    fn slot_of(&self, cell: u32) -> u32 {
        (cell & self.slot_mask) - 1
    }

    /// The displacement of the key in (non-empty) cell `pos`, reading the key only if the
    /// displacement field saturated.
    #[inline]
    fn displacement(&self, pos: usize) -> usize {
        let cell = self.table[pos];
        let field = (cell >> self.disp_shift) & self.disp_max;
        if field < self.disp_max {
            return field as usize;
        }
        let key = self.slots[self.slot_of(cell) as usize].load(Relaxed) & LBA_MASK;
        debug_assert_ne!(key, 0, "table cell {pos} references a free slot");
        let n = self.table.len();
        distance(home(hash(key.wrapping_sub(1)), n), pos, n)
    }

    /// The word of `slot` if it holds `lba`.
    #[inline]
    fn word_if(&self, lba: u64, slot: u32) -> Option<u64> {
        let word = self.slots.get(slot as usize)?.load(Relaxed);
        (lba <= Self::MAX_LBA && word & LBA_MASK == lba + 1).then_some(word)
    }

    /// Looks `lba` (of hash `h`, `lba <= MAX_LBA`) up in the table.
    #[inline]
    fn probe(&self, lba: u64, h: u64) -> Probe {
        let key = lba + 1;
        let fingerprint = h as u32 & self.fp_mask;
        let n = self.table.len();
        let mut pos = home(h, n);
        let mut disp = 0;
        loop {
            let cell = self.table[pos];
            if cell == 0 {
                return Probe::Vacant { pos, disp };
            }
            // Only a cell with the key's fingerprint, as far from its home as this one is from
            // the key's, can hold the key.
            if cell & !self.slot_mask == fingerprint | self.disp_bits(disp) {
                let slot = self.slot_of(cell);
                if self.slots[slot as usize].load(Relaxed) & LBA_MASK == key {
                    return Probe::Found { pos, slot };
                }
            }
            pos += 1;
            if pos == n {
                pos = 0;
            }
            disp += 1;
        }
    }

    /// Makes sure `slot` is free or holds `lba`, unmapping any other occupant (a caller bug:
    /// panics in debug builds). Returns whether it unmapped something.
    fn make_room(&mut self, slot: u32, lba: u64) -> bool {
        let held = self.slots[slot as usize].load(Relaxed) & LBA_MASK;
        if held == 0 || held == lba + 1 {
            return false;
        }
        if cfg!(debug_assertions) {
            panic!(
                "index: mapping lba {lba} to slot {slot}, which still holds lba {}",
                held - 1
            );
        }
        tracing::error!(
            "index: mapping lba {lba} to slot {slot}, which still holds lba {}; unmapping it",
            held - 1
        );
        self.remove(held - 1);
        true
    }

    /// Unmaps the LBA living in `slot`, referenced by table cell `pos`.
    fn unmap_at(&mut self, pos: usize, slot: u32) {
        *self.slots[slot as usize].get_mut() = 0;
        self.delete_cell(pos);
        self.len -= 1;
    }

    /// Empties table cell `pos` by backward shift: each following cell of the cluster moves into
    /// the hole if its home is not cyclically in `(hole, its position]`, i.e. if it is at least
    /// as far past its home as past the hole, so it stays reachable from its home. Reads the keys
    /// of following cells only where their displacement saturated (never `pos`'s).
    fn delete_cell(&mut self, pos: usize) {
        let n = self.table.len();
        let mut hole = pos;
        let mut j = pos;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let cell = self.table[j];
            if cell == 0 {
                break;
            }
            let disp = self.displacement(j);
            let gap = distance(hole, j, n);
            if disp >= gap {
                let field = self.disp_max << self.disp_shift;
                self.table[hole] = (cell & !field) | self.disp_bits(disp - gap);
                hole = j;
            }
        }
        self.table[hole] = 0;
    }

    fn remove_range_probing(
        &mut self,
        first: u64,
        end: u64,
        mut on_removed: impl FnMut(u64, u32, bool),
    ) {
        for lba in first..end {
            if self.len == 0 {
                return;
            }
            if let Probe::Found { pos, slot } = self.probe(lba, hash(lba)) {
                let dirty = self.slots[slot as usize].load(Relaxed) & DIRTY != 0;
                self.unmap_at(pos, slot);
                on_removed(lba, slot, dirty);
            }
        }
    }

    /// Scans the slots for LBAs in `[first, end)`. `rebuild` forces the choice between rebuilding
    /// the table and deleting cells one by one (tests); `None` picks the cheaper.
    fn remove_range_scanning(
        &mut self,
        first: u64,
        end: u64,
        rebuild: Option<bool>,
        mut on_removed: impl FnMut(u64, u32, bool),
    ) {
        let mut doomed = 0usize;
        let in_range = |w: &AtomicU64| {
            let key = w.load(Relaxed) & LBA_MASK;
            key > first && key <= end
        };
        // Only chunks holding a doomed slot are written (copied first if a checkpoint's snapshot
        // shares them), and the never-used ones are skipped whole.
        self.slots.for_each_chunk_mut(
            |words| words.iter().any(in_range),
            |at, words| {
                for (i, w) in words.iter_mut().enumerate() {
                    let word = w.get_mut();
                    let key = *word & LBA_MASK;
                    if key > first && key <= end {
                        *word |= DOOMED;
                        doomed += 1;
                        on_removed(key - 1, (at + i) as u32, *word & DIRTY != 0);
                    }
                }
            },
        );
        if doomed == 0 {
            return;
        }
        let is_doomed = |w: &AtomicU64| w.load(Relaxed) & DOOMED != 0;
        // Deleting a cell costs a probe plus a backward shift, several random memory accesses;
        // rebuilding costs about one per surviving entry.
        let survivors = self.len - doomed;
        if rebuild.unwrap_or(doomed.saturating_mul(4) >= survivors) {
            self.slots.for_each_chunk_mut(
                |words| words.iter().any(is_doomed),
                |_, words| {
                    for w in words.iter_mut() {
                        let word = w.get_mut();
                        if *word & DOOMED != 0 {
                            *word = 0;
                        }
                    }
                },
            );
            self.len = survivors;
            self.rebuild_table();
        } else {
            let starts: Vec<usize> = self
                .slots
                .chunks()
                .filter(|(_, words)| words.iter().any(is_doomed))
                .map(|(at, _)| at)
                .collect();
            let n = self.slots.len();
            let slots = starts
                .into_iter()
                .flat_map(|at| at..(at + crate::cow::CHUNK_LEN).min(n));
            for slot in slots {
                let word = self.slots[slot].load(Relaxed);
                if word & DOOMED != 0 {
                    let lba = (word & LBA_MASK) - 1;
                    let Probe::Found { pos, .. } = self.probe(lba, hash(lba)) else {
                        unreachable!("lba {lba} lives in slot {slot} but is not in the table");
                    };
                    self.unmap_at(pos, slot as u32);
                }
            }
        }
    }

    /// Refills the table from the slot words (which hold distinct LBAs, so no key comparisons).
    fn rebuild_table(&mut self) {
        let mut table = std::mem::take(&mut self.table);
        table.fill(0);
        let n = table.len();
        let live = self.slots.chunks().flat_map(|(at, words)| {
            words.iter().enumerate().filter_map(move |(i, w)| {
                let key = w.load(Relaxed) & LBA_MASK;
                (key != 0).then_some(((at + i) as u32, key))
            })
        });
        for (slot, key) in live {
            let h = hash(key - 1);
            let mut pos = home(h, n);
            let mut disp = 0;
            while table[pos] != 0 {
                pos += 1;
                if pos == n {
                    pos = 0;
                }
                disp += 1;
            }
            table[pos] = self.new_cell(slot, disp, h);
        }
        self.table = table;
    }
}

/// The slot words of an index at one moment (see [`Index::snapshot`]).
pub struct SlotsSnapshot {
    slots: CowVec<AtomicU64>,
    /// Live slots in it.
    len: usize,
}

impl SlotsSnapshot {
    /// How many slots hold a live block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The live slots and what they hold, in slot order. Skips the chunks of slots never used.
    /// REFERENCED may be set concurrently by `touch` in chunks still shared with the index, so
    /// it means nothing here.
    pub fn live(&self) -> impl Iterator<Item = (u32, SlotInfo)> + '_ {
        self.slots.chunks().flat_map(|(at, words)| {
            words
                .iter()
                .enumerate()
                .filter_map(move |(i, w)| Some(((at + i) as u32, decode(w.load(Relaxed))?)))
        })
    }
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("slot_count", &self.slots.len())
            .field("table_cells", &self.table.len())
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    impl Index {
        /// Checks every structural invariant; panics with a description on the first violation.
        fn check_invariants(&self) {
            let n = self.table.len();
            let mut seen_slots = HashSet::new();
            let mut seen_lbas = HashSet::new();
            for (pos, &cell) in self.table.iter().enumerate() {
                if cell == 0 {
                    continue;
                }
                let slot = (cell & self.slot_mask)
                    .checked_sub(1)
                    .unwrap_or_else(|| panic!("cell {pos} has tags but no slot"));
                assert!(
                    (slot as usize) < self.slots.len(),
                    "cell {pos}: slot {slot}"
                );
                assert!(seen_slots.insert(slot), "slot {slot} referenced twice");
                let word = self.slots[slot as usize].load(Relaxed);
                let info = decode(word).unwrap_or_else(|| panic!("cell {pos}: slot {slot} free"));
                assert!(seen_lbas.insert(info.lba), "lba {} mapped twice", info.lba);
                let h = hash(info.lba);
                let disp = distance(home(h, n), pos, n);
                assert_eq!(cell, self.new_cell(slot, disp, h), "cell {pos}: tags");
                assert_eq!(self.displacement(pos), disp, "cell {pos}: displacement");
                // Reachable from its home without crossing an empty cell.
                let mut p = home(h, n);
                while p != pos {
                    assert_ne!(
                        self.table[p],
                        0,
                        "cell {pos} (home {}) cut off at {p}",
                        home(h, n)
                    );
                    p = (p + 1) % n;
                }
            }
            assert_eq!(seen_slots.len(), self.len, "occupied cells vs len");
            assert!(self.len < n, "no empty cell left");
            let mut live = 0;
            for slot in 0..self.slots.len() {
                let word = self.slots[slot].load(Relaxed);
                assert_eq!(
                    word & !(LBA_MASK | DIRTY | REFERENCED),
                    0,
                    "slot {slot} reserved bits"
                );
                if word & LBA_MASK != 0 {
                    live += 1;
                    assert!(
                        seen_slots.contains(&(slot as u32)),
                        "slot {slot} not in the table"
                    );
                } else {
                    assert_eq!(word, 0, "free slot {slot} has flags");
                }
            }
            assert_eq!(live, self.len, "live slots vs len");
        }
    }

    /// `count` distinct LBAs (from `start` up) whose home cell in `index` is `want`.
    fn lbas_with_home(index: &Index, want: usize, count: usize, start: u64) -> Vec<u64> {
        (start..)
            .filter(|&lba| home(hash(lba), index.table.len()) == want)
            .take(count)
            .collect()
    }

    fn info(lba: u64, dirty: bool, referenced: bool) -> Option<SlotInfo> {
        Some(SlotInfo {
            lba,
            dirty,
            referenced,
        })
    }

    #[test]
    fn sizes_and_masks() {
        let i = Index::new(8);
        assert_eq!(i.table.len(), 11);
        let layout = |slot_count| {
            let l = CellLayout::new(slot_count, MAX_DISPLACEMENT_BITS, u32::BITS);
            (l.slot_mask, l.disp_shift, l.disp_max, l.fp_mask)
        };
        assert_eq!(layout(8), (0b1111, 4, 31, !0 << 9));
        assert_eq!(layout(0), (0, 0, 31, !0 << 5));
        assert_eq!(layout(1 << 20), ((1 << 21) - 1, 21, 31, !0 << 26));
        // 1 TiB of 4 KiB blocks, less the metadata.
        assert_eq!(layout((1 << 28) - 1000), ((1 << 28) - 1, 28, 15, 0));
        assert_eq!(layout(1 << 28), ((1 << 29) - 1, 29, 7, 0));
        assert_eq!(layout(u32::MAX >> 1), (u32::MAX >> 1, 31, 1, 0));
        assert_eq!(layout(u32::MAX), (u32::MAX, 0, 0, 0));
        let l = CellLayout::new(8, 2, 3);
        assert_eq!((l.disp_shift, l.disp_max, l.fp_mask), (4, 3, 0b111 << 6));
        assert_eq!(Index::MAX_LBA, (1 << 48) - 2);
        let e = Index::new(0);
        assert_eq!(e.get(5), None);
        assert_eq!(e.slot(0), None);
        assert!(e.is_empty());
        e.check_invariants();
    }

    #[test]
    fn insert_get_slot_and_replace() {
        let mut i = Index::new(16);
        assert_eq!(i.insert(100, 3, true), None);
        assert_eq!(i.insert(Index::MAX_LBA, 4, false), None);
        assert_eq!(i.insert(0, 5, false), None);
        assert_eq!(i.len(), 3);
        assert_eq!(i.get(100), Some(3));
        assert_eq!(i.get(Index::MAX_LBA), Some(4));
        assert_eq!(i.get(0), Some(5));
        assert_eq!(i.get(1), None);
        assert_eq!(i.get(u64::MAX), None);
        assert_eq!(i.slot(3), info(100, true, false));
        assert_eq!(i.slot(4), info(Index::MAX_LBA, false, false));
        assert_eq!(i.slot(6), None);
        assert_eq!(i.slot(1000), None);
        // Replacing frees the old slot.
        i.touch(3);
        assert_eq!(i.insert(100, 7, false), Some(3));
        assert_eq!(i.slot(3), None);
        assert_eq!(i.slot(7), info(100, false, false));
        assert_eq!(i.get(100), Some(7));
        assert_eq!(i.len(), 3);
        // Same slot: flags updated, slot returned (and still live).
        i.touch(7);
        assert_eq!(i.insert(100, 7, true), Some(7));
        assert_eq!(i.slot(7), info(100, true, false));
        assert_eq!(i.get(100), Some(7));
        assert_eq!(i.len(), 3);
        i.check_invariants();
    }

    #[test]
    #[should_panic(expected = "exceeds the index's limit")]
    fn insert_rejects_huge_lba() {
        Index::new(4).insert(Index::MAX_LBA + 1, 0, false);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "which still holds lba 1")]
    fn insert_into_busy_slot_panics_in_debug() {
        let mut i = Index::new(4);
        i.insert(1, 0, false);
        i.insert(2, 0, false);
    }

    #[test]
    #[cfg(not(debug_assertions))]
    fn insert_into_busy_slot_evicts_in_release() {
        let mut i = Index::new(4);
        i.insert(1, 0, true);
        i.insert(5, 1, false);
        assert_eq!(i.insert(2, 0, false), None);
        assert_eq!(i.get(1), None);
        assert!(i.move_if(5, 1, 0));
        assert_eq!(i.get(2), None);
        assert!(i.insert_if_absent(7, 0, false));
        assert_eq!((i.get(5), i.get(7), i.len()), (None, Some(0), 1));
        i.check_invariants();
    }

    #[test]
    fn insert_if_absent() {
        let mut i = Index::new(8);
        assert!(i.insert_if_absent(9, 1, false));
        assert!(!i.insert_if_absent(9, 2, true));
        assert_eq!(i.get(9), Some(1));
        assert_eq!(i.slot(2), None);
        // Into the slot the lba already lives in: it is mapped, so no.
        assert!(!i.insert_if_absent(9, 1, true));
        assert_eq!(i.slot(1), info(9, false, false));
        assert!(i.insert_if_absent(10, 2, true));
        assert_eq!(i.slot(2), info(10, true, false));
        assert_eq!(i.len(), 2);
        i.check_invariants();
    }

    #[test]
    fn move_if() {
        let mut i = Index::new(8);
        i.insert(5, 1, true);
        i.touch(1);
        assert!(!i.move_if(5, 2, 3), "not in slot 2");
        assert!(!i.move_if(6, 1, 3), "slot 1 holds 5, not 6");
        assert!(i.move_if(5, 1, 3));
        assert_eq!(i.get(5), Some(3));
        assert_eq!(i.slot(1), None);
        assert_eq!(
            i.slot(3),
            info(5, true, false),
            "dirty kept, referenced cleared"
        );
        i.touch(3);
        assert!(i.move_if(5, 3, 3));
        assert_eq!(i.slot(3), info(5, true, false));
        assert!(!i.move_if(5, 1, 4), "stale move after the block moved on");
        assert_eq!(i.len(), 1);
        i.check_invariants();
    }

    #[test]
    fn remove_and_remove_if() {
        let mut i = Index::new(8);
        i.insert(1, 0, false);
        i.insert(2, 1, true);
        assert_eq!(i.remove(1), Some(0));
        assert_eq!(i.remove(1), None);
        assert_eq!(i.remove(u64::MAX), None);
        assert_eq!(i.slot(0), None);
        assert!(!i.remove_if(2, 0));
        assert!(!i.remove_if(2, 99));
        assert_eq!(i.get(2), Some(1));
        assert!(i.remove_if(2, 1));
        assert!(!i.remove_if(2, 1));
        assert!(i.is_empty());
        i.check_invariants();
    }

    #[test]
    fn set_clean_touch_clear_referenced() {
        let mut i = Index::new(8);
        i.insert(7, 2, true);
        assert!(!i.set_clean_if(7, 3));
        assert!(!i.set_clean_if(8, 2));
        assert_eq!(i.slot(2), info(7, true, false));
        i.touch(2);
        assert_eq!(i.slot(2), info(7, true, true));
        assert!(i.set_clean_if(7, 2));
        assert_eq!(i.slot(2), info(7, false, true));
        assert!(i.set_clean_if(7, 2), "already clean still counts as done");
        i.clear_referenced(2);
        assert_eq!(i.slot(2), info(7, false, false));
        // Touching a free slot does nothing.
        i.touch(5);
        i.clear_referenced(5);
        assert_eq!(i.slot(5), None);
        i.check_invariants();
    }

    #[test]
    fn slots_in_iterates_live_slots_in_order() {
        let mut i = Index::new(16);
        i.insert(40, 9, true);
        i.insert(30, 2, false);
        i.insert(20, 15, false);
        i.touch(2);
        let all: Vec<_> = i.slots_in(0, 16).collect();
        assert_eq!(
            all,
            vec![
                (2, info(30, false, true).unwrap()),
                (9, info(40, true, false).unwrap()),
                (15, info(20, false, false).unwrap()),
            ]
        );
        assert_eq!(i.slots_in(3, 7).count(), 1);
        assert_eq!(i.slots_in(3, 6).count(), 0);
        assert_eq!(i.slots_in(10, u32::MAX).count(), 1);
        assert_eq!(i.slots_in(100, 5).count(), 0);
    }

    #[test]
    fn wrap_around_cluster_deletion() {
        let mut i = Index::new(8);
        let n = i.table.len();
        assert_eq!(n, 11);
        // Three keys homed at the last cell occupy 10, 0, 1; one homed at 0 lands at 2, one homed
        // at 1 at 3.
        let last = lbas_with_home(&i, n - 1, 3, 0);
        let at0 = lbas_with_home(&i, 0, 1, 0)[0];
        let at1 = lbas_with_home(&i, 1, 1, 0)[0];
        for (s, &lba) in last.iter().enumerate() {
            i.insert(lba, s as u32, false);
        }
        i.insert(at0, 3, false);
        i.insert(at1, 4, false);
        let cells = |i: &Index| -> Vec<u32> { i.table.iter().map(|&c| c & i.slot_mask).collect() };
        assert_eq!(cells(&i), vec![2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 1]);
        i.check_invariants();
        // Deleting the cell at the end pulls the wrapped keys back across the boundary: slot 1
        // (home 10) moves 0 -> 10, slot 2 (home 10) 1 -> 0, at0 (home 0) 2 -> 1, at1 (home 1)
        // 3 -> 2.
        assert_eq!(i.remove(last[0]), Some(0));
        assert_eq!(cells(&i), vec![3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 2]);
        i.check_invariants();
        // Deleting the wrapped keys one by one: at0 and at1 end up in their home cells.
        assert_eq!(i.remove(last[1]), Some(1));
        assert_eq!(cells(&i), vec![4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(i.remove(last[2]), Some(2));
        assert_eq!(cells(&i), vec![4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for lba in last {
            assert_eq!(i.get(lba), None);
        }
        assert_eq!(i.get(at0), Some(3));
        assert_eq!(i.get(at1), Some(4));
        i.check_invariants();
    }

    #[test]
    fn wrap_around_deletion_keeps_keys_that_must_not_move() {
        let mut i = Index::new(8);
        let n = i.table.len();
        // Keys homed at 9 (two: cells 9, 10) and at 0 (two: cells 0, 1), and at 10 (one: cell 2).
        let h9 = lbas_with_home(&i, 9, 2, 0);
        let h0 = lbas_with_home(&i, 0, 2, 0);
        let h10 = lbas_with_home(&i, n - 1, 1, 0)[0];
        for (s, &lba) in h9.iter().chain(&h0).enumerate() {
            i.insert(lba, s as u32, false);
        }
        i.insert(h10, 4, false);
        let cells = |i: &Index| -> Vec<u32> { i.table.iter().map(|&c| c & i.slot_mask).collect() };
        assert_eq!(cells(&i), vec![3, 4, 5, 0, 0, 0, 0, 0, 0, 1, 2]);
        // Remove the key at 9: the other homed-9 key moves 10 -> 9; the homed-0 keys at 0 and 1
        // must stay (their home 0 is in (10, 0] / (10, 1]), but h10 at 2 moves to 10.
        assert_eq!(i.remove(h9[0]), Some(0));
        assert_eq!(cells(&i), vec![3, 4, 0, 0, 0, 0, 0, 0, 0, 2, 5]);
        i.check_invariants();
        // Remove the key at 0: the homed-0 key at 1 moves to 0.
        assert_eq!(i.remove(h0[0]), Some(2));
        assert_eq!(cells(&i), vec![4, 0, 0, 0, 0, 0, 0, 0, 0, 2, 5]);
        i.check_invariants();
        assert_eq!(i.get(h9[1]), Some(1));
        assert_eq!(i.get(h0[1]), Some(3));
        assert_eq!(i.get(h10), Some(4));
    }

    #[test]
    fn full_table_of_colliding_keys() {
        for (disp_bits, fp_bits) in LAYOUTS {
            full_table_of_colliding_keys_with(Index::with_layout(8, disp_bits, fp_bits));
        }
    }

    fn full_table_of_colliding_keys_with(mut i: Index) {
        // All 8 slots used by keys homed at the same cell near the end: one long wrapped cluster.
        let n = i.table.len();
        let keys = lbas_with_home(&i, n - 2, 8, 1 << 40);
        for (s, &lba) in keys.iter().enumerate() {
            assert_eq!(i.insert(lba, s as u32, s % 2 == 0), None);
        }
        i.check_invariants();
        for (s, &lba) in keys.iter().enumerate() {
            assert_eq!(i.get(lba), Some(s as u32));
        }
        // Misses must stop at the single empty cell region.
        assert_eq!(i.get(keys[7] + 1), None);
        // Remove in an order that exercises holes in the middle and at both ends.
        for &k in &[3usize, 0, 7, 1, 6, 2, 5, 4] {
            assert_eq!(i.remove(keys[k]), Some(k as u32));
            i.check_invariants();
            for (s, &lba) in keys.iter().enumerate() {
                let expect = i.slot(s as u32).map(|_| s as u32);
                assert_eq!(i.get(lba), expect);
            }
        }
        assert!(i.is_empty());
    }

    #[test]
    fn remove_range_probing_and_scanning() {
        for mode in 0..4 {
            let mut i = Index::new(64);
            for s in 0..64u32 {
                i.insert(1000 + s as u64 * 3, s, s % 3 == 0);
            }
            let mut removed = Vec::new();
            let cb = |lba, slot, dirty| removed.push((lba, slot, dirty));
            match mode {
                0 => i.remove_range_probing(1010, 1050, cb),
                1 => i.remove_range_scanning(1010, 1050, Some(true), cb),
                2 => i.remove_range_scanning(1010, 1050, Some(false), cb),
                _ => i.remove_range(1010, 40, cb),
            }
            removed.sort();
            let expect: Vec<_> = (4..17u32)
                .map(|s| (1000 + s as u64 * 3, s, s % 3 == 0))
                .collect();
            assert_eq!(removed, expect, "mode {mode}");
            assert_eq!(i.len(), 64 - 13);
            i.check_invariants();
            for s in 0..64u32 {
                let lba = 1000 + s as u64 * 3;
                assert_eq!(i.get(lba).is_some(), !(4..17).contains(&s), "mode {mode}");
            }
        }
    }

    #[test]
    fn remove_range_whole_disk_and_edges() {
        let mut i = Index::new(33);
        for s in 0..32u32 {
            i.insert(s as u64 * 1_000_000_007, s, true);
        }
        i.insert(Index::MAX_LBA, 32, false);
        let mut n = 0;
        i.remove_range(5, 0, |_, _, _| n += 1);
        i.remove_range(Index::MAX_LBA + 1, 10, |_, _, _| n += 1);
        assert_eq!(n, 0);
        i.remove_range(Index::MAX_LBA, u64::MAX, |lba, slot, dirty| {
            assert_eq!((lba, slot, dirty), (Index::MAX_LBA, 32, false));
            n += 1;
        });
        assert_eq!(n, 1);
        i.remove_range(0, u64::MAX, |_, _, _| n += 1);
        assert_eq!(n, 33);
        assert!(i.is_empty());
        i.check_invariants();
        assert_eq!(i.slots_in(0, 32).count(), 0);
    }

    #[test]
    fn sequential_lbas_spread_evenly() {
        // Sequential keys must not cluster: with a full 0.8 load the longest probe stays short.
        let slots = 1 << 16;
        let mut i = Index::new(slots);
        for s in 0..slots {
            i.insert(s as u64, s, false);
        }
        let n = i.table.len();
        let mut longest = 0;
        for lba in 0..slots as u64 {
            let h = hash(lba);
            let Probe::Found { pos, .. } = i.probe(lba, h) else {
                panic!("lost {lba}");
            };
            longest = longest.max((pos + n - home(h, n)) % n);
        }
        assert!(longest < 200, "longest probe {longest}");
        i.check_invariants();
    }

    /// A checkpoint's snapshot is what the index held when it was taken, whatever the index
    /// does afterwards (inserts, moves, cleaning, removal of a range by scanning), and it skips
    /// the slots never used.
    #[test]
    fn a_snapshot_does_not_change_when_the_index_does() {
        let slots = 4 * crate::cow::CHUNK_LEN as u32;
        let mut i = Index::new(slots);
        let far = slots - 1;
        i.insert(10, 1, true);
        i.insert(11, 2, false);
        i.insert(12, far, true);
        let snap = i.snapshot();
        let before: Vec<(u32, u64, bool)> = snap
            .live()
            .map(|(s, info)| (s, info.lba, info.dirty))
            .collect();
        assert_eq!(before, vec![(1, 10, true), (2, 11, false), (far, 12, true)]);
        assert_eq!(snap.len(), 3);
        i.insert(10, 5, false);
        i.move_if(11, 2, 7);
        i.set_clean_if(12, far);
        i.insert(13, crate::cow::CHUNK_LEN as u32 + 3, true);
        i.touch(7);
        i.remove_range_scanning(0, 100, Some(true), |_, _, _| {});
        assert!(i.is_empty());
        i.check_invariants();
        let after: Vec<(u32, u64, bool)> = snap
            .live()
            .map(|(s, info)| (s, info.lba, info.dirty))
            .collect();
        assert_eq!(after, before);
        assert_eq!(snap.len(), 3);
    }

    #[test]
    fn at_most_16_bytes_per_slot() {
        let slots = 1u32 << 20;
        let i = Index::new(slots);
        let per_slot = i.memory_bytes() as f64 / slots as f64;
        println!("index memory: {per_slot:.3} bytes per slot");
        assert!(per_slot <= 16.0, "{per_slot} bytes per slot");
    }

    #[test]
    fn touch_from_many_threads() {
        let mut i = Index::new(1024);
        for s in 0..1024u32 {
            i.insert(s as u64 + 77, s, s % 2 == 0);
        }
        std::thread::scope(|scope| {
            for t in 0..4u32 {
                let i = &i;
                scope.spawn(move || {
                    for s in (t..1024).step_by(3) {
                        i.touch(s);
                    }
                });
            }
        });
        for s in 0..1024u32 {
            assert_eq!(i.slot(s), info(s as u64 + 77, s % 2 == 0, true));
        }
        i.check_invariants();
    }

    // ---- model test ----

    #[derive(Debug, Clone)]
    enum Op {
        /// `own`: reuse the slot the lba lives in, if any (the same-slot replace).
        Insert {
            lba: u64,
            pick: usize,
            dirty: bool,
            own: bool,
        },
        InsertIfAbsent {
            lba: u64,
            pick: usize,
            dirty: bool,
        },
        /// `actual`: move from the slot the lba lives in (else from slot `from`); `same`: to == from.
        MoveIf {
            lba: u64,
            from: u32,
            pick: usize,
            actual: bool,
            same: bool,
        },
        Remove {
            lba: u64,
        },
        RemoveIf {
            lba: u64,
            slot: u32,
            actual: bool,
        },
        /// `how`: 0 automatic, 1 probing, 2 scanning + rebuild, 3 scanning + deleting.
        RemoveRange {
            first: u64,
            count: u64,
            how: u8,
        },
        SetCleanIf {
            lba: u64,
            slot: u32,
            actual: bool,
        },
        Touch {
            slot: u32,
        },
        ClearReferenced {
            slot: u32,
        },
    }

    fn lba_strategy() -> impl Strategy<Value = u64> {
        prop_oneof![
            8 => 0..48u64,
            1 => (Index::MAX_LBA - 3)..=Index::MAX_LBA,
            1 => (1u64 << 40)..(1u64 << 40) + 4,
        ]
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        let lba = lba_strategy;
        let slot = || 0..40u32;
        prop_oneof![
            6 => (lba(), any::<usize>(), any::<bool>(), prop::bool::weighted(0.2))
                .prop_map(|(lba, pick, dirty, own)| Op::Insert { lba, pick, dirty, own }),
            3 => (lba(), any::<usize>(), any::<bool>())
                .prop_map(|(lba, pick, dirty)| Op::InsertIfAbsent { lba, pick, dirty }),
            3 => (lba(), slot(), any::<usize>(), prop::bool::weighted(0.7), prop::bool::weighted(0.1))
                .prop_map(|(lba, from, pick, actual, same)| Op::MoveIf { lba, from, pick, actual, same }),
            3 => lba().prop_map(|lba| Op::Remove { lba }),
            2 => (lba(), slot(), any::<bool>())
                .prop_map(|(lba, slot, actual)| Op::RemoveIf { lba, slot, actual }),
            1 => (lba(), prop_oneof![0..4u64, 0..60u64, Just(u64::MAX)], 0..4u8)
                .prop_map(|(first, count, how)| Op::RemoveRange { first, count, how }),
            2 => (lba(), slot(), any::<bool>())
                .prop_map(|(lba, slot, actual)| Op::SetCleanIf { lba, slot, actual }),
            2 => slot().prop_map(|slot| Op::Touch { slot }),
            1 => slot().prop_map(|slot| Op::ClearReferenced { slot }),
        ]
    }

    #[derive(Default)]
    struct Model {
        /// lba -> (slot, dirty)
        lbas: HashMap<u64, (u32, bool)>,
        /// slot -> (lba, referenced)
        slots: HashMap<u32, (u64, bool)>,
    }

    impl Model {
        fn free_slot(&self, slot_count: u32, pick: usize) -> Option<u32> {
            let free: Vec<u32> = (0..slot_count)
                .filter(|s| !self.slots.contains_key(s))
                .collect();
            (!free.is_empty()).then(|| free[pick % free.len()])
        }

        fn map(&mut self, lba: u64, slot: u32, dirty: bool) -> Option<u32> {
            let old = self.lbas.insert(lba, (slot, dirty)).map(|(s, _)| s);
            if let Some(old) = old {
                self.slots.remove(&old);
            }
            self.slots.insert(slot, (lba, false));
            old
        }

        fn unmap(&mut self, lba: u64) -> Option<(u32, bool)> {
            let (slot, dirty) = self.lbas.remove(&lba)?;
            self.slots.remove(&slot);
            Some((slot, dirty))
        }

        fn lives_in(&self, lba: u64, slot: u32) -> bool {
            self.lbas.get(&lba).is_some_and(|&(s, _)| s == slot)
        }
    }

    /// Cell layouts for the model test: (displacement bits, fingerprint bits).
    const LAYOUTS: [(u32, u32); 5] = [(MAX_DISPLACEMENT_BITS, 32), (0, 0), (1, 0), (2, 1), (0, 3)];

    fn run_model(slot_count: u32, layout: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let (disp_bits, fp_bits) = LAYOUTS[layout];
        let mut index = Index::with_layout(slot_count, disp_bits, fp_bits);
        let mut model = Model::default();
        let mut seen_lbas: HashSet<u64> = HashSet::new();
        for op in ops {
            match op {
                Op::Insert {
                    lba,
                    pick,
                    dirty,
                    own,
                } => {
                    let slot = match model.lbas.get(&lba) {
                        Some(&(s, _)) if own => Some(s),
                        _ => model.free_slot(slot_count, pick),
                    };
                    if let Some(slot) = slot {
                        seen_lbas.insert(lba);
                        let expect = model.map(lba, slot, dirty);
                        prop_assert_eq!(index.insert(lba, slot, dirty), expect);
                    }
                }
                Op::InsertIfAbsent { lba, pick, dirty } => {
                    seen_lbas.insert(lba);
                    if model.lbas.contains_key(&lba) {
                        // Any slot will do: nothing happens.
                        let slot = (pick % slot_count as usize) as u32;
                        prop_assert!(!index.insert_if_absent(lba, slot, dirty));
                    } else if let Some(slot) = model.free_slot(slot_count, pick) {
                        model.map(lba, slot, dirty);
                        prop_assert!(index.insert_if_absent(lba, slot, dirty));
                    }
                }
                Op::MoveIf {
                    lba,
                    from,
                    pick,
                    actual,
                    same,
                } => {
                    let from = match model.lbas.get(&lba) {
                        Some(&(s, _)) if actual => s,
                        _ => from % slot_count,
                    };
                    if model.lives_in(lba, from) {
                        let to = if same {
                            Some(from)
                        } else {
                            model.free_slot(slot_count, pick)
                        };
                        if let Some(to) = to {
                            let dirty = model.lbas[&lba].1;
                            model.unmap(lba);
                            model.map(lba, to, dirty);
                            prop_assert!(index.move_if(lba, from, to));
                        }
                    } else {
                        // `to` can be anything, even busy: nothing happens.
                        let to = (pick % slot_count as usize) as u32;
                        prop_assert!(!index.move_if(lba, from, to));
                    }
                }
                Op::Remove { lba } => {
                    let expect = model.unmap(lba).map(|(s, _)| s);
                    prop_assert_eq!(index.remove(lba), expect);
                }
                Op::RemoveIf { lba, slot, actual } => {
                    let slot = match model.lbas.get(&lba) {
                        Some(&(s, _)) if actual => s,
                        _ => slot % slot_count,
                    };
                    let expect = model.lives_in(lba, slot);
                    if expect {
                        model.unmap(lba);
                    }
                    prop_assert_eq!(index.remove_if(lba, slot), expect);
                }
                Op::RemoveRange { first, count, how } => {
                    let end = first.saturating_add(count);
                    let mut expect: Vec<(u64, u32, bool)> = model
                        .lbas
                        .iter()
                        .filter(|(&lba, _)| lba >= first && lba < end)
                        .map(|(&lba, &(slot, dirty))| (lba, slot, dirty))
                        .collect();
                    for &(lba, _, _) in &expect {
                        model.unmap(lba);
                    }
                    let mut got = Vec::new();
                    let cb = |lba, slot, dirty| got.push((lba, slot, dirty));
                    let clipped = end.min(Index::MAX_LBA + 1);
                    match how {
                        1 if first <= Index::MAX_LBA && count < 1000 => {
                            index.remove_range_probing(first, clipped, cb)
                        }
                        2 if first <= Index::MAX_LBA => {
                            index.remove_range_scanning(first, clipped, Some(true), cb)
                        }
                        3 if first <= Index::MAX_LBA => {
                            index.remove_range_scanning(first, clipped, Some(false), cb)
                        }
                        _ => index.remove_range(first, count, cb),
                    }
                    expect.sort_unstable();
                    got.sort_unstable();
                    prop_assert_eq!(got, expect);
                }
                Op::SetCleanIf { lba, slot, actual } => {
                    let slot = match model.lbas.get(&lba) {
                        Some(&(s, _)) if actual => s,
                        _ => slot % slot_count,
                    };
                    let expect = model.lives_in(lba, slot);
                    if expect {
                        model.lbas.get_mut(&lba).unwrap().1 = false;
                    }
                    prop_assert_eq!(index.set_clean_if(lba, slot), expect);
                }
                Op::Touch { slot } => {
                    let slot = slot % slot_count;
                    if let Some(e) = model.slots.get_mut(&slot) {
                        e.1 = true;
                    }
                    index.touch(slot);
                }
                Op::ClearReferenced { slot } => {
                    let slot = slot % slot_count;
                    if let Some(e) = model.slots.get_mut(&slot) {
                        e.1 = false;
                    }
                    index.clear_referenced(slot);
                }
            }
            index.check_invariants();
            prop_assert_eq!(index.len(), model.lbas.len());
            for &lba in &seen_lbas {
                prop_assert_eq!(index.get(lba), model.lbas.get(&lba).map(|&(s, _)| s));
            }
            for slot in 0..slot_count {
                let expect = model.slots.get(&slot).map(|&(lba, referenced)| SlotInfo {
                    lba,
                    dirty: model.lbas[&lba].1,
                    referenced,
                });
                prop_assert_eq!(index.slot(slot), expect);
            }
            let listed: Vec<(u32, SlotInfo)> = index.slots_in(0, slot_count).collect();
            prop_assert_eq!(listed.len(), model.slots.len());
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn behaves_like_a_model(
            slot_count in prop_oneof![1..4u32, 4..12u32, 12..40u32],
            layout in 0..LAYOUTS.len(),
            ops in prop::collection::vec(op_strategy(), 1..200),
        ) {
            run_model(slot_count, layout, ops)?;
        }
    }

    /// `cargo test --release -p flashtier-engine index::tests::bench_lookup -- --ignored --nocapture`
    #[test]
    #[ignore = "benchmark: run in release with --nocapture"]
    fn bench_lookup() {
        use std::hint::black_box;
        use std::time::Instant;
        let slots: u32 = 1 << 22;
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        // Sequential LBAs in a shuffled slot order, as a log scatters them.
        let mut order: Vec<u32> = (0..slots).collect();
        for k in (1..order.len()).rev() {
            order.swap(k, (next() % (k as u64 + 1)) as usize);
        }
        let mut index = Index::new(slots);
        let t = Instant::now();
        for (lba, &slot) in order.iter().enumerate() {
            index.insert(lba as u64, slot, false);
        }
        let fill = t.elapsed();
        println!(
            "filled {slots} slots (load {:.2}) in {:?}: {:.1} ns/insert; {:.2} bytes/slot",
            index.len() as f64 / index.table.len() as f64,
            fill,
            fill.as_nanos() as f64 / slots as f64,
            index.memory_bytes() as f64 / slots as f64
        );
        // As recovery loads a checkpoint: in slot order.
        let mut loaded = Index::new(slots);
        let t = Instant::now();
        for (slot, &lba) in order.iter().enumerate() {
            loaded.insert(lba as u64, slot as u32, false);
        }
        println!(
            "loaded {slots} slots in slot order: {:.1} ns/insert",
            t.elapsed().as_nanos() as f64 / slots as f64
        );
        drop(loaded);
        let queries: Vec<u64> = (0..slots).map(|_| next() % slots as u64).collect();
        for (what, offset) in [("hit", 0u64), ("miss", 1u64 << 40)] {
            let t = Instant::now();
            let mut found = 0u64;
            for &q in &queries {
                found += black_box(index.get(q + offset)).is_some() as u64;
            }
            let dt = t.elapsed();
            println!(
                "get ({what}, random): {:.1} ns/lookup ({found} found)",
                dt.as_nanos() as f64 / queries.len() as f64
            );
        }
        let t = Instant::now();
        let mut found = 0u64;
        for q in 0..slots as u64 {
            found += black_box(index.get(q)).is_some() as u64;
        }
        println!(
            "get (hit, sequential lbas): {:.1} ns/lookup ({found} found)",
            t.elapsed().as_nanos() as f64 / slots as f64
        );
        let t = Instant::now();
        let live = black_box(index.slots_in(0, slots).count());
        println!(
            "slots_in scan: {:.2} ns/slot ({live} live)",
            t.elapsed().as_nanos() as f64 / slots as f64
        );
        let t = Instant::now();
        let mut removed = 0u64;
        index.remove_range_probing(0, 1 << 16, |_, _, _| removed += 1);
        println!(
            "remove_range probing (all mapped): {:.1} ns/lba",
            t.elapsed().as_nanos() as f64 / (1 << 16) as f64
        );
        let t = Instant::now();
        for lba in (1u64 << 16)..(1 << 17) {
            removed += index.remove_if(lba, order[lba as usize]) as u64;
        }
        println!(
            "remove_if (eviction): {:.1} ns/call",
            t.elapsed().as_nanos() as f64 / (1 << 16) as f64
        );
        let t = Instant::now();
        index.remove_range(0, u64::MAX, |_, _, _| removed += 1);
        println!(
            "remove_range whole disk: {:?} ({removed} removed)",
            t.elapsed()
        );
        assert!(index.is_empty());
    }
}

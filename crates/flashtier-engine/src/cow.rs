//! A fixed-length array stored in chunks shared copy-on-write, so that a snapshot of it costs
//! one reference count per chunk rather than a copy of every element.
//!
//! Checkpoints need a consistent picture of the per-slot arrays (the index's slot words and the
//! blocks' checksums) at one exact log position, while the log goes on changing them. Copying
//! them under the state lock took the log writer 310 ms on a 1 TiB cache (2^28 slots, 3 GiB of
//! arrays), and every client write waited behind it. Here a snapshot clones the chunk pointers
//! (16,384 per 2^28 slots); a later change to a chunk still shared with a snapshot copies that
//! chunk first ([`CowVec::get_mut`]), and the snapshot keeps the old one. The first change to
//! each chunk after a snapshot costs a copy of one chunk (128 KiB of slot words), paid under the
//! state lock by whoever changes it; only chunks that change while the snapshot lives are ever
//! copied.
//!
//! All chunks start as the same all-zero chunk: a cache that is mostly empty (a sparse 1 TiB
//! cache file) allocates memory only for the chunks that ever held something, and walking a
//! snapshot skips the shared zero chunk whole ([`CowVec::chunks`]).
//!
//! Elements are read through `&self` and written through `&mut self` (the state lock decides
//! who may), with one exception: atomic elements may be changed through `&self` (the index's
//! REFERENCED bit), and such a change to a chunk shared with a snapshot is seen by both. Callers
//! doing that must only change what snapshots do not read (see `Index::touch`).

use std::ops::Index;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Elements per chunk (log2). 2^14: a snapshot of 2^28 slots clones 16,384 pointers per array
/// (well under a millisecond), and the copy a shared chunk costs is 128 KiB of slot words or
/// 64 KiB of checksums (tens of microseconds).
const CHUNK_SHIFT: u32 = 14;
/// Elements per chunk.
pub const CHUNK_LEN: usize = 1 << CHUNK_SHIFT;
const CHUNK_MASK: usize = CHUNK_LEN - 1;

/// What a [`CowVec`] can hold: something with a zero and a way to copy it.
pub trait Element: Send + Sync {
    /// The value every element starts with.
    fn zero() -> Self;
    /// A copy (atomics are not `Clone`).
    fn copy(&self) -> Self;
}

impl Element for u32 {
    fn zero() -> u32 {
        0
    }

    fn copy(&self) -> u32 {
        *self
    }
}

impl Element for AtomicU64 {
    fn zero() -> AtomicU64 {
        AtomicU64::new(0)
    }

    /// Relaxed: copies happen under the exclusive state lock, so the only concurrent writes are
    /// `touch`es, whose REFERENCED bit may land in either copy (it is only a hint).
    fn copy(&self) -> AtomicU64 {
        AtomicU64::new(self.load(Relaxed))
    }
}

/// A fixed-length array of `len` elements in copy-on-write chunks. See the
/// [module documentation](self). `Clone` is the snapshot: O(chunks).
pub struct CowVec<T: Element> {
    chunks: Vec<Arc<[T]>>,
    /// The shared all-zero chunk, to recognise chunks that never held anything.
    zero: Arc<[T]>,
    len: usize,
}

impl<T: Element> Clone for CowVec<T> {
    fn clone(&self) -> CowVec<T> {
        CowVec {
            chunks: self.chunks.clone(),
            zero: self.zero.clone(),
            len: self.len,
        }
    }
}

impl<T: Element> CowVec<T> {
    /// `len` zeroes, sharing one zero chunk (no memory per element until written).
    pub fn new(len: usize) -> CowVec<T> {
        let zero: Arc<[T]> = (0..CHUNK_LEN).map(|_| T::zero()).collect();
        CowVec {
            chunks: vec![zero.clone(); len.div_ceil(CHUNK_LEN)],
            zero,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The element at `i`; `None` past the end.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        Some(&self.chunks[i >> CHUNK_SHIFT][i & CHUNK_MASK])
    }

    /// The element at `i`, for writing: copies its chunk first if a snapshot shares it.
    ///
    /// Panics if `i >= len`.
    #[inline]
    pub fn get_mut(&mut self, i: usize) -> &mut T {
        assert!(
            i < self.len,
            "index {i} out of range for length {}",
            self.len
        );
        &mut unshare(&mut self.chunks[i >> CHUNK_SHIFT])[i & CHUNK_MASK]
    }

    /// The chunks that ever held anything, as `(index of their first element, elements)`, in
    /// order; the last may be shorter than [`CHUNK_LEN`]. Chunks still sharing the zero chunk
    /// are left out: all their elements are zero.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, &[T])> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| !Arc::ptr_eq(c, &self.zero))
            .map(|(n, c)| {
                let first = n << CHUNK_SHIFT;
                (first, &c[..CHUNK_LEN.min(self.len - first)])
            })
    }

    /// Calls `f(index of first element, elements)` on each chunk that ever held anything and for
    /// which `touches` (shown the chunk read-only) says yes, copying it first if a snapshot
    /// shares it: a pass over the whole array that changes only some chunks copies only those.
    pub fn for_each_chunk_mut(
        &mut self,
        touches: impl Fn(&[T]) -> bool,
        mut f: impl FnMut(usize, &mut [T]),
    ) {
        for n in 0..self.chunks.len() {
            let first = n << CHUNK_SHIFT;
            let end = CHUNK_LEN.min(self.len - first);
            if Arc::ptr_eq(&self.chunks[n], &self.zero) || !touches(&self.chunks[n][..end]) {
                continue;
            }
            f(first, &mut unshare(&mut self.chunks[n])[..end]);
        }
    }

    /// Bytes of RAM the array would take with every chunk allocated (what a full cache costs).
    pub fn nominal_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

/// `chunk` for writing, copied first if anyone else holds it (a snapshot, or the zero chunk's
/// other users).
#[inline]
fn unshare<T: Element>(chunk: &mut Arc<[T]>) -> &mut [T] {
    if Arc::get_mut(chunk).is_none() {
        *chunk = chunk.iter().map(T::copy).collect();
    }
    Arc::get_mut(chunk).expect("a chunk just copied is not shared")
}

impl<T: Element> Index<usize> for CowVec<T> {
    type Output = T;

    /// Panics if `i >= len`.
    #[inline]
    fn index(&self, i: usize) -> &T {
        self.get(i)
            .unwrap_or_else(|| panic!("index {i} out of range for length {}", self.len))
    }
}

impl<T: Element> std::ops::IndexMut<usize> for CowVec<T> {
    /// Copies the chunk first if a snapshot shares it (see [`CowVec::get_mut`]): read through
    /// `&self` what is only read.
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        self.get_mut(i)
    }
}

impl From<Vec<u32>> for CowVec<u32> {
    /// Chunks of `v` that are all zero share the zero chunk (recovery builds the checksums of a
    /// mostly empty cache this way).
    fn from(v: Vec<u32>) -> CowVec<u32> {
        let mut out = CowVec::new(v.len());
        for (n, part) in v.chunks(CHUNK_LEN).enumerate() {
            if part.iter().any(|&x| x != 0) {
                let mut chunk = vec![0u32; CHUNK_LEN];
                chunk[..part.len()].copy_from_slice(part);
                out.chunks[n] = chunk.into();
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_does_not_see_later_changes() {
        let n = 3 * CHUNK_LEN + 5;
        let mut v: CowVec<u32> = CowVec::new(n);
        v[7] = 70;
        v[CHUNK_LEN + 1] = 11;
        let snap = v.clone();
        v[7] = 71;
        v[2 * CHUNK_LEN] = 20;
        v[n - 1] = 99;
        assert_eq!(
            (snap[7], snap[CHUNK_LEN + 1], snap[2 * CHUNK_LEN]),
            (70, 11, 0)
        );
        assert_eq!(snap[n - 1], 0);
        assert_eq!(
            (v[7], v[CHUNK_LEN + 1], v[2 * CHUNK_LEN], v[n - 1]),
            (71, 11, 20, 99)
        );
        // The chunk nobody changed after the snapshot is still shared, not copied.
        assert!(Arc::ptr_eq(&v.chunks[1], &snap.chunks[1]));
        assert!(!Arc::ptr_eq(&v.chunks[0], &snap.chunks[0]));
    }

    #[test]
    fn untouched_chunks_are_the_zero_chunk_and_skipped() {
        let n = 4 * CHUNK_LEN + 3;
        let mut v: CowVec<u32> = CowVec::new(n);
        assert_eq!(v.chunks().count(), 0);
        v[CHUNK_LEN * 4 + 2] = 1;
        v[CHUNK_LEN] = 2;
        let seen: Vec<(usize, usize)> = v.chunks().map(|(at, c)| (at, c.len())).collect();
        assert_eq!(seen, vec![(CHUNK_LEN, CHUNK_LEN), (4 * CHUNK_LEN, 3)]);
        assert_eq!(v.get(n), None);
        // Writing into the zero chunk did not change it for the others.
        assert_eq!(v[0], 0);
        assert_eq!(v.zero.iter().filter(|&&x| x != 0).count(), 0);
    }

    #[test]
    fn from_vec_shares_zero_chunks() {
        let mut raw = vec![0u32; 2 * CHUNK_LEN + 1];
        raw[2 * CHUNK_LEN] = 5;
        let v = CowVec::from(raw);
        assert_eq!(v.len(), 2 * CHUNK_LEN + 1);
        assert_eq!(v[2 * CHUNK_LEN], 5);
        assert_eq!(
            v.chunks().map(|(at, _)| at).collect::<Vec<_>>(),
            vec![2 * CHUNK_LEN]
        );
    }

    #[test]
    fn atomic_elements_copy_their_value() {
        let mut v: CowVec<AtomicU64> = CowVec::new(10);
        *v.get_mut(3).get_mut() = 42;
        let snap = v.clone();
        *v.get_mut(3).get_mut() = 43;
        assert_eq!(snap[3].load(Relaxed), 42);
        assert_eq!(v[3].load(Relaxed), 43);
    }
}

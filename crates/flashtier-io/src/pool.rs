//! A pool of aligned buffers, so a request's data can be handed to a background writer without a
//! heap allocation per request.
//!
//! A write's data travels from the client's thread to the log writer, which writes it and drops
//! it: without a pool every write allocates (and zeroes) a buffer and frees it on another thread.
//! [`BufPool::take`] hands out a [`PooledBuf`]; dropping it puts the buffer back in its pool.
//!
//! Buffers are kept in size classes (powers of two from [`AlignedBuf::ALIGN`] up to the pool's
//! largest), each a free list behind its own short mutex. A class keeps at most
//! `bytes_per_class` bytes of idle buffers: a burst allocates what it needs, and what it leaves
//! beyond that is freed rather than held forever. Requests above the largest class are served by
//! a plain allocation (they are rare and large enough that the allocation is noise).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use crate::AlignedBuf;

/// Idle buffers of one size.
struct Class {
    len: usize,
    max_idle: usize,
    idle: Mutex<Vec<AlignedBuf>>,
}

/// Aligned buffers by size class; see the module doc.
pub struct BufPool {
    classes: Vec<Class>,
}

impl BufPool {
    /// A pool of classes from [`AlignedBuf::ALIGN`] to `largest` bytes (rounded up to a power of
    /// two), each keeping at most `bytes_per_class` bytes of idle buffers (at least one buffer).
    pub fn new(largest: usize, bytes_per_class: usize) -> Arc<BufPool> {
        let largest = largest.max(AlignedBuf::ALIGN).next_power_of_two();
        let mut classes = Vec::new();
        let mut len = AlignedBuf::ALIGN;
        while len <= largest {
            let max_idle = (bytes_per_class / len).max(1);
            classes.push(Class {
                len,
                max_idle,
                idle: Mutex::new(Vec::with_capacity(max_idle)),
            });
            len *= 2;
        }
        Arc::new(BufPool { classes })
    }

    fn class_of(&self, len: usize) -> Option<usize> {
        self.classes.iter().position(|c| c.len >= len)
    }

    /// A buffer of `len` bytes whose contents are unspecified (a reused buffer keeps what its last
    /// user wrote): the caller fills all of it.
    pub fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        let Some(i) = self.class_of(len) else {
            return PooledBuf::from(AlignedBuf::zeroed(len));
        };
        let class = &self.classes[i];
        let reused = class.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut buf = reused.unwrap_or_else(|| AlignedBuf::zeroed(class.len));
        buf.resize(len);
        PooledBuf {
            buf,
            home: Some((self.clone(), i)),
        }
    }

    /// Idle buffers held, all classes together.
    #[cfg(test)]
    fn idle_buffers(&self) -> usize {
        self.classes
            .iter()
            .map(|c| c.idle.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    fn give_back(&self, class: usize, buf: AlignedBuf) {
        let class = &self.classes[class];
        let mut idle = class.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < class.max_idle {
            idle.push(buf);
        }
    }
}

/// A buffer from a [`BufPool`] (or a plain [`AlignedBuf`] that belongs to none); dropping it
/// returns it to its pool.
pub struct PooledBuf {
    buf: AlignedBuf,
    home: Option<(Arc<BufPool>, usize)>,
}

impl From<AlignedBuf> for PooledBuf {
    /// A buffer that belongs to no pool: dropping it frees it.
    fn from(buf: AlignedBuf) -> PooledBuf {
        PooledBuf { buf, home: None }
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some((pool, class)) = self.home.take() {
            pool.give_back(class, std::mem::take(&mut self.buf));
        }
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuf")
            .field("len", &self.buf.len())
            .field("pooled", &self.home.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_is_reused_not_reallocated() {
        let pool = BufPool::new(64 << 10, 1 << 20);
        let mut a = pool.take(4096);
        a.fill(7);
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.idle_buffers(), 1);
        let b = pool.take(4096);
        assert_eq!(b.as_ptr(), ptr, "the idle buffer is handed out again");
        assert_eq!(b.len(), 4096);
        assert_eq!(pool.idle_buffers(), 0);
    }

    #[test]
    fn sizes_go_to_their_class_and_lengths_are_exact() {
        let pool = BufPool::new(64 << 10, 1 << 20);
        for len in [512, 4096, 4097, 12 << 10, 16 << 10, 64 << 10] {
            let b = pool.take(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        }
        // 512 and 4096 share the 4K class, 4097 goes to 8K, 12K and 16K share 16K: each class kept one.
        assert_eq!(pool.idle_buffers(), 4);
        // Beyond the largest class: a plain buffer, not kept.
        drop(pool.take(1 << 20));
        assert_eq!(pool.idle_buffers(), 4);
    }

    #[test]
    fn a_class_keeps_at_most_its_idle_bytes() {
        let pool = BufPool::new(4096, 3 * 4096);
        let held: Vec<_> = (0..10).map(|_| pool.take(4096)).collect();
        drop(held);
        assert_eq!(pool.idle_buffers(), 3);
    }

    #[test]
    fn a_plain_buffer_belongs_to_no_pool() {
        let b = PooledBuf::from(AlignedBuf::zeroed(8192));
        assert_eq!(b.len(), 8192);
        assert!(b.iter().all(|&x| x == 0));
    }
}

//! Page-aligned byte buffers.
//!
//! O_DIRECT wants the buffer address, the file offset and the length all aligned to the device's
//! logical block size. Allocating every I/O buffer at [`AlignedBuf::ALIGN`] lets the layers above
//! hand their buffers straight to the device without a bounce copy.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A heap buffer whose start is aligned to [`AlignedBuf::ALIGN`] bytes.
///
/// The length can change with [`AlignedBuf::resize`]; the allocation only grows, so a buffer reused
/// for many requests stops allocating once it has seen the largest one.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only permit reads of initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Alignment of every buffer: the largest logical block size we expect from a device.
    pub const ALIGN: usize = 4096;

    /// An empty buffer that has not allocated.
    pub const fn new() -> Self {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        let mut buf = Self::new();
        buf.resize(len);
        buf
    }

    /// Sets the length to `len`. Bytes beyond the previous length read as zero only on a fresh
    /// allocation; a reused buffer keeps whatever its last user left there, which is what the I/O
    /// paths want (they overwrite it) and avoids a memset per request.
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            self.grow(len);
        }
        self.len = len;
    }

    /// Releases the allocation if it is larger than `max_cap`, so one huge request does not pin
    /// its buffer for the life of a connection.
    pub fn shrink_to(&mut self, max_cap: usize) {
        if self.cap > max_cap {
            self.free();
            self.len = 0;
        }
    }

    /// Bytes it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    fn grow(&mut self, min_cap: usize) {
        let cap = min_cap.next_multiple_of(Self::ALIGN);
        let layout = Layout::from_size_align(cap, Self::ALIGN).expect("buffer size overflows");
        // SAFETY: layout has non-zero size (min_cap > self.cap >= 0 and rounded up to ALIGN).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        // Contents are not preserved: every caller refills the buffer after resizing it.
        self.free();
        self.ptr = ptr;
        self.cap = cap;
    }

    fn free(&mut self) {
        if self.cap > 0 {
            let layout = Layout::from_size_align(self.cap, Self::ALIGN).expect("valid layout");
            // SAFETY: ptr was allocated with exactly this layout in grow().
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
            self.ptr = NonNull::dangling();
            self.cap = 0;
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes (alloc_zeroed), or dangling with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

/// True when `buf`, `offset` and the length are all multiples of `align` (a power of two), which
/// is what O_DIRECT requires.
pub fn is_aligned(buf: &[u8], offset: u64, align: usize) -> bool {
    let mask = align as u64 - 1;
    (buf.as_ptr() as u64 | offset | buf.len() as u64) & mask == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed_on_first_allocation() {
        let buf = AlignedBuf::zeroed(10_000);
        assert_eq!(buf.len(), 10_000);
        assert_eq!(buf.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(buf.capacity(), 12_288);
    }

    #[test]
    fn resize_reuses_allocation_until_it_must_grow() {
        let mut buf = AlignedBuf::zeroed(4096);
        let first = buf.as_ptr();
        buf.resize(100);
        buf.resize(4096);
        assert_eq!(buf.as_ptr(), first);
        buf.resize(8192);
        assert_eq!(buf.len(), 8192);
        assert_eq!(buf.as_ptr() as usize % AlignedBuf::ALIGN, 0);
    }

    #[test]
    fn shrink_releases_large_buffers_only() {
        let mut buf = AlignedBuf::zeroed(1 << 20);
        buf.shrink_to(1 << 21);
        assert_eq!(buf.capacity(), 1 << 20);
        buf.shrink_to(4096);
        assert_eq!(buf.capacity(), 0);
        assert!(buf.is_empty());
    }

    #[test]
    fn empty_buffer_is_a_valid_slice() {
        let buf = AlignedBuf::new();
        assert!(buf.is_empty());
        assert_eq!(&buf[..], &[] as &[u8]);
    }

    #[test]
    fn alignment_check() {
        let buf = AlignedBuf::zeroed(8192);
        assert!(is_aligned(&buf, 4096, 4096));
        assert!(!is_aligned(&buf, 512, 4096));
        assert!(is_aligned(&buf, 512, 512));
        assert!(!is_aligned(&buf[1..513], 0, 512));
        assert!(!is_aligned(&buf[..100], 0, 512));
    }
}

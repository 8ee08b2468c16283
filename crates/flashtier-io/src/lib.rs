//! # flashtier-io: the devices flashtier reads and writes
//!
//! Everything flashtier stores goes through one trait, [`BlockDev`]: a fixed-size byte array with
//! positioned reads and writes, an explicit durability point (`flush`, or `fua` on a single write),
//! and the hints a block device understands (trim, zeroing, prefetch, allocation map). The backing
//! store is a `BlockDev`, the cache device is a `BlockDev`, and what the NBD front end serves is a
//! `BlockDev` too, so layers stack freely: a pass-through export is simply the backing device
//! served as is, and tests can put any device under any layer.
//!
//! Design choices:
//! - **Synchronous, thread-safe, positioned I/O.** Every method takes `&self` and may be called
//!   from many threads at once; concurrency comes from the callers' threads (the NBD server runs a
//!   small pool per connection), not from futures. This keeps the hot path free of allocation and
//!   boxing, and `pread`/`pwrite` on O_DIRECT files already run in parallel in the kernel.
//! - **Errors are `std::io::Error`** carrying the errno, because the protocol above reports
//!   failures as errno values; a device saying `ENOSPC` must reach the client as `ENOSPC`.
//! - **Aligned buffers everywhere** ([`AlignedBuf`]): the layers above allocate page-aligned
//!   buffers so an O_DIRECT device never needs a bounce copy for well-formed requests; unaligned
//!   requests still work, through a bounce buffer and read-modify-write.
//! - **Defence at every layer**: devices re-check ranges and read-only state even though the
//!   front end validates requests, so a bug above cannot grow a file or write past a partition.
//!
//! The NBD *client* device (a backing store that is any NBD server) lives in `flashtier-nbd`
//! beside the rest of the protocol code and implements this trait.

mod alloc;
mod buf;
pub mod crash;
mod dev;
pub mod fault;
mod file;
pub mod identity;
mod mem;
pub mod signature;
mod slow;
pub mod sysfs;

pub use alloc::{allocate_existing, allocated_bytes, create_allocated_file};
pub use buf::{is_aligned, AlignedBuf};
pub use crash::{CrashDev, CrashPolicy};
pub use dev::{check_range, write_zero_buffers, BlockDev, DevInfo, Extent, ZeroOpts};
pub use fault::{Fault, FaultDev, WriteFailure};
pub use file::{create_sparse_file, FileDev, FileOptions};
pub use mem::MemDev;
pub use slow::SlowDev;

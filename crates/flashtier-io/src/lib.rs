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
//!   boxing, and `pread`/`pwrite` on O_DIRECT files already run in parallel in the kernel. The
//!   one exception is [`BlockDev::read_batch`]: a thread holding several reads (pipelined client
//!   READs) submits them at once and sleeps once, through its own io_uring for a file.
//! - **Errors are `std::io::Error`** carrying the errno, because the protocol above reports
//!   failures as errno values; a device saying `ENOSPC` must reach the client as `ENOSPC`.
//! - **Aligned buffers everywhere** ([`AlignedBuf`]): the layers above allocate page-aligned
//!   buffers so an O_DIRECT device never needs a bounce copy for well-formed requests; unaligned
//!   requests still work, through a bounce buffer and read-modify-write.
//! - **Defence at every layer**: devices re-check ranges and read-only state even though the
//!   front end validates requests, so a bug above cannot grow a file or write past a partition.
//!
//! What is here: [`FileDev`] (files and block devices, O_DIRECT or not), [`AlignedBuf`] and
//! [`BufPool`] (aligned buffers, pooled so a request's data reaches a background writer without
//! an allocation), the helpers for sparse and allocated files, [`identity`] (what names a backing store),
//! [`versions`] (the per-block write record that lets a memory tier prove a copy is current),
//! [`signature`] (recognising what a device already holds), [`SlowDev`] (a slow disk, for
//! `flashtier demo`), and [`sys`]: the few system calls the other crates need, as safe wrappers,
//! so that the engine and the control plane can `forbid(unsafe_code)`. The devices that exist only
//! for tests (power loss, fault injection, memory) are in the `flashtier-testkit` crate, which
//! nothing shipped depends on.
//!
//! The NBD *client* device (a backing store that is any NBD server) lives in `flashtier-nbd`
//! beside the rest of the protocol code and implements this trait.

#![deny(missing_docs)]

mod alloc;
mod buf;
mod dev;
mod file;
pub mod identity;
mod pool;
pub mod signature;
mod slow;
pub mod sys;
pub mod sysfs;
mod uring;
pub mod versions;

pub use alloc::{allocate_existing, allocated_bytes, create_allocated_file};
pub use buf::{is_aligned, AlignedBuf};
pub use dev::{
    check_range, read_runs, write_zero_buffers, BatchRead, BatchWrite, BlockDev, DevInfo, Extent,
    ZeroOpts,
};
pub use file::{create_sparse_file, FileDev, FileOptions};
pub use pool::{BufPool, PooledBuf};
pub use slow::SlowDev;

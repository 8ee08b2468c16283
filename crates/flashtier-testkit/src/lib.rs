//! # flashtier-testkit: devices that misbehave on purpose
//!
//! flashtier promises that an acknowledged FLUSH survives power loss, that a failing disk is
//! reported rather than trusted, and that a crash at any instant recovers to a prefix of the
//! history. None of that can be checked against a real disk in a test: the power cannot be cut
//! at a chosen instant, a healthy disk does not fail on cue, and a disk that does fail does not
//! do it the same way twice. The devices here stand in for such disks. Each implements
//! [`flashtier_io::BlockDev`], so it goes wherever a file or block device would, under the engine,
//! behind the NBD server, or inside another test device:
//!
//! - [`CrashDev`] **simulates power loss**: a RAM device with a volatile write cache, whose
//!   [`CrashDev::crash`] computes what a power cut now could leave (unflushed writes kept, dropped
//!   or torn, deterministically for a seed), and whose [`CrashDev::cut_power`] makes the device go
//!   dead while other threads still use it. The power-loss, flush and detach tests are built on it.
//! - [`FaultDev`] **injects I/O errors**: a wrapper that fails the *n*-th write or flush, reads or
//!   writes of a range, or everything from some point on (optionally landing half of the failing
//!   write, like a torn write), so a test can watch the layers above handle a failing cache or
//!   backing store.
//! - [`MemDev`] is **a plain device in RAM**, for unit tests, fuzzing and seed generation, where a
//!   file would only add noise (and a filesystem to depend on).
//!
//! - [`stamp`] makes **self-describing blocks** (block number and version in every 8 bytes) for
//!   verifying workloads.
//!
//! - [`memcached`] runs **memcached servers**: real ones on loopback ports, killed and restarted
//!   on cue, and a stand-in that answers with values older than the last one set.
//!
//! The slow device ([`flashtier_io::SlowDev`]) is not here: `flashtier demo` uses it to show what a
//! cache in front of slow storage does, so it ships in the I/O crate.
//!
//! - [`alloc_count`] is a **counting global allocator** for the tests that prove a path
//!   allocates nothing (the crate's one `unsafe`, allowed in that module only).
//!
//! This crate is `publish = false` and only ever a dev-dependency (and a dependency of the fuzz
//! harness): nothing in the shipped binary links it.

#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod alloc_count;
pub mod crash;
pub mod fault;
mod mem;
pub mod memcached;
pub mod stamp;

pub use crash::{CrashDev, CrashPolicy};
pub use fault::{Fault, FaultDev, WriteFailure};
pub use mem::MemDev;

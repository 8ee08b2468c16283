//! The fuzz harnesses, as plain functions so the seed generator (`examples/gen_seeds.rs`) can run
//! every seed through them and check it goes where it is meant to.
//!
//! Each harness panics on anything the code under test must never do: a panic in the server or a
//! decoder itself, or a reply stream or decoded value that breaks an invariant checked here.
//! Returning normally means "fine".

pub mod client;
pub mod handshake;
pub mod memcached_reply;
pub mod on_device;
pub mod quirky;
pub mod request_header;
pub mod transmission;

use std::sync::Arc;

use flashtier_io::{BlockDev, ZeroOpts};
use flashtier_nbd::Export;
use flashtier_testkit::MemDev;

/// Size of the device behind every export: small, so out-of-range requests are easy to reach.
pub const DEV_SIZE: usize = 1 << 20;
/// Name of the export; it also answers to the empty name.
pub const EXPORT_NAME: &str = "disk";

/// An export over a zeroed in-memory device.
///
/// The two devices (writable and read-only) are made once per thread and reused, because
/// allocating 1 MiB per run costs more in page faults than everything else a run does. So a target
/// must leave the device zeroed when it returns (the read-only one cannot change, and the
/// transmission target checks that it did not).
/// The device serves batches of reads and writes (`MemDev::batching`), so the server's batched
/// paths run; with `quirky`, it is wrapped in [`quirky::Quirky`], which does not forward them.
pub fn export(read_only_dev: bool, force_read_only: bool, quirky: bool) -> (Export, Arc<MemDev>) {
    thread_local! {
        static DEVS: [Arc<MemDev>; 2] = [
            Arc::new(MemDev::new(DEV_SIZE).batching()),
            Arc::new(MemDev::new(DEV_SIZE).read_only().batching()),
        ];
    }
    let mem = DEVS.with(|d| d[read_only_dev as usize].clone());
    let dev: Arc<dyn BlockDev> = if quirky {
        Arc::new(quirky::Quirky::new(mem.clone()))
    } else {
        mem.clone()
    };
    let mut export = Export::new(EXPORT_NAME, dev);
    export.force_read_only = force_read_only;
    (export, mem)
}

/// Zeroes `range` of a device from [`export`] again, for the next run.
pub fn reset(mem: &MemDev, range: std::ops::Range<usize>) {
    if !mem.info().read_only && !range.is_empty() {
        mem.write_zeroes(range.start as u64, range.len() as u64, ZeroOpts::default())
            .expect("zeroing the in-memory device");
    }
}

/// A cursor over the rest of a byte slice, for walking client input and server output.
pub struct Bytes<'a> {
    pub buf: &'a [u8],
    pub pos: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Bytes { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let b = self.buf.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(b)
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
    }
}

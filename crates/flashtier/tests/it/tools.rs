//! Interoperability with real NBD tools: nbdinfo, qemu-img, qemu-io, nbdcopy, fio, nbdfuse.

#[allow(unused_imports)]
use crate::harness;

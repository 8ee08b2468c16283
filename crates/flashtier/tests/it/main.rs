//! Integration tests: the real `flashtier` binary against real tools (nbdinfo, qemu-img, qemu-io,
//! nbdcopy, fio, nbdfuse + loop + ext4) and against raw, malformed protocol input.
//!
//! One test binary (faster to link, one place to look). Tests that need a tool fail with a clear
//! message when it is missing; `./test.sh` installs them all.

mod cache_cli;
mod control;
mod crash;
mod detach;
mod disk_safety;
mod files;
mod harness;
mod hostile;
mod integrity;
mod mariadb;
mod memcached;
mod packaging;
mod probe;
mod protocol;
mod ram;
mod tls;
mod tools;
mod trace;

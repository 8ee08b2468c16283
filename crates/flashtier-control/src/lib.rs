//! # flashtier-control: operating a running flashtier
//!
//! A cache earns its keep only if the person running it can see what it does and change how it
//! does it without stopping the database on top. This crate is everything between a running
//! `flashtier serve` and that person: statistics, latencies, live parameters, mode switches,
//! and the three ways to reach them (a control socket with a CLI, a stats file to `cat`, and
//! Prometheus metrics).
//!
//! **One source of truth.** Every view is a rendering of one [`Report`] built by the
//! [`Controller`]: `flashtier stats` (a table), `stats --json`, the stats file and its `.json`,
//! and `/metrics`. They cannot disagree, and a new engine counter shows up in all of them
//! without touching this crate, because counters are always iterated, never listed.
//!
//! **The engine stays simple.** Engine counters only grow (relaxed atomics on the I/O paths).
//! Everything that is about *observing* them lives here: `reset-stats` is a baseline the
//! controller remembers, the bcache-style windows (5 minutes, hour, day, total) come from a
//! sampler that keeps a copy of the counters each second ([`windows`]), and latency is measured
//! by a [`Timed`] wrapper around whatever is exported, cache or pass-through, into lock-free
//! log-linear histograms ([`histogram`]). Nothing on the I/O path takes a lock for statistics.
//!
//! **Live tuning without detaching.** Parameters go through the engine's registry
//! (`flashtier_engine::tunables`), which validates and applies them as atomics read per request;
//! the error for a bad value names the allowed range. A mode switch can take hours (leaving
//! write-back writes every dirty block back), so it runs on a background thread as a *job* whose
//! progress (dirty blocks left) is in every report; one job at a time. `--persist` writes the
//! config file *before* applying, so a setting is never live but lost, or saved but refused.
//!
//! **Failure-proof control.** The control socket is private (0600), speaks one JSON object per
//! line ([`protocol`]), gives any bad input an error answer and keeps serving; a stuck or
//! abusive client costs one thread for a while, never the server, and never locks the operator
//! out (idle clients are closed, and the one idle longest makes room when all slots are taken). Files it writes are replaced atomically,
//! through unpredictable temporary names opened `O_EXCL | O_NOFOLLOW` and given their mode on
//! the open file, so a link planted by another user never redirects a write, and the umask
//! never widens a mode; the run directory is created 0755 and refused when others could write
//! it ([`run_dir`]).
//!
//! **Working set.** The distinct 4 KiB blocks the clients read or wrote in the last 5 minutes,
//! hour and day, what sizes a cache, is estimated in [`Timed`] with a HyperLogLog sketch (4 KiB
//! of atomic registers, standard error 1.6%), frozen once a minute into the windows
//! ([`working_set`]).
//!
//! Modules, one job each: [`histogram`], [`timed`], [`windows`], [`working_set`], [`report`]
//! (the types),
//! [`render`] (status, table, stats text), [`prometheus`], [`controller`], [`protocol`],
//! [`server`] (control socket), [`client`] (for the CLI), [`switch`] (the exported device, swapped by detach and attach), [`metrics`] (HTTP), `acceptor` (the
//! accept loop both listeners share), `atomic_file` (replacing a file whole, safely), [`run_dir`], [`statsfile`],
//! [`plane`] (starts and stops them together), [`config`] (the TOML config file), [`trace`]
//! (recording the clients' requests, and the trace file).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod acceptor;
mod atomic_file;
pub mod client;
pub mod config;
pub mod controller;
pub mod histogram;
pub mod metrics;
pub mod plane;
pub mod prometheus;
pub mod protocol;
pub mod render;
pub mod report;
pub mod run_dir;
pub mod scrub_job;
pub mod server;
pub mod statsfile;
pub mod switch;
pub mod timed;
pub mod trace;
pub mod windows;
pub mod working_set;

pub use client::{Client, ClientError};
pub use controller::{
    Attached, ControlError, Controller, ControllerOptions, DetachOptions, OpenDeviceFn, ParamRow,
    PersistFn, MEMCACHED_MODE, MODES,
};
pub use plane::{ControlPlane, ControlPlaneOptions};
pub use report::Report;
pub use switch::Switchable;
pub use timed::Timed;

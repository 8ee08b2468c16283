//! Block traces of what the clients ask of the export: [`format`] (the file, version 1),
//! [`recorder`] (recording while the server runs: `serve --trace`, `flashtier trace
//! start|stop`) and [`iolog`] (to and from fio's iolog, so a trace replays with fio).
//!
//! A trace is recorded by [`crate::Timed`], the wrapper every request to the export already
//! passes through, so it sees exactly what the clients asked, cache or pass-through, and
//! nothing the cache does on its own (write-back, reclaim, promotion): the input a cache-size
//! advisor or a replay needs.

pub mod format;
pub mod iolog;
pub mod recorder;

pub use format::{TraceError, TraceHeader, TraceOp, TraceReader, TraceRecord, TraceWriter};
pub use recorder::{TraceStartError, TraceStatus, Tracer};

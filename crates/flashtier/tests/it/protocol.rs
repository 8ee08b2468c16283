//! Malformed and edge-case protocol input over raw sockets: every refusal is the spec's, and the
//! server keeps serving other clients.

#[allow(unused_imports)]
use crate::harness;

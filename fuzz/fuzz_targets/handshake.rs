//! cargo-fuzz target `handshake`: see `flashtier_fuzz::handshake` for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flashtier_fuzz::handshake::run(data);
});

//! cargo-fuzz target `transmission`: see `flashtier_fuzz::transmission` for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flashtier_fuzz::transmission::run(data);
});

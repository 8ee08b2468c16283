//! cargo-fuzz target `request_header`: see `flashtier_fuzz::request_header` for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flashtier_fuzz::request_header::run(data);
});

//! cargo-fuzz target `on_device`: see `flashtier_fuzz::on_device` for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flashtier_fuzz::on_device::run(data);
});

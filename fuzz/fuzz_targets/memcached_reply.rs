//! cargo-fuzz target `memcached_reply`: see `flashtier_fuzz::memcached_reply` for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flashtier_fuzz::memcached_reply::run(data);
});

//! Target `memcached_reply`: what a memcached server (or anything answering on its port) sends
//! back, through the pool client's reply parsers and the tier's value decoder.
//!
//! Input: a selector byte, then the reply bytes. The selector picks the parser (get with up to
//! three keys, set, delete); for a get, every value parsed is also run through
//! `value::decode`, as the tier does with what a server returns. Checked: no panic, a parsed get
//! returns one entry per key asked and no value longer than the limit, and a value that decodes
//! carries exactly the block's length of data.
use std::io::BufReader;

use flashtier_memcached::client::protocol;
use flashtier_memcached::value::{self, KeySpace};

const KEYS: [&[u8]; 3] = [b"a", b"b", b"a"];
const MAX_VALUE: usize = 8192;
const BLOCK: usize = 4096;

pub fn run(data: &[u8]) {
    let Some((&selector, reply)) = data.split_first() else {
        return;
    };
    // A small buffer: replies split across reads are the parser's hard case.
    let mut r = BufReader::with_capacity(7, reply);
    match selector % 3 {
        0 => {
            let keys = &KEYS[..1 + (selector as usize / 3) % 3];
            if let Ok(values) = protocol::parse_get_reply(&mut r, keys, MAX_VALUE) {
                assert_eq!(values.len(), keys.len());
                let space = KeySpace::new(1, 2);
                for v in values.iter().flatten() {
                    assert!(v.len() <= MAX_VALUE);
                    if let Ok((_, block)) = value::decode(&space, v, 0, BLOCK) {
                        assert_eq!(block.len(), BLOCK);
                    }
                }
            }
        }
        1 => {
            let _ = protocol::parse_store_reply(&mut r);
        }
        _ => {
            let _ = protocol::parse_delete_reply(&mut r);
        }
    }
}

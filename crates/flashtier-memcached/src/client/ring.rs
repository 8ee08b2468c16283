//! The consistent-hash ring (ketama-style) that places keys on servers.
//!
//! Each server owns [`POINTS_PER_SERVER`] points on a `u64` ring, hashed from `"<addr>-<i>"`; a
//! key belongs to the server of the first point at or after the key's hash, wrapping around.
//! Adding or removing a server then moves only about `1/n` of the keys, and only to or from that
//! server, so the rest of the pool's cache stays warm.
//!
//! The hash must never change between releases or differ between processes: clients sharing a
//! pool must agree on where each key lives, and a restarted client must find what it stored.
//! That rules out std's `DefaultHasher` (its algorithm is unspecified and may change), so the
//! hash is spelled out here: FNV-1a 64, then murmur3's `fmix64` finalizer, because FNV alone
//! spreads short, similar inputs like `"host:port-17"` poorly over the high bits a ring compares.

/// Points each server owns on the ring: libketama's number, enough for shares of the keys that
/// stay close to even.
pub(crate) const POINTS_PER_SERVER: usize = 160;

/// The stable 64-bit hash of keys and ring points.
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    fmix64(fnv1a64(bytes))
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET_BASIS, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The ring for one list of servers: immutable, rebuilt whenever the list changes.
#[derive(Debug, Default)]
pub(crate) struct Ring {
    /// Sorted by point; the index is the server's position in the list the ring was built from.
    points: Vec<(u64, usize)>,
}

impl Ring {
    /// Builds the ring for servers named by `addrs` (their position is what lookups return).
    pub(crate) fn new<S: AsRef<str>>(addrs: &[S]) -> Ring {
        let mut points = Vec::with_capacity(addrs.len() * POINTS_PER_SERVER);
        for (server, addr) in addrs.iter().enumerate() {
            for i in 0..POINTS_PER_SERVER {
                points.push((hash(format!("{}-{i}", addr.as_ref()).as_bytes()), server));
            }
        }
        // Two servers hashing to the same point is unlikely but possible; breaking the tie by
        // name (not by position) keeps the ring independent of the order servers were added.
        points.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| addrs[a.1].as_ref().cmp(addrs[b.1].as_ref()))
        });
        points.dedup_by_key(|p| p.0);
        Ring { points }
    }

    /// The position of the server owning `key_hash`, or `None` for an empty ring.
    pub(crate) fn lookup(&self, key_hash: u64) -> Option<usize> {
        let at = self.points.partition_point(|p| p.0 < key_hash);
        let (_, server) = self.points.get(at).or_else(|| self.points.first())?;
        Some(*server)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("10.0.0.{i}:11211")).collect()
    }

    fn owners(addrs: &[String], keys: &[String]) -> Vec<String> {
        let ring = Ring::new(addrs);
        keys.iter()
            .map(|k| addrs[ring.lookup(hash(k.as_bytes())).unwrap()].clone())
            .collect()
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("block:{i}")).collect()
    }

    #[test]
    fn the_hash_is_pinned() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        // fmix64 fixes 0 and is a bijection; these pin the whole hash so that a change to it,
        // which would move every key of every deployed pool, fails here first.
        assert_eq!(fmix64(0), 0);
        assert_eq!(hash(b""), fmix64(0xcbf2_9ce4_8422_2325));
        assert_eq!(hash(b"block:0"), 0xe853_5381_f1d7_9191);
        assert_eq!(hash(b"10.0.0.1:11211-0"), 0x2448_7de7_7cd9_13bd);
    }

    #[test]
    fn mapping_is_stable_and_independent_of_order() {
        let addrs = servers(4);
        let keys = keys(2000);
        let a = owners(&addrs, &keys);
        assert_eq!(a, owners(&addrs, &keys));
        let mut reversed = addrs.clone();
        reversed.reverse();
        assert_eq!(a, owners(&reversed, &keys));
        assert_eq!(
            &a[..4],
            [
                "10.0.0.1:11211",
                "10.0.0.3:11211",
                "10.0.0.4:11211",
                "10.0.0.1:11211"
            ]
        );
    }

    #[test]
    fn keys_spread_evenly() {
        let addrs = servers(4);
        let owners = owners(&addrs, &keys(10_000));
        for addr in &addrs {
            let share = owners.iter().filter(|o| *o == addr).count();
            assert!((1500..=3500).contains(&share), "{addr}: {share} of 10000");
        }
    }

    #[test]
    fn adding_a_server_moves_a_fair_share_and_only_to_it() {
        let keys = keys(10_000);
        let four = servers(4);
        let five = servers(5);
        let before = owners(&four, &keys);
        let after = owners(&five, &keys);
        let moved: Vec<_> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
        assert!(
            (1000..=3000).contains(&moved.len()),
            "{} of 10000 moved",
            moved.len()
        );
        assert!(moved.iter().all(|&i| after[i] == five[4]));
    }

    #[test]
    fn removing_a_server_moves_only_its_keys() {
        let keys = keys(10_000);
        let five = servers(5);
        let mut four = five.clone();
        let gone = four.remove(2);
        let before = owners(&five, &keys);
        let after = owners(&four, &keys);
        for i in 0..keys.len() {
            if before[i] == gone {
                assert_ne!(after[i], gone);
            } else {
                assert_eq!(after[i], before[i], "{} moved", keys[i]);
            }
        }
    }

    #[test]
    fn lookups_wrap_and_empty_rings_miss() {
        assert_eq!(Ring::new::<String>(&[]).lookup(42), None);
        let ring = Ring::new(&servers(3));
        let first = ring.points[0];
        let last = *ring.points.last().unwrap();
        assert_eq!(ring.lookup(0), Some(first.1));
        assert_eq!(ring.lookup(first.0), Some(first.1));
        assert_eq!(ring.lookup(last.0), Some(last.1));
        if last.0 < u64::MAX {
            assert_eq!(ring.lookup(last.0 + 1), Some(first.1));
            assert_eq!(ring.lookup(u64::MAX), Some(first.1));
        }
        assert_eq!(ring.points.len(), 3 * POINTS_PER_SERVER);
    }
}

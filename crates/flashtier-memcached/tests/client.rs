//! The pool client against real memcached servers (and a server that never answers).
//!
//! Every test starts its own `memcached` processes on free loopback ports, so the tests run in
//! parallel. Timing assertions are loose on purpose (the suite must pass on a loaded 2-core
//! machine): deadlines are generous except where the deadline itself is under test, and then the
//! bound checked is ten times the deadline.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use flashtier_memcached::client::{Health, Pool, PoolOptions, ServerReport, ServerStats};
use flashtier_testkit::memcached::{BlackHole, Memcached};

/// How a [`FakeServer`] answers a command line.
type Reply = fn(&str) -> Vec<u8>;

/// A scripted server: answers each command line with `reply(line)`, and closes each
/// connection after `per_connection` commands. Its threads live until the test process exits.
struct FakeServer {
    addr: String,
    connections: Arc<AtomicUsize>,
}

impl FakeServer {
    fn start(per_connection: usize, reply: Reply) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                counted.fetch_add(1, Ordering::Relaxed);
                thread::spawn(move || {
                    let mut reader = BufReader::new(&stream);
                    for _ in 0..per_connection {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if (&stream).write_all(&reply(line.trim_end())).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        FakeServer { addr, connections }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }
}

fn options(timeout: Duration) -> PoolOptions {
    PoolOptions {
        timeout,
        ..PoolOptions::default()
    }
}

fn report(pool: &Pool, addr: &str) -> ServerReport {
    pool.servers()
        .into_iter()
        .find(|s| s.addr == addr)
        .unwrap_or_else(|| panic!("{addr} is not in the pool"))
}

fn value_of(key: &str) -> Vec<u8> {
    // Lengths vary, and the data holds what the protocol uses as delimiters.
    let mut v = format!("value of {key}\r\nEND\r\n").into_bytes();
    v.resize(v.len() + key.len() * 37 % 500, 0);
    v
}

fn as_refs(keys: &[String]) -> Vec<&[u8]> {
    keys.iter().map(|k| k.as_bytes()).collect()
}

fn set_all(pool: &Pool, keys: &[String]) -> usize {
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_of(k)).collect();
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_bytes(), v.as_slice()))
        .collect();
    pool.set_multi(&items)
}

fn no_failures(stats: &ServerStats) -> bool {
    stats.errors == 0 && stats.timeouts == 0 && stats.skipped == 0
}

#[test]
fn set_get_delete_round_trip() {
    let mc = Memcached::start(&[]);
    let connections = mc.stat("total_connections");
    let pool = Pool::new(&[mc.addr()], options(Duration::from_secs(2))).unwrap();

    assert_eq!(pool.get(b"alpha"), None);
    assert!(pool.set(b"alpha", b"one"));
    assert_eq!(pool.get(b"alpha").as_deref(), Some(&b"one"[..]));
    assert!(pool.set(b"alpha", b"two"));
    assert_eq!(pool.get(b"alpha").as_deref(), Some(&b"two"[..]));
    let binary = b"\0\r\nEND\r\nVALUE x 0 1\r\n\xff".to_vec();
    assert!(pool.set(b"binary", &binary));
    assert!(pool.set(b"empty", b""));
    assert_eq!(
        pool.get_multi(&[b"binary", b"empty", b"nothing", b"alpha"]),
        vec![Some(binary), Some(vec![]), None, Some(b"two".to_vec())]
    );
    assert!(pool.delete(b"alpha"));
    assert_eq!(pool.get(b"alpha"), None);
    assert!(pool.delete(b"alpha"), "NOT_FOUND: the key is not there");

    let r = report(&pool, &mc.addr());
    assert_eq!(r.health, Health::Up);
    let s = r.stats;
    assert!(no_failures(&s), "{s:?}");
    assert_eq!((s.gets, s.hits, s.misses), (8, 5, 3));
    assert_eq!((s.sets, s.deletes), (4, 2));
    // One round trip per call, each on the one server.
    assert_eq!(s.latency.count(), 11);
    assert!(s.latency.percentile(50.0) <= s.latency.percentile(100.0));
    let server = mc.stats();
    let stat = |name: &str| server[name].parse::<u64>().unwrap();
    assert_eq!((stat("get_hits"), stat("cmd_set")), (5, 4));
    // One connection, reused by every call (and one more asking for stats).
    assert_eq!(stat("total_connections"), connections + 2);
    assert_eq!(pool.totals(), s);
}

#[test]
fn get_multi_sends_one_pipelined_get_per_server() {
    let servers: Vec<Memcached> = (0..3).map(|_| Memcached::start(&[])).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let pool = Pool::new(&addrs, options(Duration::from_secs(2))).unwrap();

    let stored: Vec<String> = (0..100).map(|i| format!("key:{i}")).collect();
    assert_eq!(set_all(&pool, &stored), 100);
    let mut keys = stored.clone();
    keys.extend((0..5).map(|i| format!("absent:{i}")));

    let before: Vec<(u64, ServerStats)> = servers
        .iter()
        .map(|m| (m.stat("bytes_read"), report(&pool, &m.addr()).stats))
        .collect();
    let values = pool.get_multi(&as_refs(&keys));
    for (key, value) in keys.iter().zip(&values) {
        let expected = key.starts_with("key:").then(|| value_of(key));
        assert_eq!(value, &expected, "{key}");
    }

    for (m, (bytes_before, stats_before)) in servers.iter().zip(before) {
        let mine: Vec<&String> = keys
            .iter()
            .filter(|k| pool.server_for(k.as_bytes()) == Some(m.addr()))
            .collect();
        assert!(!mine.is_empty(), "no keys on {}", m.addr());
        // What memcached read since: exactly one `get` line with this server's keys in order
        // (and the `stats` command asking).
        let line: usize = "get\r\n".len() + mine.iter().map(|k| k.len() + 1).sum::<usize>();
        let read = m.stat("bytes_read") - bytes_before;
        assert_eq!(read as usize, line + "stats\r\n".len(), "{}", m.addr());

        let delta = report(&pool, &m.addr()).stats.sub(&stats_before);
        assert_eq!(delta.latency.count(), 1, "one request to {}", m.addr());
        assert_eq!(delta.gets as usize, mine.len());
        assert_eq!(delta.hits + delta.misses, delta.gets);
        assert_eq!(delta.bytes_written as usize, line);
        assert!(no_failures(&delta));
    }
    let totals = pool.totals();
    assert_eq!((totals.gets, totals.hits, totals.misses), (105, 100, 5));
    assert_eq!(totals.sets, 100);
}

#[test]
fn a_killed_server_misses_quickly_and_comes_back_after_its_backoff() {
    let mut servers: Vec<Memcached> = (0..3).map(|_| Memcached::start(&[])).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    let timeout = Duration::from_millis(200);
    let pool = Pool::new(
        &addrs,
        PoolOptions {
            timeout,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_millis(400),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    assert_eq!(set_all(&pool, &keys), 60);
    assert!(pool.get_multi(&as_refs(&keys)).iter().all(Option::is_some));

    let dead = addrs[1].clone();
    let on_dead = |k: &String| pool.server_for(k.as_bytes()) == Some(dead.clone());
    assert!(keys.iter().any(on_dead));
    servers[1].kill();

    for round in 0..3 {
        let start = Instant::now();
        let values = pool.get_multi(&as_refs(&keys));
        let elapsed = start.elapsed();
        assert!(
            elapsed < timeout + Duration::from_secs(2),
            "round {round}: {elapsed:?}"
        );
        for (key, value) in keys.iter().zip(&values) {
            if on_dead(key) {
                assert_eq!(value, &None, "{key}");
            } else {
                assert_eq!(value.as_deref(), Some(&value_of(key)[..]), "{key}");
            }
        }
    }
    let r = report(&pool, &dead);
    let Health::Down {
        since, retry_at, ..
    } = r.health
    else {
        panic!("{dead} is not down: {r:?}");
    };
    assert!(retry_at > since);
    assert!(r.stats.errors + r.stats.timeouts >= 1, "{:?}", r.stats);
    assert_eq!(r.stats.misses, 0, "failures are not misses");
    let dead_key = keys.iter().find(|k| on_dead(k)).unwrap();
    assert!(!pool.delete(dead_key.as_bytes()));
    for addr in [&addrs[0], &addrs[2]] {
        let r = report(&pool, addr);
        assert_eq!(r.health, Health::Up);
        assert!(no_failures(&r.stats), "{addr}: {:?}", r.stats);
    }

    servers[1].restart();
    let until = Instant::now() + Duration::from_secs(20);
    while !report(&pool, &dead).health.is_up() {
        assert!(Instant::now() < until, "{dead} never came back up");
        pool.get(dead_key.as_bytes());
        thread::sleep(Duration::from_millis(20));
    }
    // The restarted server is empty; it takes sets and serves gets again.
    let mine: Vec<String> = keys.iter().filter(|k| on_dead(k)).cloned().collect();
    assert_eq!(set_all(&pool, &mine), mine.len());
    let values = pool.get_multi(&as_refs(&keys));
    assert!(values.iter().all(Option::is_some));
    assert_eq!(report(&pool, &dead).health, Health::Up);
}

#[test]
fn a_server_that_never_answers_times_out_without_holding_up_the_others() {
    let hole = BlackHole::start();
    let mc = Memcached::start(&[]);
    let timeout = Duration::from_millis(100);
    let pool = Pool::new(
        &[hole.addr.clone(), mc.addr()],
        PoolOptions {
            timeout,
            backoff_min: Duration::from_secs(60),
            backoff_max: Duration::from_secs(60),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let (on_hole, on_mc): (Vec<String>, Vec<String>) = keys
        .iter()
        .cloned()
        .partition(|k| pool.server_for(k.as_bytes()) == Some(hole.addr.clone()));
    assert!(!on_hole.is_empty() && !on_mc.is_empty());
    assert_eq!(set_all(&pool, &on_mc), on_mc.len());

    let start = Instant::now();
    let values = pool.get_multi(&as_refs(&keys));
    let elapsed = start.elapsed();
    assert!(elapsed >= timeout, "{elapsed:?}");
    assert!(elapsed < timeout * 10, "{elapsed:?}");
    for (key, value) in keys.iter().zip(&values) {
        let expected = on_mc.contains(key).then(|| value_of(key));
        assert_eq!(value, &expected, "{key}");
    }

    let r = report(&pool, &hole.addr);
    assert_eq!((r.stats.timeouts, r.stats.errors), (1, 0));
    assert_eq!(r.stats.gets as usize, on_hole.len());
    let Health::Down { last_error, .. } = r.health else {
        panic!("{} is not down: {r:?}", hole.addr);
    };
    assert!(last_error.contains("timed out"), "{last_error}");
    let r = report(&pool, &mc.addr());
    assert_eq!(r.health, Health::Up);
    assert!(no_failures(&r.stats), "{:?}", r.stats);

    // While down, its keys are skipped without waiting on it.
    let start = Instant::now();
    assert_eq!(pool.get(on_hole[0].as_bytes()), None);
    assert!(!pool.set(on_hole[0].as_bytes(), b"v"));
    assert!(start.elapsed() < timeout * 10);
    let r = report(&pool, &hole.addr);
    assert_eq!(r.stats.skipped, 2);
    assert_eq!(r.stats.timeouts, 1);
}

#[test]
fn servers_come_and_go_while_other_threads_use_the_pool() {
    let servers: Vec<Memcached> = (0..4).map(|_| Memcached::start(&[])).collect();
    let addrs: Vec<String> = servers.iter().map(Memcached::addr).collect();
    // Generous: this test is about membership changes, not deadlines.
    let pool = Arc::new(Pool::new(&addrs[..3], options(Duration::from_secs(5))).unwrap());
    let keys: Vec<String> = (0..200).map(|i| format!("live:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));

    let mut threads = Vec::new();
    for t in 0..3 {
        let (pool, keys, stop) = (pool.clone(), keys.clone(), stop.clone());
        threads.push(thread::spawn(move || {
            let mut last_gets = 0;
            let mut calls = 0;
            while !stop.load(Ordering::Relaxed) || calls < 10 {
                if t == 0 {
                    set_all(&pool, &keys);
                } else {
                    let chunk = &keys[(calls * 20) % 200..][..20];
                    for (key, value) in chunk.iter().zip(pool.get_multi(&as_refs(chunk))) {
                        // Every writer stores the same value for a key, so anything found is it.
                        if let Some(value) = value {
                            assert_eq!(value, value_of(key), "{key}");
                        }
                    }
                    let gets = pool.totals().gets;
                    assert!(gets >= last_gets, "totals went backwards");
                    last_gets = gets;
                }
                calls += 1;
            }
            calls
        }));
    }

    let pause = || thread::sleep(Duration::from_millis(30));
    for _ in 0..5 {
        pause();
        pool.add_server(&addrs[3]).unwrap();
        pause();
        pool.remove_server(&addrs[0]).unwrap();
        pause();
        pool.add_server(&addrs[0]).unwrap();
        pause();
        pool.remove_server(&addrs[3]).unwrap();
    }
    pause();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        assert!(t.join().expect("no thread panicked") >= 10);
    }

    let reports = pool.servers();
    let names: Vec<&str> = reports.iter().map(|r| r.addr.as_str()).collect();
    assert_eq!(names, [&addrs[1], &addrs[2], &addrs[0]]);
    for r in &reports {
        assert_eq!(r.health, Health::Up, "{}", r.addr);
        assert!(no_failures(&r.stats), "{}: {:?}", r.addr, r.stats);
    }
    let totals = pool.totals();
    assert_eq!((totals.errors, totals.timeouts, totals.skipped), (0, 0, 0));
    let current: u64 = reports.iter().map(|r| r.stats.gets).sum();
    assert!(totals.gets > current, "removed servers' counts are kept");
    assert_eq!(totals.gets, totals.hits + totals.misses);
    // The pool still works for every key.
    assert_eq!(set_all(&pool, &keys), keys.len());
    assert!(pool.get_multi(&as_refs(&keys)).iter().all(Option::is_some));
}

#[test]
fn a_value_too_large_for_the_server_fails_but_the_server_stays_up() {
    let mc = Memcached::start(&["-I", "1m"]);
    let connections = mc.stat("total_connections");
    let timeout = Duration::from_secs(5);
    // A client limit above the server's, so the server is the one that refuses.
    let generous = Pool::new(
        &[mc.addr()],
        PoolOptions {
            max_value_len: 4 << 20,
            ..options(timeout)
        },
    )
    .unwrap();
    let big = vec![b'x'; 2 << 20];
    assert!(!generous.set(b"big", &big));
    let r = report(&generous, &mc.addr());
    assert_eq!(r.health, Health::Up);
    assert_eq!((r.stats.errors, r.stats.timeouts, r.stats.sets), (1, 0, 1));
    assert!(r.stats.bytes_written > 2 << 20, "the value was sent");
    // The connection stayed in step: the next requests on it work.
    assert!(generous.set(b"small", b"fits"));
    assert_eq!(generous.get(b"small").as_deref(), Some(&b"fits"[..]));
    assert_eq!(generous.get(b"big"), None);
    let half = vec![b'h'; 512 << 10];
    assert!(generous.set(b"half", &half));
    assert_eq!(generous.get(b"half"), Some(half));
    let r = report(&generous, &mc.addr());
    assert_eq!(r.health, Health::Up);
    assert_eq!(r.stats.errors, 1);
    // The rejection did not cost the connection: one for the pool, one asking for stats.
    assert_eq!(mc.stat("total_connections"), connections + 2);

    // With the default limit (memcached's default item size), the value is not even sent.
    let default = Pool::new(&[mc.addr()], options(timeout)).unwrap();
    assert!(!default.set(b"big", &big));
    let r = report(&default, &mc.addr());
    assert_eq!(r.health, Health::Up);
    assert_eq!(
        (r.stats.errors, r.stats.sets, r.stats.bytes_written),
        (1, 0, 0)
    );
    // A value at the limit goes out; this server cannot hold it either (its item header counts).
    assert!(!default.set(b"max", &vec![b'm'; 1 << 20]));
    assert!(default.set(b"small", b"still fine"));
    assert_eq!(report(&default, &mc.addr()).health, Health::Up);
}

#[test]
fn a_connection_the_server_closed_is_retried_once_on_a_new_one() {
    // Each connection answers one request, then closes: every later request finds its pooled
    // connection closed.
    let fake = FakeServer::start(1, |line| match line {
        "get k" => b"VALUE k 0 2\r\nhi\r\nEND\r\n".to_vec(),
        _ => b"END\r\n".to_vec(),
    });
    let pool = Pool::new(
        std::slice::from_ref(&fake.addr),
        options(Duration::from_secs(2)),
    )
    .unwrap();
    for _ in 0..3 {
        assert_eq!(pool.get(b"k").as_deref(), Some(&b"hi"[..]));
        assert_eq!(pool.get(b"other"), None);
    }
    let r = report(&pool, &fake.addr);
    assert_eq!(r.health, Health::Up);
    assert!(no_failures(&r.stats), "{:?}", r.stats);
    assert_eq!((r.stats.hits, r.stats.misses), (3, 3));
    assert_eq!(fake.connections(), 6);
}

#[test]
fn replies_out_of_step_with_the_commands_take_the_server_down() {
    let cases: [(Reply, &str); 5] = [
        (|_| b"VALUE x 0 1\r\n!\r\nEND\r\n".to_vec(), "not asked for"),
        (|_| b"END\r\nEND\r\n".to_vec(), "unexpected bytes"),
        (|_| b"SERVER_ERROR busy\r\n".to_vec(), "SERVER_ERROR busy"),
        (|_| b"VALUE k 0 99999999\r\n".to_vec(), "over the limit"),
        (
            |_| b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
            "malformed",
        ),
    ];
    for (reply, error) in cases {
        let fake = FakeServer::start(usize::MAX, reply);
        let pool = Pool::new(
            std::slice::from_ref(&fake.addr),
            PoolOptions {
                backoff_min: Duration::from_secs(60),
                ..options(Duration::from_secs(2))
            },
        )
        .unwrap();
        assert_eq!(pool.get(b"k"), None, "{error}");
        let r = report(&pool, &fake.addr);
        assert_eq!((r.stats.errors, r.stats.timeouts), (1, 0), "{error}");
        assert_eq!((r.stats.hits, r.stats.misses), (0, 0), "{error}");
        let Health::Down { last_error, .. } = r.health else {
            panic!("{error}: still up");
        };
        assert!(last_error.contains(error), "{error}: {last_error}");
        // Skipped from now on, without touching the server.
        assert_eq!(pool.get(b"k"), None);
        assert_eq!(report(&pool, &fake.addr).stats.skipped, 1);
        assert_eq!(fake.connections(), 1);
    }
}

#[test]
fn only_one_request_at_a_time_probes_a_down_server() {
    let hole = BlackHole::start();
    let backoff = Duration::from_millis(50);
    let pool = Arc::new(
        Pool::new(
            std::slice::from_ref(&hole.addr),
            PoolOptions {
                timeout: Duration::from_secs(1),
                backoff_min: backoff,
                backoff_max: Duration::from_secs(60),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    assert_eq!(pool.get(b"k"), None);
    assert_eq!(report(&pool, &hole.addr).stats.timeouts, 1);
    thread::sleep(backoff * 2);
    let before = Instant::now();

    // The backoff has passed: of four requests at once, one probes (and waits out the
    // deadline), the others skip at once.
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                pool.get(b"k")
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), None);
    }
    let r = report(&pool, &hole.addr);
    assert_eq!((r.stats.timeouts, r.stats.skipped), (2, 3), "{:?}", r.stats);
    let Health::Down { retry_at, .. } = r.health else {
        panic!("the failed probe left it up");
    };
    // The failed probe set the next retry after its own failure (the doubling itself is
    // checked by the health state machine's unit tests, without a clock).
    assert!(retry_at >= before + Duration::from_secs(1) + backoff);
}

#[test]
fn large_set_multi_goes_out_in_batches_on_one_connection() {
    let mc = Memcached::start(&[]);
    let connections = mc.stat("total_connections");
    let pool = Pool::new(&[mc.addr()], options(Duration::from_secs(10))).unwrap();
    // More sets than one batch holds, and more bytes.
    let keys: Vec<String> = (0..300).map(|i| format!("batch:{i}")).collect();
    let values: Vec<Vec<u8>> = (0..300).map(|i| vec![i as u8; 8 << 10]).collect();
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_bytes(), v.as_slice()))
        .collect();
    assert_eq!(pool.set_multi(&items), 300);
    let got = pool.get_multi(&as_refs(&keys));
    assert!(got.iter().zip(&values).all(|(g, v)| g.as_ref() == Some(v)));
    let r = report(&pool, &mc.addr());
    assert!(no_failures(&r.stats), "{:?}", r.stats);
    assert_eq!(r.stats.latency.count(), 2, "one request each");
    assert_eq!(mc.stat("total_connections"), connections + 2);
}

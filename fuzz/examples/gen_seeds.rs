//! Writes the seed corpus, `fuzz/corpus/<target>/seed-*`, and runs every seed through its harness
//! to check it goes where it is meant to (a seed that stops early seeds nothing useful):
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds
//!
//! Seeds are named descriptively; the hash-named files the fuzzer adds are ignored by git.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use flashtier_engine::internals::batch::{BatchHeader, Kind};
use flashtier_engine::internals::checkpoint::{self, Checkpoint};
use flashtier_engine::internals::superblock;
use flashtier_engine::{BackingIdentity, Cache, FormatOptions, IdentityField, Superblock};
use flashtier_fuzz::client::{client_flags, info_payload, meta_payload, option, request, write};
use flashtier_fuzz::handshake::{self, Ended};
use flashtier_fuzz::on_device::{self, BATCH, CHECKPOINT, CHOOSE, FIX_CRC, SUPERBLOCK};
use flashtier_fuzz::transmission::{self, MAX_PAYLOAD_SMALL};
use flashtier_fuzz::{quirky, request_header, DEV_SIZE};
use flashtier_io::{AlignedBuf, BlockDev};
use flashtier_nbd::wire::{cmd, cmd_flag, errno, handshake as hflag, info, opt, BASE_ALLOCATION};
use flashtier_testkit::MemDev;

const FIXED_NZ: u32 = hflag::C_FIXED_NEWSTYLE | hflag::C_NO_ZEROES;
const DEV: u64 = DEV_SIZE as u64;

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn go(name: &str, items: &[u16]) -> Vec<u8> {
    option(opt::GO, &info_payload(name, items))
}

fn disc(handle: u64) -> Vec<u8> {
    request(0, cmd::DISC, handle, 0, 0)
}

/// A short request stream to follow a successful handshake.
fn after_handshake() -> Vec<u8> {
    cat(&[
        write(0, 1, 0, &pattern(512, 1)),
        request(0, cmd::READ, 2, 0, 512),
        request(0, cmd::FLUSH, 3, 0, 0),
        disc(4),
    ])
}

struct Writer {
    dir: std::path::PathBuf,
    count: usize,
}

impl Writer {
    fn new(root: &Path, target: &str) -> Writer {
        let dir = root.join(target);
        fs::create_dir_all(&dir).unwrap();
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            // Regression inputs (`seed-regress-*`, kept from crashes) are not generated here.
            let stale = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seed-") && !n.starts_with("seed-regress-"));
            if stale {
                fs::remove_file(path).unwrap();
            }
        }
        Writer { dir, count: 0 }
    }

    fn seed(&mut self, name: &str, data: &[u8]) {
        fs::write(self.dir.join(format!("seed-{name}")), data).unwrap();
        self.count += 1;
    }
}

fn handshake_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "handshake");
    let mut seed = |name: &str, data: Vec<u8>, check: &dyn Fn(Ended) -> bool| {
        let ended = handshake::run(&data);
        assert!(check(ended), "handshake seed {name} ended {ended:?}");
        w.seed(name, &data);
    };
    let transmission = |e: Ended| matches!(e, Ended::Transmission(_));
    let plain = |e: Ended| matches!(e, Ended::Transmission(s) if !s.structured_replies && s.base_allocation.is_none());
    let with_context = |e: Ended| matches!(e, Ended::Transmission(s) if s.structured_replies && s.base_allocation.is_some());
    let closed = |e: Ended| e == Ended::Closed;

    seed(
        "go-read",
        cat(&[
            client_flags(FIXED_NZ),
            go("disk", &[info::BLOCK_SIZE]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "go-default-name-all-info",
        cat(&[
            client_flags(FIXED_NZ),
            go("", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE, 77]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "structured-meta-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &[BASE_ALLOCATION]),
            ),
            go("disk", &[info::BLOCK_SIZE]),
            request(cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, 1, 0, 65536),
            request(cmd_flag::DF, cmd::READ, 2, 4096, 4096),
            disc(3),
        ]),
        &with_context,
    );
    seed(
        "list-meta-context",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(opt::LIST_META_CONTEXT, &meta_payload("", &[])),
            option(opt::LIST_META_CONTEXT, &meta_payload("disk", &["base:"])),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &["qemu:dirty-bitmap:x", BASE_ALLOCATION]),
            ),
            go("", &[]),
            disc(1),
        ]),
        &with_context,
    );
    seed(
        "list-info-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::LIST, &[]),
            option(
                opt::INFO,
                &info_payload("disk", &[info::NAME, info::BLOCK_SIZE]),
            ),
            go("disk", &[]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "abort",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::LIST, &[]),
            option(opt::ABORT, &[]),
        ]),
        &closed,
    );
    seed(
        "export-name-zeroes",
        cat(&[
            client_flags(hflag::C_FIXED_NEWSTYLE),
            option(opt::EXPORT_NAME, b"disk"),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "export-name-no-zeroes",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(opt::EXPORT_NAME, b""),
            after_handshake(),
        ]),
        &transmission,
    );
    seed(
        "export-name-unknown",
        cat(&[client_flags(FIXED_NZ), option(opt::EXPORT_NAME, b"nope")]),
        &closed,
    );
    seed(
        "refused-options-then-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STARTTLS, &[]),
            option(opt::EXTENDED_HEADERS, &[]),
            option(42, b"whatever"),
            option(opt::STRUCTURED_REPLY, b"x"),
            option(opt::LIST, b"x"),
            option(opt::GO, &[0, 0, 0, 4, b'd']),
            go("other", &[]),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &[BASE_ALLOCATION]),
            ),
            option(opt::INFO, &info_payload("disk", &[info::BLOCK_SIZE])[..7]),
            go("disk", &[info::BLOCK_SIZE]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "too-big-then-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(99, &vec![0x5a; 64 * 1024 + 1]),
            go("disk", &[info::BLOCK_SIZE]),
            disc(1),
        ]),
        &plain,
    );
    seed(
        "bad-client-flags",
        cat(&[client_flags(1 << 5), go("disk", &[])]),
        &|e| e == Ended::Error,
    );
    w.count
}

fn transmission_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "transmission");
    type Want = Vec<(u16, Result<(), u32>)>;
    let mut seed = |name: &str, config: u8, stream: Vec<u8>, want: Want| {
        let mut data = vec![config];
        data.extend_from_slice(&stream);
        let answers = transmission::run(&data);
        assert_eq!(answers, want, "transmission seed {name}");
        w.seed(name, &data);
    };
    const STRUCTURED: u8 = 1;
    const CONTEXT: u8 = 2;
    const FORCE_RO: u8 = 4;
    const DEV_RO: u8 = 8;
    const SMALL_PAYLOAD: u8 = 16;
    const SHORT_WRITES: u8 = 32;
    const BROKEN_WRITER: u8 = 64;
    const QUIRKY: u8 = 128;
    use cmd::*;
    let ok = Ok(());

    seed(
        "simple-all-commands",
        0,
        cat(&[
            write(0, 1, 0, &pattern(4096, 7)),
            request(0, READ, 2, 0, 4096),
            write(cmd_flag::FUA, 3, 8192, &pattern(100, 9)),
            request(0, FLUSH, 4, 0, 0),
            request(0, TRIM, 5, 0, 1024),
            request(cmd_flag::NO_HOLE, WRITE_ZEROES, 6, 2048, 1024),
            request(cmd_flag::FUA, CACHE, 7, 0, 1 << 20),
            request(0, READ, 8, 0, 8192 + 100),
            request(cmd_flag::FUA, TRIM, 9, DEV - 512, 512),
            disc(10),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (WRITE, ok),
            (FLUSH, ok),
            (TRIM, ok),
            (WRITE_ZEROES, ok),
            (CACHE, ok),
            (READ, ok),
            (TRIM, ok),
        ],
    );
    seed(
        "structured-block-status",
        STRUCTURED | CONTEXT,
        cat(&[
            write(cmd_flag::FUA, 1, 4096, &pattern(4096, 3)),
            request(cmd_flag::DF, READ, 2, 4096, 4096),
            request(0, READ, 3, 0, 0),
            request(cmd_flag::REQ_ONE, BLOCK_STATUS, 4, 0, 65536),
            request(0, BLOCK_STATUS, 5, 4096, 1 << 19),
            request(
                cmd_flag::FAST_ZERO | cmd_flag::FUA,
                WRITE_ZEROES,
                6,
                4096,
                2048,
            ),
            request(0, READ, 7, 4000, 8192),
            disc(8),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (READ, ok),
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (WRITE_ZEROES, ok),
            (READ, ok),
        ],
    );
    seed(
        "structured-errors",
        STRUCTURED,
        cat(&[
            request(0, BLOCK_STATUS, 1, 0, 4096),
            request(0, READ, 2, DEV, 1),
            write(0, 3, DEV - 10, &pattern(20, 1)),
            request(cmd_flag::REQ_ONE, READ, 4, 0, 512),
            request(0, 12, 5, 0, 0),
            request(0, READ, 6, 0, 65537),
            disc(7),
        ]),
        vec![
            (BLOCK_STATUS, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (WRITE, Err(errno::ENOSPC)),
            (READ, Err(errno::EINVAL)),
            (12, Err(errno::EINVAL)),
            (READ, Err(errno::EOVERFLOW)),
        ],
    );
    seed(
        "simple-errors",
        0,
        cat(&[
            request(0, READ, 1, DEV - 1, 2),
            request(0, READ, 2, u64::MAX, 1),
            request(0, WRITE_ZEROES, 3, DEV, 1),
            request(0, FLUSH, 4, 1, 0),
            request(cmd_flag::DF, READ, 5, 0, 512),
            request(cmd_flag::NO_HOLE, TRIM, 6, 0, 512),
            request(0, BLOCK_STATUS, 7, 0, 512),
            request(0, 0xffff, 8, 0, 0),
            disc(9),
        ]),
        vec![
            (READ, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (WRITE_ZEROES, Err(errno::ENOSPC)),
            (FLUSH, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (TRIM, Err(errno::EINVAL)),
            (BLOCK_STATUS, Err(errno::EINVAL)),
            (0xffff, Err(errno::EINVAL)),
        ],
    );
    seed(
        "read-only-export",
        FORCE_RO | STRUCTURED,
        cat(&[
            write(0, 1, 0, &pattern(512, 1)),
            request(0, TRIM, 2, 0, 512),
            request(0, WRITE_ZEROES, 3, 0, 512),
            request(0, READ, 4, 0, 512),
            request(0, FLUSH, 5, 0, 0),
            disc(6),
        ]),
        vec![
            (WRITE, Err(errno::EPERM)),
            (TRIM, Err(errno::EPERM)),
            (WRITE_ZEROES, Err(errno::EPERM)),
            (READ, ok),
            (FLUSH, ok),
        ],
    );
    seed(
        "read-only-device",
        DEV_RO,
        cat(&[
            write(cmd_flag::FUA, 1, 512, &pattern(512, 2)),
            request(0, READ, 2, 512, 512),
            disc(3),
        ]),
        vec![(WRITE, Err(errno::EPERM)), (READ, ok)],
    );
    let big = MAX_PAYLOAD_SMALL as usize + 1000;
    seed(
        "oversized-payloads",
        SMALL_PAYLOAD,
        cat(&[
            write(0, 1, 0, &pattern(big, 4)),
            request(0, READ, 2, 0, big as u32),
            write(0, 3, 0, &pattern(MAX_PAYLOAD_SMALL as usize, 5)),
            request(0, READ, 4, 0, MAX_PAYLOAD_SMALL),
            disc(5),
        ]),
        vec![
            (WRITE, Err(errno::EOVERFLOW)),
            (READ, Err(errno::EOVERFLOW)),
            (WRITE, ok),
            (READ, ok),
        ],
    );
    seed(
        "short-writes",
        SHORT_WRITES | STRUCTURED | CONTEXT,
        cat(&[
            write(0, 1, 100, &pattern(300, 6)),
            request(0, READ, 2, 0, 1000),
            request(0, BLOCK_STATUS, 3, 0, 1000),
            request(0, READ, 4, DEV, 1),
            disc(5),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (BLOCK_STATUS, ok),
            (READ, Err(errno::EINVAL)),
        ],
    );
    // The reply writer fails after 256 bytes: in the middle of the READ's reply here...
    seed(
        "broken-connection-mid-reply",
        STRUCTURED | BROKEN_WRITER,
        cat(&[
            write(0, 1, 0, &pattern(100, 1)),
            request(0, READ, 2, 0, 512),
            write(0, 3, 4096, &pattern(64, 2)),
            disc(4),
        ]),
        vec![(WRITE, ok)],
    );
    // ... and here between replies: 16 acks fill it, the WRITE_ZEROES is executed but its reply
    // fails, and the last WRITE is never read.
    let mut stream: Vec<Vec<u8>> = (0..16).map(|i| write(0, i, i, &[0xaa])).collect();
    stream.push(request(0, WRITE_ZEROES, 16, 0, 8));
    stream.push(write(0, 17, 100, &[0xbb]));
    seed(
        "broken-connection-between-replies",
        BROKEN_WRITER,
        cat(&stream),
        vec![(WRITE, ok); 16],
    );
    // Small WRITEs and READs in a row are served in batches (the plain device batches): a
    // batch's refusals are sent before its other replies, so these come back out of order.
    seed(
        "batches-with-refusals",
        0,
        cat(&[
            write(0, 1, 0, &pattern(4096, 1)),
            write(0, 2, DEV - 256, &pattern(512, 2)),
            write(0, 3, 4096, &pattern(4096, 3)),
            write(0, 4, 6000, &pattern(100, 4)),
            request(0, READ, 5, 0, 4096),
            request(0, READ, 6, DEV, 1),
            request(0, READ, 7, 4096, 4096),
            request(0, READ, 8, 5900, 300),
            disc(9),
        ]),
        vec![
            (WRITE, ok),
            (WRITE, Err(errno::ENOSPC)),
            (WRITE, ok),
            (WRITE, ok),
            (READ, ok),
            (READ, Err(errno::EINVAL)),
            (READ, ok),
            (READ, ok),
        ],
    );
    // The reply writer fails in the middle of a batch's first reply (a refusal, sent first):
    // the batch's valid WRITEs were carried out all the same.
    seed(
        "broken-connection-in-a-batch",
        BROKEN_WRITER,
        cat(&[
            request(0, READ, 1, 0, 232),
            write(0, 2, 0, &pattern(4096, 5)),
            write(0, 3, DEV - 256, &pattern(512, 6)),
            write(0, 4, 8192, &pattern(4096, 7)),
            disc(5),
        ]),
        vec![(READ, ok)],
    );
    let bad = quirky::BAD.start;
    seed(
        "quirky-device",
        STRUCTURED | CONTEXT | QUIRKY,
        cat(&[
            request(0, BLOCK_STATUS, 1, 0, 65536),
            request(cmd_flag::REQ_ONE, BLOCK_STATUS, 2, 1000, 5000),
            request(0, BLOCK_STATUS, 3, 0, DEV as u32),
            request(0, READ, 4, bad - 100, 200),
            write(0, 5, bad + 4000, &pattern(200, 3)),
            request(cmd_flag::FAST_ZERO, WRITE_ZEROES, 6, 4096, 1000),
            request(cmd_flag::FAST_ZERO, WRITE_ZEROES, 7, 8192, 8192),
            request(0, CACHE, 8, 0, DEV as u32),
            request(0, TRIM, 9, bad, 1),
            write(0, 10, bad - 512, &pattern(512, 4)),
            request(0, READ, 11, bad - 512, 512),
            request(0, FLUSH, 12, 0, 0),
            disc(13),
        ]),
        vec![
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (READ, Err(errno::EIO)),
            (WRITE, Err(errno::EIO)),
            (WRITE_ZEROES, Err(errno::ENOTSUP)),
            (WRITE_ZEROES, ok),
            (CACHE, Err(errno::EIO)),
            (TRIM, Err(errno::EIO)),
            (WRITE, ok),
            (READ, ok),
            (FLUSH, ok),
        ],
    );
    seed(
        "quirky-device-simple",
        QUIRKY,
        cat(&[
            request(0, READ, 1, bad, 512),
            write(cmd_flag::FUA, 2, 0, &pattern(512, 5)),
            request(0, READ, 3, 0, 512),
            disc(4),
        ]),
        vec![(READ, Err(errno::EIO)), (WRITE, ok), (READ, ok)],
    );
    seed(
        "bad-magic",
        0,
        cat(&[
            request(0, READ, 1, 0, 512),
            vec![0xde; 28],
            request(0, READ, 2, 0, 512),
        ]),
        vec![(READ, ok)],
    );
    seed(
        "eof-inside-write",
        STRUCTURED,
        cat(&[
            request(0, FLUSH, 1, 0, 0),
            request(0, WRITE, 2, 0, 4096),
            pattern(100, 0),
        ]),
        vec![(FLUSH, ok)],
    );
    w.count
}

fn request_header_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "request_header");
    let mut seed = |name: &str, data: Vec<u8>| {
        request_header::run(&data);
        w.seed(name, &data);
    };
    seed("read", request(0, cmd::READ, 1, 4096, 4096));
    seed(
        "write-fua",
        request(cmd_flag::FUA, cmd::WRITE, u64::MAX, 1 << 40, 65536),
    );
    seed(
        "block-status",
        request(cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, 7, 0, 1 << 20),
    );
    seed("bad-magic", vec![0xde; 28]);
    seed(
        "info-payload",
        info_payload("disk", &[info::NAME, info::BLOCK_SIZE]),
    );
    seed("info-payload-empty-name", info_payload("", &[]));
    seed(
        "meta-payload",
        meta_payload("disk", &[BASE_ALLOCATION, "qemu:dirty-bitmap:x"]),
    );
    seed("meta-payload-no-queries", meta_payload("", &[]));
    w.count
}

/// A real cache device, for the `on_device` seeds: formatted, used, closed.
struct Image {
    /// Right after `format`.
    formatted: Vec<u8>,
    /// After some traffic and a clean close.
    closed: Vec<u8>,
    /// The superblock the closed device opens with.
    sb: Superblock,
}

fn real_cache_image() -> Image {
    const CACHE_SIZE: usize = 16 << 20;
    const BACKING_SIZE: usize = 4 << 20;
    const BS: u64 = 4096;
    let cache = Arc::new(MemDev::new(CACHE_SIZE));
    let backing = Arc::new(MemDev::new(BACKING_SIZE));
    let ident = BackingIdentity {
        size: BACKING_SIZE as u64,
        name: "/dev/disk/by-id/fuzz-backing".into(),
        // Fields for the fuzzer to mutate, as a disk with a WWN would have them.
        fingerprint: vec![
            IdentityField::required("kind", "block"),
            IdentityField::required("wwid", "naa.5000c500a1b2c3d4"),
            IdentityField::info("path", "/dev/sdb"),
            IdentityField::info("devno", "8:16"),
        ],
    };
    let opts = FormatOptions {
        segment_size: 1 << 20,
        ..FormatOptions::default()
    };
    flashtier_engine::format(&*cache, ident.clone(), opts).expect("format");
    let formatted = cache.snapshot();
    let c = Cache::open(cache.clone(), backing.clone(), &ident, None).expect("open");
    let data = |len: usize, seed: u8| {
        let mut b = AlignedBuf::zeroed(len);
        b.copy_from_slice(&pattern(len, seed));
        b
    };
    // WRITE of 3 dirty blocks; WRITE with FUA; a partial block (read-modify-write); a read miss
    // (PROMOTE); a trim (INVALIDATE); writing the dirty blocks back (CLEANED).
    c.write_at(&data(3 * BS as usize, 1), 2 * BS, false)
        .unwrap();
    c.write_at(&data(BS as usize, 2), 256 * BS, true).unwrap();
    c.write_at(&data(512, 3), 100 * BS + 512, false).unwrap();
    let mut r = AlignedBuf::zeroed(2 * BS as usize);
    c.read_at(&mut r, 64 * BS).unwrap();
    c.trim(3 * BS, BS).unwrap();
    c.write_back_all().unwrap();
    // 64 writes of 4 blocks: more than the 256 blocks of segment 0, so the log seals it.
    for i in 0..64 {
        c.write_at(&data(4 * BS as usize, 4), (400 + 4 * i) * BS, false)
            .unwrap();
    }
    c.flush().unwrap();
    c.close().expect("close");
    let closed = cache.snapshot();
    let sb = flashtier_engine::read_superblock(&*cache).expect("superblock");
    Image {
        formatted,
        closed,
        sb,
    }
}

/// A superblock copy with its random uuid and format time replaced, so regenerating the seeds
/// gives the same bytes (still `Superblock::encode`'s own encoding).
fn stable_superblock(copy: &[u8]) -> Vec<u8> {
    let mut sb = Superblock::decode(copy).expect("a superblock copy of the real device");
    sb.uuid = *b"flashtier-fuzz!!";
    sb.created = 1_790_000_000;
    sb.encode().unwrap().to_vec()
}

/// The checkpoint in `slot` of `img` (header and body), if that slot holds one.
fn checkpoint_bytes(img: &[u8], sb: &Superblock, slot: u32) -> Option<(u64, Vec<u8>)> {
    let at = sb.geometry.checkpoint_slot_offset(slot) as usize;
    let h = Checkpoint::decode_header(&img[at..at + checkpoint::HEADER_LEN]).ok()?;
    let len = checkpoint::HEADER_LEN + h.body_len as usize;
    Some((h.number, img[at..at + len].to_vec()))
}

/// The batch headers of the log, in log order: from segment 0 (the first one a new cache
/// opens), following each segment's batches, and at a SEAL (or a segment's end) the next segment
/// in the formatted checkpoint's free list.
fn log_headers(img: &[u8], sb: &Superblock) -> Vec<(BatchHeader, Vec<u8>)> {
    let g = &sb.geometry;
    let bs = g.block_size as usize;
    let mut out = Vec::new();
    'segments: for segment in 0..g.segment_count {
        let mut used = 0;
        while used < g.blocks_per_segment() {
            let at = g.slot_offset(g.first_slot(segment) + used) as usize;
            let block = &img[at..at + bs];
            let Ok(h) = BatchHeader::decode(block) else {
                break 'segments;
            };
            out.push((h.clone(), block.to_vec()));
            if h.is_seal() {
                continue 'segments;
            }
            used += 1 + h.data_blocks();
        }
    }
    out
}

fn on_device_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "on_device");
    let accepted = on_device::Ended::Accepted;
    let mut seed =
        |name: &str, selector: u8, parts: &[&[u8]], want: &dyn Fn(&on_device::Ended) -> bool| {
            let mut data = vec![selector];
            for p in parts {
                data.extend_from_slice(p);
            }
            let ended = on_device::run(&data);
            assert!(want(&ended), "on_device seed {name} ended {ended:?}");
            w.seed(name, &data);
        };
    let ok = |e: &on_device::Ended| *e == accepted;
    let img = real_cache_image();
    let sb = &img.sb;
    let len = superblock::LEN;

    // Superblock copies: the newest (written by the clean close) and the one before it (written
    // by open: not clean, the new epoch).
    let newest = sb.copy_index() as usize;
    let copy = |i: usize| stable_superblock(&img.closed[i * len..(i + 1) * len]);
    let (a, b) = (copy(0), copy(1));
    let (new, old) = if newest == 0 { (&a, &b) } else { (&b, &a) };
    seed("superblock-newest", SUPERBLOCK, &[new], &ok);
    seed("superblock-older", SUPERBLOCK, &[old], &ok);
    let mut no_crc = new.clone();
    no_crc[len - 4..].fill(0);
    seed("superblock-fix-crc", SUPERBLOCK | FIX_CRC, &[&no_crc], &ok);
    seed(
        "superblock-formatted",
        SUPERBLOCK,
        &[&stable_superblock(&img.formatted[..len])],
        &ok,
    );

    seed("choose-both-copies", CHOOSE, &[&a, &b], &ok);
    seed("choose-swapped", CHOOSE, &[&b, &a], &ok);
    let mut torn = new.clone();
    torn[2000] ^= 0x40;
    seed("choose-newest-torn", CHOOSE, &[&torn, old], &ok);
    seed("choose-one-copy-blank", CHOOSE, &[old, &vec![0; len]], &ok);
    seed("choose-fix-crc", CHOOSE | FIX_CRC, &[&no_crc, old], &ok);
    let unknown = flashtier_engine::internals::FORMAT_VERSION + 1;
    let mut newer = new.clone();
    newer[8..12].copy_from_slice(&unknown.to_le_bytes());
    seed(
        "choose-unknown-version",
        CHOOSE | FIX_CRC,
        &[old, &newer],
        &|e| matches!(e, on_device::Ended::Rejected(m) if m.contains(&format!("version {unknown}"))),
    );

    // Checkpoints: the formatted device's (every segment free, no entries) and the newest one
    // after the close (a log head, the index).
    let (n0, formatted_ckpt) =
        checkpoint_bytes(&img.formatted, sb, 0).expect("the format's checkpoint");
    assert_eq!(n0, 0);
    seed("checkpoint-formatted", CHECKPOINT, &[&formatted_ckpt], &ok);
    let closed_ckpt = (0..2)
        .filter_map(|slot| checkpoint_bytes(&img.closed, sb, slot))
        .max_by_key(|(n, _)| *n)
        .map(|(_, b)| b)
        .unwrap();
    let entries = Checkpoint::decode_header(&closed_ckpt).unwrap().entry_count;
    assert!(entries > 0, "the closed cache's checkpoint holds no blocks");
    seed("checkpoint-closed", CHECKPOINT, &[&closed_ckpt], &ok);
    let mut no_crc = closed_ckpt.clone();
    no_crc[72..76].fill(0);
    no_crc[checkpoint::HEADER_LEN - 4..checkpoint::HEADER_LEN].fill(0);
    seed("checkpoint-fix-crc", CHECKPOINT | FIX_CRC, &[&no_crc], &ok);

    // Batch headers from the log: the first batch of each combination of record kinds (group
    // commit may put several records in one batch), and the first seal.
    let headers = log_headers(&img.closed, sb);
    let mut names: Vec<String> = Vec::new();
    for (h, block) in &headers {
        let mut kinds: Vec<&str> = Vec::new();
        for e in &h.entries {
            let k = match e.kind {
                Kind::Write => "write",
                Kind::Promote => "promote",
                Kind::Move => "move",
                Kind::Invalidate => "invalidate",
                Kind::Cleaned => "cleaned",
                Kind::Lost => "lost",
                Kind::Free => "free",
            };
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
        let name = if h.is_seal() {
            "batch-seal".to_string()
        } else {
            format!("batch-{}", kinds.join("-"))
        };
        if !names.contains(&name) {
            seed(&name, BATCH, &[&block[..4096]], &ok);
            names.push(name);
        }
    }
    for want in ["write", "promote", "invalidate", "cleaned", "seal"] {
        assert!(
            names.iter().any(|n| n.split('-').any(|k| k == want)),
            "the log lacks a {want} batch: found {names:?}"
        );
    }
    if let Some((_, block)) = headers.iter().max_by_key(|(h, _)| h.entries.len()) {
        let mut no_crc = block[..4096].to_vec();
        no_crc[2044..2048].fill(0);
        seed("batch-fix-crc", BATCH | FIX_CRC, &[&no_crc], &ok);
    }
    // A FREE record (format version 3): the small cache above seldom reclaims, so this batch
    // is the first one of the log with its records replaced by FREE records of two segments.
    if let Some((h, block)) = headers.iter().find(|(h, _)| !h.is_seal()) {
        let mut free = h.clone();
        free.entries = [3u64, 5]
            .map(|segment| flashtier_engine::internals::batch::Entry {
                kind: Kind::Free,
                dirty: false,
                lba: 0,
                nblocks: 1,
                aux: segment,
                volume: 0,
                data_crc: 0,
            })
            .to_vec();
        let mut out = vec![0u8; 4096];
        free.encode(&block[2048..4096], &mut out);
        seed("batch-free", BATCH, &[&out], &ok);
    }
    w.count
}

fn main() {
    let root = std::env::args_os()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let n = handshake_seeds(&root)
        + transmission_seeds(&root)
        + request_header_seeds(&root)
        + on_device_seeds(&root);
    println!("wrote {n} seeds under {}", root.display());
}

#!/usr/bin/env python3
"""What the cache keeps: flashtier's read miss ratio through NBD against exact LRU (and
S3-FIFO) simulated on the same requests at the same capacity, and how much of its capacity
holds live blocks.

For each workload a fresh cache is formatted over a sparse backing file (miss ratios do not
depend on the backing store's speed), `flashtier serve --trace` records every request the
server is sent, and fio sends them through the nbd engine at QD16. Then:

  flashtier     read miss ratio from the server's counters (read_miss_blocks / block reads; a
                write covering a 4K block in part reads it first and counts as a block read
                there too: none on the fio rows, the redo log's 512-byte writes on oltp, whose
                range over the trace's reads alone the report gives)
  LRU, S3-FIFO  `flashtier advise TRACE --sample 1` at the cache's capacity in blocks: exact
                simulations of the very requests flashtier served
  OPT           the same advise run's floor: Belady's clairvoyant MIN, the fewest read misses any
                cache of that capacity could have on those requests. OPT ÷ LRU is the best ratio
                to LRU any policy could reach; where it is above a target, no cache meets it
  LRU at live   exact LRU holding only as many blocks as flashtier held live (the mean over the
                row's second half, see live)
  live          live blocks / capacity (status, sampled every LIVE_PERIOD s while fio runs): the
                mean over the second half of the row, with its range there, and the share at the
                end. The end alone swung by up to 15 points between two runs of one build (reclaim
                works in rounds); the mean over the row's second half is the steady state the
                target speaks of, and the target is checked on it. Where the workload touched fewer
                blocks than the cache holds, the share of those at the end instead (a cache that
                never filled holds all it was sent). Also the share of log slots that went to batch
                headers (batches / (batches + blocks written to the log))
  device ÷ client writes
                bytes written to the cache device (the clients' data, promotions, blocks reclaim
                moved, batch headers, checkpoints) per byte the clients wrote: what keeping the
                cache costs the SSD's endurance
  advise --engine
                the trace the server recorded, replayed whole by `flashtier advise --engine` into
                a real cache of the same capacity at the pace the server took it: the advisor's
                flashtier curve against the server it stands for (--no-replay skips it; it
                takes about as long as the row)

Workloads:
  zipf0.6, zipf0.9, zipf1.2, pareto0.9, hot+scan
          fio 4K randrw 70/30 (--number_ios each, default 1 M) with that random distribution over
          the backing file, a 1 GiB cache over 4 GiB (--cache-mib, --data-mib); hot+scan: a hot set
          (zipf 0.9 over the first quarter) with a sequential read scan of the rest beside it.
  oltp    a block trace of MariaDB under sysbench oltp_read_write (--rand-type=pareto), replayed.
          Recorded once per run: bench/oltp.py's database (its prepared image and defaults: 8
          tables x 265,000 rows, 16K pages, doublewrite ON, a 32 MiB buffer pool, 8 threads) on
          ext4 over loop over nbdfuse over a flashtier pass-through server (`serve --trace`, no
          cache) on a copy of the image, so the trace is the database's own requests: mariadbd
          starts, sysbench runs --oltp-seconds (default 180), mariadbd shuts down cleanly. The trace
          is kept as WORKDIR/eviction-oltp.ft (described in eviction-oltp.json beside it; --quick
          records eviction-oltp-quick.ft, so a quick run never replaces a full recording);
          --oltp-trace FILE replays that file instead of recording. `flashtier trace to-fio`
          converts it, and fio replays it (--read_iolog, --replay_no_stall=1, nbd engine, QD16)
          through a fresh cache of each --oltp-cache-pct (default 50,25) percent of the data the
          trace touched (its distinct 4K blocks), over a sparse file the size of its export, one
          row a size. The 1 GiB of the fio rows would hold all of it.

Targets (issue 12): read miss ratio <= 1.0x exact LRU's on every trace and <= 0.9x on the
zipf and OLTP traces; live >= 90% of capacity.

--only NAME,... runs only these workloads (oltp: all its cache sizes) and merges their rows into
the results already in --out (eviction.json), keeping the other rows and saying where each came
from. Default run: 19 minutes on this 2-CPU machine with nothing else running, 15.5 with
--oltp-trace (no recording; stop 53, each row's `advise --engine` replay included; preparing the
database is done once and kept in --workdir). --quick: 2 minutes. The
oltp workload needs root (loop devices, mounts), /dev/fuse, nbdfuse, mariadbd and sysbench
(scripts/install-deps.sh installs them).

Writes bench/results/eviction.{md,json,png} and eviction_live.png (--quick: /tmp/flashtier-bench-quick).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchlib as bl
import oltp

WORKLOADS = [
    ("zipf0.6", "zipf:0.6", None),
    ("zipf0.9", "zipf:0.9", None),
    ("zipf1.2", "zipf:1.2", None),
    ("pareto0.9", "pareto:0.9", None),
    ("hot+scan", "zipf:0.9", "scan"),
]
GROUPS = [w[0] for w in WORKLOADS] + ["oltp"]  # what --only names, in the table's order
OLTP_PAGE_KIB = 16
LIVE_PERIOD = 0.5  # seconds between samples of the live share


def group_of(row):
    return "oltp" if row["workload"].startswith("oltp") else row["workload"]


def fio_jobs(uri, dist, extra, size, ios):
    common = ["--ioengine=nbd", f"--uri={uri}", "--bs=4k", "--iodepth=16", "--norandommap",
              "--randrepeat=1"]
    if extra == "scan":
        hot = size // 4
        return ["fio", "--name=hot", *common, "--rw=randrw", "--rwmixread=70",
                f"--random_distribution={dist}", f"--size={hot}", f"--number_ios={ios}",
                "--name=scan", *common, "--rw=read", f"--offset={hot}", f"--size={size - hot}",
                f"--number_ios={ios // 3}", "--output=/dev/null"]
    return ["fio", "--name=w", *common, "--rw=randrw", "--rwmixread=70",
            f"--random_distribution={dist}", f"--size={size}", f"--number_ios={ios}",
            "--output=/dev/null"]


def replay_job(uri, iolog):
    return ["fio", "--name=replay", "--ioengine=nbd", f"--uri={uri}", f"--read_iolog={iolog}",
            "--replay_no_stall=1", "--iodepth=16", "--output=/dev/null"]


def ctl(binary, sock, *args):
    return subprocess.run([str(binary), *args, "--control", str(sock)], capture_output=True, text=True,
                          check=True).stdout


def run(argv):
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(map(str, argv))} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return out.stdout


def advise(binary, trace, sizes_bytes=None):
    sizes = ["--sizes", ",".join(str(s) for s in sizes_bytes)] if sizes_bytes else []
    return json.loads(run([binary, "advise", trace, "--sample", "1", "--json", *sizes]))


class LiveSampler:
    """Samples the server's live, unwritten and stale blocks (`stats --json`'s status) every
    LIVE_PERIOD seconds until stopped: `samples` holds (seconds since start, cached, unwritten,
    stale). A sample the server does not answer is skipped."""

    def __init__(self, binary, sock):
        self.binary, self.sock = binary, sock
        self.samples = []
        self.capacity = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.t0 = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(LIVE_PERIOD):
            try:
                st = json.loads(ctl(self.binary, self.sock, "stats", "--json"))["status"]
            except (subprocess.CalledProcessError, ValueError, KeyError):
                continue
            self.capacity = st["capacity_blocks"]
            self.samples.append((round(time.time() - self.t0, 2), st["cached_blocks"],
                                 st.get("unwritten_blocks"), st.get("stale_blocks")))

    def steady(self):
        """Mean, lowest and highest live share, and mean unwritten and stale shares, over the
        samples of the run's second half; None without samples there."""
        if not self.samples or not self.capacity:
            return None
        half = self.samples[-1][0] / 2
        tail = [x for x in self.samples if x[0] >= half]
        live = [c / self.capacity for _, c, _, _ in tail]

        def mean_share(i):
            vals = [x[i] for x in tail if x[i] is not None]
            return sum(vals) / len(vals) / self.capacity if vals else None
        return {"mean": sum(live) / len(live), "min": min(live), "max": max(live), "samples": len(tail),
                "unwritten": mean_share(2), "stale": mean_share(3)}


def sparse_file(path: Path, size):
    if not path.exists() or path.stat().st_size != size:
        path.unlink(missing_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)


def measure(binary, work, name, cache_bytes, backing: Path, driver, args, rmw_blocks=0):
    """A fresh cache of `cache_bytes` over `backing`, served with --trace while `driver(uri)` (a fio
    command line) runs; the row of its counters and the simulations of its trace. `rmw_blocks`: the
    partly written 4K blocks of the workload's writes (see rmw_block_reads)."""
    d = work / f"eviction-{name.replace('@', '-').replace('%', 'pct')}"  # no URI escapes in its socket's path
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cache = d / "cache.img"
    bl.flashtier_format(binary, cache, str(backing), cache_bytes)
    sock, ctl_sock, trace = d / "nbd.sock", d / "ctl.sock", d / "trace.ft"
    server = bl.flashtier_serve(binary, str(backing), sock, d / "serve.log",
                                extra=["--cache", str(cache), "--control-socket", str(ctl_sock),
                                       "--trace", str(trace), *args.serve_arg])
    t0 = time.time()
    with LiveSampler(binary, ctl_sock) as sampler:
        fio = subprocess.run(driver(server.uri), capture_output=True, text=True)
    if fio.returncode != 0:
        sys.exit(f"fio failed on {name}:\n{fio.stdout}{fio.stderr}")
    seconds = time.time() - t0
    stats = json.loads(ctl(binary, ctl_sock, "stats", "--json"))
    server.stop()
    (d / "stats.json").write_text(json.dumps(stats, indent=2))
    c = stats["windows"]["total"]
    cached, capacity = stats["status"]["cached_blocks"], stats["status"]["capacity_blocks"]
    reads = c["read_hit_blocks"] + c["read_miss_blocks"]
    steady = sampler.steady()
    mean_live = max(round(steady["mean"] * capacity), 1) if steady else cached
    # The capacity, flashtier's live blocks at the end and on average, and 90% of the capacity
    # (issue 12's live target: what LRU and S3-FIFO would miss holding that much).
    sims = advise(binary, trace, [capacity * 4096, cached * 4096, mean_live * 4096, capacity * 9 // 10 * 4096])
    # Exact LRU at as many blocks as flashtier held live: the steady state's mean, or the end's
    # count where the cache never filled (it was still filling in the second half).
    never = sims["working_set_bytes"] // 4096 < capacity
    live_blocks = cached if never else mean_live
    # A write that covers a 4K block only in part reads the block first (read-modify-write), and
    # the server counts that read as a hit or a miss too, unless the block came from memory (the
    # partial write before it ended in that block and nothing changed it since:
    # partial_write_blocks_from_memory): its counters hold the trace's block reads plus the others.
    from_memory = c.get("partial_write_blocks_from_memory", 0)
    rmw_reads = rmw_blocks - from_memory
    if reads - sims["reads"] != rmw_reads:
        sys.exit(f"{name}: the server counted {reads:,} block reads; its trace holds {sims['reads']:,}, and its "
                 f"writes cover {rmw_blocks:,} blocks in part, {from_memory:,} of them taken from memory")
    full, at_live, at_90 = sims["curve"][0], sims["curve"][1 if never else 2], sims["curve"][3]
    data_written = c["write_blocks"] - c.get("bypassed_write_blocks", 0) + c["promoted_blocks"] + c["moved_blocks"]
    r = {
        "workload": name, "seconds": round(seconds, 1), "cache_bytes": cache_bytes,
        "block_reads": reads, "block_writes": c["write_blocks"], "trace_block_writes": sims["writes"],
        "flashtier_miss_ratio": c["read_miss_blocks"] / reads,
        "trace_block_reads": sims["reads"], "rmw_block_reads": rmw_reads, "rmw_blocks": rmw_blocks,
        "rmw_blocks_from_memory": from_memory,
        # The miss ratio of the trace's reads alone: the read-modify-write reads were all hits, or
        # all misses.
        "flashtier_miss_ratio_range": [max(c["read_miss_blocks"] - rmw_reads, 0) / sims["reads"],
                                       c["read_miss_blocks"] / sims["reads"]],
        "lru_miss_ratio": full["lru_miss_ratio"], "s3fifo_miss_ratio": full["s3fifo_miss_ratio"],
        "fifo_miss_ratio": full["fifo_miss_ratio"], "lru_at_live_miss_ratio": at_live["lru_miss_ratio"],
        "opt_miss_ratio": full["opt_miss_ratio"],
        "lru_at_90pct_miss_ratio": at_90["lru_miss_ratio"], "s3fifo_at_90pct_miss_ratio": at_90["s3fifo_miss_ratio"],
        "capacity_blocks": capacity, "live_blocks": cached, "live_fraction": cached / capacity,
        # The rest of the capacity at the end (status; servers before stop 47 do not say): left
        # for the log, and stale until reclaim empties their segments.
        "unwritten_blocks": stats["status"].get("unwritten_blocks"),
        "stale_blocks": stats["status"].get("stale_blocks"),
        "header_share": c["batches"] / (c["batches"] + data_written),
        "evicted_blocks": c["evicted_blocks"], "moved_blocks": c["moved_blocks"],
        "write_hit_blocks": c["write_hit_blocks"], "bypassed_read_blocks": c.get("bypassed_read_blocks"),
        "bypassed_write_blocks": c.get("bypassed_write_blocks"), "client_flushes": c.get("client_flushes"),
        "working_set_blocks": sims["working_set_bytes"] // 4096,
        # The live share while fio ran (LiveSampler): the steady state over the row's second half,
        # and every sample (seconds, cached, unwritten, stale blocks).
        "live_steady": steady, "lru_at_live_blocks": live_blocks,
        "live_samples": sampler.samples,
        # Every counter of the server at the end of the row (what the cache device's bytes were
        # made of: promoted_blocks, moved_blocks, batches, checkpoints, cache_write_bytes, ...).
        "counters": c,
        # What the SSD pays: bytes written to the cache device per byte the clients wrote.
        "device_write_amplification": c["cache_write_bytes"] / c["client_write_bytes"]
        if c.get("client_write_bytes") else None,
    }
    r["vs_lru"] = r["flashtier_miss_ratio"] / max(r["lru_miss_ratio"], 1e-9)
    if args.replay:
        # The same requests replayed into a real cache of the same geometry by `advise --engine`,
        # whole (no sampling) and at the pace this server took them: how far the advisor's own
        # curve is from the server it stands for.
        t1 = time.time()
        eng = json.loads(run([binary, "advise", trace, "--sample", "1", "--json", "--engine",
                              "--engine-accesses", str(10 ** 9), "--sizes", str(capacity * 4096),
                              "--scratch-dir", d]))["curve"][0]
        # A cache of too few segments is not replayed (engine_sim::MIN_SEGMENTS): --quick's
        # smallest oltp row.
        r["replay_skipped"] = "flashtier_miss_ratio" not in eng
        if not r["replay_skipped"]:
            r["replayed_miss_ratio"] = eng["flashtier_miss_ratio"]
            r["replayed_live_fraction"] = eng["flashtier_live_share"]
            r["replay_seconds"] = round(time.time() - t1, 1)
    if rmw_reads:
        print(f"{name}: {rmw_reads:,} read-modify-write block reads in the counters; the trace's reads alone "
              f"missed {r['flashtier_miss_ratio_range'][0]:.4f}-{r['flashtier_miss_ratio_range'][1]:.4f}", flush=True)
    print(f"{name}: flashtier {r['flashtier_miss_ratio']:.3f}, LRU {r['lru_miss_ratio']:.3f} ({r['vs_lru']:.2f}x), "
          f"S3-FIFO {r['s3fifo_miss_ratio']:.3f}, OPT {r['opt_miss_ratio']:.3f}, live {r['live_fraction']:.1%} "
          f"({seconds:.0f} s)", flush=True)
    return r


def run_fio_workload(binary, work, name, dist, extra, args):
    backing = work / "eviction-backing.img"
    sparse_file(backing, args.data_mib << 20)
    r = measure(binary, work, name, args.cache_mib << 20, backing,
                lambda uri: fio_jobs(uri, dist, extra, args.data_mib << 20, args.ios), args)
    r.update({"fio_distribution": dist, "scan": extra == "scan", "cache_mib": args.cache_mib,
              "data_mib": args.data_mib, "ios": args.ios})
    return r


# --- The MariaDB OLTP trace ---------------------------------------------------------------------

def oltp_db_args(args):
    """bench/oltp.py's database settings: its defaults (--quick: its quick sizes)."""
    p = argparse.ArgumentParser(add_help=False)
    oltp.add_database_args(p)
    db = p.parse_args([])
    if args.quick:
        oltp.quick_sizes(db)
    return db


def record_oltp(binary, work, args):
    """Records MariaDB + sysbench through a flashtier pass-through server into WORKDIR/eviction-oltp.ft
    (--quick: eviction-oltp-quick.ft, leaving a full recording alone); returns (trace, description), the
    description also written beside it (.json)."""
    db_args = oltp_db_args(args)
    img, meta = oltp.prepared_image(db_args, work, OLTP_PAGE_KIB)
    d = work / "eviction-oltp-record"
    if os.path.ismount(d / "mnt"):
        sys.exit(f"{d / 'mnt'} is still mounted (left over from an interrupted run?): unmount it first")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    stem = "eviction-oltp-quick" if args.quick else "eviction-oltp"
    trace, desc_path = work / f"{stem}.ft", work / f"{stem}.json"
    trace.unlink(missing_ok=True)
    desc_path.unlink(missing_ok=True)
    disk = d / "disk.img"
    subprocess.run(["cp", "--sparse=always", str(img), str(disk)], check=True)
    print(f"oltp: recording MariaDB + sysbench ({args.oltp_seconds} s) through flashtier pass-through ...",
          flush=True)
    t0 = time.time()
    server = fuse = db = None
    try:
        server = bl.flashtier_serve(binary, str(disk), d / "nbd.sock", d / "serve.log",
                                    extra=["--control-socket", str(d / "ctl.sock"), "--trace", str(trace)])
        fuse = bl.FuseLoop(server.uri, d / "fuse", db_args.disk_mib << 20, d / "nbdfuse.log")
        fuse.mount(d / "mnt")
        db = oltp.MariaDB(d / "db", d / "mnt" / "data", OLTP_PAGE_KIB, db_args.pool_mib, doublewrite=True)
        db.start()
        sb, _ = oltp.run_sysbench(db, db_args, args.oltp_seconds, d / "sysbench.txt")
        db.stop()
        db = None
    finally:
        if db is not None:
            db.kill()
        if fuse is not None:
            fuse.stop()
        if server is not None:
            server.stop()
    desc = {
        "trace": str(trace), "recorded": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "flashtier": bl._first_line([str(binary), "--version"]), "command": bl.command_line(),
        "seconds": round(time.time() - t0, 1), "mariadbd": meta.get("mariadbd"),
        "sysbench_version": bl._first_line(["sysbench", "--version"]),
        "database": {k: getattr(db_args, k) for k in ("tables", "table_size", "pool_mib", "disk_mib",
                                                     "sysbench_threads")}
        | {"page_kib": OLTP_PAGE_KIB, "doublewrite": True, "sysbench_seconds": args.oltp_seconds,
           "data_bytes": meta["data_bytes"], "table_bytes": meta["table_bytes"]},
        "sysbench": {k: sb[k] for k in ("transactions", "tps", "qps", "p95_ms", "seconds", "ignored_errors")},
        "show": run([binary, "trace", "show", trace]),
    }
    desc_path.write_text(json.dumps(desc, indent=2))
    shutil.rmtree(d, ignore_errors=True)  # the copy of the image
    print(f"oltp: recorded in {desc['seconds']:.0f} s ({sb['tps']:.0f} TPS):\n{desc['show']}", flush=True)
    return trace, desc


def scan_iolog(iolog: Path, bs=4096):
    """(the end of the furthest request, the blocks its writes cover in part) of a fio iolog: a
    write reads the block at its start if it starts inside one, and the block at its end if it ends
    inside one (once if that is the same block)."""
    end = rmw = 0
    with open(iolog) as f:
        for line in f:
            p = line.split()
            if len(p) == 5 and p[2] in ("read", "write", "trim"):
                off, n = int(p[3]), int(p[4])
                end = max(end, off + n)
                if p[2] == "write" and n:
                    head, tail = off % bs != 0, (off + n) % bs != 0
                    same = off // bs == (off + n - 1) // bs
                    rmw += head + (tail and not (head and same))
    return end, rmw


def run_oltp(binary, work, args):
    if args.oltp_trace:
        trace = Path(args.oltp_trace).resolve()
        desc_path = trace.with_suffix(".json")
        desc = json.loads(desc_path.read_text()) if desc_path.exists() else {"trace": str(trace)}
        desc["show"] = run([binary, "trace", "show", trace])
        desc["replayed_from"] = str(trace)
    else:
        trace, desc = record_oltp(binary, work, args)
    iolog = work / "eviction-oltp.iolog"
    iolog.unlink(missing_ok=True)
    desc["to_fio"] = run([binary, "trace", "to-fio", trace, iolog]).strip()
    orig = advise(binary, trace)
    desc.update({"block_reads": orig["reads"], "block_writes": orig["writes"],
                 "working_set_bytes": orig["working_set_bytes"]})
    backing = work / "eviction-oltp-backing.img"
    extent, rmw = scan_iolog(iolog)
    sparse_file(backing, -(-extent // (1 << 20)) << 20)
    desc["backing_bytes"], desc["rmw_block_reads"] = backing.stat().st_size, rmw
    rows = []
    for pct in args.oltp_cache_pct:
        cache_bytes = max(-(-int(orig["working_set_bytes"] * pct / 100) // (4 << 20)) * (4 << 20), 16 << 20)
        r = measure(binary, work, f"oltp@{pct:g}%", cache_bytes, backing, lambda uri: replay_job(uri, iolog), args,
                    rmw_blocks=rmw)
        r.update({"cache_pct_of_touched": pct, "touched_bytes": orig["working_set_bytes"],
                  "recorded_block_reads": orig["reads"], "recorded_block_writes": orig["writes"]})
        if (r["trace_block_reads"], r["trace_block_writes"]) != (orig["reads"], orig["writes"]):
            print(f"warning: the replay served {r['trace_block_reads']:,} block reads and {r['trace_block_writes']:,} "
                  f"block writes; the recording has {orig['reads']:,} and {orig['writes']:,}", flush=True)
        rows.append(r)
    iolog.unlink(missing_ok=True)
    return rows, desc


# --- Report -------------------------------------------------------------------------------------

def provenance(machine, args_d, command):
    return {"command": command, "flashtier": machine.get("flashtier"), "flashtier_commit":
            machine.get("flashtier_commit"), "date": machine.get("date"), "loadavg": machine.get("loadavg"),
            "serve_args": args_d.get("serve_arg", [])}


def merge(out: Path, rows, groups, doc):
    """Rows of an earlier eviction.json in `out` for the workloads not run now, and its OLTP
    description when oltp is not run now."""
    path = out / "eviction.json"
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    here = provenance(old.get("machine", {}), old.get("args", {}), "(not recorded)")
    kept = []
    for r in old.get("rows", []):
        if group_of(r) in groups:
            continue
        r.setdefault("run", here)
        if group_of(r) != "oltp":
            for k, v in (("cache_mib", old.get("args", {}).get("cache_mib")),
                         ("data_mib", old.get("args", {}).get("data_mib")), ("ios", old.get("args", {}).get("ios"))):
                r.setdefault(k, v)
        kept.append(r)
    if "oltp" not in groups and old.get("oltp"):
        doc["oltp"] = old["oltp"]
    order = {g: i for i, g in enumerate(GROUPS)}
    return sorted(kept + rows, key=lambda r: order.get(group_of(r), len(order)))  # stable within a group


def label(r):
    if group_of(r) == "oltp":
        return f"oltp, {r['cache_bytes'] >> 20} MiB ({r['cache_pct_of_touched']:g}% of touched)"
    return r["workload"]


def never_filled(r):
    return r["working_set_blocks"] < r["capacity_blocks"]


def live_share(r):
    """What the live target is checked on: the mean live share of the capacity over the row's
    second half (rows run before the sampler: at the end); where the workload touched fewer blocks
    than the cache holds, the live blocks at the end of those (a cache that never filled holds all
    it was sent, and its share of the capacity says how big the workload was, not how well reclaim
    keeps space)."""
    if never_filled(r):
        return r["live_blocks"] / r["working_set_blocks"]
    steady = r.get("live_steady")
    return steady["mean"] if steady else r["live_fraction"]


def live_cell(r):
    steady = r.get("live_steady")
    if never_filled(r):
        return f"{r['live_fraction']:.1%} ({live_share(r):.1%} of the {r['working_set_blocks']:,} blocks touched)"
    if not steady:
        return f"end {r['live_fraction']:.1%}"
    return f"{steady['mean']:.1%} ({steady['min']:.0%}–{steady['max']:.0%}), end {r['live_fraction']:.1%}"


def report(args, machine, rows, doc, out, wall):
    zo = [r for r in rows if r["workload"].startswith(("zipf", "oltp"))]

    def with_floor(result, rows, bound):
        beyond = beyond_any_cache(rows, bound)
        if not beyond:
            return result
        return (result[0], f"{result[1]}; beyond any cache, the clairvoyant one included, on " + ", ".join(beyond))
    targets = [
        ("read miss ratio <= 1.0x exact LRU on every trace",
         with_floor(check(all(r["vs_lru"] <= 1.0 for r in rows), max(r["vs_lru"] for r in rows), "x at worst"),
                    rows, 1.0)),
        ("read miss ratio <= 0.9x exact LRU on the zipf and OLTP traces",
         with_floor(check(all(r["vs_lru"] <= 0.9 for r in zo), max(r["vs_lru"] for r in zo), "x at worst"), zo, 0.9)
         if zo else ("not run", "")),
        ("live >= 90% of capacity, the mean over each row's second half (of the blocks touched at the end, "
         "where the cache could hold them all)",
         check(all(live_share(r) >= 0.9 for r in rows), min(live_share(r) for r in rows) * 100,
               "% at worst")),
    ]
    doc["targets"] = targets
    doc["would_take"] = would_take(rows, zo)
    md = bl.results_header("Eviction: flashtier against exact LRU on the same requests", machine, args.quick)
    md += [f"This run: {', '.join(doc['ran'])} in {wall / 60:.1f} min wall time.", ""]
    earlier = {}
    for r in rows:
        if r.get("run", {}).get("date") != machine["date"]:
            earlier.setdefault(json.dumps(r["run"], sort_keys=True), []).append(r["workload"])
    if earlier:
        md += ["Rows kept from earlier runs (this run had `--only`):", ""]
        for key, names in earlier.items():
            p = json.loads(key)
            md.append(f"- {', '.join(names)}: {p['flashtier']} (tree {p['flashtier_commit']}), {p['date']}, "
                      f"command {p['command']}, load average {' '.join(p.get('loadavg') or [])}")
        md.append("")
    fio_rows = [r for r in rows if group_of(r) != "oltp"]
    if fio_rows:
        sets = {(r["cache_mib"], r["data_mib"], r["ios"]) for r in fio_rows}
        if len(sets) == 1:
            (cm, dm, ios), = sets
            md += [f"fio rows: cache {cm} MiB over {dm} MiB, fio 4K QD16, {ios:,} requests a workload, "
                   f"serve args: {' '.join(fio_rows[0]['run'].get('serve_args') or []) or '(defaults)'}.", ""]
        else:
            md += ["fio rows: cache and data sizes differ between rows: see eviction.json.", ""]
    o = doc.get("oltp")
    if o and any(group_of(r) == "oltp" for r in rows):
        db = o.get("database", {})
        sb = o.get("sysbench", {})
        src = (f"recorded {o.get('recorded', '?')} with {o.get('flashtier', '?')}: " if "database" in o
               else f"replayed from {o['trace']} (no description beside it): ")
        if db:
            src += (f"MariaDB ({db['page_kib']}K pages, doublewrite ON, {db['pool_mib']} MiB buffer pool) on "
                    f"ext4 over loop over nbdfuse over `flashtier serve --trace` without a cache (pass-through) on "
                    f"a copy of bench/oltp.py's prepared image ({db['tables']} tables × {db['table_size']:,} rows, "
                    f"data directory {db['data_bytes'] / 2**20:.0f} MiB); mariadbd start, sysbench oltp_read_write "
                    f"--rand-type=pareto, {db['sysbench_threads']} threads, {db['sysbench_seconds']} s "
                    f"({sb.get('tps', float('nan')):.0f} TPS), clean shutdown. ")
        md += [f"oltp rows: a block trace of MariaDB + sysbench, {src}The trace: "
               f"{o['block_reads']:,} block reads and {o['block_writes']:,} block writes, "
               f"{o['working_set_bytes'] / 2**20:.0f} MiB touched (`trace to-fio`: {o['to_fio']}). Replayed by fio "
               "(`--read_iolog --replay_no_stall=1`, nbd engine, QD16) through a fresh cache of each size (a "
               "percentage of the data touched, rounded up to 4 MiB; the capacity in blocks is in eviction.json) "
               f"over a sparse {o['backing_bytes'] >> 20} MiB file, `serve --trace` recording what it served as in "
               "the fio rows.", "", "```", o["show"].rstrip(), "```", ""]
        bad = [r["workload"] for r in rows if group_of(r) == "oltp"
               and (r["trace_block_reads"], r["trace_block_writes"]) != (r["recorded_block_reads"], r["recorded_block_writes"])]
        if bad:
            md += [f"**The replay did not send the recorded block reads and writes exactly** ({', '.join(bad)}; "
                   "counts in eviction.json); the simulations are of what was served all the same.", ""]
    md += ["| workload | flashtier | exact LRU | flashtier ÷ LRU | S3-FIFO | FIFO | OPT (÷ LRU) "
           "| LRU with flashtier's live blocks "
           "| live | unwritten, stale | header slots | device ÷ client writes | `advise --engine`: miss, live |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def floor(r):
        if r.get("opt_miss_ratio") is None:
            return "—"
        return f"{r['opt_miss_ratio']:.1%} ({floor_vs_lru(r):.2f}x)"

    def rest(r):
        steady = r.get("live_steady")
        if steady and steady["stale"] is not None and not never_filled(r):
            return f"{steady['unwritten']:.1%}, {steady['stale']:.1%}"
        if r.get("stale_blocks") is None:
            return "—"
        return f"{r['unwritten_blocks'] / r['capacity_blocks']:.1%}, {r['stale_blocks'] / r['capacity_blocks']:.1%}"

    def amplification(r):
        x = r.get("device_write_amplification")
        return "—" if x is None else f"{x:.1f}x"

    def replayed(r):
        if "replayed_miss_ratio" not in r:
            return "too small to replay" if r.get("replay_skipped") else "not run"
        return f"{r['replayed_miss_ratio']:.1%}, {r['replayed_live_fraction']:.1%}"
    for r in rows:
        md.append(f"| {label(r)} | {r['flashtier_miss_ratio']:.1%} | {r['lru_miss_ratio']:.1%} | "
                  f"{r['vs_lru']:.2f}x | {r['s3fifo_miss_ratio']:.1%} | {r['fifo_miss_ratio']:.1%} | {floor(r)} | "
                  f"{r['lru_at_live_miss_ratio']:.1%} | {live_cell(r)} | {rest(r)} | {r['header_share']:.1%} | "
                  f"{amplification(r)} | {replayed(r)} |")
    md += ["", f"*live*: the live share of the capacity, from `status` sampled every {LIVE_PERIOD:g} s while fio ran: "
           "the mean over the row's second half (its range there), and at the end. The end alone swung by up to "
           "15 points between two runs of one build; the target is checked on the mean (on the share of the blocks "
           "touched where the cache never filled). *unwritten, stale*: the rest of the capacity, as means over the "
           "same samples (at the end where the cache never filled): blocks left for the log "
           "(free segments, emptied ones waiting for their FREE records, the open segment's rest) and stale slots "
           "(old copies of overwritten or evicted blocks, batch headers, the unused ends of segments sealed early), "
           "which reclaim turns back into unwritten ones by emptying their segments."]
    md += ["", "*OPT*: Belady's clairvoyant MIN on the same requests at the same capacity (`flashtier advise`): "
           "the fewest read misses any cache could have, knowing every request to come; in brackets, ÷ exact LRU, "
           "the lowest ratio to LRU any policy could reach. Where the clients read many blocks for the first time "
           "(every such read misses in any cache), it sits close to LRU."]
    md += ["", "The last column is `flashtier advise --engine` on the trace the server recorded, replayed whole "
           "into a real cache of the same capacity at the pace the server took it: the advisor's own flashtier "
           "curve, against the server it stands for (`--no-replay` skips it)."]
    rmw_rows = [r for r in rows if r.get("rmw_block_reads")]
    if rmw_rows:
        md += ["", "flashtier's column is its counters' ratio, read_miss_blocks ÷ (read_hit_blocks + read_miss_blocks). "
               "A write that covers a 4K block only in part (InnoDB's redo log writes 512-byte multiples) reads "
               "the block first, unless the partial write before it ended in that block (then it is taken from "
               "memory), and the counters count that read as a hit or a miss too; the simulations count such a "
               "write as an access, not a read. Over the trace's reads alone flashtier missed between "
               "(misses − those reads) and misses ÷ the trace's block reads: " + "; ".join(
                   f"{label(r)}: {r['rmw_block_reads']:,} such reads beside {r['trace_block_reads']:,}, "
                   f"{r['flashtier_miss_ratio_range'][0]:.1%}–{r['flashtier_miss_ratio_range'][1]:.1%} "
                   f"({r['flashtier_miss_ratio_range'][0] / max(r['lru_miss_ratio'], 1e-9):.2f}–"
                   f"{r['flashtier_miss_ratio_range'][1] / max(r['lru_miss_ratio'], 1e-9):.2f}x LRU)"
                   for r in rmw_rows) + "."]
    md += ["", "| target | result | measured | what it would take (measured in this run) |", "|---|:---:|---|---|",
           *[f"| {what} | {mark} | {gap} | {take} |"
             for (what, (mark, gap)), take in zip(targets, doc["would_take"])]]
    md += ["", "![read miss ratios](eviction.png)"]
    if any(r.get("live_samples") for r in rows):
        md += ["", "![live share over each row](eviction_live.png)"]
    bl.write_results(out, "eviction", doc, md)
    plt = bl.pyplot()
    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(rows) + 2), 4.8))
    xs = range(len(rows))
    w = 0.16
    for i, (key, name, colour) in enumerate([("flashtier_miss_ratio", "flashtier", "tab:red"),
                                              ("lru_miss_ratio", "exact LRU", "tab:blue"),
                                              ("s3fifo_miss_ratio", "S3-FIFO", "tab:green"),
                                              ("lru_at_live_miss_ratio", "LRU, flashtier's live blocks",
                                               "tab:grey"),
                                              ("opt_miss_ratio", "OPT (no cache misses less)", "tab:orange")]):
        ax.bar([x + (i - 2) * w for x in xs], [(r.get(key) or 0) * 100 for r in rows], w, label=name,
               color=colour)

    def tick(r):
        if never_filled(r):
            return f"{r['workload']}\nlive {r['live_fraction']:.0%}\n({live_share(r):.0%} of touched)"
        head = f"oltp\n{r['cache_bytes'] >> 20} MiB" if group_of(r) == "oltp" else r["workload"]
        return f"{head}\nlive {live_share(r):.0%}"
    ax.set_xticks(list(xs), [tick(r) for r in rows], fontsize=8)
    ax.set_ylabel("read miss ratio (%)")
    fio_sizes = {(r["cache_mib"], r["data_mib"]) for r in fio_rows}
    sizes = "{} MiB cache over {} MiB for fio".format(*fio_sizes.pop()) if len(fio_sizes) == 1 else "fio"
    ax.set_title(f"Read misses at the same capacity ({sizes}; oltp at the sizes shown)", fontsize=10)
    ax.legend(fontsize=8)
    bl.save_figure(fig, out / "eviction.png", args.quick)
    sampled = [r for r in rows if r.get("live_samples")]
    if sampled:
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for r in sampled:
            ax.plot([t for t, *_ in r["live_samples"]],
                    [c / r["capacity_blocks"] * 100 for _, c, *_ in r["live_samples"]],
                    label=label(r), linewidth=1)
        ax.axhline(90, color="black", linestyle=":", linewidth=1, label="target")
        ax.set_xlabel("seconds into the row")
        ax.set_ylabel("live blocks (% of capacity)")
        ax.set_ylim(0, 100)
        ax.set_title(f"Live share while each row ran (status every {LIVE_PERIOD:g} s)", fontsize=10)
        ax.legend(fontsize=7)
        bl.save_figure(fig, out / "eviction_live.png", args.quick)


def check(ok, value, unit):
    return ("met" if ok else "**not met**", f"{value:.2f}{unit}")


def would_take(rows, zo):
    """For each target, what the rows say it would take: the capacity flashtier would have to keep
    live, and the policy it would need there, from the simulations of the very requests it served."""
    filled = [r for r in rows if not never_filled(r)]
    out = []
    worst = max(rows, key=lambda r: r["vs_lru"])
    near = max(abs(r["flashtier_miss_ratio"] - r["lru_at_live_miss_ratio"]) for r in rows)
    if worst["vs_lru"] <= 1.0:
        out.append("—")
    elif "lru_at_90pct_miss_ratio" not in worst:
        out.append("(a row from before the 90% simulations)")
    else:
        lru = worst["lru_miss_ratio"]
        out.append(
            f"capacity: on every row flashtier misses within {near * 100:.1f} points of exact LRU holding "
            f"flashtier's live blocks. On the worst row ({label(worst)}), with 90% of the capacity live, exact LRU "
            f"would miss {worst['lru_at_90pct_miss_ratio']:.1%} ({worst['lru_at_90pct_miss_ratio'] / lru:.2f}x LRU) "
            f"and S3-FIFO {worst['s3fifo_at_90pct_miss_ratio']:.1%} ({worst['s3fifo_at_90pct_miss_ratio'] / lru:.2f}x): "
            "the live target and a policy at least that much better than LRU, or a live share near 100%")
    if not zo:
        out.append("—")
    else:
        reachable = [r for r in zo if floor_vs_lru(r) is not None and floor_vs_lru(r) <= 0.9]
        parts = []
        if len(reachable) < len(zo):
            parts.append("on the other rows nothing: the clairvoyant cache misses more than 0.9x LRU there (the "
                         "clients' first reads of blocks, which every cache misses)")
        if reachable:
            parts.insert(0, "a policy better than S3-FIFO: at full capacity S3-FIFO reaches " + ", ".join(
                f"{r['s3fifo_miss_ratio'] / max(r['lru_miss_ratio'], 1e-9):.2f}x on {label(r)} (OPT "
                f"{floor_vs_lru(r):.2f}x)" for r in reachable))
        out.append("; ".join(parts) if parts else "—")
    low = min(filled or rows, key=live_share)
    steady = low.get("live_steady") or {}
    if live_share(low) >= 0.9:
        out.append("—")
    else:
        out.append(
            f"on the worst row ({label(low)}) {steady.get('unwritten', 0):.0%} of the capacity was unwritten "
            f"(the log's free reserve) and {steady.get('stale', 0):.0%} stale, and reclaim already wrote "
            f"{low.get('device_write_amplification') or 0:.1f}x the clients' bytes to the cache device: garbage "
            "collection that copies less per block freed (bench/results/compaction90/: at reclaim_compact_pct=90, "
            "the most it takes, the zipf rows were 87–90% live at 1.8x these device writes)")
    return out


def floor_vs_lru(r):
    """OPT ÷ LRU: the lowest ratio to exact LRU any cache could have on the row (None: a row from
    before OPT was reported)."""
    opt = r.get("opt_miss_ratio")
    return None if opt is None else opt / max(r["lru_miss_ratio"], 1e-9)


def beyond_any_cache(rows, bound):
    """The rows where even the clairvoyant cache misses more than `bound` x exact LRU."""
    return [f"{label(r)} (OPT {floor_vs_lru(r):.2f}x)" for r in rows
            if floor_vs_lru(r) is not None and floor_vs_lru(r) > bound]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-mib", type=int, default=1024, help="cache file size of the fio rows (default 1024)")
    ap.add_argument("--data-mib", type=int, default=4096, help="backing store size of the fio rows (default 4096)")
    ap.add_argument("--ios", type=int, default=1_000_000, help="fio requests per workload (default 1,000,000)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for serve, e.g. --serve-arg=--set --serve-arg=reclaim_policy=fifo")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip replaying each served trace through `flashtier advise --engine` (the advisor's "
                         "own flashtier curve against the server; about as long as the row itself)")
    ap.add_argument("--only", metavar="NAME,...",
                    help=f"run only these workloads ({', '.join(GROUPS)}) and merge their rows into the "
                         "results already in --out")
    ap.add_argument("--oltp-seconds", type=int,
                    help="sysbench seconds while recording the oltp trace (default 180; --quick 20)")
    ap.add_argument("--oltp-cache-pct", default="50,25",
                    help="oltp cache sizes, percent of the data its trace touched (default 50,25)")
    ap.add_argument("--oltp-trace", metavar="FILE",
                    help="replay this trace for the oltp rows instead of recording one (each recording is kept "
                         "as WORKDIR/eviction-oltp.ft, described in eviction-oltp.json beside it; --quick's as "
                         "eviction-oltp-quick.ft)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    args.oltp_cache_pct = [float(x) for x in args.oltp_cache_pct.split(",")]
    if args.quick:
        args.cache_mib, args.data_mib, args.ios = 128, 512, 100_000
    if args.oltp_seconds is None:
        args.oltp_seconds = 20 if args.quick else 180
    groups = GROUPS if not args.only else args.only.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        ap.error(f"--only: unknown workloads {', '.join(sorted(unknown))} (workloads: {', '.join(GROUPS)})")
    t_all = time.time()
    if "oltp" in groups:
        if os.geteuid() != 0 and not args.oltp_trace:
            ap.error("recording the oltp trace needs root (loop devices, mounts): run as root, or "
                     "--oltp-trace FILE, or leave oltp out with --only")
        binary, work, machine = oltp.setup_run(args, "fio")
    else:
        binary, work, machine = bl.setup(args, "fio")
    command = bl.command_line()
    here = provenance(machine, vars(args), command)
    rows = [run_fio_workload(binary, work, *w, args) for w in WORKLOADS if w[0] in groups]
    doc = {"machine": machine, "args": vars(args), "command": command}
    if "oltp" in groups:
        oltp_rows, doc["oltp"] = run_oltp(binary, work, args)
        rows += oltp_rows
    for r in rows:
        r["run"] = here
    doc["ran"] = [g for g in GROUPS if g in groups]
    out = bl.results_dir(args)
    doc["rows"] = merge(out, rows, groups, doc) if args.only else rows
    report(args, machine, doc["rows"], doc, out, time.time() - t_all)
    print(f"whole run: {(time.time() - t_all) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()

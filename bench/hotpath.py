#!/usr/bin/env python3
"""The hot path against its ceilings: how far flashtier's 4K read hits, write-back writes and
write+FLUSH commits are from the NBD protocol's own speed and from the device's (issue 11,
item 5: "a hot path at the device's speed, without allocation").

One fio job per line, one after the other in one run, all with fio's nbd engine (libnbd, one
connection) or io_uring on a local file; 4K, QD32 (QD1 for the commits), time-based (--seconds,
default 20 s; --quick 5 s), no ramp, so the I/Os fio reports are all the I/Os the server saw:

  NBD ceiling     `nbdkit memory`: random writes, then random reads (of the written data): what
                  one NBD connection does when the server keeps the data in RAM; `nbdkit null`:
                  the same when the server does no work at all (writes discarded, reads zeros)
  raw file        fio --ioengine=io_uring --direct=1, random reads and random writes on a file the
                  size of the cache file, on the same filesystem: what the cache device does
  qemu-nbd        `qemu-nbd --cache=none --aio=io_uring` on the raw file: random reads (one
                  connection, then 4 at QD16 each), random writes, and commits (below): what a
                  production NBD server does serving the device itself, O_DIRECT through
                  io_uring, the same hop flashtier's requests take
  flashtier       write-back cache (cache file on the disk, backing file in --backing-dir, RAM by
                  default): random reads of a working set warmed into the cache beforehand (the
                  server's read_hit_blocks / read_miss_blocks counters prove every read hit), the
                  same from 4 connections at QD16 each (where the server's CPU is the limit), the
                  commit below on a cache with nothing dirty, then (after `flashtier flush`)
                  random writes over the same working set
  flashtier RAM   the same, with the cache file in --backing-dir too (RAM by default): read hits
                  (warmed the same way) and random writes, the server's own path when the cache
                  device costs nothing (not durable, never a configuration: a measurement of what
                  the device adds)
  nbdkit file     `nbdkit file FILE cache=none` (page cache dropped after each request): random
                  writes to a file of the working set's size on the same filesystem
  nbdkit cache    `nbdkit --filter=cache file FILE cache=writeback cache-min-block-size=4K`: the
                  cache filter in write-back mode, its cache a temporary file in the page cache
  commit (QD1)    4K random write + FLUSH, one at a time (fio --fsync=1 over NBD, a FLUSH after
                  every write) through flashtier, `nbdkit file cache=none`, qemu-nbd, and on the
                  raw file (io_uring O_DIRECT + fdatasync after every write, --fdatasync=1).
                  flashtier's is measured twice: on a cache with nothing dirty (nothing to write
                  back but what the commits themselves leave), and right after the random-write
                  line, while the cleaner writes back the dirty blocks that line left (the rate
                  controller drains the excess over its target): the cleaner's reads of those
                  blocks share the cache device with the commits

Server CPU per I/O: utime+stime of the server process (/proc/PID/stat, all threads) before and
after the fio job, divided by the I/Os fio did. It includes whatever the server does in the
background meanwhile (flashtier: log writer, reclaim, write-back of dirty blocks to the backing
file), which is part of what an I/O costs.

Ratios (IOPS): flashtier read hits / raw file random reads; flashtier write-back writes / nbdkit
cache filter writes; flashtier QD1 write+flush / raw file write+fdatasync (issue 11 item 5's
three); the RAM cache's read hits / raw file random reads and its writes / nbdkit cache filter
writes (the same targets without the device's cost). Beside them, what the hop allows: qemu-nbd's
reads of the raw file / the raw file's, and nbdkit's cache filter / `nbdkit null` (a server that
does nothing).

The machine is shared: the load average at the start and the end is recorded, and the results
say so when it was above 2. This is one pass, not interleaved rounds: a line's figure may be off
by the noise of its seconds.

Writes bench/results/hotpath.{md,json} (with --quick: /tmp/flashtier-bench-quick).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

QD = 32


def fio_job(target, rw, iodepth, seconds, size, extra=(), numjobs=1):
    """One time-based fio job without ramp: IOPS, p50/p99/mean latency of the dominant direction,
    I/Os done, and (with --fsync/--fdatasync) the sync side's latency. `numjobs` > 1: that many
    jobs (over NBD, a connection each), reported together."""
    group = ["--group_reporting"] if numjobs > 1 else []
    argv = ["fio", "--name=hotpath", *target, f"--rw={rw}", "--bs=4k", f"--iodepth={iodepth}",
            f"--numjobs={numjobs}", *group, f"--size={size}", "--time_based", f"--runtime={seconds}",
            "--output-format=json", *extra]
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio failed: {' '.join(map(str, argv))}\n{out.stderr}")
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    job = doc["jobs"][0]
    side = job["read"] if job["read"]["total_ios"] >= job["write"]["total_ios"] else job["write"]
    pct = side["clat_ns"].get("percentile", {})
    res = {
        "argv": " ".join(map(str, argv)),
        "iops": side["iops"],
        "ios": job["read"]["total_ios"] + job["write"]["total_ios"],
        "lat_p50_us": pct.get("50.000000", 0) / 1000,
        "lat_p99_us": pct.get("99.000000", 0) / 1000,
        "lat_mean_us": side["clat_ns"]["mean"] / 1000,
        "fio_cpu_pct": job.get("usr_cpu", 0) + job.get("sys_cpu", 0),
    }
    sync = job.get("sync", {}).get("lat_ns")
    if sync and sync.get("N"):
        sp = sync.get("percentile", {})
        res["sync"] = {"n": sync["N"], "lat_p50_us": sp.get("50.000000", 0) / 1000,
                       "lat_p99_us": sp.get("99.000000", 0) / 1000, "lat_mean_us": sync["mean"] / 1000}
    return res


def on_server(server, target, rw, iodepth, seconds, size, extra=(), numjobs=1):
    """fio_job with the server's CPU time per I/O (`cpu_us_per_io`)."""
    cpu0 = server.cpu_seconds()
    m = fio_job(target, rw, iodepth, seconds, size, extra, numjobs)
    cpu = server.cpu_seconds() - cpu0
    m["server_cpu_s"] = cpu
    m["cpu_us_per_io"] = cpu * 1e6 / m["ios"] if m["ios"] else float("nan")
    return m


def nbdkit(name, argv_tail, work: Path, extra=(), env=None):
    sock = work / f"hotpath-{name}.sock"
    argv = ["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), *extra, *argv_tail]
    return bl.Server(f"nbdkit-{name}", argv, sock, f"nbd+unix:///?socket={sock}", work / f"hotpath-{name}.log",
                     env=env)


def qemu_nbd(image: Path, work: Path):
    """`qemu-nbd` serving `image` O_DIRECT (--cache=none) through io_uring, up to 4 connections."""
    sock = work / "hotpath-qemu-nbd.sock"
    argv = ["qemu-nbd", "--format=raw", "--cache=none", "--aio=io_uring", "--shared=4", "--persistent",
            "--socket", str(sock), str(image)]
    return bl.Server("qemu-nbd", argv, sock, f"nbd+unix:///?socket={sock}", work / "hotpath-qemu-nbd.log")


def dirty_blocks(binary, control):
    return bl.report_cache_status(bl.flashtier_report(binary, control)).get("dirty_blocks")


def hit_counters(binary, control):
    c = bl.flashtier_report(binary, control)["counters"]
    return c.get("read_hit_blocks", 0), c.get("read_miss_blocks", 0)


def read_hits(binary, server, control, ws, seconds):
    """Warms the working set into the cache by reading it (1 MiB reads, promotions settled, up to
    four passes, until one misses nothing), then measures QD32 random reads; `hits` says how many
    of them the server counted as hits and misses."""
    for p in range(4):
        h0, m0 = hit_counters(binary, control)
        bl.run_fio(bl.nbd_target(server.uri), "read", bs="1M", iodepth=4, size=ws, time_based=False)
        bl.flashtier_wait_promotions(binary, control)
        h1, m1 = hit_counters(binary, control)
        print(f"warm pass {p + 1}: {h1 - h0} hit blocks, {m1 - m0} missed blocks", flush=True)
        if m1 == m0:
            break
    h0, m0 = hit_counters(binary, control)
    m = on_server(server, bl.nbd_target(server.uri), "randread", QD, seconds, ws)
    h1, m1 = hit_counters(binary, control)
    m["hits"] = {"hit_blocks": h1 - h0, "miss_blocks": m1 - m0, "fio_reads": m["ios"]}
    if m1 != m0:
        print(f"warning: {m1 - m0} of the measured reads missed", flush=True)
    return m


ALLOC_TEST = ["cargo", "test", "--locked", "-q", "-p", "flashtier-engine", "--test", "hot_path_allocations", "--",
              "--nocapture"]


def allocation_figures():
    """Heap allocations per 4K read hit, write-back write and write + FLUSH (the engine's
    counting-allocator test, crates/flashtier-engine/tests/hot_path_allocations.rs, run with cargo
    into $CARGO_TARGET_DIR): {"read_hit": (calling thread, all threads), "batched_read_hit": (...),
    "write_back_write": (...),
    "write_flush": (...), "output": ...}, or None when it cannot run."""
    try:
        out = subprocess.run(ALLOC_TEST, cwd=bl.REPO, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"warning: the allocation test did not run: {e}", flush=True)
        return None
    text = out.stdout + out.stderr
    figs = {"command": " ".join(ALLOC_TEST), "passed": out.returncode == 0,
            "output": [ln for ln in text.splitlines() if "allocations" in ln or "calling thread" in ln]}
    for key, label in (("read_hit", "  read hit:"), ("batched_read_hit", "batched read hit:"),
                       ("write_back_write", "write-back write:"), ("write_flush", "write + flush:")):
        m = re.search(re.escape(label) + r"\s+([\d.]+) on the calling thread, ([\d.]+) on all threads", text)
        figs[key] = (float(m.group(1)), float(m.group(2))) if m else None
    if figs["read_hit"] is None:
        print(f"warning: no figures from the allocation test:\n{text[-2000:]}", flush=True)
        return None
    return figs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=20, help="seconds per fio job (default 20; --quick: 5)")
    ap.add_argument("--working-set-mib", type=int, default=1024,
                    help="the exports' size, read and written at random (default 1024)")
    ap.add_argument("--cache-mib", type=int, default=2048,
                    help="flashtier's cache file, and the raw file of the same size (default 2048)")
    ap.add_argument("--backing-dir", default="/dev/shm/flashtier-bench",
                    help="where flashtier's backing file lives (default /dev/shm/flashtier-bench: fast, so "
                         "write-back of dirty blocks does not wait for a disk)")
    ap.add_argument("--no-alloc-test", action="store_true",
                    help="skip the engine's allocation count (run with cargo before the I/O measurements)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 5)
        args.working_set_mib, args.cache_mib = 256, 512

    load_start = os.getloadavg()
    binary, work, machine = bl.setup(args, "fio", "nbdkit", "qemu-nbd")
    ws = args.working_set_mib << 20
    cache_bytes = args.cache_mib << 20
    bdir = Path(args.backing_dir)
    bdir.mkdir(parents=True, exist_ok=True)
    allocs = None
    if not args.no_alloc_test:
        print(f"allocation count: {' '.join(ALLOC_TEST)}", flush=True)
        allocs = allocation_figures()
    t_start = time.time()

    raw_img = work / "hotpath-raw.img"
    cache_img = work / "hotpath-cache.img"
    file_img = work / "hotpath-file.img"
    backing_img = bdir / "hotpath-backing.img"
    bl.make_random_file(raw_img, cache_bytes)
    bl.make_random_file(file_img, ws)
    bl.make_random_file(backing_img, ws)  # in RAM: written in full so nothing reads as a hole

    rows = []

    def add(line, kind, m, peer):
        m.update({"line": line, "kind": kind, "peer": peer})
        rows.append(m)
        cpu = m.get("cpu_us_per_io", float("nan"))
        sync = m.get("sync")
        print(f"{line:44} {m['iops']:9.0f} IOPS  p50 {m['lat_p50_us']:7.0f} us  p99 {m['lat_p99_us']:7.0f} us"
              f"  server CPU {cpu:6.1f} us/IO"
              + (f"  flush p50 {sync['lat_p50_us']:.0f} p99 {sync['lat_p99_us']:.0f} us" if sync else ""),
              flush=True)

    hits = None
    fmt = None
    dirty_at = {}
    closed = {}
    try:
        # 1. The NBD protocol's ceiling: a server that keeps the data in RAM, and one that does
        # nothing at all.
        for plugin in ("memory", "null"):
            srv = nbdkit(plugin, [plugin, str(ws)], work)
            for rw, what in (("randwrite", "random writes"), ("randread", "random reads")):
                add(f"nbdkit {plugin}: {what}", rw,
                    on_server(srv, bl.nbd_target(srv.uri), rw, QD, args.seconds, ws), f"nbdkit-{plugin}")
            srv.stop()

        # 2. The device: io_uring O_DIRECT on a file the size of the cache file.
        add("raw file (io_uring O_DIRECT): random reads", "randread",
            fio_job(bl.local_target(raw_img), "randread", QD, args.seconds, cache_bytes), "raw")
        add("raw file (io_uring O_DIRECT): random writes", "randwrite",
            fio_job(bl.local_target(raw_img), "randwrite", QD, args.seconds, cache_bytes), "raw")

        # 2b. A production NBD server on the device itself: the hop, without a cache.
        bl.evict_from_page_cache(raw_img)
        qn = qemu_nbd(raw_img, work)
        add("qemu-nbd (O_DIRECT, io_uring) on the raw file: random reads", "randread",
            on_server(qn, bl.nbd_target(qn.uri), "randread", QD, args.seconds, cache_bytes), "qemu-nbd")
        add("qemu-nbd on the raw file: random reads, 4 connections × QD16", "randread-4conn",
            on_server(qn, bl.nbd_target(qn.uri), "randread", 16, args.seconds, cache_bytes, numjobs=4), "qemu-nbd")
        add("qemu-nbd on the raw file: random writes", "randwrite",
            on_server(qn, bl.nbd_target(qn.uri), "randwrite", QD, args.seconds, cache_bytes), "qemu-nbd")
        add("qemu-nbd on the raw file: write+flush QD1", "commit",
            on_server(qn, bl.nbd_target(qn.uri), "randwrite", 1, args.seconds, cache_bytes, ["--fsync=1"]),
            "qemu-nbd")
        qn.stop()

        # 3. flashtier write-back: read hits (warm the working set by reading it), then writes.
        fmt = bl.flashtier_format(binary, cache_img, str(backing_img), cache_bytes)
        control = work / "hotpath-ft.control"
        ft = bl.flashtier_cache_serve(binary, cache_img, str(backing_img), work / "hotpath-ft.sock",
                                      work / "hotpath-ft.log", threads=args.threads,
                                      extra=["--control-socket", str(control)])
        m = read_hits(binary, ft, control, ws, args.seconds)
        hits = m["hits"]
        add("flashtier write-back: read hits", "randread", m, "flashtier")
        # Four connections at QD16 each: the server's CPU, not one connection's round trips, is
        # the limit (a kernel NBD client or qemu with several connections).
        add("flashtier write-back: read hits, 4 connections × QD16", "randread-4conn",
            on_server(ft, bl.nbd_target(ft.uri), "randread", 16, args.seconds, ws, numjobs=4), "flashtier")
        # The database commit (4K write + FLUSH at QD1; the raw file's is step 5), first with
        # nothing dirty to write back.
        dirty_at["commit-clean"] = dirty_blocks(binary, control)
        add("flashtier write-back: write+flush QD1, nothing dirty", "commit-clean",
            on_server(ft, bl.nbd_target(ft.uri), "randwrite", 1, args.seconds, ws, ["--fsync=1"]), "flashtier")
        bl.flashtier_ctl(binary, control, "flush")
        add("flashtier write-back: random writes", "randwrite",
            on_server(ft, bl.nbd_target(ft.uri), "randwrite", QD, args.seconds, ws), "flashtier")
        # Then right after the writes, while the cleaner drains what they left.
        dirty_at["commit"] = dirty_blocks(binary, control)
        add("flashtier write-back: write+flush QD1, while write-back drains the writes' backlog", "commit",
            on_server(ft, bl.nbd_target(ft.uri), "randwrite", 1, args.seconds, ws, ["--fsync=1"]), "flashtier")
        ft.stop()
        closed = bl.flashtier_closed_event(ft.log_text())

        # 3b. The same with the cache file in the backing directory (RAM by default): the
        # server's own path when the cache device costs nothing (not durable: a measurement).
        ram_cache = bdir / "hotpath-ram-cache.img"
        try:
            bl.flashtier_format(binary, ram_cache, str(backing_img), cache_bytes)
            ram_control = work / "hotpath-ft-ram.control"
            fr = bl.flashtier_cache_serve(binary, ram_cache, str(backing_img), work / "hotpath-ft-ram.sock",
                                          work / "hotpath-ft-ram.log", threads=args.threads,
                                          extra=["--control-socket", str(ram_control)])
            where = f"cache file in {args.backing_dir}"
            add(f"flashtier write-back, {where}: read hits", "randread",
                read_hits(binary, fr, ram_control, ws, args.seconds), "flashtier-ram")
            bl.flashtier_ctl(binary, ram_control, "flush")
            add(f"flashtier write-back, {where}: random writes", "randwrite",
                on_server(fr, bl.nbd_target(fr.uri), "randwrite", QD, args.seconds, ws), "flashtier-ram")
            fr.stop()
        finally:
            ram_cache.unlink(missing_ok=True)

        # 4. nbdkit file cache=none and nbdkit's cache filter (page cache) random writes.
        bl.evict_from_page_cache(file_img)
        nf = nbdkit("file", ["file", str(file_img), "cache=none"], work)
        add("nbdkit file cache=none: random writes", "randwrite",
            on_server(nf, bl.nbd_target(nf.uri), "randwrite", QD, args.seconds, ws), "nbdkit-file")
        add("nbdkit file cache=none: write+flush QD1", "commit",
            on_server(nf, bl.nbd_target(nf.uri), "randwrite", 1, args.seconds, ws, ["--fsync=1"]), "nbdkit-file")
        nf.stop()

        bl.evict_from_page_cache(file_img)
        tmp = work / "hotpath-cachefilter-tmp"
        tmp.mkdir(exist_ok=True)
        nc = nbdkit("cachefilter", ["file", str(file_img), "cache=writeback", "cache-min-block-size=4K"], work,
                    extra=["--filter=cache"], env={**os.environ, "TMPDIR": str(tmp)})
        add("nbdkit --filter=cache file: random writes", "randwrite",
            on_server(nc, bl.nbd_target(nc.uri), "randwrite", QD, args.seconds, ws), "nbdkit-cache-filter")
        nc.stop()

        # 5. (the device's part) write + fdatasync at QD1 on the raw file.
        add("raw file (io_uring O_DIRECT): write+fdatasync QD1", "commit",
            fio_job(bl.local_target(raw_img), "randwrite", 1, args.seconds, cache_bytes, ["--fdatasync=1"]), "raw")
    finally:
        backing_img.unlink(missing_ok=True)  # it is in RAM (/dev/shm by default)
    load_end = os.getloadavg()
    wall = time.time() - t_start

    by = {(r["peer"], r["kind"]): r for r in rows}

    def ratio(a, b):
        return by[a]["iops"] / by[b]["iops"]
    ratios = {
        "read_hits_vs_raw_reads": ratio(("flashtier", "randread"), ("raw", "randread")),
        "writeback_writes_vs_nbdkit_cache_filter_writes": ratio(("flashtier", "randwrite"),
                                                                ("nbdkit-cache-filter", "randwrite")),
        "commit_qd1_vs_raw_fdatasync": ratio(("flashtier", "commit"), ("raw", "commit")),
        "commit_qd1_nothing_dirty_vs_raw_fdatasync": ratio(("flashtier", "commit-clean"), ("raw", "commit")),
        "read_hits_vs_qemu_nbd_reads": ratio(("flashtier", "randread"), ("qemu-nbd", "randread")),
        "qemu_nbd_reads_vs_raw_reads": ratio(("qemu-nbd", "randread"), ("raw", "randread")),
        "qemu_nbd_reads_4conn_vs_raw_reads": ratio(("qemu-nbd", "randread-4conn"), ("raw", "randread")),
        "commit_qd1_qemu_nbd_vs_raw_fdatasync": ratio(("qemu-nbd", "commit"), ("raw", "commit")),
        "writeback_writes_vs_qemu_nbd_writes": ratio(("flashtier", "randwrite"), ("qemu-nbd", "randwrite")),
        "nbdkit_cache_filter_writes_vs_nbdkit_null_writes": ratio(("nbdkit-cache-filter", "randwrite"),
                                                                  ("nbdkit-null", "randwrite")),
        "commit_qd1_vs_nbdkit_file": ratio(("flashtier", "commit"), ("nbdkit-file", "commit")),
        "read_hits_4conn_vs_raw_reads": ratio(("flashtier", "randread-4conn"), ("raw", "randread")),
        "read_hits_vs_nbdkit_memory_reads": ratio(("flashtier", "randread"), ("nbdkit-memory", "randread")),
        "writeback_writes_vs_nbdkit_memory_writes": ratio(("flashtier", "randwrite"),
                                                          ("nbdkit-memory", "randwrite")),
        "writeback_writes_vs_raw_writes": ratio(("flashtier", "randwrite"), ("raw", "randwrite")),
        "ram_cache_read_hits_vs_raw_reads": ratio(("flashtier-ram", "randread"), ("raw", "randread")),
        "ram_cache_writes_vs_nbdkit_cache_filter_writes": ratio(("flashtier-ram", "randwrite"),
                                                                ("nbdkit-cache-filter", "randwrite")),
    }
    loaded = max(load_start[0], load_end[0]) > 2
    doc = {"machine": machine, "args": vars(args), "command": bl.command_line(), "rows": rows, "ratios": ratios,
           "loadavg_start": load_start, "loadavg_end": load_end, "loaded": loaded, "wall_s": wall,
           "format_output": fmt, "closed": closed, "allocations_per_io": allocs, "dirty_blocks_at_start": dirty_at}

    def f0(x):
        return "—" if x is None or x != x else f"{x:,.0f}"

    def f1(x):
        return "—" if x is None or x != x else f"{x:,.1f}"
    lines = bl.results_header("Hot path: flashtier vs the NBD protocol's and the device's ceilings", machine,
                              args.quick)
    lines += [
        f"Load average (1, 5, 15 min) at the start {' '.join(f'{x:.2f}' for x in load_start)}, at the end "
        f"{' '.join(f'{x:.2f}' for x in load_end)}."
        + (f" **The machine was shared and loaded during this run (load average above 2, on {os.cpu_count()} "
           "CPUs): other jobs competed with the servers and fio for the CPUs and the disk, so these IOPS and "
           "latencies are those of a busy machine; compare the lines of this run with each other.**"
           if loaded else ""),
        "",
        f"4K I/Os, fio's nbd engine (one connection) or io_uring O_DIRECT on a local file; QD{QD} unless the line "
        f"says QD1; {args.seconds} s per line, time-based, no ramp, one pass (not interleaved rounds). Working set "
        f"(every export's size) {args.working_set_mib} MiB; flashtier's cache file and the raw file "
        f"{args.cache_mib} MiB each, side by side on {machine.get('disk', '?')}; flashtier's backing file in "
        f"{args.backing_dir}. Server CPU µs/IO = the server's utime+stime (/proc/PID/stat, all threads) during "
        "the job ÷ the I/Os fio did (background work included). Write+flush lines: IOPS = commits per second, "
        "server CPU per commit (a write and its FLUSH), latency = the write's, then the FLUSH's (fdatasync's) "
        "p50/p99.",
        "",
        "| line | IOPS | p50 µs | p99 µs | server CPU µs/IO | flush p50 µs | flush p99 µs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r.get("sync") or {}
        lines.append(f"| {r['line']} | {f0(r['iops'])} | {f0(r['lat_p50_us'])} | {f0(r['lat_p99_us'])} | "
                     f"{f1(r.get('cpu_us_per_io'))} | {f0(s.get('lat_p50_us'))} | {f0(s.get('lat_p99_us'))} |")
    lines += [
        "",
        "| ratio (IOPS) | measured |",
        "|---|---:|",
        f"| flashtier read hits ÷ raw file random reads | {ratios['read_hits_vs_raw_reads']:.2f}× |",
        f"| flashtier read hits, 4 connections × QD16 ÷ raw file random reads (QD32) | "
        f"{ratios['read_hits_4conn_vs_raw_reads']:.2f}× |",
        f"| flashtier write-back writes ÷ nbdkit cache filter writes | "
        f"{ratios['writeback_writes_vs_nbdkit_cache_filter_writes']:.2f}× |",
        f"| flashtier write+flush QD1 ÷ raw file write+fdatasync QD1 (during write-back of a backlog) | "
        f"{ratios['commit_qd1_vs_raw_fdatasync']:.2f}× |",
        f"| flashtier write+flush QD1 ÷ raw file write+fdatasync QD1 (nothing dirty) | "
        f"{ratios['commit_qd1_nothing_dirty_vs_raw_fdatasync']:.2f}× |",
        f"| flashtier write+flush QD1 ÷ nbdkit file cache=none write+flush QD1 | "
        f"{ratios['commit_qd1_vs_nbdkit_file']:.2f}× |",
        f"| flashtier read hits ÷ nbdkit memory reads | {ratios['read_hits_vs_nbdkit_memory_reads']:.2f}× |",
        f"| flashtier write-back writes ÷ nbdkit memory writes | "
        f"{ratios['writeback_writes_vs_nbdkit_memory_writes']:.2f}× |",
        f"| flashtier write-back writes ÷ raw file random writes | {ratios['writeback_writes_vs_raw_writes']:.2f}× |",
        "",
        f"The same build with its cache file in {args.backing_dir} (no device cost, not durable): what "
        "flashtier's own path does against the same targets (see bench/results/instant_device/):",
        "",
        "| ratio (IOPS) | measured |",
        "|---|---:|",
        f"| flashtier read hits, cache file in {args.backing_dir} ÷ raw file random reads | "
        f"{ratios['ram_cache_read_hits_vs_raw_reads']:.2f}× |",
        f"| flashtier write-back writes, cache file in {args.backing_dir} ÷ nbdkit cache filter writes | "
        f"{ratios['ram_cache_writes_vs_nbdkit_cache_filter_writes']:.2f}× |",
        "",
        "What the NBD hop allows on this machine, measured in the same run:",
        "",
        "| ratio (IOPS) | measured |",
        "|---|---:|",
        f"| qemu-nbd reads of the raw file ÷ raw file random reads | {ratios['qemu_nbd_reads_vs_raw_reads']:.2f}× |",
        f"| qemu-nbd reads of the raw file, 4 connections × QD16 ÷ raw file random reads | "
        f"{ratios['qemu_nbd_reads_4conn_vs_raw_reads']:.2f}× |",
        f"| flashtier read hits ÷ qemu-nbd reads of the raw file | {ratios['read_hits_vs_qemu_nbd_reads']:.2f}× |",
        f"| flashtier write-back writes ÷ qemu-nbd writes to the raw file | "
        f"{ratios['writeback_writes_vs_qemu_nbd_writes']:.2f}× |",
        f"| qemu-nbd write+flush QD1 ÷ raw file write+fdatasync QD1 | "
        f"{ratios['commit_qd1_qemu_nbd_vs_raw_fdatasync']:.2f}× |",
        f"| nbdkit cache filter writes ÷ nbdkit null writes (a server that does nothing) | "
        f"{ratios['nbdkit_cache_filter_writes_vs_nbdkit_null_writes']:.2f}× |",
        "",
    ]
    if dirty_at:
        lines += [f"Dirty blocks in flashtier's cache as each commit line started: "
                  + ", ".join(f"{k}: {v:,}" if isinstance(v, int) else f"{k}: {v}" for k, v in dirty_at.items())
                  + f" (of {int(closed.get('cached_blocks', 0)):,} cached at shutdown).", ""]
    if hits is not None:
        lines.append(f"Read hits: during the read line the server counted {hits['hit_blocks']:,} hit blocks and "
                     f"{hits['miss_blocks']:,} missed blocks for {hits['fio_reads']:,} fio reads "
                     f"({'every read hit' if hits['miss_blocks'] == 0 else 'NOT every read hit'}).")
    if closed:
        lines.append(f"At shutdown flashtier's cache held {int(closed.get('cached_blocks', 0)):,} blocks, "
                     f"{int(closed.get('dirty_blocks', 0)):,} dirty.")
    lines += [""]
    if allocs:
        def row(name, figs):
            return f"| {name} | {figs[0]:.2f} | {figs[1]:.2f} |" if figs else f"| {name} | ? | ? |"
        lines += [
            "Heap allocations per I/O in the engine (in-memory devices, 1000 4K I/Os in steady state, counted by a "
            f"counting global allocator; `{allocs['command']}`, "
            f"{'passed' if allocs['passed'] else 'FAILED'}). The test requires 0 per read hit on the calling thread "
            "(16 at a time through `read_batch` too) and at most 0.05 per write (a write that leads the log's round may copy an index chunk a checkpoint "
            "shares); on all threads, what the background does per checkpoint shows as a fraction (issue 11, item 5).",
            "",
            "| path | allocations/IO, calling thread | allocations/IO, all threads (log writer included) |",
            "|---|---:|---:|",
            row("4K read hit", allocs["read_hit"]),
            row("4K read hit, batched (16 a batch)", allocs.get("batched_read_hit")),
            row("4K write-back write", allocs["write_back_write"]),
            row("4K write + FLUSH", allocs.get("write_flush")),
            "",
        ]
    else:
        lines += ["Heap allocations per I/O: not measured (--no-alloc-test, or the test did not run).", ""]
    lines += ["fio command of each line:", ""]
    lines += [f"- {r['line']}: `{r['argv']}`" for r in rows]
    lines += ["", f"Wall time of the run: {wall:.0f} s."]
    bl.write_results(bl.results_dir(args), "hotpath", doc, lines)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Requests executed at once per connection (`serve --threads`): what each setting does to 4K
write-back writes and read hits at QD32 over one NBD connection.

A write-back write holds its NBD worker thread until the log writer has written its record. Before
the NBD layer batched WRITEs, that made the threads of a connection bound how many writes a log
batch could gather (each batch costs a header block of cache space and a device write of its own),
which is why the default is 16. Since a thread takes up to 8 pipelined WRITEs (or READs) at once,
4 threads keep a QD32 client's requests in flight too, and in bench/results/hotpath_hop/ (stop 49)
they served as much at 15-30% less server CPU per I/O; what keeps the default at 16 is requests
that wait on the backing store (misses, write-through writes), which hold a thread each. This
measures the settings against each other, in interleaved rounds on the same files:

  for each round, for each --threads setting (order alternating between rounds): format a fresh
  write-back cache (cache file on the disk, backing file in --backing-dir, RAM by default), serve
  it with that setting, warm the working set into it by reading it, then fio (nbd engine, one
  connection, QD32, 4K, time-based) random reads (all hits: checked with the server's counters)
  and random writes over the working set.

Reported per setting (median of the rounds): IOPS, p50/p99 latency, server CPU µs per I/O
(utime+stime of the server during the job ÷ I/Os), and for the writes the records per log batch
and the share of the cache's writes that were batch headers (from the server's counters: batches,
records, cache_write_bytes).

--profile also records where the server's CPU goes during the write job of one more cell (the first
setting): `perf record -e cpu-clock -g` of the server (cpu-clock: a software event, since this
machine's VM has no hardware counters), reported flat by thread name and symbol.

Writes bench/results/threads/threads.{md,json} (with --quick: /tmp/flashtier-bench-quick/threads.*).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl
from hotpath import hit_counters, on_server

QD = 32


def one_cell(binary, work, bdir, threads, ws, cache_bytes, seconds, profile=False):
    """A fresh cache served with `threads`: read hits, then writes; counters of the write job (and
    with `profile`, perf's flat report of the server during it)."""
    cache_img = work / "threads-cache.img"
    backing_img = bdir / "threads-backing.img"
    bl.make_random_file(backing_img, ws)
    cache_img.unlink(missing_ok=True)
    try:
        bl.flashtier_format(binary, cache_img, str(backing_img), cache_bytes)
        control = work / "threads-ft.control"
        ft = bl.flashtier_cache_serve(binary, cache_img, str(backing_img), work / "threads-ft.sock",
                                      work / "threads-ft.log", threads=threads,
                                      extra=["--control-socket", str(control)])
        try:
            for _ in range(4):
                h0, m0 = hit_counters(binary, control)
                bl.run_fio(bl.nbd_target(ft.uri), "read", bs="1M", iodepth=4, size=ws, time_based=False)
                bl.flashtier_wait_promotions(binary, control)
                h1, m1 = hit_counters(binary, control)
                if m1 == m0:
                    break
            h0, m0 = hit_counters(binary, control)
            reads = on_server(ft, bl.nbd_target(ft.uri), "randread", QD, seconds, ws)
            h1, m1 = hit_counters(binary, control)
            reads["missed_blocks"] = m1 - m0
            c0 = bl.flashtier_report(binary, control)["counters"]
            rec = None
            if profile:
                perf_data = work / "threads-perf.data"
                rec = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1000", "-g", "-o",
                                        str(perf_data), "-p", str(ft.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            writes = on_server(ft, bl.nbd_target(ft.uri), "randwrite", QD, seconds, ws)
            if rec is not None:
                rec.send_signal(signal.SIGINT)
                rec.wait(60)
                rep = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--percent-limit",
                                      "1", "--stdio", "-g", "none", "--sort", "comm,dso,sym"],
                                     capture_output=True, text=True)
                writes["perf_flat"] = [ln for ln in rep.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
            c1 = bl.flashtier_report(binary, control)["counters"]
            d = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("batches", "records", "cache_write_bytes", "cache_writes")}
            written_blocks = d["cache_write_bytes"] / 4096
            writes["batches"] = d["batches"]
            writes["records_per_batch"] = d["records"] / d["batches"] if d["batches"] else float("nan")
            writes["header_share"] = d["batches"] / written_blocks if written_blocks else float("nan")
        finally:
            ft.stop()
    finally:
        backing_img.unlink(missing_ok=True)
        cache_img.unlink(missing_ok=True)
    return {"threads": threads, "reads": reads, "writes": writes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="16,32,64", help="--threads values to compare (default 16,32,64)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3; --quick 1)")
    ap.add_argument("--seconds", type=int, default=10, help="seconds per fio job (default 10; --quick 3)")
    ap.add_argument("--working-set-mib", type=int, default=1024, help="the export's size (default 1024)")
    ap.add_argument("--cache-mib", type=int, default=2048, help="the cache file's size (default 2048)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the server's CPU during one more cell's write job (perf record)")
    ap.add_argument("--backing-dir", default="/dev/shm/flashtier-bench",
                    help="where the backing file lives (default /dev/shm/flashtier-bench: in RAM, so write-back "
                         "of dirty blocks does not wait for a disk)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.threads is not None:
        ap.error("--threads: use --settings")
    if args.quick:
        args.rounds, args.seconds = 1, min(args.seconds, 3)
        args.working_set_mib, args.cache_mib = 256, 512
    settings = [int(s) for s in args.settings.split(",")]

    load_start = os.getloadavg()
    binary, work, machine = bl.setup(args, "fio", *(["perf"] if args.profile else []))
    bdir = Path(args.backing_dir)
    bdir.mkdir(parents=True, exist_ok=True)
    ws, cache_bytes = args.working_set_mib << 20, args.cache_mib << 20
    t0 = time.time()
    cells = []
    for r in range(args.rounds):
        for t in (settings if r % 2 == 0 else list(reversed(settings))):
            c = one_cell(binary, work, bdir, t, ws, cache_bytes, args.seconds)
            c["round"] = r + 1
            cells.append(c)
            w, rd = c["writes"], c["reads"]
            print(f"round {r + 1} threads {t:3}: reads {rd['iops']:8.0f} IOPS {rd['cpu_us_per_io']:5.1f} us/IO"
                  f" (missed {rd['missed_blocks']}); writes {w['iops']:8.0f} IOPS {w['cpu_us_per_io']:5.1f} us/IO,"
                  f" {w['records_per_batch']:.1f} records/batch, headers {100 * w['header_share']:.1f}%",
                  flush=True)
    profiled = None
    if args.profile:
        profiled = one_cell(binary, work, bdir, settings[0], ws, cache_bytes, args.seconds, profile=True)
    wall = time.time() - t0
    load_end = os.getloadavg()

    def med(t, side, key):
        return statistics.median(c[side][key] for c in cells if c["threads"] == t)
    summary = {t: {f"{side}_{key}": med(t, side, key)
                   for side in ("reads", "writes")
                   for key in ("iops", "lat_p50_us", "lat_p99_us", "cpu_us_per_io")} for t in settings}
    for t in settings:
        summary[t]["writes_records_per_batch"] = med(t, "writes", "records_per_batch")
        summary[t]["writes_header_share"] = med(t, "writes", "header_share")
    base = settings[0]
    doc = {"machine": machine, "args": vars(args), "command": bl.command_line(), "cells": cells,
           "summary": summary, "profiled": profiled, "loadavg_start": load_start, "loadavg_end": load_end,
           "wall_s": wall}
    lines = bl.results_header("NBD worker threads per connection: write-back writes and read hits at QD32",
                              machine, args.quick)
    lines += [
        f"Load average at the start {' '.join(f'{x:.2f}' for x in load_start)}, at the end "
        f"{' '.join(f'{x:.2f}' for x in load_end)}. {args.rounds} interleaved round(s), {args.seconds} s per fio "
        f"job, fio nbd engine, one connection, QD{QD}, 4K; working set {args.working_set_mib} MiB in a "
        f"{args.cache_mib} MiB write-back cache (fresh for each cell, warmed by reading the working set), backing "
        f"file in {args.backing_dir}. Medians over the rounds; ratios against --threads {base}.",
        "",
        "| --threads | read hits IOPS | ÷ | p50 µs | p99 µs | CPU µs/IO | writes IOPS | ÷ | p50 µs | p99 µs | "
        "CPU µs/IO | records/batch | header blocks |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in settings:
        s, b = summary[t], summary[base]
        lines.append(
            f"| {t} | {s['reads_iops']:,.0f} | {s['reads_iops'] / b['reads_iops']:.2f}× | {s['reads_lat_p50_us']:,.0f} "
            f"| {s['reads_lat_p99_us']:,.0f} | {s['reads_cpu_us_per_io']:.1f} | {s['writes_iops']:,.0f} | "
            f"{s['writes_iops'] / b['writes_iops']:.2f}× | {s['writes_lat_p50_us']:,.0f} | "
            f"{s['writes_lat_p99_us']:,.0f} | {s['writes_cpu_us_per_io']:.1f} | "
            f"{s['writes_records_per_batch']:.1f} | {100 * s['writes_header_share']:.1f}% |")
    lines += ["", "Per cell (round, threads: reads IOPS, writes IOPS, records/batch):", ""]
    for c in cells:
        lines.append(f"- round {c['round']}, {c['threads']}: {c['reads']['iops']:,.0f}, {c['writes']['iops']:,.0f}, "
                     f"{c['writes']['records_per_batch']:.1f}")
    if profiled is not None:
        w = profiled["writes"]
        lines += ["", f"Where the server's CPU went during the random writes of one more cell (--threads "
                  f"{settings[0]}: {w['iops']:,.0f} IOPS, {w['cpu_us_per_io']:.1f} µs/IO; `perf record -e cpu-clock "
                  "-g`, `perf report --no-children --sort comm,dso,sym -g none`, entries of 1% or more):", "", "```",
                  *w.get("perf_flat", []), "```"]
    lines += ["", f"Wall time: {wall:.0f} s."]
    out = Path(args.out) if args.out else (bl.results_dir(args) if args.quick else bl.results_dir(args) / "threads")
    out.mkdir(parents=True, exist_ok=True)
    bl.write_results(out, "threads", doc, lines)


if __name__ == "__main__":
    sys.exit(main())

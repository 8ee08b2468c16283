#!/usr/bin/env python3
"""Warm cache hits: flashtier write-back cache vs the raw cache file vs `nbdkit file`.

flashtier serves an emulated slow backing store (DESIGN.md §5: nbdkit with noparallel + 4 ms
delay + stats + log filters) through a cache file on the local disk. The working set (first
--working-set-mib of the device) is warmed by reading it once sequentially through NBD, the
script waits until the promotions have reached the cache device, and re-reads until a pass
promotes nothing more. Then 4K random reads at QD32 over the working set are measured on:

  raw        fio --ioengine=io_uring --direct=1 on the cache file itself (the physical limit)
  nbdkit     `nbdkit file CACHEFILE cache=none fadvise=random` through fio's nbd engine
  flashtier  the warmed cache through fio's nbd engine

Fairness: flashtier reads its cache file with O_DIRECT, so nbdkit must not serve from the page
cache either. nbdkit 1.32's file plugin has no O_DIRECT; `cache=none` drops the pages of every
read right after it (posix_fadvise DONTNEED) and `fadvise=random` turns read-ahead off, so each
4K read goes to the disk. The script checks that: it reports the disk bytes each server read per
I/O (from /proc/PID/io; ~1.0 blocks/IO means every read went to the disk). The cache file is
evicted from the page cache before every nbdkit run. Both NBD peers read the same region of the
same file that raw fio reads.

Rounds are interleaved (the order of the three rotates each round) and medians reported, with
the servers' CPU time per I/O. Backing I/O during the measurement (from the log filter) proves
the reads were all hits.

Targets: flashtier >= 0.8x raw and >= 1.0x nbdkit (IOPS).

Writes bench/results/cache_hits.{md,json,png}.
"""

import argparse
import time

import benchlib as bl

PEERS = ["raw", "nbdkit", "flashtier"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_fio_args(ap, rounds=5, runtime=10, ramp=2)
    ap.add_argument("--cache-mib", type=int, default=1024, help="cache file size (default 1024)")
    ap.add_argument("--working-set-mib", type=int, default=512, help="working set read at random (default 512)")
    ap.add_argument("--backing-mib", type=int, default=1024, help="backing store size (default 1024)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.runtime, args.ramp = 2, 3, 1
        args.cache_mib, args.working_set_mib, args.backing_mib = 256, 128, 256

    binary, work, machine = bl.setup(args, "fio", "nbdkit")
    ws = args.working_set_mib << 20

    backing_img = work / "hits-backing.img"
    cache_img = work / "hits-cache.img"
    bl.make_random_file(backing_img, args.backing_mib << 20)
    reqlog = work / "hits-backing.requests.log"
    stats = work / "hits-backing.stats.txt"
    backing = bl.slow_backing(backing_img, work / "hits-backing.sock", work / "hits-backing.log", stats, reqlog)
    servers = []
    windows = {}
    try:
        fmt = bl.flashtier_format(binary, cache_img, backing.uri, args.cache_mib << 20)
        ft = bl.flashtier_cache_serve(binary, cache_img, backing.uri, work / "hits-ft.sock",
                                      work / "hits-ft.log", threads=args.threads)
        servers.append(ft)

        # Warm: sequential reads of the working set until a pass promotes (writes) nothing.
        t0 = time.time()
        warm_passes = []
        for p in range(4):
            w0 = ft.io_counters()["write_bytes"]
            m = bl.run_fio(bl.nbd_target(ft.uri), "read", bs="1M", iodepth=4, size=ws, time_based=False)
            waited = ft.wait_io_quiet()
            wrote = ft.io_counters()["write_bytes"] - w0
            warm_passes.append({"pass": p + 1, "seconds": m["elapsed_s"], "MBps": m["read"]["bytes"] / m["elapsed_s"] / 1e6,
                                "cache_write_mib": wrote / 2**20, "quiet_wait_s": waited})
            print(f"warm pass {p + 1}: {m['elapsed_s']:.1f} s, cache device writes {wrote / 2**20:.1f} MiB",
                  flush=True)
            if p > 0 and wrote < (1 << 20):
                break
        else:
            print("warning: the cache was still promoting after 4 passes; some reads may miss", flush=True)
        windows["warm-up"] = (t0, time.time())

        bl.evict_from_page_cache(cache_img)
        nk = bl.nbdkit_file(cache_img, work / "hits-nbdkit.sock", work / "hits-nbdkit.log",
                            params=["cache=none", "fadvise=random"])
        servers.append(nk)

        samples = {p: [] for p in PEERS}
        fio_args = dict(rw="randread", bs="4k", iodepth=args.iodepth, size=ws, runtime=args.runtime, ramp=args.ramp)
        meas_start = time.time()
        for r in range(args.rounds):
            order = PEERS[r % 3:] + PEERS[:r % 3]
            if r % 2:
                order = order[::-1]
            for peer in order:
                if peer == "raw":
                    m = bl.measure_local(cache_img, **fio_args)
                    m["disk_blocks_per_io"] = float("nan")
                else:
                    s = ft if peer == "flashtier" else nk
                    if peer == "nbdkit":
                        bl.evict_from_page_cache(cache_img)
                    io0 = s.io_counters()
                    m = bl.measure(s, **fio_args)
                    io1 = s.io_counters()
                    ios = m["iops"] * (args.runtime + args.ramp)
                    m["disk_blocks_per_io"] = (io1["read_bytes"] - io0["read_bytes"]) / 4096 / ios if ios else float("nan")
                samples[peer].append(m)
                print(f"round {r + 1}/{args.rounds} {peer:9} {m['iops']:9.0f} IOPS  p99 {m['lat_p99_us']:7.0f} us  "
                      f"server CPU {m['cpu_us_per_io']:5.1f} us/IO  fio CPU {m['fio_cpu_pct']:3.0f}%  "
                      f"disk reads {m['disk_blocks_per_io']:.2f} blocks/IO", flush=True)
        windows["measurement"] = (meas_start, time.time())
    finally:
        for s in servers:
            s.stop()
        backing.stop()

    io = bl.count_backing_io(reqlog, windows)
    rows = [{"peer": peer,
             **bl.medians(samples[peer], ["iops", "lat_p99_us", "lat_mean_us", "cpu_us_per_io", "fio_cpu_pct",
                                       "disk_blocks_per_io"]),
             "iops_all": [x["iops"] for x in samples[peer]]} for peer in PEERS]
    by = {r["peer"]: r for r in rows}
    vs_raw = by["flashtier"]["iops"] / by["raw"]["iops"]
    vs_nbdkit = by["flashtier"]["iops"] / by["nbdkit"]["iops"]
    t_raw = bl.check_target(vs_raw, 0.8)
    t_nk = bl.check_target(vs_nbdkit, 1.0)
    meas_reads = io["measurement"].get("read", {"ops": 0, "bytes": 0})
    warm_reads = io["warm-up"].get("read", {"ops": 0, "bytes": 0})

    doc = {"machine": machine, "args": vars(args), "rows": rows, "ratio_vs_raw": vs_raw,
           "ratio_vs_nbdkit": vs_nbdkit, "warm_passes": warm_passes, "backing_io": io,
           "backing_stats_file": bl.read_stats_file(stats), "format_output": fmt,
           "samples": samples}
    out = bl.results_dir(args)
    lines = bl.results_header("Warm cache hits: flashtier vs raw cache file vs nbdkit file", machine, args.quick)
    lines += [
        f"4K random reads at QD{args.iodepth} over a {args.working_set_mib} MiB working set that is fully cached "
        f"in a {args.cache_mib} MiB flashtier write-back cache (backing: {args.backing_mib} MiB behind the "
        f"emulated slow disk). Median of {args.rounds} interleaved rounds of {args.runtime} s "
        f"(+{args.ramp} s ramp). **raw** = `fio --ioengine=io_uring --direct=1` on the cache file; "
        "**nbdkit** = `nbdkit file CACHEFILE cache=none fadvise=random` (no page-cache hits: pages are "
        "dropped after each read, read-ahead off, file evicted before each run); **flashtier** = the "
        "warmed cache (O_DIRECT). " + bl.CLIENT_CPU_NOTE + " Disk blocks/IO is what the server read "
        "from the disk per I/O (/proc/PID/io read_bytes ÷ 4096 ÷ I/Os): ~1.00 means every read went to the "
        "disk, ≪1 would mean page-cache hits.",
        "",
        *bl.peer_table(rows, "raw", [("disk blocks/IO", lambda r: "—" if r["peer"] == "raw"
                                      else f"{r['disk_blocks_per_io']:.2f}")]),
        "",
        *bl.targets_table([("flashtier ≥ 0.8× raw (fio io_uring O_DIRECT on the cache file)", t_raw),
                           ("flashtier ≥ 1.0× `nbdkit file` on the cache file", t_nk)]),
        "",
        f"Backing I/O during the measurement: {meas_reads['ops']} reads ({meas_reads['bytes'] / 2**20:.1f} MiB) "
        f"— {'every read was a cache hit' if meas_reads['ops'] == 0 else 'NOT all hits'}. "
        f"Warm-up: {warm_reads['ops']} backing reads ({warm_reads['bytes'] / 2**20:.0f} MiB) in "
        f"{len(warm_passes)} sequential pass(es): "
        + ", ".join(f"pass {w['pass']} {w['seconds']:.1f} s ({w['MBps']:.0f} MB/s, {w['cache_write_mib']:.0f} MiB "
                    "written to the cache)" for w in warm_passes) + ".",
        "",
        "![IOPS per round](cache_hits.png)",
    ]
    bl.write_results(out, "cache_hits", doc, lines)
    bl.bar_plot(out / "cache_hits.png", f"Warm 4K random reads, QD{args.iodepth} (bars: median; dots: rounds)",
                "IOPS", ["4K randread"],
                [(p, c, [[x["iops"] for x in samples[p]]])
                 for p, c in [("raw", "#555555"), ("nbdkit", "#aaaaaa"), ("flashtier", "#1f77b4")]],
                quick=args.quick)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Write-back random writes: flashtier through NBD vs the raw disk's random-write IOPS.

4K random writes at QD32 over a --size-mib device:

  raw        fio --ioengine=io_uring --direct=1 --rw=randwrite on a file of that size on the same
             disk (and filesystem) as the cache file: what the disk does with random 4K writes
  flashtier  write-back cache through fio's nbd engine; every write is one record appended to the
             log, so random client writes become sequential device writes

The backing store is a file on a fast, separate filesystem (--backing-dir, default /dev/shm), so
the measurement is of flashtier's write path and not of the backing disk. The cache file
(--cache-mib, larger than the device) is written in full before it is formatted, so neither
peer writes into holes. The cache is kept across rounds: the first round starts with an empty
log; later rounds run on a log that has wrapped, so reclaim is writing dirty blocks back (to
the fast backing) and freeing segments while clients write. Per-round dots and the per-second
timeline in the plot show the difference.

Rounds are interleaved (raw, flashtier, flashtier, raw, ...) and medians reported: IOPS, p99,
server CPU per I/O, and cache-device bytes written per client byte. After the rounds, one extra
flashtier run counts the log's batch writes (each batch is one pwritev of the log writer) with
`perf stat` on syscall tracepoints, giving 4 KiB client writes per log batch (flashtier does not
export its own batch counter yet); skipped when perf is missing (--no-perf).

Target: flashtier >= 1.0x raw (IOPS).

Writes bench/results/cache_writes.{md,json,png}.
"""

import argparse
from pathlib import Path

import benchlib as bl


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_fio_args(ap, rounds=5, runtime=30, ramp=5)
    ap.add_argument("--size-mib", type=int, default=1024,
                    help="device written at random: the export and the raw file (default 1024)")
    ap.add_argument("--cache-mib", type=int, default=2048, help="cache file size (default 2048)")
    ap.add_argument("--backing-dir", default="/dev/shm/flashtier-bench",
                    help="where the (fast) backing file lives (default /dev/shm/flashtier-bench)")
    ap.add_argument("--no-perf", action="store_true", help="skip the perf-based batch count")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.runtime, args.ramp = 2, 5, 1
        args.size_mib, args.cache_mib = 128, 256

    binary, work, machine = bl.setup(args, "fio")
    bdir = Path(args.backing_dir)
    bdir.mkdir(parents=True, exist_ok=True)
    size = args.size_mib << 20

    raw_img = work / "writes-raw.img"
    cache_img = work / "writes-cache.img"
    backing_img = bdir / "writes-backing.img"
    bl.make_random_file(raw_img, size)
    if backing_img.exists():
        backing_img.unlink()
    with open(backing_img, "wb") as f:
        f.truncate(size)

    samples = {"raw": [], "flashtier": []}
    timelines = {"raw": [], "flashtier": []}
    batch = None
    fio_args = dict(rw="randwrite", bs="4k", iodepth=args.iodepth, size=size, runtime=args.runtime, ramp=args.ramp)
    ft = None
    try:
        fmt = bl.flashtier_format(binary, cache_img, str(backing_img), args.cache_mib << 20)
        ft = bl.flashtier_cache_serve(binary, cache_img, str(backing_img), work / "writes-ft.sock",
                                      work / "writes-ft.log", threads=args.threads)
        for r in range(args.rounds):
            order = ["raw", "flashtier"] if r % 2 == 0 else ["flashtier", "raw"]
            for peer in order:
                logp = str(work / f"writes-{peer}-{r}")
                if peer == "raw":
                    m = bl.measure_local(raw_img, iops_log=logp, **fio_args)
                    m["cache_bytes_per_client_byte"] = float("nan")
                else:
                    io0 = ft.io_counters()
                    m = bl.measure(ft, iops_log=logp, **fio_args)
                    io1 = ft.io_counters()
                    client = m["iops"] * (args.runtime + args.ramp) * 4096
                    m["cache_bytes_per_client_byte"] = (io1["write_bytes"] - io0["write_bytes"]) / client
                timelines[peer].append(m["timeline"])
                samples[peer].append(m)
                print(f"round {r + 1}/{args.rounds} {peer:9} {m['iops']:9.0f} IOPS  p99 {m['lat_p99_us']:7.0f} us  "
                      f"server CPU {m['cpu_us_per_io']:5.1f} us/IO  fio CPU {m['fio_cpu_pct']:3.0f}%  "
                      f"device bytes/client byte {m['cache_bytes_per_client_byte']:.2f}", flush=True)

        if not args.no_perf and bl.PerfCounter.available():
            events = ["syscalls:sys_enter_pwritev", "syscalls:sys_enter_pwrite64",
                      "syscalls:sys_enter_fdatasync", "syscalls:sys_enter_writev"]
            pc = bl.PerfCounter(ft.pid, events, work / "writes-perf.txt")
            m = bl.run_fio(bl.nbd_target(ft.uri), "randwrite", bs="4k", iodepth=args.iodepth, size=size,
                           runtime=min(args.runtime, 10), ramp=0)
            counts = pc.stop()
            writes = m["write"]["ios"]
            batches = counts.get("syscalls:sys_enter_pwritev") or 0
            batch = {"client_writes": writes, "counts": counts, "iops": m["iops"],
                     "writes_per_batch": writes / batches if batches else float("nan")}
            print(f"batching: {writes} client writes in {batches} log batch writes "
                  f"({batch['writes_per_batch']:.1f} per batch)", flush=True)
        elif not args.no_perf:
            print("perf is not usable here: skipping the batch count", flush=True)
    finally:
        if ft:
            ft.stop()
        backing_img.unlink(missing_ok=True)  # it is in RAM (/dev/shm by default)
    closed = bl.flashtier_closed_event(ft.log_text())

    rows = [{"peer": peer,
             **bl.medians(samples[peer], ["iops", "lat_p99_us", "lat_mean_us", "cpu_us_per_io", "fio_cpu_pct",
                                          "cache_bytes_per_client_byte"]),
             "iops_all": [x["iops"] for x in samples[peer]],
             "p99_all": [x["lat_p99_us"] for x in samples[peer]]} for peer in ("raw", "flashtier")]
    by = {r["peer"]: r for r in rows}
    ratio = by["flashtier"]["iops"] / by["raw"]["iops"]
    target = bl.check_target(ratio, 1.0)
    doc = {"machine": machine, "args": vars(args), "rows": rows, "ratio": ratio, "batching": batch,
           "timelines": timelines, "closed": closed, "format_output": fmt, "samples": samples}

    out = bl.results_dir(args)
    lines = bl.results_header("Write-back random writes: flashtier vs the raw disk", machine, args.quick)
    lines += [
        f"4K random writes at QD{args.iodepth} over {args.size_mib} MiB, no flushes. **raw** = `fio "
        f"--ioengine=io_uring --direct=1 --rw=randwrite` on a {args.size_mib} MiB file next to the cache "
        f"file; **flashtier** = write-back through fio's nbd engine, {args.cache_mib} MiB cache file "
        f"(fully written before formatting), backing file in {args.backing_dir}. Median of {args.rounds} "
        f"interleaved rounds of {args.runtime} s (+{args.ramp} s ramp); the cache is kept across rounds, so "
        "from the round where the log wraps on, reclaim writes dirty blocks back while clients write. "
        "Device bytes per client byte = the server's /proc/PID/io write_bytes ÷ bytes written by the client "
        "(log headers, checkpoints, copy-forward). " + bl.CLIENT_CPU_NOTE,
        "",
        *bl.peer_table(rows, "raw", [
            ("device bytes / client byte", lambda r: "—" if r["peer"] == "raw"
             else f"{r['cache_bytes_per_client_byte']:.2f}"),
            ("IOPS per round", lambda r: ", ".join(f"{x:,.0f}" for x in r["iops_all"]))]),
        "",
        *bl.targets_table([("flashtier (write-back, through NBD) ≥ 1.0× the raw disk's random-write IOPS", target)]),
        "",
    ]
    if batch:
        c = batch["counts"]
        lines.append(
            f"Log batching (separate {min(args.runtime, 10)} s run, counted with `perf stat` on syscall "
            f"tracepoints of the server): {batch['client_writes']:,} client writes, "
            f"{c.get('syscalls:sys_enter_pwritev', 0):,} log batch writes (`pwritev`) → "
            f"**{batch['writes_per_batch']:.1f} 4 KiB writes per batch**; also "
            f"{c.get('syscalls:sys_enter_pwrite64', 0):,} `pwrite64` (segment seals, checkpoints, write-back), "
            f"{c.get('syscalls:sys_enter_fdatasync', 0):,} `fdatasync`, {c.get('syscalls:sys_enter_writev', 0):,} "
            "`writev` (NBD replies).")
    else:
        lines.append("Log batching: not measured (perf unavailable or --no-perf; flashtier exports no batch counter).")
    if closed:
        lines += ["", f"At shutdown the cache held {int(closed.get('cached_blocks', 0)):,} blocks, "
                      f"{int(closed.get('dirty_blocks', 0)):,} dirty."]
    lines += ["", "![IOPS per round and per second](cache_writes.png)"]
    bl.write_results(out, "cache_writes", doc, lines)
    plot(out / "cache_writes.png", samples, timelines, args)


def plot(path, samples, timelines, args):
    plt = bl.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2.4]})
    colors = {"raw": "#555555", "flashtier": "#1f77b4"}
    bl.draw_bars(a1, [f"4K randwrite QD{args.iodepth}"],
                 [(peer, colors[peer], [[x["iops"] for x in samples[peer]]]) for peer in ("raw", "flashtier")],
                 "IOPS", "Median (dots: rounds)")
    bl.draw_timelines(a2, timelines, colors, "IOPS (1 s averages)", "Per second, rounds in order")
    bl.save_figure(fig, path, args.quick)


if __name__ == "__main__":
    main()

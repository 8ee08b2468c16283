#!/usr/bin/env python3
"""flashtier write-back vs `nbdkit --filter=cache cache=writeback`, over the same slow disk.

Both caches sit in front of their own copy of the same backing image, each served by DESIGN.md
§5's emulated slow disk (`nbdkit --filter=noparallel --filter=delay --filter=stats file IMG
serialize=all-requests rdelay=4ms wdelay=4ms`, plus the log filter so backing I/O can be
counted per workload). Both caches are the same size (--cache-mib) and live on the same local
disk: flashtier's is a cache file it reads and writes with O_DIRECT; nbdkit's cache filter keeps
its cache in a temporary file under TMPDIR (set to --workdir), through the page cache.

Page cache limited equally: each cache server runs in its own cgroup-v1 memory cgroup with the
same limit (--mem-limit-mib; page cache the process faults in is charged to it), so nbdkit's
cache cannot quietly become a RAM cache. The backing servers are not limited (they are the
emulated disk and equal for both).

nbdkit is configured for these workloads: cache-on-read=true (else it caches no reads at all),
cache-min-block-size=4K (its default 64K would turn each 4K write to an uncached block into a
64K read-modify-write from the slow disk), cache-max-size=--cache-mib.

Workloads, each interleaved over --rounds rounds (the server order alternates), medians:
  (a) hits:   4K randread QD32 over a --working-set-mib working set that fits both caches,
              after both were warmed by sequential reads until a pass read nothing from the disk
  (b) writes: 4K randwrite QD32 over the working set for --write-runtime seconds per run
  (c) mixed:  4K randrw QD32, rwmixread=70, random_distribution=pareto:0.9 over the whole device,
              --mixed-runtime seconds per run
The cache state carries over from (a) to (b) to (c), the same for both servers.

Reported per workload: IOPS, p99, server CPU per I/O, the flashtier/nbdkit ratio, and the
backing I/O (requests and MiB read and written on the slow disk during the runs, from the log
filter; the stats filter's own summaries for the whole run are kept in the JSON). Target
(DESIGN.md §5's userspace caching peer): flashtier >= 1.0x nbdkit.

Writes bench/results/cache_vs_nbdkit_cache.{md,json,png}. Needs root (cgroups).
"""

import argparse
import os
import time

import benchlib as bl

SERVERS = ["nbdkit", "flashtier"]
SHORT = {"hits": "(a) hits", "writes": "(b) random writes", "mixed": "(c) pareto mix"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_fio_args(ap, rounds=3, ramp=2)
    ap.add_argument("--read-runtime", type=int, default=10, help="seconds per hits run (default 10)")
    ap.add_argument("--write-runtime", type=int, default=60, help="seconds per random-write run (default 60)")
    ap.add_argument("--mixed-runtime", type=int, default=60, help="seconds per mixed run (default 60)")
    ap.add_argument("--backing-mib", type=int, default=4096, help="backing image size (default 4096)")
    ap.add_argument("--cache-mib", type=int, default=1024, help="size of each cache (default 1024)")
    ap.add_argument("--working-set-mib", type=int, default=512,
                    help="working set of the hits and write workloads (default 512)")
    ap.add_argument("--mem-limit-mib", type=int, default=256,
                    help="memory cgroup limit of each cache server, page cache included (default 256)")
    ap.add_argument("--nbdkit-block", default="4K", help="nbdkit cache-min-block-size (default 4K)")
    ap.add_argument("--delay-ms", type=int, default=4, help="slow disk delay per read/write (default 4)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.read_runtime, args.write_runtime, args.mixed_runtime, args.ramp = 1, 3, 10, 10, 1
        args.backing_mib, args.cache_mib, args.working_set_mib, args.mem_limit_mib = 512, 128, 64, 64
    if os.geteuid() != 0:
        ap.error("needs root for memory cgroups")

    binary, work, machine = bl.setup(args, "fio", "nbdkit")
    ws = args.working_set_mib << 20
    dev_size = args.backing_mib << 20

    base = work / "peer-base.img"
    bl.make_random_file(base, dev_size)
    backing, reqlog, statsf = {}, {}, {}
    for name in SERVERS:
        img = work / f"peer-{name}-backing.img"
        bl.copy_file(base, img)  # both caches start from byte-identical backing stores
        reqlog[name] = work / f"peer-{name}-backing.requests.log"
        statsf[name] = work / f"peer-{name}-backing.stats.txt"
        reqlog[name].unlink(missing_ok=True)
    cgroups = {}
    servers = {}
    results = {"hits": {}, "writes": {}, "mixed": {}}
    timelines = {"nbdkit": [], "flashtier": []}
    warm_info = {}
    mem = {}
    phase_start, phase_end = {}, {}
    try:
        for name in SERVERS:
            backing[name] = bl.slow_backing(work / f"peer-{name}-backing.img", work / f"peer-{name}-backing.sock",
                                            work / f"peer-{name}-backing.log", statsf[name], reqlog[name],
                                            delay_ms=args.delay_ms)
            cgroups[name] = bl.MemCgroup(name, args.mem_limit_mib << 20)
        cache_img = work / "peer-flashtier-cache.img"
        fmt = bl.flashtier_format(binary, cache_img, backing["flashtier"].uri, args.cache_mib << 20)
        bl.evict_from_page_cache(cache_img)
        servers["flashtier"] = bl.flashtier_cache_serve(
            binary, cache_img, backing["flashtier"].uri, work / "peer-flashtier.sock", work / "peer-flashtier.log",
            threads=args.threads, cgroup=cgroups["flashtier"])
        servers["nbdkit"] = bl.nbdkit_cache_filter(
            backing["nbdkit"].socket, work / "peer-nbdkit.sock", work / "peer-nbdkit.log", args.cache_mib << 20,
            work / "peer-nbdkit-tmp", min_block=args.nbdkit_block, cgroup=cgroups["nbdkit"])

        # Warm both with sequential reads of the working set until a pass reads nothing from the disk.
        for name in SERVERS:
            s = servers[name]
            passes = []
            for p in range(4):
                t0 = time.time()
                m = bl.run_fio(bl.nbd_target(s.uri), "read", bs="1M", iodepth=4, size=ws, time_based=False)
                if name == "flashtier":
                    s.wait_io_quiet()
                reads = bl.count_backing_io(reqlog[name], {"w": (t0, time.time())})["w"].get("read", {"ops": 0, "bytes": 0})
                passes.append({"pass": p + 1, "seconds": m["elapsed_s"], "backing_reads": reads["ops"],
                               "backing_read_mib": reads["bytes"] / 2**20})
                print(f"warm {name} pass {p + 1}: {m['elapsed_s']:.1f} s, {reads['ops']} backing reads "
                      f"({reads['bytes'] / 2**20:.0f} MiB)", flush=True)
                if reads["ops"] == 0:
                    break
            else:
                print(f"warning: {name} still read from the slow disk after 4 passes; hits may miss", flush=True)
            warm_info[name] = passes

        workloads = [
            ("hits", dict(rw="randread", size=ws, runtime=args.read_runtime)),
            ("writes", dict(rw="randwrite", size=ws, runtime=args.write_runtime)),
            ("mixed", dict(rw="randrw", size=dev_size, runtime=args.mixed_runtime,
                           extra=["--rwmixread=70", "--random_distribution=pareto:0.9"])),
        ]
        for k, (wl, fa) in enumerate(workloads):
            phase_start[wl] = time.time()
            if k:
                phase_end[workloads[k - 1][0]] = phase_start[wl]
            for name in SERVERS:
                results[wl][name] = []
            for r in range(args.rounds):
                order = SERVERS if r % 2 == 0 else SERVERS[::-1]
                for name in order:
                    s = servers[name]
                    logp = str(work / f"peer-{name}-{wl}-{r}") if wl == "writes" else None
                    t0 = time.time()
                    m = bl.measure(s, bs="4k", iodepth=args.iodepth, ramp=args.ramp, iops_log=logp, **fa)
                    t1 = time.time()
                    io = bl.count_backing_io(reqlog[name], {"run": (t0, t1)})["run"]
                    m["backing"] = {op: io.get(op, {"ops": 0, "bytes": 0}) for op in ("read", "write", "flush")}
                    if logp:
                        timelines[name].append(m["timeline"])
                    results[wl][name].append(m)
                    b = m["backing"]
                    print(f"{wl:6} round {r + 1}/{args.rounds} {name:9} {m['iops']:9.0f} IOPS  p99 {m['lat_p99_us']:8.0f} us  "
                          f"CPU {m['cpu_us_per_io']:5.1f} us/IO  backing: {b['read']['ops']} reads, "
                          f"{b['write']['ops']} writes", flush=True)
            for name in SERVERS:
                mem.setdefault(name, {})[wl] = cgroups[name].stat()
        # The last phase ends now, before shutdown (whatever a server writes back on its way out
        # does not count); background work after the runs does count.
        phase_end[workloads[-1][0]] = time.time()
    finally:
        for name, s in servers.items():
            s.stop(timeout=120)
        for name, s in backing.items():
            s.stop()
        for cg in cgroups.values():
            cg.remove()
        for name in SERVERS:  # copied anew by every run (the base image is kept)
            (work / f"peer-{name}-backing.img").unlink(missing_ok=True)

    phases = {}
    for name in SERVERS:
        windows = {wl: (phase_start[wl], phase_end[wl]) for wl in phase_end}
        phases[name] = bl.count_backing_io(reqlog[name], windows)
    report(args, machine, results, timelines, warm_info, mem, statsf, fmt, phases)


def report(args, machine, results, timelines, warm_info, mem, statsf, fmt, phases):
    out = bl.results_dir(args)
    rows = []
    for wl in ("hits", "writes", "mixed"):
        row = {"workload": wl}
        for name in SERVERS:
            xs = results[wl][name]
            if not xs:
                continue
            m = bl.medians(xs, ["iops", "read.iops", "write.iops", "read.lat_p99_us", "write.lat_p99_us",
                                "cpu_us_per_io", "backing.read.ops", "backing.read.bytes", "backing.write.ops",
                                "backing.write.bytes", "backing.flush.ops"])
            row[name] = {
                "iops": m["iops"], "read_iops": m["read.iops"], "write_iops": m["write.iops"],
                "read_p99_us": m["read.lat_p99_us"], "write_p99_us": m["write.lat_p99_us"],
                "cpu_us_per_io": m["cpu_us_per_io"],
                "backing_reads": m["backing.read.ops"], "backing_read_mib": m["backing.read.bytes"] / 2**20,
                "backing_writes": m["backing.write.ops"], "backing_write_mib": m["backing.write.bytes"] / 2**20,
                "backing_flushes": m["backing.flush.ops"],
                "iops_all": [x["iops"] for x in xs],
            }
            ph = phases.get(name, {}).get(wl, {})
            row[name]["phase_backing"] = {op: ph.get(op, {"ops": 0, "bytes": 0}) for op in ("read", "write", "flush")}
        if "nbdkit" in row and "flashtier" in row:
            row["ratio"] = row["flashtier"]["iops"] / row["nbdkit"]["iops"] if row["nbdkit"]["iops"] else float("inf")
        rows.append(row)
    doc = {"machine": machine, "args": vars(args), "rows": rows, "warm_up": warm_info, "memcg": mem,
           "backing_io_per_phase": phases,
           "timelines": timelines, "backing_stats_files": {n: bl.read_stats_file(statsf[n]) for n in SERVERS},
           "format_output": fmt, "samples": results}

    wl_desc = {
        "hits": f"(a) hits: 4K randread over {args.working_set_mib} MiB, warmed",
        "writes": f"(b) 4K randwrite over {args.working_set_mib} MiB, {args.write_runtime} s runs",
        "mixed": f"(c) pareto:0.9 randrw 70/30 over {args.backing_mib} MiB, {args.mixed_runtime} s runs",
    }
    lines = bl.results_header("flashtier write-back vs nbdkit cache filter (writeback), over the same slow disk",
                              machine, args.quick)
    lines += [
        f"Each cache: {args.cache_mib} MiB on the local disk, in front of its own copy of a {args.backing_mib} MiB "
        f"image behind the emulated slow disk (one request at a time, {args.delay_ms} ms per read/write). Each "
        f"cache server in a memory cgroup limited to {args.mem_limit_mib} MiB (page cache included). nbdkit: "
        f"`--filter=cache nbd cache=writeback cache-on-read=true cache-max-size={args.cache_mib}M "
        f"cache-min-block-size={args.nbdkit_block}`, TMPDIR on the same disk as flashtier's cache file. "
        f"fio nbd engine, QD{args.iodepth}; median of {args.rounds} interleaved rounds; state carries over "
        "(a) → (b) → (c). Backing columns: requests and MiB that reached the slow disk during a run (median "
        "over runs); the phase columns count everything each server sent to its slow disk from the start of "
        "the workload's first run to the start of the next workload (all rounds, including background "
        "write-back between runs).",
        "",
        "| workload | server | IOPS | read p99 µs | write p99 µs | server CPU µs/IO | backing reads per run (MiB) | backing writes per run (MiB) | phase: backing reads / writes / flushes | flashtier ÷ nbdkit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    targets = []
    for row in rows:
        for name in SERVERS:
            if name not in row:
                continue
            r = row[name]
            pb = r["phase_backing"]
            rp99 = f"{r['read_p99_us']:,.0f}" if r["read_iops"] else "—"
            wp99 = f"{r['write_p99_us']:,.0f}" if r["write_iops"] else "—"
            ratio = f"**{row['ratio']:.2f}×**" if name == "flashtier" and "ratio" in row else ""
            lines.append(f"| {wl_desc[row['workload']]} | {name} | {r['iops']:,.0f} | {rp99} | {wp99} | "
                         f"{r['cpu_us_per_io']:.1f} | {r['backing_reads']:,.0f} ({r['backing_read_mib']:,.1f}) | "
                         f"{r['backing_writes']:,.0f} ({r['backing_write_mib']:,.1f}) | "
                         f"{pb['read']['ops']:,} / {pb['write']['ops']:,} ({pb['write']['bytes'] / 2**20:,.1f} MiB) / "
                         f"{pb['flush']['ops']:,} | {ratio} |")
        if "ratio" in row:
            targets.append((row["workload"], bl.check_target(row["ratio"], 1.0)))
    lines += ["", *bl.targets_table([(f"{SHORT[wl]}: flashtier ≥ 1.0× nbdkit IOPS", t) for wl, t in targets])]
    lines += ["", "Warm-up (sequential 1 MiB reads of the working set until a pass reads nothing from the slow disk):", ""]
    for name in SERVERS:
        ps = warm_info.get(name, [])
        lines.append(f"- {name}: " + "; ".join(f"pass {p['pass']} {p['seconds']:.1f} s, {p['backing_reads']:,} backing "
                                                f"reads ({p['backing_read_mib']:.0f} MiB)" for p in ps))
    lines += ["", "Memory cgroup at the end of each workload (max usage / page cache now):", ""]
    for name in SERVERS:
        lines.append(f"- {name}: " + "; ".join(
            f"{wl} {st['max_usage_in_bytes'] / 2**20:.0f} / {st.get('total_cache', st.get('cache', 0)) / 2**20:.0f} MiB"
            for wl, st in mem.get(name, {}).items()))
    lines += ["", "![IOPS per workload; random writes per second](cache_vs_nbdkit_cache.png)"]
    bl.write_results(out, "cache_vs_nbdkit_cache", doc, lines)
    plot(out / "cache_vs_nbdkit_cache.png", rows, timelines, args)


def plot(path, rows, timelines, args):
    plt = bl.pyplot()
    colors = {"nbdkit": "#888888", "flashtier": "#1f77b4"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.3, 2]})
    bl.draw_bars(a1, [SHORT[r["workload"]] for r in rows],
                 [(name, colors[name], [row[name]["iops_all"] if name in row else [] for row in rows])
                  for name in SERVERS],
                 "IOPS (log scale; bars median, dots rounds)", f"4K, QD{args.iodepth}, over the emulated slow disk",
                 log_y=True)
    bl.draw_timelines(a2, timelines, colors, "IOPS, 1 s averages (log scale; stalls at 1)",
                      "(b) random writes over time", log_y=True)
    bl.save_figure(fig, path, args.quick)


if __name__ == "__main__":
    main()

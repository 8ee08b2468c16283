#!/usr/bin/env python3
"""The grudge match: 4 KiB random read latency from each tier flashtier has, at queue depths 1-16.

Four flashtier servers run side by side over one emulated slow disk (DESIGN.md §5: nbdkit
noparallel + --delay-ms (4 ms) per request + stats + log filters, on a file of random bytes), each
answering reads from a different tier:
  memcached  `flashtier serve --backing <slow disk> --memcached A,B --memcached-mode inclusive`
             (pass-through, no SSD tier; --servers memcached servers on loopback with room for the
             working set 1.5× over), the working set warmed into memcached
  ssd        `flashtier serve --backing <slow disk> --cache FILE` (write-back; FILE on the local disk
             in --workdir, --cache-mib, read and written with O_DIRECT), the working set warmed
             into the cache (read passes until one promotes nothing)
  backing    `flashtier serve --backing <slow disk>` (pass-through, no memcached): every read is a
             slow-disk read
  ram        `flashtier serve --backing <slow disk> --ram-cache SIZE` (pass-through, no SSD tier: a
             RAM-tier hit never goes below it, so what is under it does not change the hit path;
             SIZE = 1.25 × the working set), the working set warmed into it

The working set is the first --working-set-mib (default 256) of the disk. For each queue depth
(--qds, default 1,2,4,8,16) and tier: fio --ioengine=nbd --rw=randread --bs=4k --iodepth=QD over
the working set, --ramp seconds then --runtime seconds (default 2 + 10), JSON output; --rounds
rounds (default 2), the tiers' order rotating every run, all of one queue depth before the next.
Reported per tier and queue depth (medians over rounds): IOPS, mean, p50 and p99 completion
latency, the server's CPU per I/O, and proof of where the reads were answered: the tier's hit % over
the run from flashtier's `stats --json` (memcached and ram: hit ÷ looked-up blocks; ssd: read hit
÷ hit + miss blocks) and the slow disk's reads during the run per fio I/O (its log filter; ~0 for a hit,
~1 for the backing tier). The machine is shared and has 2 CPUs, which fio, flashtier and memcached
share: the report says so and records the load average.

--quick: a 64 MiB working set, 1 round of 3 s (1 s ramp) per run, and checks that memcached, ssd
and ram hit ≥ 95% and the backing tier read the slow disk; a failure exits non-zero.

Writes bench/results/tier_latency/tier_latency.{md,json,png} (--quick: /tmp/flashtier-bench-quick/tier_latency).
Needs root (or a writable /run), fio, nbdkit, memcached, python3-libnbd.
"""

import argparse
import atexit
import math
import os
import shutil
import sys
import time
from pathlib import Path

import benchlib as bl
import memcached as mcb
import oltp

TIERS = {
    "ram": "RAM-tier hit: pass-through + --ram-cache (1.25 × the working set, lru), working set warmed",
    "memcached": "memcached hit: pass-through + memcached tier (inclusive), working set warmed into memcached",
    "ssd": "SSD-tier hit: --cache file on the local disk (write-back, O_DIRECT), working set warmed",
    "backing": "backing read: pass-through without memcached, every read from the slow disk",
}
RUNDIR = Path("/run") / f"flashtier-tierlat-{os.getpid()}"  # tmpfs: control sockets


def counters(binary, control):
    return oltp.flatten(bl.flashtier_report(binary, control))


def tier_hits(tier, before, after):
    """(hit blocks, looked-up blocks) of the tier over a run, from two flattened reports."""
    if tier == "memcached":
        d = {f: after.get(k, 0) - before.get(k, 0) for f in ("hit_blocks", "lookup_blocks")
             if (k := mcb.mc_key(after, f))}
        return d.get("hit_blocks"), d.get("lookup_blocks")
    if tier == "ram":
        d = [after.get(f"counters.ram_{f}", 0) - before.get(f"counters.ram_{f}", 0)
             for f in ("hit_blocks", "lookup_blocks")]
        return d[0], d[1]
    if tier == "ssd":
        h = after.get("counters.read_hit_blocks", 0) - before.get("counters.read_hit_blocks", 0)
        m = after.get("counters.read_miss_blocks", 0) - before.get("counters.read_miss_blocks", 0)
        return h, h + m
    return None, None


MC_EXTRA = ("stored_blocks", "store_failures", "pool_timeouts", "pool_errors")


def mc_extra(before, after):
    """The memcached tier's stores, store failures, pool timeouts and errors between two flattened reports."""
    return {f: after[k] - before.get(k, 0) for f in MC_EXTRA if (k := mcb.mc_key(after, f))}


def warm(tier, server, binary, control, ws, max_passes=5):
    """Reads the working set through `server` until a pass misses nothing in its tier (at most
    `max_passes`): [{seconds, hit, lookup}] per pass."""
    passes = []
    for _ in range(max_passes):
        before = counters(binary, control)
        secs, _ = oltp.warm_through(server.uri, [(0, ws)])
        if tier == "ssd":
            secs += bl.flashtier_wait_promotions(binary, control)
        after = counters(binary, control)
        hit, look = tier_hits(tier, before, after)
        passes.append({"seconds": round(secs, 2), "hit_blocks": hit, "lookup_blocks": look,
                       **(mc_extra(before, after) if tier == "memcached" else {})})
        print(f"  warm {tier} pass {len(passes)}: {secs:.1f} s, {hit} of {look} blocks hit", flush=True)
        if look and hit == look:
            break
    return passes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, workdir="/var/tmp/flashtier-tier-latency")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--runtime", type=int, default=10, help="measured seconds per fio run (default 10)")
    ap.add_argument("--ramp", type=int, default=2, help="fio ramp seconds before measuring (default 2)")
    ap.add_argument("--qds", default="1,2,4,8,16", help="queue depths (default 1,2,4,8,16)")
    ap.add_argument("--working-set-mib", type=int, default=256, help="working set read at random (default 256)")
    ap.add_argument("--disk-mib", type=int, default=512, help="slow disk size (default 512)")
    ap.add_argument("--cache-mib", type=int, default=512, help="SSD-tier cache file size (default 512)")
    ap.add_argument("--delay-ms", type=int, default=4, help="slow disk delay per read and write (default 4)")
    ap.add_argument("--servers", type=int, default=2, help="memcached servers (default 2)")
    ap.add_argument("--memcached-timeout-ms", type=int,
                    help="flashtier serve --memcached-timeout-ms (default: the server's default)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.runtime, args.ramp = 1, 3, 1
        args.working_set_mib, args.disk_mib, args.cache_mib = 64, 128, 128
    qds = [int(q) for q in args.qds.split(",")]
    if args.working_set_mib > min(args.disk_mib, args.cache_mib):
        ap.error("--working-set-mib must fit in --disk-mib and --cache-mib")
    t_all = time.time()
    binary, work, machine = bl.setup(args, "fio", "nbdkit", mcb.MEMCACHED)
    machine["memcached"] = bl._first_line([mcb.MEMCACHED, "--version"])
    RUNDIR.mkdir(mode=0o755, exist_ok=True)
    atexit.register(shutil.rmtree, RUNDIR, ignore_errors=True)
    ws = args.working_set_mib << 20
    img = work / f"backing-{args.disk_mib}M.img"
    bl.make_random_file(img, args.disk_mib << 20)
    rd = work / "run"
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir(parents=True)
    reqlog, statsf = rd / "slow.requests.log", rd / "slow.stats.txt"
    slow = bl.slow_backing(img, rd / "slow.sock", rd / "slow.log", statsf, reqlog, delay_ms=args.delay_ms)
    mc_mib = math.ceil(1.5 * ws / (1 << 20) / args.servers)
    pool = mcb.MemcachedPool(args.servers, mc_mib, rd)
    controls = {t: RUNDIR / f"{t}.ctl" for t in TIERS}

    def ctl(t):
        return ["--control-socket", str(controls[t]), "--stats-file", str(RUNDIR / f"{t}.stats")]
    mc_args = ["--memcached", pool.arg, "--memcached-mode", "inclusive",
                *(["--memcached-timeout-ms", str(args.memcached_timeout_ms)] if args.memcached_timeout_ms else [])]
    threads = ["--threads", str(args.threads)] if args.threads else []
    servers = {"memcached": bl.flashtier_serve(binary, slow.uri, rd / "ft-mc.sock", rd / "ft-mc.log",
                                               extra=[*ctl("memcached"), *threads, *mc_args])}
    cache = work / f"ssd-cache-{args.cache_mib}M.img"
    fmt_out = bl.flashtier_format(binary, cache, slow.uri, args.cache_mib << 20)
    bl.evict_from_page_cache(cache)
    servers["ssd"] = bl.flashtier_cache_serve(binary, cache, slow.uri, rd / "ft-ssd.sock", rd / "ft-ssd.log",
                                              threads=args.threads, extra=ctl("ssd"))
    ram_mib = math.ceil(1.25 * ws / (1 << 20))
    servers["ram"] = bl.flashtier_serve(binary, slow.uri, rd / "ft-ram.sock", rd / "ft-ram.log",
                                        extra=[*ctl("ram"), *threads, "--ram-cache", f"{ram_mib}M"])
    servers["backing"] = bl.flashtier_serve(binary, slow.uri, rd / "ft-pass.sock", rd / "ft-pass.log",
                                            extra=[*ctl("backing"), *threads])
    for t, s in servers.items():
        s.name = f"flashtier-{t}"
    print(f"memcached: {args.servers} × {mc_mib} MiB on {pool.arg}", flush=True)
    warmups = {t: warm(t, servers[t], binary, controls[t], ws) for t in ("memcached", "ssd", "ram")}
    mc_after_warm = pool.stats()

    samples = []
    tiers = list(TIERS)
    k = 0
    for rnd in range(args.rounds):
        for qd in qds:
            order = tiers[k % len(tiers):] + tiers[:k % len(tiers)]
            k += 1
            for t in order:
                before = counters(binary, controls[t])
                mc_cpu0 = sum(s.cpu_seconds() for s in pool.servers)
                t0 = time.time()
                m = bl.measure(servers[t], rw="randread", bs="4k", iodepth=qd, size=f"{args.working_set_mib}M",
                               runtime=args.runtime, ramp=args.ramp)
                t1 = time.time()
                mc_cpu = sum(s.cpu_seconds() for s in pool.servers) - mc_cpu0
                after = counters(binary, controls[t])
                hit, look = tier_hits(t, before, after)
                ios = m["iops"] * (args.runtime + args.ramp)
                samples.append({
                    "round": rnd, "qd": qd, "tier": t, "window": (t0, t1), "iops": m["iops"],
                    "lat_mean_us": m["read"]["lat_mean_us"], "lat_p50_us": m["read"]["lat_p50_us"],
                    "lat_p99_us": m["read"]["lat_p99_us"], "lat_p999_us": m["read"]["lat_p999_us"],
                    "read_ios": m["read"]["ios"], "cpu_us_per_io": m["cpu_us_per_io"],
                    "memcached_cpu_us_per_io": mc_cpu * 1e6 / ios if t == "memcached" and ios else None,
                    "hit_blocks": hit, "lookup_blocks": look,
                    "hit_pct": 100 * hit / look if look else None, "fio_cpu_pct": m["fio_cpu_pct"],
                    "memcached": mc_extra(before, after) if t == "memcached" else None})
                s = samples[-1]
                print(f"r{rnd + 1} QD{qd} {t}: {m['iops']:,.0f} IOPS, mean {s['lat_mean_us']:,.0f} µs, "
                      f"p99 {s['lat_p99_us']:,.0f} µs" + (f", hit {s['hit_pct']:.1f}%" if look else ""), flush=True)
    mc_end = pool.stats()
    for t in TIERS:
        servers[t].stop()
    pool.stop()
    slow.stop()
    io = bl.count_backing_io(reqlog, {i: s["window"] for i, s in enumerate(samples)})
    for i, s in enumerate(samples):
        s["slow_disk_reads"] = io[i].get("read", {}).get("ops", 0)
        # The window includes fio's ramp: compare with the I/Os of ramp + measured time.
        s["slow_reads_per_io"] = s["slow_disk_reads"] / (s["iops"] * (args.runtime + args.ramp)) if s["iops"] else None
    slow_stats = bl.read_stats_file(statsf)
    out = Path(args.out) if args.out else bl.results_dir(args) / "tier_latency"
    rows = summarize(samples, qds)
    problems = check(rows)
    doc = {"machine": machine, "args": vars(args), "qds": qds, "memcached_mib_each": mc_mib,
           "memcached_after_warm": mc_after_warm, "memcached_end": mc_end, "warm_passes": warmups,
           "format_output": fmt_out, "slow_disk_stats": slow_stats, "rows": rows, "samples": samples,
           "problems": problems, "wall_seconds": round(time.time() - t_all, 1)}
    write_report(args, machine, doc, rows, qds, out)
    if not (out / "tier_latency.json").exists():
        sys.exit("tier_latency.json was not written")
    if problems:
        print("hit checks failed:\n  " + "\n  ".join(problems), flush=True)
        if args.quick:
            sys.exit(1)
    print(f"whole run: {(time.time() - t_all) / 60:.1f} min", flush=True)


FIELDS = ("iops", "lat_mean_us", "lat_p50_us", "lat_p99_us", "lat_p999_us", "cpu_us_per_io",
          "memcached_cpu_us_per_io", "hit_pct", "slow_reads_per_io")


def summarize(samples, qds):
    rows = []
    for t in TIERS:
        for qd in qds:
            ss = [s for s in samples if s["tier"] == t and s["qd"] == qd]
            if not ss:
                continue
            row = {"tier": t, "qd": qd, "rounds": len(ss),
                   "hit_blocks": sum(s["hit_blocks"] or 0 for s in ss),
                   "lookup_blocks": sum(s["lookup_blocks"] or 0 for s in ss),
                   "slow_disk_reads": sum(s["slow_disk_reads"] for s in ss),
                   "memcached_pool_timeouts": sum((s["memcached"] or {}).get("pool_timeouts", 0) for s in ss)
                   if t == "memcached" else None}
            for f in FIELDS:
                vals = [s[f] for s in ss if s[f] is not None]
                row[f] = bl.median(vals) if vals else None
            rows.append(row)
    return rows


def check(rows):
    """Where a row's reads were not answered by its tier."""
    bad = []
    for r in rows:
        if r["tier"] in ("memcached", "ssd", "ram") and not (r["hit_pct"] is not None and r["hit_pct"] >= 95):
            bad.append(f"{r['tier']} QD{r['qd']}: hit % {r['hit_pct']} (< 95)")
        if r["tier"] == "backing" and not (r["slow_reads_per_io"] or 0) > 0.9:
            bad.append(f"backing QD{r['qd']}: {r['slow_reads_per_io']} slow-disk reads per I/O (< 0.9)")
    return bad


def f_(x, spec=",.0f"):
    return "—" if x is None or x != x else format(x, spec)


def write_report(args, machine, doc, rows, qds, out):
    lines = bl.results_header("4 KiB random read latency per tier and queue depth", machine, args.quick)
    lines += [
        f"Whole run: **{doc['wall_seconds'] / 60:.1f} min**. The machine has {machine['cpus']} CPUs and is shared "
        "with other test runs (load average at the start in the line above); fio, flashtier and memcached run on "
        "the same CPUs.",
        "",
        f"Working set: the first {args.working_set_mib} MiB of a {args.disk_mib} MiB slow disk of random bytes (one "
        f"request at a time, {args.delay_ms} ms per request). fio --ioengine=nbd --rw=randread --bs=4k "
        f"--iodepth=QD over the working set, {args.ramp} s ramp + {args.runtime} s measured per run; "
        f"{args.rounds} round(s), the tiers' order rotating; figures are medians over rounds. Latency: fio's "
        "completion latency (submission to completion through NBD). memcached: "
        f"{args.servers} × {doc['memcached_mib_each']} MiB on loopback ({machine.get('memcached', '?')}). SSD tier: a "
        f"{args.cache_mib} MiB cache file on the local disk ({machine.get('disk', '?')}). Hit %: the tier's hit "
        "blocks ÷ looked-up blocks over the run (ramp included) from flashtier's `stats --json`; slow-disk reads "
        "per I/O: the slow disk's reads during the run ÷ fio's I/Os in it (ramp included). Server CPU: flashtier's "
        "user+system CPU per I/O (memcached's for the memcached tier in the JSON).",
        "",
        "| tier | QD | IOPS | mean µs | p50 µs | p99 µs | hit % | slow-disk reads per I/O | flashtier CPU µs/IO |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['qd']} | {f_(r['iops'])} | {f_(r['lat_mean_us'])} | {f_(r['lat_p50_us'])} | "
                     f"{f_(r['lat_p99_us'])} | {f_(r['hit_pct'], '.1f')} | {f_(r['slow_reads_per_io'], '.3f')} | "
                     f"{f_(r['cpu_us_per_io'], '.1f')} |")
    lines += ["", "Tiers: " + "; ".join(f"**{k}**: {v}" for k, v in TIERS.items()), ""]
    by = {(r["tier"], r["qd"]): r for r in rows}
    comp = []
    for qd in qds:
        m, s, b, r = (by.get((t, qd)) for t in ("memcached", "ssd", "backing", "ram"))
        if m and s and b and r and m["lat_mean_us"] and s["lat_mean_us"] and r["lat_mean_us"]:
            comp.append(f"| {qd} | {m['lat_mean_us'] / s['lat_mean_us']:.2f}× | "
                        f"{b['lat_mean_us'] / m['lat_mean_us']:.1f}× "
                        f"| {m['iops'] / s['iops']:.2f}× | {r['lat_mean_us'] / s['lat_mean_us']:.2f}× "
                        f"| {r['iops'] / s['iops']:.2f}× |")
    if comp:
        lines += ["Ratios (from the medians above):", "",
                  "| QD | memcached ÷ ssd mean latency | backing ÷ memcached mean latency | memcached ÷ ssd IOPS "
                  "| ram ÷ ssd mean latency | ram ÷ ssd IOPS |",
                  "|---:|---:|---:|---:|---:|---:|", *comp, ""]
    if doc["problems"]:
        lines += ["**Hit checks failed** (the rows named were not all answered by their tier):", "",
                  *[f"- {p}" for p in doc["problems"]], ""]
    wp = doc["warm_passes"]
    mc_to = [f"QD{r['qd']}: {r['memcached_pool_timeouts']}" for r in rows if r["tier"] == "memcached"]
    lines += ["memcached pool timeouts during the memcached tier's runs (flashtier's counter, all rounds; a timed-out "
              "lookup is a miss read from the slow disk): " + ", ".join(mc_to) + ".", ""] if mc_to else []
    lines += ["Warm-up (read passes over the working set until one hits every block): " + "; ".join(
        f"{t}: " + ", ".join(f"pass {i + 1} {p['hit_blocks']}/{p['lookup_blocks']} hit in {p['seconds']:.1f} s"
                             + (f" (stored {p['stored_blocks']}, store failures {p['store_failures']}, pool timeouts "
                                f"{p['pool_timeouts']})" if "stored_blocks" in p else "")
                             for i, p in enumerate(ps)) for t, ps in wp.items()), "",
              "memcached after the warm-up (per server): " + "; ".join(
                  f"{s['addr']}: {s['curr_items']:,} items, {s['bytes'] / 2**20:.0f} MiB, {s['evictions']} evictions"
                  for s in doc["memcached_after_warm"]), "",
              "![latency and IOPS vs queue depth per tier](tier_latency.png)"]
    bl.write_results(out, "tier_latency", doc, lines)
    plot(out / "tier_latency.png", rows, qds, args)


def plot(path, rows, qds, args):
    plt = bl.pyplot()
    colors = {"ram": "tab:purple", "memcached": "tab:green", "ssd": "tab:blue", "backing": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for t in TIERS:
        rs = [r for r in rows if r["tier"] == t]
        if not rs:
            continue
        ax.plot([r["qd"] for r in rs], [r["lat_mean_us"] for r in rs], marker="o", color=colors[t], label=f"{t} mean")
        ax.plot([r["qd"] for r in rs], [r["lat_p99_us"] for r in rs], marker="^", ls="--", color=colors[t],
                label=f"{t} p99")
    ax.set_xscale("log", base=2)
    ax.set_xticks(qds)
    ax.set_xticklabels([str(q) for q in qds])
    ax.set_yscale("log")
    ax.set_xlabel("queue depth")
    ax.set_ylabel("latency µs (log)")
    ax.set_title("4 KiB random read latency")
    ax.legend(fontsize=8)
    ax = axes[1]
    for t in TIERS:
        rs = [r for r in rows if r["tier"] == t]
        ax.plot([r["qd"] for r in rs], [r["iops"] for r in rs], marker="o", color=colors[t], label=t)
    ax.set_xscale("log", base=2)
    ax.set_xticks(qds)
    ax.set_xticklabels([str(q) for q in qds])
    ax.set_yscale("log")
    ax.set_xlabel("queue depth")
    ax.set_ylabel("IOPS (log)")
    ax.set_title("4 KiB random read IOPS")
    ax.legend(fontsize=8)
    bl.save_figure(fig, path, args.quick)


if __name__ == "__main__":
    main()

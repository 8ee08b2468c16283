#!/usr/bin/env python3
"""What the cache keeps: flashtier's read miss ratio through NBD against exact LRU (and
S3-FIFO) simulated on the same requests at the same capacity, and how much of its capacity
holds live blocks.

For each workload a fresh cache (default 1 GiB) is formatted over a backing file (default
4 GiB, sparse: miss ratios do not depend on the backing store's speed), `flashtier serve
--trace` records every request, and fio drives 4K requests through the nbd engine (QD16,
--number_ios each). Then:

  flashtier     read miss ratio from the server's counters (read_miss_blocks / block reads)
  LRU, S3-FIFO  `flashtier advise TRACE --sample 1` at the cache's capacity in blocks: exact
                simulations of the very requests flashtier served
  LRU at live   exact LRU holding only as many blocks as flashtier held live at the end
  live          live blocks / capacity at the end (status), and the share of log slots that
                went to batch headers (batches / (batches + blocks written to the log))

Workloads (fio randrw 70/30 unless said): zipf 0.6, 0.9, 1.2; pareto 0.9; a hot set (zipf
0.9 over the first quarter) with a sequential read scan of the rest running beside it. A
MariaDB OLTP trace is not part of this run (record one with `flashtier trace` under
bench/oltp.py's database and replay it with `trace to-fio`).

Targets (issue 12): read miss ratio <= 1.0x exact LRU's on every trace and <= 0.9x on the
zipf traces; live >= 90% of capacity.

Writes bench/results/eviction.{md,json,png}.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

WORKLOADS = [
    ("zipf0.6", "zipf:0.6", None),
    ("zipf0.9", "zipf:0.9", None),
    ("zipf1.2", "zipf:1.2", None),
    ("pareto0.9", "pareto:0.9", None),
    ("hot+scan", "zipf:0.9", "scan"),
]


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


def ctl(binary, sock, *args):
    return subprocess.run([str(binary), *args, "--control", str(sock)], capture_output=True, text=True,
                          check=True).stdout


def advise(binary, trace, sizes_bytes):
    out = subprocess.run([str(binary), "advise", str(trace), "--sample", "1", "--json", "--sizes",
                          ",".join(str(s) for s in sizes_bytes)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_one(binary, work, name, dist, extra, args):
    d = work / f"eviction-{name}"
    subprocess.run(["rm", "-rf", str(d)], check=True)
    d.mkdir(parents=True)
    backing = work / "eviction-backing.img"
    if not backing.exists() or backing.stat().st_size != args.data_mib << 20:
        backing.unlink(missing_ok=True)
        with open(backing, "wb") as f:
            f.truncate(args.data_mib << 20)
    cache = d / "cache.img"
    bl.flashtier_format(binary, cache, str(backing), args.cache_mib << 20)
    sock, ctl_sock, trace = d / "nbd.sock", d / "ctl.sock", d / "trace.ft"
    server = bl.flashtier_serve(binary, str(backing), sock, d / "serve.log",
                                extra=["--cache", str(cache), "--control-socket", str(ctl_sock),
                                       "--trace", str(trace), *args.serve_arg])
    t0 = time.time()
    fio = subprocess.run(fio_jobs(server.uri, dist, extra, args.data_mib << 20, args.ios), capture_output=True,
                         text=True)
    if fio.returncode != 0:
        sys.exit(f"fio failed on {name}:\n{fio.stdout}{fio.stderr}")
    seconds = time.time() - t0
    stats = json.loads(ctl(binary, ctl_sock, "stats", "--json"))
    server.stop()
    c = stats["windows"]["total"]
    cached, capacity = stats["status"]["cached_blocks"], stats["status"]["capacity_blocks"]
    reads = c["read_hit_blocks"] + c["read_miss_blocks"]
    sims = advise(binary, trace, [capacity * 4096, cached * 4096])
    assert sims["reads"] == reads, (sims["reads"], reads)
    full, at_live = sims["curve"][0], sims["curve"][1]
    data_written = c["write_blocks"] - c.get("bypassed_write_blocks", 0) + c["promoted_blocks"] + c["moved_blocks"]
    r = {
        "workload": name, "fio_distribution": dist, "scan": extra == "scan", "seconds": round(seconds, 1),
        "block_reads": reads, "block_writes": c["write_blocks"],
        "flashtier_miss_ratio": c["read_miss_blocks"] / reads,
        "lru_miss_ratio": full["lru_miss_ratio"], "s3fifo_miss_ratio": full["s3fifo_miss_ratio"],
        "fifo_miss_ratio": full["fifo_miss_ratio"], "lru_at_live_miss_ratio": at_live["lru_miss_ratio"],
        "capacity_blocks": capacity, "live_blocks": cached, "live_fraction": cached / capacity,
        "header_share": c["batches"] / (c["batches"] + data_written),
        "evicted_blocks": c["evicted_blocks"], "moved_blocks": c["moved_blocks"],
        "write_hit_blocks": c["write_hit_blocks"],
    }
    r["vs_lru"] = r["flashtier_miss_ratio"] / max(r["lru_miss_ratio"], 1e-9)
    print(f"{name}: flashtier {r['flashtier_miss_ratio']:.3f}, LRU {r['lru_miss_ratio']:.3f} ({r['vs_lru']:.2f}x), "
          f"S3-FIFO {r['s3fifo_miss_ratio']:.3f}, live {r['live_fraction']:.1%}", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-mib", type=int, default=1024, help="cache file size (default 1024)")
    ap.add_argument("--data-mib", type=int, default=4096, help="backing store size (default 4096)")
    ap.add_argument("--ios", type=int, default=1_000_000, help="fio requests per workload (default 1,000,000)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for serve, e.g. --serve-arg=--set --serve-arg=reclaim_policy=fifo")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.cache_mib, args.data_mib, args.ios = 128, 512, 100_000
    binary, work, machine = bl.setup(args, "fio")
    rows = [run_one(binary, work, *w, args) for w in WORKLOADS]
    out = bl.results_dir(args)
    zipf = [r for r in rows if r["workload"].startswith("zipf")]
    targets = [
        ("read miss ratio <= 1.0x exact LRU on every trace",
         check(all(r["vs_lru"] <= 1.0 for r in rows), max(r["vs_lru"] for r in rows), "x at worst")),
        ("read miss ratio <= 0.9x exact LRU on the zipf traces",
         check(all(r["vs_lru"] <= 0.9 for r in zipf), max(r["vs_lru"] for r in zipf), "x at worst")),
        ("live >= 90% of capacity",
         check(all(r["live_fraction"] >= 0.9 for r in rows), min(r["live_fraction"] for r in rows) * 100,
               "% at worst")),
    ]
    md = [f"# Eviction: flashtier against exact LRU on the same requests",
          "", f"{machine}", "",
          f"Cache {args.cache_mib} MiB over {args.data_mib} MiB, fio 4K QD16, {args.ios:,} requests a workload, "
          f"serve args: {' '.join(args.serve_arg) or '(defaults)'}.", "",
          "| workload | flashtier | exact LRU | flashtier ÷ LRU | S3-FIFO | FIFO | LRU with flashtier's live blocks "
          "| live | header slots |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['workload']} | {r['flashtier_miss_ratio']:.1%} | {r['lru_miss_ratio']:.1%} | "
                  f"{r['vs_lru']:.2f}x | {r['s3fifo_miss_ratio']:.1%} | {r['fifo_miss_ratio']:.1%} | "
                  f"{r['lru_at_live_miss_ratio']:.1%} | {r['live_fraction']:.1%} | {r['header_share']:.1%} |")
    md += ["", *bl.targets_table(targets)]
    bl.write_results(out, "eviction", {"machine": machine, "args": vars(args), "rows": rows}, md)
    plt = bl.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(rows))
    w = 0.2
    for i, (key, label, colour) in enumerate([("flashtier_miss_ratio", "flashtier", "tab:red"),
                                               ("lru_miss_ratio", "exact LRU", "tab:blue"),
                                               ("s3fifo_miss_ratio", "S3-FIFO", "tab:green"),
                                               ("lru_at_live_miss_ratio", "LRU, flashtier's live blocks",
                                                "tab:grey")]):
        ax.bar([x + (i - 1.5) * w for x in xs], [r[key] * 100 for r in rows], w, label=label, color=colour)
    ax.set_xticks(list(xs), [f"{r['workload']}\nlive {r['live_fraction']:.0%}" for r in rows])
    ax.set_ylabel("read miss ratio (%)")
    ax.set_title(f"Read misses at the same capacity ({args.cache_mib} MiB cache, {args.data_mib} MiB data)")
    ax.legend(fontsize=8)
    bl.save_figure(fig, out / "eviction.png", args.quick)


def check(ok, value, unit):
    return ("met" if ok else "**not met**", f"{value:.2f}{unit}")


if __name__ == "__main__":
    main()

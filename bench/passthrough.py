#!/usr/bin/env python3
"""flashtier pass-through vs `nbdkit file`: the plain NBD server speed of light.

Both servers serve the same file, both through the kernel page cache (the file is read once
beforehand so it is fully cached for both), on unix sockets, driven by fio's nbd engine:
4K randread and 4K randwrite at QD32 per connection, with 1 and 2 connections. Rounds are
interleaved and the order of the two servers alternates, so drift on this shared machine hits
both alike; medians are reported. Target: flashtier >= 1.0x nbdkit on every row.

    bench/passthrough.py [--rounds 5] [--runtime 10] [--size-mib 1024]

Writes bench/results/passthrough.{md,json,png}.
"""

import argparse
import json
from pathlib import Path

import benchlib as bl

ROWS = [
    ("randread", 1),
    ("randwrite", 1),
    ("randread", 2),
    ("randwrite", 2),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (default 5)")
    ap.add_argument("--runtime", type=int, default=10, help="seconds per fio run (default 10)")
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the served file (default 1024)")
    ap.add_argument("--workdir", default="/var/tmp/flashtier-bench", help="where the data file lives")
    ap.add_argument("--out", default=str(bl.REPO / "bench" / "results"), help="results directory")
    args = ap.parse_args()

    bl.ensure_matplotlib()
    bl.require("fio", "nbdkit")
    binary = bl.build_flashtier()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "passthrough.img"
    bl.make_random_file(data, args.size_mib << 20)
    bl.warm_page_cache(data)

    servers = [
        bl.nbdkit_file(data, work / "nbdkit.sock", work / "nbdkit.log"),
        bl.flashtier_serve(binary, str(data), work / "flashtier.sock", work / "flashtier.log"),
    ]
    samples = {(rw, jobs, s.name): [] for rw, jobs in ROWS for s in servers}
    try:
        for r in range(args.rounds):
            for rw, jobs in ROWS:
                order = servers if r % 2 == 0 else servers[::-1]
                for s in order:
                    m = bl.measure(s, rw=rw, jobs=jobs, runtime=args.runtime, size=f"{args.size_mib}M")
                    samples[(rw, jobs, s.name)].append(m)
                    print(f"round {r + 1}/{args.rounds} {rw:9} jobs={jobs} {s.name:9} "
                          f"{m['iops']:9.0f} IOPS  {m['cpu_us_per_io']:5.1f} CPU us/IO", flush=True)
    finally:
        for s in servers:
            s.stop()

    rows = []
    for rw, jobs in ROWS:
        k = samples[(rw, jobs, "nbdkit")]
        f = samples[(rw, jobs, "flashtier")]
        med = lambda xs, key: bl.median([x[key] for x in xs])  # noqa: E731
        rows.append({
            "workload": f"4K {rw} QD32",
            "connections": jobs,
            "nbdkit_iops": med(k, "iops"),
            "flashtier_iops": med(f, "iops"),
            "ratio": med(f, "iops") / med(k, "iops"),
            "nbdkit_cpu_us_per_io": med(k, "cpu_us_per_io"),
            "flashtier_cpu_us_per_io": med(f, "cpu_us_per_io"),
            "nbdkit_p99_us": med(k, "lat_p99_us"),
            "flashtier_p99_us": med(f, "lat_p99_us"),
            "nbdkit_iops_all": [x["iops"] for x in k],
            "flashtier_iops_all": [x["iops"] for x in f],
        })
    write_results(Path(args.out), args, rows)


def write_results(out: Path, args, rows):
    out.mkdir(parents=True, exist_ok=True)
    machine = bl.machine_description()
    (out / "passthrough.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))

    lines = [
        "# flashtier pass-through vs nbdkit file",
        "",
        f"Command: `bench/passthrough.py --rounds {args.rounds} --runtime {args.runtime} --size-mib {args.size_mib}`  ",
        f"Machine: {machine['cpus']} CPUs, Linux {machine['kernel']}, {machine['fio']}, {machine['nbdkit']}, "
        f"flashtier {machine['flashtier_commit']}, {machine['date']}",
        "",
        f"Both servers serve the same {args.size_mib} MiB file from the page cache (read once beforehand), "
        "on unix sockets, through fio's nbd engine; each connection is one fio job at QD32. "
        f"Median of {args.rounds} interleaved rounds of {args.runtime} s. CPU µs/IO is the server's "
        "user+system CPU time divided by the I/Os completed (lower is better; less sensitive to "
        "noise from other processes than IOPS).",
        "",
        "| workload | conns | nbdkit IOPS | flashtier IOPS | ratio | nbdkit CPU µs/IO | flashtier CPU µs/IO | nbdkit p99 µs | flashtier p99 µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['connections']} | {r['nbdkit_iops']:,.0f} | {r['flashtier_iops']:,.0f} | "
            f"**{r['ratio']:.2f}×** | {r['nbdkit_cpu_us_per_io']:.1f} | {r['flashtier_cpu_us_per_io']:.1f} | "
            f"{r['nbdkit_p99_us']:,.0f} | {r['flashtier_p99_us']:,.0f} |"
        )
    lines += ["", "Target: flashtier ≥ 1.0× nbdkit on every row.", "", "![IOPS per round](passthrough.png)", ""]
    (out / "passthrough.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['workload'].split()[1]}\n{r['connections']} conn" for r in rows]
    x = range(len(rows))
    for i, (name, color) in enumerate([("nbdkit", "#888888"), ("flashtier", "#1f77b4")]):
        xs = [j + (i - 0.5) * 0.38 for j in x]
        med = [r[f"{name}_iops"] for r in rows]
        ax.bar(xs, med, width=0.36, color=color, label=f"{name} (median)")
        for xj, r in zip(xs, rows):
            ax.scatter([xj] * len(r[f"{name}_iops_all"]), r[f"{name}_iops_all"], s=9, color="black", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("IOPS (4K, QD32 per connection)")
    ax.set_title("Pass-through NBD: flashtier vs nbdkit file (dots: each round)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "passthrough.png", dpi=110)
    print((out / "passthrough.md").read_text())


if __name__ == "__main__":
    main()

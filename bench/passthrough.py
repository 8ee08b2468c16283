#!/usr/bin/env python3
"""flashtier pass-through vs `nbdkit file`: the plain NBD server speed of light.

Both servers serve the same file, both through the kernel page cache (the file is read once
beforehand so it is fully cached for both), on unix sockets, driven by fio's nbd engine:
4K randread and 4K randwrite at QD32 per connection, with 1 and 2 connections. Rounds are
interleaved and the order of the two servers alternates, so drift on this shared machine hits
both alike; medians are reported. Target: flashtier >= 1.0x nbdkit on every row.

--baseline BIN adds an older flashtier binary (e.g. one built from the commit before a change to
the front end) as a third server in the same interleaved rounds, and reports flashtier's IOPS and
CPU per I/O as ratios to it.

    bench/passthrough.py [--rounds 5] [--runtime 10] [--size-mib 1024] [--flashtier BIN] [--baseline BIN]

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
    ap.add_argument("--flashtier", metavar="BIN", help="flashtier binary to measure (default: a release build)")
    ap.add_argument("--baseline", metavar="BIN", help="an older flashtier binary to measure in the same rounds")
    args = ap.parse_args()

    bl.ensure_matplotlib()
    bl.require("fio", "nbdkit")
    binary = bl.flashtier_binary(args.flashtier)
    baseline = bl.flashtier_binary(args.baseline) if args.baseline else None
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "passthrough.img"
    bl.make_random_file(data, args.size_mib << 20)
    bl.warm_page_cache(data)

    servers = [
        bl.nbdkit_file(data, work / "nbdkit.sock", work / "nbdkit.log"),
        bl.flashtier_serve(binary, str(data), work / "flashtier.sock", work / "flashtier.log"),
    ]
    if baseline:
        servers.append(bl.flashtier_serve(baseline, str(data), work / "baseline.sock", work / "baseline.log"))
        servers[-1].name = "baseline"
    samples = {(rw, jobs, s.name): [] for rw, jobs in ROWS for s in servers}
    try:
        for r in range(args.rounds):
            for rw, jobs in ROWS:
                # Alternate the order, and rotate it, so that no server always runs first or last.
                order = servers[r % len(servers):] + servers[:r % len(servers)]
                order = order if r % 2 == 0 else order[::-1]
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
        if baseline:
            b = samples[(rw, jobs, "baseline")]
            # Per-round ratios (each round measures both back to back), then their median.
            rows[-1].update({
                "baseline_iops": med(b, "iops"),
                "baseline_cpu_us_per_io": med(b, "cpu_us_per_io"),
                "baseline_p99_us": med(b, "lat_p99_us"),
                "baseline_iops_all": [x["iops"] for x in b],
                "vs_baseline_iops_ratio": bl.median([x["iops"] / y["iops"] for x, y in zip(f, b)]),
                "vs_baseline_cpu_ratio": bl.median([x["cpu_us_per_io"] / y["cpu_us_per_io"] for x, y in zip(f, b)]),
            })
    write_results(Path(args.out), args, rows, baseline)


def write_results(out: Path, args, rows, baseline):
    out.mkdir(parents=True, exist_ok=True)
    machine = bl.machine_description()
    (out / "passthrough.json").write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
    command = f"bench/passthrough.py --rounds {args.rounds} --runtime {args.runtime} --size-mib {args.size_mib}"
    if baseline:
        command += f" --baseline {baseline}"

    lines = [
        "# flashtier pass-through vs nbdkit file",
        "",
        f"Command: `{command}`  ",
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
    lines += ["", "Target: flashtier ≥ 1.0× nbdkit on every row.", ""]
    if baseline:
        lines += [
            f"**baseline** = `{baseline}` ({bl._first_line([str(baseline), '--version'])}), served the same way "
            "in the same rounds. Ratios are medians of the per-round ratios (flashtier ÷ baseline; for CPU "
            "per I/O lower is better).",
            "",
            "| workload | conns | baseline IOPS | flashtier IOPS | IOPS ratio | baseline CPU µs/IO | flashtier CPU µs/IO | CPU ratio | baseline p99 µs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['workload']} | {r['connections']} | {r['baseline_iops']:,.0f} | {r['flashtier_iops']:,.0f} | "
                f"**{r['vs_baseline_iops_ratio']:.2f}×** | {r['baseline_cpu_us_per_io']:.1f} | "
                f"{r['flashtier_cpu_us_per_io']:.1f} | **{r['vs_baseline_cpu_ratio']:.2f}×** | "
                f"{r['baseline_p99_us']:,.0f} |"
            )
        lines.append("")
    lines += ["![IOPS per round](passthrough.png)", ""]
    (out / "passthrough.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['workload'].split()[1]}\n{r['connections']} conn" for r in rows]
    x = range(len(rows))
    peers = [("nbdkit", "#888888"), ("flashtier", "#1f77b4")] + ([("baseline", "#ff7f0e")] if baseline else [])
    width = 0.76 / len(peers)
    for i, (name, color) in enumerate(peers):
        xs = [j + (i - (len(peers) - 1) / 2) * width for j in x]
        med = [r[f"{name}_iops"] for r in rows]
        ax.bar(xs, med, width=width * 0.95, color=color, label=f"{name} (median)")
        for xj, r in zip(xs, rows):
            ax.scatter([xj] * len(r[f"{name}_iops_all"]), r[f"{name}_iops_all"], s=9, color="black", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("IOPS (4K, QD32 per connection)")
    ax.set_title("Pass-through NBD: flashtier vs nbdkit file" + (" and baseline" if baseline else "")
                 + " (dots: each round)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "passthrough.png", dpi=110)
    print((out / "passthrough.md").read_text())


if __name__ == "__main__":
    main()

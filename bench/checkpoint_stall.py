#!/usr/bin/env python3
"""Checkpoint stalls: do client writes wait while the cache writes a checkpoint?

A checkpoint snapshots the index so that recovery replays only the log written since; the engine
takes one every 30 s while the log moves. Issue 11 measured the log writer doing it inline: on a
1 TiB cache, writes stalled up to 310 ms each time (the index is sized for the whole capacity,
2^28 slots, whatever is cached).

Setup, per binary: a sparse --cache-gib (default 1024) cache file, attached to a loop device
(`losetup`; `flashtier format` allocates every block of a cache *file*, and would fill the disk,
while on a block device it zeroes by discarding, which keeps the file sparse), in front of a
sparse --backing-gib (default 16) backing file,
write-back, with the background cleaner held off (writeback_controller=off, no age, no idle
write-back, where the binary has those parameters) so that only the log and its checkpoints write
to the cache's disk. The measured window: fio, nbd engine, 4K random writes at QD --iodepth
(default 32) over the first --region-gib (default 8) of the backing store, for --seconds
(default 120), with fio's per-window logs (--log_avg_msec=100): IOPS, and the maximum write
latency in each 100 ms (--log_max_value=1). The server's report is polled every second
(`flashtier stats --json --watch`); a checkpoint completed between two polls where the
`checkpoints` counter moved.

A 100 ms window is *with a checkpoint* when it overlaps the span from one second before the poll
that last saw the old count to the poll that saw the new one (a checkpoint, start to finish, lies
within that span with the 30 s interval and these sizes; the 1 s margin covers one started just
before the earlier poll), else *between checkpoints*. The first and last second of the window
are left out (fio starting and stopping).

Reported per binary: max write latency with a checkpoint vs between, the lowest second's IOPS vs
the median second, checkpoints seen, the server's peak RSS. Targets (issue 11): max latency with
a checkpoint ≤ 2× the max between, and no second below half the median IOPS.

--baseline PATH runs that binary first (the "before"), then --flashtier (the "after"), in one
report. The loop device is detached and the sparse files deleted after each run (the log writes
~25 GiB into the cache file in 120 s at 50k IOPS); a run is stopped (the server killed) if the
disk's free space falls below --min-free-gib (default 20).

Writes bench/results/checkpoint_stall.{md,json,png}.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchlib as bl

# The background cleaner held off: only the log and checkpoints write to the cache's disk.
HOLD = ["writeback_controller=off", "writeback_max_age_secs=0", "writeback_idle_delay_ms=0"]
WINDOW_MS = 100


def read_window_log(prefix, kind, t0):
    """fio's averaged log PREFIX_KIND.N.log (--log_unix_epoch=1): [(seconds since t0 at the end
    of the window, value)], write direction only, all jobs; the files are removed."""
    out = []
    for path in sorted(Path(prefix).parent.glob(Path(prefix).name + f"_{kind}.*.log")):
        for line in path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3 and parts[2] == "1":
                out.append((int(parts[0]) / 1000 - t0, int(parts[1])))
        path.unlink()
    for k in ("clat", "slat") if kind == "lat" else ():
        for path in Path(prefix).parent.glob(Path(prefix).name + f"_{k}.*.log"):
            path.unlink()
    out.sort()
    return out


def checkpoint_spans(samples, t0):
    """[(start, end)] in seconds since t0: where a checkpoint may have run, from the polls of the
    `checkpoints` counter (see the module documentation)."""
    spans = []
    prev = None
    for t, rep in samples:
        n = rep.get("counters", {}).get("checkpoints")
        if n is None:
            continue
        if prev is not None and n > prev[1]:
            spans.append((prev[0] - t0 - 1.0, t - t0))
        prev = (t, n)
    return spans


def run_one(args, binary, work, label):
    known = bl.flashtier_known_params(binary)
    tag = f"ckpt-{label}"
    cache = work / f"{tag}-cache.img"
    backing = work / f"{tag}-backing.img"
    ctl = work / f"{tag}.ctl"
    for f, gib in ((backing, args.backing_gib), (cache, args.cache_gib)):
        f.unlink(missing_ok=True)
        with open(f, "wb") as fh:
            fh.truncate(gib << 30)
    ft = poller = loop = None
    stop_watch = threading.Event()
    try:
        loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(cache)], capture_output=True, text=True,
                              check=True).stdout.strip()
        argv = [str(binary), "format", "--cache", loop, "--backing", str(backing), "--force",
                *bl.format_no_probe(binary)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"flashtier format failed: {' '.join(argv)}\n{done.stdout}{done.stderr}")
        fmt = done.stdout
        extra = ["--control-socket", str(ctl)]
        for kv in HOLD:
            if kv.split("=", 1)[0] in known:
                extra += ["--set", kv]
        ft = bl.flashtier_cache_serve(binary, loop, str(backing), work / f"{tag}.sock", work / f"{tag}.log",
                                      threads=args.threads, extra=extra)

        def watch():
            while not stop_watch.wait(1.0):
                free = shutil.disk_usage(work).free >> 30
                if free < args.min_free_gib:
                    print(f"only {free} GiB free on {work}: stopping the server", flush=True)
                    ft.proc.kill()
                    return
        threading.Thread(target=watch, daemon=True).start()
        poller = bl.ReportPoller(binary, ctl)
        prefix = str(work / f"{tag}-fio")
        t0 = time.time()
        m = bl.run_fio(bl.nbd_target(ft.uri), "randwrite", bs="4k", iodepth=args.iodepth,
                       size=args.region_gib << 30, runtime=args.seconds, ramp=0,
                       extra=["--norandommap", "--randrepeat=0", f"--write_lat_log={prefix}",
                              f"--write_iops_log={prefix}", f"--log_avg_msec={WINDOW_MS}", "--log_max_value=1",
                              "--log_unix_epoch=1"])
        t1 = time.time()
        samples = poller.stop()
        poller = None
        status = bl.proc_status(ft.proc.pid)
    finally:
        stop_watch.set()
        if poller:
            poller.stop()
        if ft:
            ft.stop(timeout=300)
        if loop:
            subprocess.run(["losetup", "--detach", loop])
        cache.unlink(missing_ok=True)
        backing.unlink(missing_ok=True)
    lat = read_window_log(prefix, "lat", t0)  # (t, max total latency in ns over the window)
    iops = read_window_log(prefix, "iops", t0)  # (t, IOPS over the window)
    spans = checkpoint_spans(samples, t0)
    lo, hi = 1.0, (t1 - t0) - 1.0

    def with_checkpoint(t):
        return any(a <= t and t - WINDOW_MS / 1000 <= b for a, b in spans)

    during = [v / 1e6 for t, v in lat if lo <= t <= hi and with_checkpoint(t)]
    between = [v / 1e6 for t, v in lat if lo <= t <= hi and not with_checkpoint(t)]
    per_sec = {}
    for t, v in iops:
        s = int(t - 1e-6)
        per_sec.setdefault(s, []).append(v)
    seconds = [(s, statistics.mean(vs)) for s, vs in sorted(per_sec.items()) if lo <= s and s + 1 <= hi]
    # A second with no completion at all has no entry: count it as 0.
    if seconds:
        have = {s for s, _ in seconds}
        seconds = sorted(seconds + [(s, 0.0) for s in range(seconds[0][0], seconds[-1][0]) if s not in have])
    values = [v for _, v in seconds]
    # The log writer's part of each checkpoint, from the server's own counters (binaries that
    # have them): its two syncs and the snapshot, and the checkpoint thread's image write.
    counters = samples[-1][1].get("counters", {}) if samples else {}
    timed = {}
    if counters.get("checkpoints") and "checkpoint_sync_us" in counters:
        n = counters["checkpoints"]
        timed = {k: counters[f"checkpoint_{k}_us"] / n / 1000 for k in ("sync", "snapshot", "write")}
    summary = {
        "max_lat_with_checkpoint_ms": max(during) if during else float("nan"),
        "max_lat_between_ms": max(between) if between else float("nan"),
        "min_second_iops": min(values) if values else float("nan"),
        "median_second_iops": statistics.median(values) if values else float("nan"),
        "checkpoints": len(spans),
        "fio_iops": m["iops"], "fio_write_p99_us": m["write"]["lat_p99_us"],
        "fio_write_p999_us": m["write"]["lat_p999_us"],
        "rss_peak_mib": status.get("VmHWM", 0) / 1024, "rss_end_mib": status.get("VmRSS", 0) / 1024,
        "per_checkpoint_ms": timed,
    }
    return {"label": label, "binary": str(binary), "summary": summary, "spans": spans,
            "per_second_iops": seconds, "max_lat_windows": [(t, v / 1e6) for t, v in lat],
            "format_output": fmt, "fio_argv": m["argv"], "closed": bl.flashtier_closed_event(ft.log_text())}


def report(args, machine, runs, elapsed):
    out = bl.results_dir(args)
    lines = bl.results_header("Checkpoint stalls: 4K random writes on a sparse 1 TiB cache", machine, args.quick)
    lines += [f"{args.cache_gib} GiB sparse cache file, {args.backing_gib} GiB sparse backing file, fio 4K randwrite "
              f"QD{args.iodepth} over {args.region_gib} GiB for {args.seconds} s (nbd engine); cleaner held off. "
              f"Latency: fio's maximum per {WINDOW_MS} ms window; a window is *with a checkpoint* when it overlaps "
              "the span from 1 s before the last poll of the old `checkpoints` count to the poll of the new one. "
              f"Total time {elapsed / 60:.1f} min.", "",
              "| binary | checkpoints | max write latency with a checkpoint | max between | ratio (≤ 2) | "
              "min second IOPS | median second IOPS | min ÷ median (≥ 0.5) | fio IOPS | write p99.9 | peak RSS |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    targets = []
    for r in runs:
        s = r["summary"]
        ratio = s["max_lat_with_checkpoint_ms"] / s["max_lat_between_ms"]
        dip = s["min_second_iops"] / s["median_second_iops"]
        lines.append(f"| {r['label']} | {s['checkpoints']} | {s['max_lat_with_checkpoint_ms']:.1f} ms | "
                     f"{s['max_lat_between_ms']:.1f} ms | {ratio:.2f} | {s['min_second_iops']:,.0f} | "
                     f"{s['median_second_iops']:,.0f} | {dip:.2f} | {s['fio_iops']:,.0f} | "
                     f"{s['fio_write_p999_us'] / 1000:.1f} ms | {s['rss_peak_mib']:,.0f} MiB |")
        if r is runs[-1]:
            targets = [
                (f"{r['label']}: max write latency with a checkpoint ÷ max between ≤ 2",
                 bl.check_target(ratio, 2.0, higher_is_better=False)),
                (f"{r['label']}: lowest second's IOPS ÷ median second's ≥ 0.5",
                 bl.check_target(dip, 0.5)),
            ]
    lines += ["", *bl.targets_table(targets), ""]
    for r in runs:
        spans = ", ".join(f"{a:.0f}–{b:.0f} s" for a, b in r["spans"])
        lines.append(f"- {r['label']} (`{r['binary']}`): checkpoint spans {spans or 'none'}")
        timed = r["summary"].get("per_checkpoint_ms")
        if timed:
            lines.append(f"  - per checkpoint (mean, from the server's counters): the log writer's syncs "
                         f"{timed['sync']:.1f} ms and snapshot {timed['snapshot']:.1f} ms; the checkpoint "
                         f"thread's encoding and write {timed['write']:.1f} ms")
    lines.append("")
    doc = {"args": vars(args), "machine": machine, "runs": runs, "elapsed_s": elapsed}
    bl.write_results(out, "checkpoint_stall", doc, lines)
    plot(out, runs, args.quick)


def plot(out, runs, quick):
    plt = bl.pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        ax2 = ax.twinx()
        ax.plot([t for t, _ in r["max_lat_windows"]], [v for _, v in r["max_lat_windows"]], color="#d62728",
                lw=0.7, label=f"max write latency per {WINDOW_MS} ms (ms)")
        ax2.plot([s + 0.5 for s, _ in r["per_second_iops"]], [v for _, v in r["per_second_iops"]], color="#1f77b4",
                 lw=1.0, label="IOPS per second")
        for a, b in r["spans"]:
            ax.axvspan(a, b, color="#ff7f0e", alpha=0.2)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax2.set_ylabel("IOPS")
        ax2.set_ylim(bottom=0)
        ax.set_title(f"{r['label']}: shaded = with a checkpoint")
        ax.set_xlabel("s")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="lower left", fontsize=8)
    bl.save_figure(fig, out / "checkpoint_stall.png", quick)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=120, help="fio runtime (default 120)")
    ap.add_argument("--iodepth", type=int, default=32, help="fio queue depth (default 32)")
    ap.add_argument("--cache-gib", type=int, default=1024, help="sparse cache file size (default 1024)")
    ap.add_argument("--backing-gib", type=int, default=16, help="sparse backing file size (default 16)")
    ap.add_argument("--region-gib", type=int, default=8, help="fio region at the start of the backing (default 8)")
    ap.add_argument("--min-free-gib", type=int, default=20,
                    help="stop a run when the work directory's disk has less free (default 20)")
    ap.add_argument("--baseline", metavar="PATH", help="a flashtier binary to run first, as the 'before'")
    ap.add_argument("--baseline-label", default="before", help="its label (default before)")
    ap.add_argument("--label", default="after", help="label of --flashtier's run (default after)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 40)
    binary, work, machine = bl.setup(args, "fio", "losetup")
    runs = []
    t_all = time.time()
    todo = ([(bl.flashtier_binary(args.baseline), args.baseline_label)] if args.baseline else []) + [
        (binary, args.label)]
    for b, label in todo:
        r = run_one(args, b, work, label)
        s = r["summary"]
        print(f"{label}: {s['checkpoints']} checkpoints, max latency {s['max_lat_with_checkpoint_ms']:.1f} ms with "
              f"a checkpoint vs {s['max_lat_between_ms']:.1f} ms between; IOPS min second "
              f"{s['min_second_iops']:,.0f} vs median {s['median_second_iops']:,.0f}", flush=True)
        runs.append(r)
    report(args, machine, runs, time.time() - t_all)


if __name__ == "__main__":
    main()

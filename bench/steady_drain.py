#!/usr/bin/env python3
"""Steady drain: a steady mixed load over a slow disk while the cache holds dirty data above its
target, under three cleaning configurations; how flat is the client's throughput and latency?

The backing store is DESIGN.md §5's emulated slow disk (one request at a time, --delay-ms per
request, ~250 random IOPS; nbdkit's log filter counts its requests) over a --backing-mib image of
random bytes. The cache is small (--cache-mib, by default an eighth of the image) so that the
dirty level moves between the watermarks within the measured window.

Each configuration gets, in turn, the same sequence on a freshly formatted cache and a fresh
slow-disk server:

  1. serve with the background cleaner held off (writeback_controller=off, no age, no idle
     write-back), then pre-fill: 4K random writes (fio's random map: each block once; seed 1) of
     --prefill-pct of the cache's capacity in blocks, over the whole image, so the dirty level
     starts above the rate controller's target and below the high watermark;
  2. apply the configuration's parameters live (`flashtier set`);
  3. the measured window: fio nbd engine, 4K randrw --rwmixread (default 70) % reads, QD
     --iodepth, --runtime seconds, uniformly over the whole image (seed 2, so it does not start
     by rereading the pre-filled blocks), at an offered load of --rate-iops (default 200/s: 140
     reads, 60 writes). Most reads miss the small cache and go to the slow disk: they take about
     half of its ~250 requests/s, and writing back the ~60 new dirty blocks/s (scattered over
     2 GiB, so hardly any coalesce) a quarter to a third. The slow disk can keep up on average; how
     evenly write-back takes its share decides whether the client sees its offered load every
     second or dips and catch-up bursts (fio catches up after falling behind). fio logs every I/O's latency (--write_lat_log, epoch timestamps); the report is
     polled each second (`flashtier stats --json --watch`: dirty level, write-back state, rate).

Watermarks: every configuration runs with writeback_dirty_high_pct=--high-pct (default 40) and
writeback_dirty_low_pct=--low-pct (default 30) instead of the engine's 70/50. The cache is
log-structured: at 65% of its capacity dirty only a few of its segments are free (the rest hold
the dirty blocks, record headers and partly filled batches), so under this load reclaim, not the
high watermark, decides when dirty blocks are written back at 70/50, and every configuration
stalls the same way on reclaim. At 40/30 the watermarks are reached first, which is what
watermark-only is about.

Configurations (contract of issue 5):
  watermark-only   writeback_controller=off writeback_max_age_secs=0 writeback_idle_delay_ms=0
                   (write-back only above the high watermark, at full speed down to the low one)
  rate-controlled  writeback_controller=pi writeback_dirty_target_pct=--target-pct (default 30:
                   below the pre-fill, so the controller drains the excess and then holds the
                   level, rather than draining hard towards the engine's default 10%);
                   --rate-set adds settings
  age-based        writeback_controller=off writeback_max_age_secs=--age-secs (default 30)
--variant LABEL:K=V,K=V adds a configuration (its settings come after the watermarks).

Per configuration, over the whole seconds of the window but the first and the last (partial):
mean client IOPS, the standard deviation and coefficient of variation (CV) of per-second IOPS,
the lowest second, the per-second p99 latency (median and p99 over the seconds), the dirty level
at the start and end, and the slow disk's requests during the window. Targets (issue 5): the
rate-controlled line is the flattest (lowest CV of per-second IOPS) and no lower on average (mean
IOPS >= each other configuration's); and (issue 11) paced, not bursty: over the seconds its
controller holds the dirty level at its target (within 1% of the capacity), the p99 of the
per-second p99 latency within 1.5x of their median (rerun with --runtime 120).

Writes bench/results/steady_drain.{md,json,png}.
"""

import argparse
import statistics
import time

import benchlib as bl

# The rate controller holds the dirty level at its target while dirty is within this share of
# the cache's capacity above it.
AT_TARGET_PCT = 1.0

# Held during the pre-fill, so every configuration starts from the same dirty level.
HOLD = ["writeback_controller=off", "writeback_max_age_secs=0", "writeback_idle_delay_ms=0"]
COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def configurations(args):
    marks = [f"writeback_dirty_high_pct={args.high_pct}", f"writeback_dirty_low_pct={args.low_pct}"]
    cfgs = {
        "watermark-only": ["writeback_controller=off", "writeback_max_age_secs=0", "writeback_idle_delay_ms=0",
                           *marks],
        "rate-controlled": ["writeback_controller=pi", "writeback_max_age_secs=0", "writeback_idle_delay_ms=0",
                            *marks, f"writeback_dirty_target_pct={args.target_pct}", *args.rate_set],
        "age-based": ["writeback_controller=off", f"writeback_max_age_secs={args.age_secs}",
                      "writeback_idle_delay_ms=0", *marks],
    }
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in wanted:
        if c not in cfgs:
            raise SystemExit(f"unknown configuration {c!r} ({', '.join(cfgs)})")
    out = {c: cfgs[c] for c in wanted}
    for v in args.variant:
        label, _, kvs = v.partition(":")
        out[label] = [*marks, *[kv for kv in kvs.split(",") if kv]]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=180, help="seconds of the measured window (default 180)")
    ap.add_argument("--iodepth", type=int, default=32, help="fio queue depth (default 32)")
    ap.add_argument("--rate-iops", type=int, default=200,
                    help="offered load: fio --rate_iops, split between reads and writes by --rwmixread "
                         "(default 200; 0 = not rate-limited)")
    ap.add_argument("--skip-secs", type=int, default=5,
                    help="seconds at the start of the window left out of the per-second figures (default 5)")
    ap.add_argument("--rwmixread", type=int, default=70, help="percent reads in the mix (default 70)")
    ap.add_argument("--backing-mib", type=int, default=2048, help="backing image = region (default 2048)")
    ap.add_argument("--cache-mib", type=int, default=256, help="cache size (default 256)")
    ap.add_argument("--prefill-pct", type=int, default=35,
                    help="dirty blocks written before the window, in percent of the cache's capacity (default 35)")
    ap.add_argument("--high-pct", type=int, default=40,
                    help="writeback_dirty_high_pct in every configuration (default 40; see above)")
    ap.add_argument("--low-pct", type=int, default=30,
                    help="writeback_dirty_low_pct in every configuration (default 30)")
    ap.add_argument("--target-pct", type=int, default=30,
                    help="writeback_dirty_target_pct of rate-controlled (default 30)")
    ap.add_argument("--age-secs", type=int, default=30, help="writeback_max_age_secs of age-based (default 30)")
    ap.add_argument("--delay-ms", type=int, default=4, help="slow disk delay per read/write (default 4)")
    ap.add_argument("--configs", default="watermark-only,rate-controlled,age-based",
                    help="configurations to run, in order (default all three)")
    ap.add_argument("--rate-set", action="append", default=[], metavar="PARAM=VALUE",
                    help="extra setting for rate-controlled (repeatable), e.g. writeback_dirty_target_pct=50")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:P=V,P=V",
                    help="an extra configuration (repeatable)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each configuration runs (order rotates each round; default 1)")
    ap.add_argument("--allow-missing-params", action="store_true",
                    help="run even if the binary lacks the write-back parameters (the configurations then "
                         "differ only in name: a plumbing check); implied by --quick")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.runtime, args.backing_mib, args.cache_mib, args.age_secs = 20, 256, 64, 5
        args.allow_missing_params = True
    cfgs = configurations(args)

    binary, work, machine = bl.setup(args, "fio", "nbdkit")
    known = bl.flashtier_known_params(binary)
    params_ok = "writeback_controller" in known
    if not params_ok:
        if not args.allow_missing_params:
            raise SystemExit(f"{binary} has no writeback_controller parameter (a build without the background "
                             "cleaner): pass --allow-missing-params to run anyway")
        print("warning: this flashtier has no write-back parameters: the configurations are not applied", flush=True)
    else:
        for label, kvs in cfgs.items():
            for kv in kvs:
                if kv.split("=", 1)[0] not in known:
                    raise SystemExit(f"{label}: {binary} has no parameter {kv.split('=', 1)[0]!r}")

    size = args.backing_mib << 20
    img = work / "steady-backing.img"
    bl.make_random_file(img, size)
    cache_img = work / "steady-cache.img"
    runs = {label: [] for label in cfgs}
    t_all = time.time()
    order = list(cfgs)
    for rnd in range(args.rounds):
        for label in order[rnd % len(order):] + order[:rnd % len(order)]:
            r = run_one(args, binary, work, img, cache_img, label, cfgs[label] if params_ok else [], params_ok)
            runs[label].append(r)
            s = r["summary"]
            print(f"round {rnd + 1} {label:16} mean {s['mean_iops']:8.1f} IOPS  CV {s['cv']:.3f}  min "
                  f"{s['min_iops']:6.0f}  p99/s median {s['p99_median_us'] / 1000:7.1f} ms  dirty "
                  f"{s['dirty_pct_start']:.1f}% -> {s['dirty_pct_end']:.1f}%", flush=True)
    report(args, machine, cfgs, runs, params_ok, time.time() - t_all)


def run_one(args, binary, work, img, cache_img, label, settings, params_ok):
    tag = "steady-" + "".join(ch if ch.isalnum() else "-" for ch in label)
    reqlog = work / f"{tag}-backing.requests.log"
    statsf = work / f"{tag}-backing.stats.txt"
    reqlog.unlink(missing_ok=True)
    srv = bl.slow_backing(img, work / f"{tag}-backing.sock", work / f"{tag}-backing.log", statsf, reqlog,
                          delay_ms=args.delay_ms)
    ctl = work / f"{tag}.ctl"
    ft = poller = None
    try:
        fmt = bl.flashtier_format(binary, cache_img, srv.uri, args.cache_mib << 20)
        extra = ["--control-socket", str(ctl), "--stats-file", str(work / f"{tag}.stats")]
        if params_ok:
            for kv in HOLD + [f"writeback_dirty_high_pct={args.high_pct}", f"writeback_dirty_low_pct={args.low_pct}"]:
                extra += ["--set", kv]
        ft = bl.flashtier_cache_serve(binary, cache_img, srv.uri, work / f"{tag}.sock", work / f"{tag}.log",
                                      threads=args.threads, extra=extra)
        cap = bl.report_cache_status(bl.flashtier_report(binary, ctl))["capacity_blocks"]
        n = cap * args.prefill_pct // 100
        t_pre = time.time()
        bl.run_fio(bl.nbd_target(ft.uri), "randwrite", bs="4k", iodepth=args.iodepth, size=args.backing_mib << 20,
                   io_size=n * 4096, time_based=False, extra=["--randrepeat=0", "--randseed=1"])
        pre_secs = time.time() - t_pre
        before = bl.flashtier_report(binary, ctl)
        for kv in settings:
            k, v = kv.split("=", 1)
            bl.flashtier_ctl(binary, ctl, "set", k, v)
        params_now = bl.flashtier_ctl(binary, ctl, "get", "--all")[1] if params_ok else ""
        poller = bl.ReportPoller(binary, ctl)
        prefix = str(work / f"{tag}-lat")
        rate = []
        if args.rate_iops:
            r_iops = round(args.rate_iops * args.rwmixread / 100)
            rate = [f"--rate_iops={r_iops},{args.rate_iops - r_iops}"]
        t0 = time.time()
        m = bl.run_fio(bl.nbd_target(ft.uri), "randrw", bs="4k", iodepth=args.iodepth, size=args.backing_mib << 20,
                       runtime=args.runtime, ramp=0,
                       # Another seed than the pre-fill's, else the window would go over the
                       # pre-filled blocks first (fio 3.33 ignores randseed unless randrepeat=0).
                       extra=[f"--rwmixread={args.rwmixread}", "--randrepeat=0", "--randseed=2",
                              f"--write_lat_log={prefix}", "--log_unix_epoch=1", *rate])
        t1 = time.time()
        samples = poller.stop()
        poller = None
        after = bl.flashtier_report(binary, ctl)
    finally:
        if poller:
            poller.stop()
        if ft:
            ft.stop(timeout=120)
        srv.stop()
    ios = bl.read_lat_log(prefix, t0)
    secs = bl.per_second(ios, int(t1 - t0) + 1)
    io = bl.count_backing_io(reqlog, {"window": (t0, t1), "prefill": (t_pre, t0)})
    # Whole seconds of the window but the first --skip-secs (fio starting: it may issue a run of
    # fast writes before its read/write mix settles) and the last (cut short).
    whole = [s for s in secs if max(1, args.skip_secs) <= s[0] <= args.runtime - 2]
    iops = [s[1] for s in whole]
    p99s = [s[2] for s in whole if s[2] == s[2]]
    mean = statistics.mean(iops) if iops else float("nan")
    sd = statistics.pstdev(iops) if iops else float("nan")
    dirty = []
    for t, rep in samples:
        st = bl.report_cache_status(rep)
        wb = st.get("writeback") or {}
        dirty.append({"t": t - t0, "dirty_blocks": st.get("dirty_blocks"), "capacity_blocks": st.get("capacity_blocks"),
                      "state": wb.get("state"), "rate_bytes_per_sec": wb.get("rate_bytes_per_sec"),
                      "target_blocks": wb.get("target_blocks"),
                      "backing_writes": rep.get("counters", {}).get("backing_writes"),
                      "cleaner_writes": rep.get("counters", {}).get("cleaner_writes")})
    # The per-second p99 of the seconds the rate controller held the dirty level at its target
    # (state polled in that second, dirty within AT_TARGET_PCT of the capacity above the target):
    # how evenly write-back at a steady rate takes its share of the slow disk.
    at_target = {int(d["t"]) for d in dirty
                 if d["state"] == "controller" and d["t"] >= 0 and d["dirty_blocks"] is not None
                 and d["target_blocks"] is not None and d["capacity_blocks"]
                 and d["dirty_blocks"] - d["target_blocks"] <= AT_TARGET_PCT / 100 * d["capacity_blocks"]}
    ctl_p99s = [s[2] for s in whole if s[0] in at_target and s[2] == s[2]]
    b_st, a_st = bl.report_cache_status(before), bl.report_cache_status(after)
    states = {}
    for d in dirty:
        if 0 <= d["t"] <= args.runtime and d["state"]:
            states[d["state"]] = states.get(d["state"], 0) + 1
    summary = {
        "mean_iops": mean, "stdev_iops": sd, "cv": sd / mean if mean else float("nan"),
        "min_iops": min(iops) if iops else float("nan"), "seconds": len(iops),
        "p99_median_us": statistics.median(p99s) if p99s else float("nan"),
        "p99_of_p99_us": bl.percentile(p99s, 99), "p99_max_us": max(p99s) if p99s else float("nan"),
        "at_target_seconds": len(ctl_p99s),
        "at_target_p99_median_us": statistics.median(ctl_p99s) if ctl_p99s else float("nan"),
        "at_target_p99_of_p99_us": bl.percentile(ctl_p99s, 99) if ctl_p99s else float("nan"),
        "fio_read_p99_us": m["read"]["lat_p99_us"], "fio_write_p99_us": m["write"]["lat_p99_us"],
        "fio_iops": m["iops"], "read_iops": m["read"]["iops"], "write_iops": m["write"]["iops"],
        "dirty_pct_start": 100 * b_st["dirty_blocks"] / b_st["capacity_blocks"],
        "dirty_pct_end": 100 * a_st["dirty_blocks"] / a_st["capacity_blocks"],
        "backing": {op: io["window"].get(op, {"ops": 0, "bytes": 0}) for op in ("read", "write", "flush")},
        "prefill_backing": {op: io["prefill"].get(op, {"ops": 0, "bytes": 0}) for op in ("read", "write")},
        "prefill_blocks": n, "prefill_seconds": pre_secs, "writeback_states": states,
    }
    return {"label": label, "settings": settings, "summary": summary, "per_second": secs, "dirty": dirty,
            "counters_before": before.get("counters", {}), "counters_after": after.get("counters", {}),
            "params": params_now, "backing_stats": bl.read_stats_file(statsf), "format_output": fmt,
            "fio_argv": m["argv"], "closed": bl.flashtier_closed_event(ft.log_text())}


def report(args, machine, cfgs, runs, params_ok, elapsed):
    out = bl.results_dir(args)
    labels = list(runs)
    agg = {}
    for label in labels:
        ss = [r["summary"] for r in runs[label]]
        agg[label] = bl.medians(ss, ["mean_iops", "stdev_iops", "cv", "min_iops", "p99_median_us", "p99_of_p99_us",
                                     "p99_max_us", "at_target_p99_median_us", "at_target_p99_of_p99_us",
                                     "fio_read_p99_us", "fio_write_p99_us", "dirty_pct_start",
                                     "dirty_pct_end", "backing.read.ops", "backing.write.ops", "backing.write.bytes"])
    targets = []
    rate = "rate-controlled"
    others = [lb for lb in ("watermark-only", "age-based") if lb in agg]
    if rate in agg and others:
        best_other_cv = min(agg[lb]["cv"] for lb in others)
        best_other_mean = max(agg[lb]["mean_iops"] for lb in others)
        targets.append(("rate-controlled is the flattest: its CV of per-second IOPS ÷ the lowest other CV ≤ 1",
                        bl.check_target(agg[rate]["cv"] / best_other_cv if best_other_cv else float("nan"), 1.0,
                                        higher_is_better=False)))
        targets.append(("rate-controlled no lower on average: its mean IOPS ÷ the highest other mean ≥ 1",
                        bl.check_target(agg[rate]["mean_iops"] / best_other_mean if best_other_mean else float("nan"),
                                        1.0)))
    if rate in agg and agg[rate]["at_target_p99_median_us"] == agg[rate]["at_target_p99_median_us"]:
        a = agg[rate]
        targets.append(("rate-controlled is paced, not bursty: over the seconds its controller holds the dirty level at "
                        f"its target (within {AT_TARGET_PCT:g}% of the capacity), the p99 of the per-second p99 latency "
                        "÷ their median ≤ 1.5",
                        bl.check_target(a["at_target_p99_of_p99_us"] / a["at_target_p99_median_us"], 1.5,
                                        higher_is_better=False)))
    doc = {"machine": machine, "args": vars(args), "configurations": cfgs, "write_back_parameters_available": params_ok,
           "summary": agg, "runs": runs, "elapsed_s": elapsed}
    lines = bl.results_header("Steady drain: client IOPS and p99 per second under three cleaning configurations",
                              machine, args.quick)
    lines += [
        f"Slow disk: {args.backing_mib} MiB image of random data, one request at a time, {args.delay_ms} ms each. "
        f"Cache: {args.cache_mib} MiB (written in full, then formatted anew for each configuration). Before each "
        f"window, with the cleaner held off, {args.prefill_pct}% of the cache's capacity is written as distinct "
        "random 4K blocks (dirty), then the configuration is applied live. Every configuration runs with the high/low watermarks at "
        f"{args.high_pct}/{args.low_pct}% (not the engine's 70/50: see the script's header). Window: fio nbd engine, 4K randrw "
        f"{args.rwmixread}/{100 - args.rwmixread}, QD{args.iodepth}, {args.runtime} s, "
        + (f"offered load fio --rate_iops {args.rate_iops} (reads and writes split {args.rwmixread}/{100 - args.rwmixread}), "
           if args.rate_iops else "not rate-limited, ") + "uniform over "
        "the whole image (most reads miss the cache and queue at the slow disk with the write-back). Per-second "
        "figures from fio's per-I/O latency log over the window's whole seconds but the first "
        f"{args.skip_secs} and the last (a "
        "second with no completion counts as 0 IOPS and has no p99); "
        f"{'median of ' + str(args.rounds) + ' rounds' if args.rounds > 1 else 'one run each'}.",
        "",
        "| configuration | settings | mean IOPS | stdev | CV | min IOPS/s | p99/s median ms | p99 of p99/s ms | "
        "fio p99 read / write ms | dirty % start → end | slow disk reads / writes (MiB written) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        a = agg[label]
        st = " ".join(f"`{kv}`" for kv in cfgs[label]) if params_ok else "(not applied: no such parameters)"
        lines.append(
            f"| {label} | {st} | {a['mean_iops']:,.1f} | {a['stdev_iops']:,.1f} | {a['cv']:.3f} | {a['min_iops']:,.0f} | "
            f"{a['p99_median_us'] / 1000:,.1f} | {a['p99_of_p99_us'] / 1000:,.1f} | "
            f"{a['fio_read_p99_us'] / 1000:,.1f} / {a['fio_write_p99_us'] / 1000:,.1f} | "
            f"{a['dirty_pct_start']:.1f} → {a['dirty_pct_end']:.1f} | {a['backing.read.ops']:,.0f} / "
            f"{a['backing.write.ops']:,.0f} ({a['backing.write.bytes'] / 2**20:,.1f}) |")
    lines += ["", "Write-back state seconds (from `status.cache_status.writeback.state`, polled each second), and "
              "the per-second p99 over the seconds the controller held the dirty level at its target (within "
              f"{AT_TARGET_PCT:g}% of the capacity; median, p99 of them):", ""]
    for label in labels:
        sm = runs[label][0]["summary"]
        sts = sm["writeback_states"]
        ctl = ""
        if sm.get("at_target_seconds"):
            ctl = (f"; at target {sm['at_target_seconds']} s, their p99 median "
                   f"{agg[label]['at_target_p99_median_us'] / 1000:,.1f} ms, p99 "
                   f"{agg[label]['at_target_p99_of_p99_us'] / 1000:,.1f} ms")
        lines.append(f"- {label}: " + (", ".join(f"{k} {v} s" for k, v in sorted(sts.items())) or "not reported") + ctl)
    lines += ["", *bl.targets_table(targets), "", f"Whole run: {elapsed / 60:.1f} min.", "",
              "![per-second IOPS, p99 and dirty level](steady_drain.png)"]
    bl.write_results(out, "steady_drain", doc, lines)
    plot(out / "steady_drain.png", runs, args)


def plot(path, runs, args):
    plt = bl.pyplot()
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(12, 11), sharex=True)
    for i, (label, rs) in enumerate(runs.items()):
        r = rs[0]
        c = COLORS[i % len(COLORS)]
        secs = [s for s in r["per_second"] if max(1, args.skip_secs) <= s[0] <= args.runtime - 2]
        a1.plot([s[0] for s in secs], [s[1] for s in secs], color=c, lw=1.2,
                label=f"{label} (mean {r['summary']['mean_iops']:,.0f}, CV {r['summary']['cv']:.3f})")
        a2.plot([s[0] for s in secs], [s[2] / 1000 for s in secs], color=c, lw=1)
        d = [x for x in r["dirty"] if x["dirty_blocks"] is not None and x["capacity_blocks"]]
        a3.plot([x["t"] for x in d], [100 * x["dirty_blocks"] / x["capacity_blocks"] for x in d], color=c, lw=1.2,
                label=label)
    a1.set_ylabel("client IOPS per second")
    a1.set_ylim(bottom=0)
    a1.set_title(f"4K randrw {args.rwmixread}/{100 - args.rwmixread} QD{args.iodepth} over the slow disk, "
                 f"{args.cache_mib} MiB cache pre-filled to {args.prefill_pct}% dirty")
    a1.legend(fontsize=8)
    a2.set_ylabel("p99 latency per second, ms (log)")
    a2.set_yscale("log")
    a3.set_ylabel("dirty, % of cache capacity")
    a3.set_xlabel("seconds of the window")
    a3.set_ylim(bottom=0)
    a3.legend(fontsize=8)
    bl.save_figure(fig, path, args.quick)


if __name__ == "__main__":
    main()

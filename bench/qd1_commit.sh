#!/bin/bash
# The database commit at QD1, two builds alternating: a 4K random write + FLUSH at a time (fio
# --fsync=1 over NBD, one connection), each round on a fresh write-back cache (no write-back
# backlog), so the figure is the commit path itself. Prints commits/s, the write's and the
# FLUSH's p50 latency and the server's CPU µs per commit (utime+stime of the server process).
# Each round also runs the raw cache file (R: fio psync O_DIRECT write + fdatasync, no NBD): the
# issue's target is a ratio to it, and this machine's disk varies by 2x from hour to hour. And
# the protocol alone (N: the same fio job over NBD to `nbdkit memory`, which stores nothing
# durably and syncs nothing): what two NBD round trips a commit cost fio and a server here,
# before any storage work.
#
# usage: bench/qd1_commit.sh BUILD_A BUILD_B [ROUNDS=3] [SECONDS=10] [WORKDIR=/tmp/flashtier-qd1] [BS=4k]
# e.g.   bench/qd1_commit.sh target-before/release/flashtier target/release/flashtier
# BS other than 4k: sequential writes of that size instead of random 4K ones, a redo log's
# appends (e.g. 1536: each write rewrites the block the previous one ended in); the table then
# also shows the blocks the server took from memory instead of reading them (its counter
# partial_write_blocks_from_memory, per write; "-" for a build without it).
# The cache file (1 GiB) is in WORKDIR, written through once before the first round and
# reformatted for each: a file with unallocated or unwritten blocks would make log writes
# allocate them, and every FLUSH commit the filesystem's journal, which a real cache device does
# not. Builds before `format` wrote its cache file once (`--no-prewrite` now) left the file's
# middle unwritten at each format, so their rounds, and the raw file's after them, paid that
# (bench/results/qd1_prewrite). The backing file (1 GiB, sparse) is in /dev/shm.
set -euo pipefail
A=$1; B=$2; ROUNDS=${3:-3}; SECS=${4:-10}; WORK=${5:-/tmp/flashtier-qd1}; BS=${6:-4k}
RW=randwrite; [ "$BS" = 4k ] || RW=write
for tool in fio python3 nbdkit; do command -v $tool >/dev/null || { echo "needs $tool" >&2; exit 2; }; done

# shellcheck source=qd1_lib.sh
. "$(dirname "$0")/qd1_lib.sh"

one() { # BIN TAG
    local bin=$1 tag=$2 d=$WORK/$2 backing=/dev/shm/flashtier-qd1-$2.img
    serve_fresh "$bin" "$d" "$WORK/cache.img" "$backing" 1G
    local pid=$SERVER_PID
    local c0 c1
    c0=$(awk '{print $14+$15}' /proc/$pid/stat)
    fio --name=q --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=$RW --bs="$BS" \
        --iodepth=1 --size=1G --time_based --runtime="$SECS" --fsync=1 --output-format=json \
        >"$d/fio.json" 2>/dev/null
    c1=$(awk '{print $14+$15}' /proc/$pid/stat)
    "$bin" stats --json --control "$d/c.sock" >"$d/counters.json" 2>/dev/null || true
    kill $pid; wait $pid 2>/dev/null || true
    rm -f "$backing"
    python3 - "$d/fio.json" "$c0" "$c1" "$tag" "$(getconf CLK_TCK)" "$d/counters.json" "$BS" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
ios, iops = job["write"]["total_ios"], job["write"]["iops"]
cpu_us = (int(sys.argv[3]) - int(sys.argv[2])) * 1e6 / int(sys.argv[5]) / ios
w50 = job["write"]["clat_ns"]["percentile"]["50.000000"] / 1000
f50 = job["sync"]["lat_ns"]["percentile"]["50.000000"] / 1000
row = f"| {sys.argv[4]} | {iops:,.0f} | {w50:.0f} | {f50:.0f} | {cpu_us:.0f} |"
if sys.argv[7] != "4k":
    try:
        n = json.load(open(sys.argv[6]))["counters"]["partial_write_blocks_from_memory"]
        row += f" {n / ios:.2f} |"
    except (OSError, ValueError, KeyError):
        row += " - |"
print(row)
PY
}

# reference_row LABEL: the table row of a reference job (fio's JSON on stdin; no server CPU).
reference_row() {
    python3 -c '
import json, sys
text = sys.stdin.read()
job = json.loads(text[text.index("{"):])["jobs"][0]
iops = job["write"]["iops"]
w50 = job["write"]["clat_ns"]["percentile"]["50.000000"] / 1000
f50 = job["sync"]["lat_ns"]["percentile"]["50.000000"] / 1000
print(f"| {sys.argv[1]} | {iops:,.0f} | {w50:.0f} | {f50:.0f} | - |" + (" - |" if sys.argv[2] != "4k" else ""))
' "$1" "$BS"
}

raw() { # TAG
    fio --name=r --filename="$WORK/cache.img" --ioengine=psync --direct=1 --rw=$RW --bs="$BS" \
        --iodepth=1 --size=1G --time_based --runtime="$SECS" --fdatasync=1 --output-format=json \
        2>/dev/null | reference_row "$1 (raw file)"
}

protocol() { # TAG
    local d=$WORK/nbdkit-memory
    rm -rf "$d"; mkdir -p "$d"
    nbdkit --unix "$d/s.sock" --foreground memory 1G &
    local pid=$!
    wait_socket "$d/s.sock"
    fio --name=q --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=$RW --bs="$BS" \
        --iodepth=1 --size=1G --time_based --runtime="$SECS" --fsync=1 --output-format=json \
        2>/dev/null | reference_row "$1 (nbdkit memory: the protocol alone)"
    kill $pid; wait $pid 2>/dev/null || true
}

mkdir -p "$WORK"
if [ "$(stat -c %s "$WORK/cache.img" 2>/dev/null || echo 0)" != $((1 << 30)) ]; then
    dd if=/dev/zero of="$WORK/cache.img" bs=1M count=1024 oflag=direct status=none
fi
if [ "$BS" = 4k ]; then what="4K random write"; else what="$BS-byte sequential write"; fi
echo "QD1 $what + FLUSH, $SECS s per round, fresh write-back cache each round; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "A = $A ($("$A" --version 2>/dev/null | head -1)), B = $B ($("$B" --version 2>/dev/null | head -1))"
echo
if [ "$BS" = 4k ]; then
    echo "| round | commits/s | write p50 µs | FLUSH p50 µs | server CPU µs/commit |"
    echo "|---|---:|---:|---:|---:|"
else
    echo "| round | commits/s | write p50 µs | FLUSH p50 µs | server CPU µs/commit | blocks from memory per write |"
    echo "|---|---:|---:|---:|---:|---:|"
fi
for r in $(seq "$ROUNDS"); do
    raw "R$r"
    protocol "N$r"
    one "$A" "A$r"
    one "$B" "B$r"
done
echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

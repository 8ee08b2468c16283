#!/bin/bash
# A database's read at QD1: 4K random reads, one at a time (fio over NBD, one connection), that
# all hit a write-back cache, two builds alternating; each round also runs `nbdkit file
# cache=none` (all on the SSD, the reference of bench/oltp.py) and the raw file (fio psync
# O_DIRECT, no NBD) on the same filesystem. Prints reads/s, p50/p99 latency and the server's CPU
# µs per read (utime+stime of the server process during the job).
#
# usage: bench/qd1_read.sh BUILD_A BUILD_B [ROUNDS=3] [SECONDS=8] [WORKDIR=/tmp/flashtier-qd1r]
# e.g.   bench/qd1_read.sh target-before/release/flashtier target/release/flashtier
# The cache file (1 GiB) and the nbdkit/raw file (512 MiB) are in WORKDIR, written through once;
# the backing file (512 MiB, sparse) is in /dev/shm. Each round formats the cache afresh and
# writes the whole 512 MiB export through it (write-back, so every block is cached) before the
# timed reads.
set -euo pipefail
A=$1; B=$2; ROUNDS=${3:-3}; SECS=${4:-8}; WORK=${5:-/tmp/flashtier-qd1r}
for tool in fio python3 nbdkit; do command -v $tool >/dev/null || { echo "needs $tool" >&2; exit 2; }; done

report() { # FIO_JSON TAG CPU_TICKS(or -)
    python3 - "$1" "$2" "$3" "$(getconf CLK_TCK)" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]["read"]
p = job["clat_ns"]["percentile"]
cpu = "-" if sys.argv[3] == "-" else f"{int(sys.argv[3]) * 1e6 / int(sys.argv[4]) / job['total_ios']:.0f}"
print(f"| {sys.argv[2]} | {job['iops']:,.0f} | {p['50.000000'] / 1000:.0f} | {p['99.000000'] / 1000:.0f} | {cpu} |")
PY
}

reads() { # URI_OR_FILE OUT [psync]
    if [ "${3:-}" = psync ]; then
        fio --name=r --filename="$1" --ioengine=psync --direct=1 --rw=randread --bs=4k \
            --iodepth=1 --size=512M --time_based --runtime="$SECS" --output-format=json >"$2" 2>/dev/null
    else
        fio --name=r --ioengine=nbd --uri="$1" --rw=randread --bs=4k --iodepth=1 --size=512M \
            --time_based --runtime="$SECS" --output-format=json >"$2" 2>/dev/null
    fi
}

# shellcheck source=qd1_lib.sh
. "$(dirname "$0")/qd1_lib.sh"

one() { # BIN TAG
    local bin=$1 tag=$2 d=$WORK/$2 backing=/dev/shm/flashtier-qd1r-$2.img
    serve_fresh "$bin" "$d" "$WORK/cache.img" "$backing" 512M
    local pid=$SERVER_PID
    fio --name=fill --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=write --bs=1M \
        --iodepth=4 --size=512M --output-format=json >/dev/null 2>&1
    local c0 c1
    c0=$(awk '{print $14+$15}' /proc/$pid/stat)
    reads "nbd+unix:///?socket=$d/s.sock" "$d/fio.json"
    c1=$(awk '{print $14+$15}' /proc/$pid/stat)
    kill $pid; wait $pid 2>/dev/null || true
    rm -f "$backing"
    report "$d/fio.json" "$tag" $((c1 - c0))
}

nbdkit_file() { # TAG
    local d=$WORK/$1
    rm -rf "$d"; mkdir -p "$d"
    nbdkit -U "$d/k.sock" -f file "$WORK/raw.img" cache=none &
    local pid=$!
    wait_socket "$d/k.sock"
    local c0 c1
    c0=$(awk '{print $14+$15}' /proc/$pid/stat)
    reads "nbd+unix:///?socket=$d/k.sock" "$d/fio.json"
    c1=$(awk '{print $14+$15}' /proc/$pid/stat)
    kill $pid; wait $pid 2>/dev/null || true
    report "$d/fio.json" "$1 (nbdkit file cache=none)" $((c1 - c0))
}

mkdir -p "$WORK"
if [ "$(stat -c %s "$WORK/raw.img" 2>/dev/null || echo 0)" != $((512 << 20)) ]; then
    dd if=/dev/zero of="$WORK/raw.img" bs=1M count=512 oflag=direct status=none
fi
if [ "$(stat -c %s "$WORK/cache.img" 2>/dev/null || echo 0)" != $((1 << 30)) ]; then
    dd if=/dev/zero of="$WORK/cache.img" bs=1M count=1024 oflag=direct status=none
fi
echo "QD1 4K random reads, every one a cache hit, $SECS s per round; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "A = $A ($("$A" --version 2>/dev/null | head -1)), B = $B ($("$B" --version 2>/dev/null | head -1))"
echo
echo "| round | reads/s | p50 µs | p99 µs | server CPU µs/read |"
echo "|---|---:|---:|---:|---:|"
for r in $(seq "$ROUNDS"); do
    reads "$WORK/raw.img" "$WORK/raw.json" psync
    report "$WORK/raw.json" "R$r (raw file)" -
    nbdkit_file "N$r"
    one "$A" "A$r"
    one "$B" "B$r"
done
echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

#!/bin/bash
# A database commit while the write-back cleaner drains a backlog: one line per run.
#
#   qd1_behind_cleaner.sh BIN LABEL [WORKDIR=/var/tmp/flashtier-qd1-cleaner]
#
# Formats a 2 GiB cache file in WORKDIR (on a disk: O_DIRECT) for a fresh 1 GiB backing file in
# /dev/shm, serves it write-back, runs 8 s of 4 KiB random writes at QD32 (about 2 GiB: the log
# wraps, and the cleaner has a backlog to drain), then 10 s of 4 KiB random write + FLUSH at QD1
# (fio --fsync=1) while the cleaner drains. Prints the commits/s, the write's and the FLUSH's
# p50/p99 (µs), the server's CPU µs per commit, and the blocks the cleaner wrote back in all.
# Run two builds alternately, several rounds.
set -euo pipefail
BIN=$1; L=$2; WORK=${3:-/var/tmp/flashtier-qd1-cleaner}
# shellcheck source=../../qd1_lib.sh
. "$(dirname "$0")/../../qd1_lib.sh"
D=$WORK/$L
mkdir -p "$WORK"
[ -f "$WORK/cache.img" ] || dd if=/dev/zero of="$WORK/cache.img" bs=1M count=2048 oflag=direct status=none
serve_fresh "$BIN" "$D" "$WORK/cache.img" /dev/shm/flashtier-qd1-cleaner.img 1G
PID=$SERVER_PID
trap 'kill $PID 2>/dev/null || true; rm -f /dev/shm/flashtier-qd1-cleaner.img' EXIT
URI="nbd+unix:///?socket=$D/s.sock"
fio --name=w --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 --size=1G \
    --time_based --runtime=8 --output-format=json >"$D/w.json" 2>/dev/null
C0=$(awk '{print $14+$15}' /proc/$PID/stat)
fio --name=q --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=1 --size=1G \
    --time_based --runtime=10 --fsync=1 --output-format=json >"$D/q.json" 2>/dev/null
C1=$(awk '{print $14+$15}' /proc/$PID/stat)
CLEANED=$("$BIN" stats --control "$D/c.sock" 2>/dev/null | awk '$1 == "cleaned_blocks" {print $2}')
python3 - "$D/q.json" "$C0" "$C1" "$L" "$(getconf CLK_TCK)" "${CLEANED:--}" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
w, s = job["write"], job["sync"]["lat_ns"]["percentile"]
p = w["clat_ns"]["percentile"]
cpu = (int(sys.argv[3]) - int(sys.argv[2])) * 1e6 / int(sys.argv[5]) / w["total_ios"]
print(f"{sys.argv[4]} commits/s {w['iops']:.0f} write p50 {p['50.000000'] / 1000:.0f} "
      f"p99 {p['99.000000'] / 1000:.0f} flush p50 {s['50.000000'] / 1000:.0f} "
      f"p99 {s['99.000000'] / 1000:.0f} cpu/commit {cpu:.0f} cleaned {sys.argv[6]}")
PY

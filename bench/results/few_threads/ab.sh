#!/bin/bash
# Builds side by side on 4K random I/O over NBD (fio's nbd engine), rounds alternating:
#
#   ab.sh MODE ROUNDS SECONDS BUILD...      (WORKDIR=/var/tmp/few-threads, QD=32, NJ=1)
#
# MODE:
#   hits         random reads over a warm 2 GiB write-back cache (1 GiB backing file in /dev/shm,
#                read through once first): every read hits. NJ=4 QD=16: four connections.
#   writes       random writes over 1 GiB through a fresh 2 GiB write-back cache each run (the log
#                starts to wrap near the end of 10 s).
#   misses-slow  random reads through a fresh 512 MiB cache over `nbdkit --filter=delay memory`
#                (2 ms a read, served in parallel): every read misses, and the IOPS say how many
#                misses were in flight.
#   misses-fast  the same over a file in /dev/shm: misses that take microseconds.
# Prints per run: IOPS, the server's CPU µs per I/O (utime+stime ÷ I/Os), fio's p50/p99 µs, and
# for the misses the server's hit and miss counters. The cache files live in WORKDIR (on the disk
# under test); each build's warm cache for `hits` is kept there between runs.
set -u
MODE=$1; R=$2; S=$3; shift 3
W=${WORKDIR:-/var/tmp/few-threads}; mkdir -p "$W"; cd "$W" || exit 1
QD=${QD:-32}; NJ=${NJ:-1}
P=; NP=
wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return; sleep 0.1; done; }
serve() { # BUILD BACKING CACHE
  rm -f ft.sock ft.ctl
  "$1" serve --backing "$2" --cache "$3" --mode writeback --set sequential_cutoff_read_kib=0 \
    --listen "$W/ft.sock" --control-socket "$W/ft.ctl" > "serve.log" 2>&1 &
  P=$!; wait_sock ft.sock; sleep 0.5
}
report() { # LABEL FIO_JSON CPU_TICKS EXTRA
  echo "$2" | /usr/bin/python3 -c "
import json,sys
t=sys.stdin.read(); d=json.loads(t[t.index('{'):]); j=d['jobs'][0]
j=j['read'] if j['read']['total_ios'] else j['write']; n=j['total_ios']; p=j['clat_ns']['percentile']
print('%s iops=%.0f cpu_us=%.1f p50=%.0f p99=%.0f %s'%('$1', j['iops'], $3*1e4/n, p['50.000000']/1000, p['99.000000']/1000, '$4'))"
}
counters() {
  "$1" stats --control "$W/ft.ctl" --json 2>/dev/null | /usr/bin/python3 -c "
import json,sys
def f(o,k):
  if isinstance(o,dict):
    for kk,v in o.items():
      if kk==k: return v
      r=f(v,k)
      if r is not None: return r
d=json.load(sys.stdin); print('hits', f(d,'read_hit_blocks'), 'misses', f(d,'read_miss_blocks'))"
}
for r in $(seq "$R"); do
  for b in "$@"; do
    name=$(basename "$b")
    case $MODE in
      hits)
        if [ ! -f "cache-$name.img" ]; then
          truncate -s 1G "/dev/shm/few-threads-$name.img"
          "$b" format --cache "cache-$name.img" --size 2G --backing "/dev/shm/few-threads-$name.img" --force --no-probe >/dev/null
          serve "$b" "/dev/shm/few-threads-$name.img" "cache-$name.img"
          for _ in 1 2 3; do fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$W/ft.sock" --rw=read --bs=1M --iodepth=4 --size=1G >/dev/null 2>&1; sleep 2; done
          kill $P; wait $P 2>/dev/null
        fi
        serve "$b" "/dev/shm/few-threads-$name.img" "cache-$name.img"
        rw=randread; size=1G; extra= ;;
      writes)
        [ -f wcache.img ] || dd if=/dev/zero of=wcache.img bs=1M count=2048 oflag=direct status=none
        rm -f /dev/shm/few-threads-w.img; truncate -s 1G /dev/shm/few-threads-w.img
        "$b" format --cache wcache.img --backing /dev/shm/few-threads-w.img --force --no-probe >/dev/null
        serve "$b" /dev/shm/few-threads-w.img wcache.img
        rw=randwrite; size=1G; extra= ;;
      misses-slow|misses-fast)
        if [ "$MODE" = misses-slow ]; then
          rm -f nbk.sock
          nbdkit --exit-with-parent -f -U "$W/nbk.sock" --filter=delay memory 4G rdelay=2ms >/dev/null 2>&1 &
          NP=$!; wait_sock nbk.sock
          backing="nbd+unix:///?socket=$W/nbk.sock"
        else
          rm -f /dev/shm/few-threads-m.img; truncate -s 4G /dev/shm/few-threads-m.img
          backing=/dev/shm/few-threads-m.img
        fi
        rm -f mcache.img; truncate -s 512M mcache.img
        "$b" format --cache mcache.img --backing "$backing" --force --no-probe >/dev/null
        serve "$b" "$backing" mcache.img
        rw=randread; size=4G; extra=counters ;;
      *) echo "unknown mode $MODE" >&2; exit 2 ;;
    esac
    c0=$(awk '{print $14+$15}' /proc/$P/stat)
    out=$(fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$W/ft.sock" --rw=$rw --bs=4k --iodepth="$QD" \
      --numjobs="$NJ" --group_reporting --size=$size --time_based --runtime="$S" --output-format=json)
    c1=$(awk '{print $14+$15}' /proc/$P/stat)
    more=; [ -n "$extra" ] && more=$(counters "$b")
    report "$r $MODE $name" "$out" "$((c1 - c0))" "$more"
    kill $P; wait $P 2>/dev/null
    if [ -n "$NP" ]; then kill $NP; wait $NP 2>/dev/null; NP=; fi
  done
done

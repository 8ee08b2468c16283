#!/bin/bash
# usage: writes.sh BIN ROUNDS: 4K random writes, fio nbd engine, QD32, one connection, 10 s over 1 GiB,
# alternating each round: flashtier write-back with its cache file on the disk, the same with the
# cache file in /dev/shm (a device with no latency and no per-I/O cost, not durable), and nbdkit's
# cache filter over a file on the disk (its temporary cache file on the disk, as bench/hotpath.py).
# Prints one line per run: IOPS and the server's CPU (utime+stime of all threads) per write.
set -e
BIN=$1; ROUNDS=${2:-3}
W=/var/tmp/instant; mkdir -p $W
disk_cache=$W/cache.img; shm_cache=/dev/shm/instant-cache.img; backing=/dev/shm/instant-backing.img
file_img=$W/file.img
[ -f $disk_cache ] || dd if=/dev/zero of=$disk_cache bs=1M count=2048 oflag=direct status=none
[ -f $file_img ] || dd if=/dev/zero of=$file_img bs=1M count=1024 oflag=direct status=none
cleanup() { rm -f $shm_cache $backing; }
trap cleanup EXIT
fio_on() { # sock -> prints "iops"
  fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$1" --rw=randwrite --bs=4k --iodepth=32 \
    --size=1G --time_based --runtime=10 --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]["write"]; print(j["iops"], j["total_ios"])'
}
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
wait_sock() { for i in $(seq 100); do [ -S $1 ] && return; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }
report() { # label pid-cpu0 pid-cpu1 "iops ios"
  read iops ios <<<"$4"
  python3 -c "print(f'$1: {float($iops):,.0f} writes/s, server CPU {($3-$2)*1e4/$ios:.1f} us/write')"
}
flashtier() { # label cache
  rm -f $backing; truncate -s 1G $backing
  [ "$2" = "$shm_cache" ] && { rm -f $shm_cache; truncate -s 2G $shm_cache; }
  rm -f $W/s.sock $W/c.sock
  $BIN format --cache $2 --backing $backing --force --no-probe >/dev/null 2>$W/format.err
  $BIN serve --backing $backing --cache $2 --mode writeback --listen $W/s.sock --control-socket $W/c.sock >"$W/serve.log" 2>&1 &
  local pid=$!; wait_sock $W/s.sock
  local c0=$(cpu $pid); local r=$(fio_on $W/s.sock); local c1=$(cpu $pid)
  kill $pid; wait $pid 2>/dev/null || true
  report "$1" $c0 $c1 "$r"
}
cachefilter() {
  sync; echo 3 > /proc/sys/vm/drop_caches
  mkdir -p $W/tmp; rm -f $W/n.sock
  TMPDIR=$W/tmp nbdkit -f -U $W/n.sock --filter=cache file $file_img cache=writeback cache-min-block-size=4K >$W/nbdkit.log 2>&1 &
  local pid=$!; wait_sock $W/n.sock
  local c0=$(cpu $pid); local r=$(fio_on $W/n.sock); local c1=$(cpu $pid)
  kill $pid; wait $pid 2>/dev/null || true
  report "nbdkit --filter=cache" $c0 $c1 "$r"
}
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  flashtier "flashtier, cache file on the disk" $disk_cache
  flashtier "flashtier, cache file in /dev/shm" $shm_cache
  cachefilter
done

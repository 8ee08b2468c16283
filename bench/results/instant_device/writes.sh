#!/bin/bash
# usage: writes.sh BIN ROUNDS: 4K random writes, fio nbd engine, QD32, one connection, 10 s over 1 GiB,
# alternating each round: flashtier write-back with its cache file on the disk, the same with the
# cache file in /dev/shm (a device with no latency and no per-I/O cost, not durable), and nbdkit's
# cache filter over a file on the disk (its temporary cache file on the disk, as bench/hotpath.py).
# Prints one line per run: IOPS and the server's CPU (utime+stime of all threads) per write.
set -e
BIN=$1; ROUNDS=${2:-3}
. "$(dirname "$0")/lib.sh"
file_img=$W/file.img
[ -f $file_img ] || dd if=/dev/zero of=$file_img bs=1M count=1024 oflag=direct status=none
trap 'rm -f $shm_cache $backing' EXIT
measure() { # label pid sock: one fio job on the server, then its line
  local c0 c1 n ios
  c0=$(cpu $2)
  read n ios < <(fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$3" --rw=randwrite --bs=4k --iodepth=32 \
    --size=1G --time_based --runtime=10 --output-format=json 2>/dev/null | fio_iops write)
  c1=$(cpu $2)
  kill $2; wait $2 2>/dev/null || true
  python3 -c "print(f'$1: {float($n):,.0f} writes/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/write')"
}
flashtier() { # label cache
  start_cache $2
  measure "$1" $pid $W/s.sock
}
cachefilter() {
  sync; echo 3 > /proc/sys/vm/drop_caches
  mkdir -p $W/tmp; rm -f $W/n.sock
  TMPDIR=$W/tmp nbdkit -f -U $W/n.sock --filter=cache file $file_img cache=writeback cache-min-block-size=4K >$W/nbdkit.log 2>&1 &
  local npid=$!; wait_sock $W/n.sock
  measure "nbdkit --filter=cache" $npid $W/n.sock
}
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  flashtier "flashtier, cache file on the disk" $disk_cache
  flashtier "flashtier, cache file in /dev/shm" $shm_cache
  cachefilter
done

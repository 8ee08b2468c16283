#!/bin/bash
# usage: reads.sh BIN ROUNDS: 4K random read hits, fio nbd engine, QD32, one connection, 10 s over
# 1 GiB of a fresh write-back cache warmed by reading it (1 MiB reads, promotions settled, repeated
# until a pass misses nothing, as bench/hotpath.py; nothing is dirty), alternating each round:
# the cache file on the disk, the cache file in /dev/shm, and fio io_uring O_DIRECT QD32 random
# reads of the disk's 2 GiB file itself. IOPS and the server's CPU per read.
set -e
BIN=$1; ROUNDS=${2:-3}
. "$(dirname "$0")/lib.sh"
trap 'rm -f $shm_cache $backing' EXIT
raw() {
  read n ios < <(fio --name=raw --ioengine=io_uring --direct=1 --filename=$disk_cache --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=10 --output-format=json 2>/dev/null | fio_iops read)
  python3 -c "print(f'raw file (io_uring O_DIRECT): {float($n):,.0f} reads/s')"
}
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  flashtier_read_hits "flashtier read hits, cache file on the disk" $disk_cache
  flashtier_read_hits "flashtier read hits, cache file in /dev/shm" $shm_cache
  raw
done

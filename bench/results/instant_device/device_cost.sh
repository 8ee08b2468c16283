#!/bin/bash
# usage: device_cost.sh [FILE]: what one I/O on the cache's disk costs the CPU that issues it, and
# what a second and fourth write in flight add: fio on FILE (default /var/tmp/instant/cache.img,
# 2 GiB, written first), 4 s a line. CPU per I/O = fio's usr+sys time ÷ I/Os.
F=${1:-/var/tmp/instant/cache.img}
[ -f $F ] || dd if=/dev/zero of=$F bs=1M count=2048 oflag=direct status=none
line() { # label, fio args...
  local label=$1; shift
  fio --name=d --direct=1 --filename=$F --size=2G --time_based --runtime=4 --output-format=json "$@" 2>/dev/null |
  python3 -c "
import json,sys;t=sys.stdin.read();J=json.loads(t[t.index('{'):])['jobs'][0]
j=J['write'] if J['write']['total_ios'] else J['read'];n=j['total_ios']
print(f'$label: {j[\"iops\"]:,.0f} I/Os/s, {j[\"bw\"]/1024:,.0f} MiB/s, p50 {j[\"clat_ns\"][\"percentile\"][\"50.000000\"]/1000:.0f} us, fio CPU {(J[\"usr_cpu\"]+J[\"sys_cpu\"])/100*J[\"job_runtime\"]*1000/n:.1f} us per I/O')"
}
line "psync O_DIRECT sequential writes 4 KiB QD1" --ioengine=psync --rw=write --bs=4k
line "psync O_DIRECT sequential writes 56 KiB QD1 (a log batch of 13 writes)" --ioengine=psync --rw=write --bs=56k
line "psync O_DIRECT sequential writes 256 KiB QD1" --ioengine=psync --rw=write --bs=256k
line "io_uring O_DIRECT sequential writes 56 KiB QD2" --ioengine=io_uring --rw=write --bs=56k --iodepth=2
line "io_uring O_DIRECT sequential writes 56 KiB QD4" --ioengine=io_uring --rw=write --bs=56k --iodepth=4
line "psync O_DIRECT random reads 4 KiB QD1" --ioengine=psync --rw=randread --bs=4k
line "io_uring O_DIRECT random reads 4 KiB QD32" --ioengine=io_uring --rw=randread --bs=4k --iodepth=32

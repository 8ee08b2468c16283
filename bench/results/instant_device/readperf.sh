#!/bin/bash
# usage: readperf.sh BIN CACHE OUT [serve args]: read hits as reads.sh (the cache warmed by reading it);
# perf record -g of the server for 5 s from the job's third second, then perf stat for 3 s
BIN=$1; cache=$2; OUT=$3; shift 3
. "$(dirname "$0")/lib.sh"
start_cache $cache --set sequential_cutoff_read_kib=0 "$@"
warm
fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$W/s.sock" --rw=randread --bs=4k --iodepth=32 --size=1G --time_based --runtime=14 --output-format=json > $OUT.fio.json 2>/dev/null &
fpid=$!
sleep 2
perf record -F 1999 -g -p $pid -o $OUT.perf.data -- sleep 5 >/dev/null 2>&1
perf stat -e context-switches,syscalls:sys_enter_io_uring_enter,syscalls:sys_enter_recvfrom,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg,syscalls:sys_enter_futex,syscalls:sys_enter_pread64,syscalls:sys_enter_poll -p $pid -- sleep 3 2> $OUT.stat.txt >/dev/null
wait $fpid
kill $pid; wait $pid 2>/dev/null
printf "reads/s %.0f\n" "$(fio_iops read < $OUT.fio.json | cut -d' ' -f1)"
rm -f $backing; case $cache in /dev/shm/*) rm -f $cache;; esac

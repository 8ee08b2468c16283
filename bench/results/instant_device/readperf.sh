#!/bin/bash
# usage: readperf.sh BIN CACHE OUT [serve args]: read hits as reads.sh (the cache warmed by reading it);
# perf record -g of the server for 5 s from the job's third second, then perf stat for 3 s
BIN=$1; cache=$2; OUT=$3; shift 3
W=/var/tmp/instant; backing=/dev/shm/instant-backing.img
rm -f $backing; truncate -s 1G $backing
case $cache in /dev/shm/*) rm -f $cache; truncate -s 2G $cache;; esac
rm -f $W/s.sock $W/c.sock
$BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>$W/format.err
$BIN serve --backing $backing --cache $cache --mode writeback --set sequential_cutoff_read_kib=0 --listen $W/s.sock --control-socket $W/c.sock "$@" >"$W/serve.log" 2>&1 &
pid=$!; for i in $(seq 100); do [ -S $W/s.sock ] && break; sleep 0.1; done
uri="nbd+unix:///?socket=$W/s.sock"
counter() { $BIN stats --control $W/c.sock --json | python3 -c "import json,sys; print(json.load(sys.stdin)['counters']['$1'])"; }
for p in 1 2 3 4; do
  before=$(counter read_miss_blocks); fio --name=warm --ioengine=nbd --uri="$uri" --rw=read --bs=1M --iodepth=4 --size=1G >/dev/null 2>&1
  last=$(counter promoted_blocks); while sleep 1; do now=$(counter promoted_blocks); [ "$now" = "$last" ] && break; last=$now; done
  [ "$before" = "$(counter read_miss_blocks)" ] && break
done
fio --name=r --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=32 --size=1G --time_based --runtime=14 --output-format=json > $OUT.fio.json 2>/dev/null &
sleep 2
perf record -F 1999 -g -p $pid -o $OUT.perf.data -- sleep 5 >/dev/null 2>&1
perf stat -e context-switches,syscalls:sys_enter_io_uring_enter,syscalls:sys_enter_recvfrom,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg,syscalls:sys_enter_futex,syscalls:sys_enter_pread64,syscalls:sys_enter_poll -p $pid -- sleep 3 2> $OUT.stat.txt >/dev/null
wait %2 2>/dev/null
kill $pid; wait $pid 2>/dev/null
python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]["read"]; print("reads/s", round(j["iops"]))' $OUT.fio.json
rm -f $backing; case $cache in /dev/shm/*) rm -f $cache;; esac

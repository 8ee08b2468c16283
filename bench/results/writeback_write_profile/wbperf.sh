#!/bin/bash
BIN=$1; d=/var/tmp/wb-perf; rm -rf $d; mkdir -p $d
cache=/var/tmp/wb-cache.img; backing=/dev/shm/wb-backing.img
rm -f $backing; truncate -s 1G $backing
$BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>$d/format.err
$BIN serve --backing $backing --cache $cache --mode writeback --listen $d/s.sock --control-socket $d/c.sock $EXTRA >$d/serve.log 2>&1 &
pid=$!
for i in $(seq 100); do [ -S $d/s.sock ] && break; sleep 0.1; done
fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json > $d/fio.json 2>/dev/null &
sleep 3
perf record -F 2000 -g -p $pid -o $d/perf.data -- sleep 5 2>/dev/null >/dev/null
perf stat -e context-switches,cpu-migrations -p $pid -- sleep 2 2>&1 | grep -E "context|migr"
wait %2 2>/dev/null
kill $pid; wait $pid 2>/dev/null

#!/bin/bash
# usage: wb.sh BIN TAG [serve args...]: 4K randwrite QD32 10 s over 1 GiB through a fresh 2 GiB write-back cache
set -e
BIN=$1; TAG=$2; shift 2
d=/var/tmp/wb-$TAG; rm -rf $d; mkdir -p $d
cache=/var/tmp/wb-cache.img; backing=/dev/shm/wb-backing.img
[ -f $cache ] || { dd if=/dev/zero of=$cache bs=1M count=2048 oflag=direct status=none; }
rm -f $backing; truncate -s 1G $backing
$BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>$d/format.err
$BIN serve --backing $backing --cache $cache --mode writeback --listen $d/s.sock --control-socket $d/c.sock "$@" >$d/serve.log 2>&1 &
pid=$!
for i in $(seq 100); do [ -S $d/s.sock ] && break; sleep 0.1; done
c0=$(awk '{print $14+$15}' /proc/$pid/stat)
fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json > $d/fio.json 2>/dev/null
c1=$(awk '{print $14+$15}' /proc/$pid/stat)
$BIN stats --control $d/c.sock --json > $d/stats.json 2>/dev/null || true
kill $pid; wait $pid 2>/dev/null || true
python3 - "$d" "$TAG" "$c0" "$c1" <<'PY'
import json,sys
d,tag,c0,c1=sys.argv[1],sys.argv[2],int(sys.argv[3]),int(sys.argv[4])
t=open(d+'/fio.json').read(); j=json.loads(t[t.index('{'):])['jobs'][0]['write']
ios=j['total_ios']; iops=j['iops']
st=json.load(open(d+'/stats.json'))
def find(o,k):
  if isinstance(o,dict):
    for kk,v in o.items():
      if kk==k: return v
      r=find(v,k)
      if r is not None: return r
cpu=(c1-c0)*1e6/100/ios
print(f"{tag}: {iops:,.0f} writes/s, server CPU {cpu:.1f} us/write, backing_writes {find(st,'backing_writes')}, moved {find(st,'moved_blocks')}, checkpoints {find(st,'checkpoints')}, batches {find(st,'batches')}, records {find(st,'records')}, syncs {find(st,'cache_syncs')}, writes {find(st,'writes')}, batched_writes {find(st,'batched_writes')}")
PY

# Sourced by this directory's scripts (they set BIN, flashtier's binary): where the files go, and
# the steps they share.
W=/var/tmp/instant; mkdir -p $W
disk_cache=$W/cache.img; shm_cache=/dev/shm/instant-cache.img; backing=/dev/shm/instant-backing.img
[ -f $disk_cache ] || dd if=/dev/zero of=$disk_cache bs=1M count=2048 oflag=direct status=none

# utime+stime of process $1, in clock ticks
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
wait_sock() { for i in $(seq 100); do [ -S $1 ] && return; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }
# fio's JSON on stdin -> "IOPS IOS" of side $1 (read or write)
fio_iops() { python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0][sys.argv[1]]; print(j["iops"], j["total_ios"])' $1; }
# counter $1 of the flashtier server started by start_cache
counter() { $BIN stats --control $W/c.sock --json | python3 -c "import json,sys; print(json.load(sys.stdin)['counters']['$1'])"; }

# Formats cache file $1 (a fresh 2 GiB one when it is in /dev/shm) over a fresh 1 GiB backing file
# in /dev/shm and starts a write-back server on it with the serve arguments after it; sets pid.
start_cache() {
  local cache=$1; shift
  rm -f $backing; truncate -s 1G $backing
  case $cache in /dev/shm/*) rm -f $cache; truncate -s 2G $cache;; esac
  rm -f $W/s.sock $W/c.sock
  $BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>$W/format.err
  $BIN serve --backing $backing --cache $cache --mode writeback --listen $W/s.sock --control-socket $W/c.sock "$@" >"$W/serve.log" 2>&1 &
  pid=$!; wait_sock $W/s.sock
}

# Reads the 1 GiB working set through the server (1 MiB reads) until a pass misses nothing, at most
# 4 passes, each followed by promotions unchanged for 1 s (bench/benchlib.py's
# flashtier_wait_promotions), as bench/hotpath.py warms its cache; sets passes.
warm() {
  local before last now i
  for passes in 1 2 3 4; do
    before=$(counter read_miss_blocks)
    fio --name=warm --ioengine=nbd --uri="nbd+unix:///?socket=$W/s.sock" --rw=read --bs=1M --iodepth=4 --size=1G >/dev/null 2>&1
    last=$(counter promoted_blocks); i=0
    while sleep 1; do now=$(counter promoted_blocks); [ "$now" = "$last" ] && break; last=$now; i=$((i+1)); [ $i -ge 60 ] && break; done
    [ "$before" = "$(counter read_miss_blocks)" ] && break
  done
}

# One line: 10 s of 4K random read hits at QD32 from a fresh cache in file $2, warmed by reading.
flashtier_read_hits() {
  local label=$1 n ios c0 c1 h0 m0
  start_cache $2 --set sequential_cutoff_read_kib=0
  warm
  h0=$(counter read_hit_blocks); m0=$(counter read_miss_blocks); c0=$(cpu $pid)
  read n ios < <(fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$W/s.sock" --rw=randread --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json 2>/dev/null | fio_iops read)
  c1=$(cpu $pid)
  local hm="$(( $(counter read_hit_blocks) - h0 )) $(( $(counter read_miss_blocks) - m0 ))"
  kill $pid; wait $pid 2>/dev/null || true
  python3 -c "print(f'$label: {float($n):,.0f} reads/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/read (hit, miss blocks during it: $hm; $passes warm passes)')"
}

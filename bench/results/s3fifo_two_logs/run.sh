#!/bin/bash
# The runs behind README.md, in the order they were made (one simulation at a time; about 25
# minutes in all on the 2-CPU machine). Each appends its rows to $OUT (results.jsonl here).
# Traces: /var/tmp/s48-oltp.iolog (`flashtier trace to-fio /var/tmp/oltp-full.ft ...`), and the
# zipf sequences made by `twologsim.py gen-zipf` (commands in README.md).
set -e
cd "$(dirname "$0")"
OUT=${OUT:-/var/tmp/s48-results.jsonl}
run() { /usr/bin/python3 twologsim.py run "$@" --out "$OUT"; }
OLTP=/var/tmp/s48-oltp.iolog
Z9="/var/tmp/s48-zipf0.9.npy --segments 254 --warm 1500000 --cold 1000000"
Z6="/var/tmp/s48-zipf0.6.npy --segments 254 --warm 1500000 --cold 1000000"

# 1. the grid: baselines, the design as briefed (S 10/20%, write = access or not, M victim
#    fifo/greedy/cost-benefit, cap 75/50%), and a few extra knobs
V="lru s3fifo onelog"
for s in 0.1 0.2; do for v in fifo greedy cb; do V="$V two:s=$s,refw=0,victim=$v,cap=0.75"; done; done
for s in 0.1 0.2; do for v in fifo greedy cb; do for c in 0.75 0.5; do
  V="$V two:s=$s,refw=1,victim=$v,cap=$c"
done; done; done
V="$V two:s=0.3,refw=1,victim=cb,cap=0.75 two:s=0.2,refw=1,victim=cb,cap=0.75,fmax=3 two:s=0.2,refw=1,victim=cb,cap=0.75,mghost=1"
V="$V two:s=0.1,refw=1,victim=cb,cap=0.75,mcompact=0.75 two:s=0.2,refw=1,victim=cb,cap=0.75,mcompact=0.75"
V="$V two:s=0.2,refw=1,victim=cb,cap=0.75,mcompact=0.9 two:s=0.2,refw=1,victim=fifo,cap=0.75,mcompact=0.75"
run $OLTP --segments 76 $V
run $OLTP --segments 38 $V
run $Z9 $V
run $Z6 $V

# 2. S may fill free space before the cache is full (sfill), 2-bit frequencies, M compaction,
#    a smaller reserve, batch headers (1 per 60 client blocks on oltp, 1 per 8 on zipf)
base="two:refw=1,victim=cb,cap=0.75"
V2() { echo "$base,s=0.2,fmax=3,sfill=1 $base,s=0.1,mcompact=0.75,sfill=1 $base,s=0.1,mcompact=0.75,fmax=3,sfill=1 $base,s=0.2,mcompact=0.9,fmax=3,sfill=1 $base,s=0.1,mcompact=0.9,fmax=3,sfill=1 $base,s=0.1,mcompact=0.75,fmax=3,sfill=1,lowdiv=64 $base,s=0.1,mcompact=0.75,fmax=3,sfill=1,hdr=$1 $base,s=0.2,mcompact=0.9,fmax=3,sfill=1,hdr=$1"; }
run $OLTP --segments 76 $(V2 60)
run $OLTP --segments 38 $(V2 60)
run $Z9 $(V2 8)
run $Z6 $(V2 8)

# 3. the one-log model at compaction 0.9, the best two-log variant with headers, and exact LRU
#    and S3-FIFO holding only the live shares measured above
E="$base,s=0.1,mcompact=0.9,fmax=3,sfill=1"
run $OLTP --segments 76 onelog:thr=0.9 $E,hdr=60 lru:frac=0.777 lru:frac=0.642 lru:frac=0.812 s3fifo:frac=0.642 s3fifo:frac=0.812
run $OLTP --segments 38 onelog:thr=0.9 $E,hdr=60 lru:frac=0.730 lru:frac=0.583 lru:frac=0.784 s3fifo:frac=0.583 s3fifo:frac=0.784
run $Z9 onelog:thr=0.9 $E,hdr=8 lru:frac=0.821 lru:frac=0.733 lru:frac=0.856 s3fifo:frac=0.733 s3fifo:frac=0.856
run $Z6 onelog:thr=0.9 $E,hdr=8 lru:frac=0.861 lru:frac=0.840 lru:frac=0.901 s3fifo:frac=0.840 s3fifo:frac=0.901

# 4. how much of the capacity exact S3-FIFO needs to match exact LRU's full-capacity miss ratio
run $OLTP --segments 76 s3fifo:frac=0.9 s3fifo:frac=0.95
run $OLTP --segments 38 s3fifo:frac=0.85 s3fifo:frac=0.9

#!/bin/bash
# A/B of compaction keeping only frequent clean blocks (FT_EXP_FREQ) on the eviction rows.
cd /work/main
for r in 1 2; do
  for v in base on; do
    B=/var/tmp/s50/bin/freq; [ $v = on ] && B=/var/tmp/s50/bin/freq-on
    python3 bench/eviction.py --only oltp,zipf0.9,hot+scan --no-replay --oltp-trace /var/tmp/oltp-full.ft \
      --flashtier $B --workdir /var/tmp/s50/evwork --out /var/tmp/s50/ev-$v-r$r > /var/tmp/s50/ev-$v-r$r.log 2>&1
  done
done
echo done > /var/tmp/s50/evab.done

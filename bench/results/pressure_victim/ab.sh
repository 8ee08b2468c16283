#!/bin/bash
# A/B/C: reclaim's victim while writers wait for space: the policy's (base), the sparsest
# (greedy), LFS cost-benefit (cb). FT_EXP_PV in trial build pv; base = the same build, unset.
cd /work/main
for r in 1 2; do
  for v in base greedy cb; do
    B=/var/tmp/s50/bin/pv; [ $v != base ] && B=/var/tmp/s50/bin/pv-$v
    python3 bench/eviction.py --only oltp,zipf0.9 --no-replay --oltp-trace /var/tmp/oltp-full.ft \
      --flashtier $B --workdir /var/tmp/s50/pvwork --out /var/tmp/s50/pv-$v-r$r > /var/tmp/s50/pv-$v-r$r.log 2>&1
  done
done
echo done > /var/tmp/s50/pvab.done

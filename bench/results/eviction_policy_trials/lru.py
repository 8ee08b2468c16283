"""Exact LRU on the same block accesses as logsim.py, at shares of the oltp@50% row's capacity
(77,824 blocks): python3 lru.py IOLOG 1.0,0.9,0.78"""
import sys, collections
from logsim import load  # same directory
ops = load(sys.argv[1])
for frac in [float(x) for x in sys.argv[2].split(',')]:
    cap = int(77824*frac)
    d = collections.OrderedDict(); r=m=0
    for o in ops:
        lba = abs(o)-1
        if o>0:
            r+=1
            if lba in d: d.move_to_end(lba)
            else:
                m+=1; d[lba]=1
        else:
            if lba in d: d.move_to_end(lba)
            else: d[lba]=1
        if len(d)>cap: d.popitem(last=False)
    print(f"LRU cap {frac:.2f}: miss {m/r:.3f}", flush=True)

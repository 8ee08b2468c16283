import sys, numpy as np
sys.path.insert(0,'/var/tmp/adm')
from sim import sim
N=1<<20; n=1_000_000
rng=np.random.default_rng(1)
for theta in (0.6,0.9,1.2):
    w=1.0/np.arange(1,N+1)**theta; w/=w.sum()
    ranks=rng.choice(N,size=n,p=w)
    perm=rng.permutation(N)
    blocks=perm[ranks]
    ops=np.where(rng.random(n)<0.7,'r','w')
    acc=list(zip(ops.tolist(),blocks.tolist()))
    cap=262144
    res=[('lru',sim(acc,cap,'lru'))]+[(f'filter g{g}',sim(acc,cap,'filter',g)) for g in (0.5,1,2)]
    print(theta, '  '.join(f'{a} {r*100:.1f}%' for a,r in res), flush=True)

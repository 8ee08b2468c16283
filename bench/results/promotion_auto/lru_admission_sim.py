import sys
from collections import OrderedDict
def load(path):
    acc=[]
    for line in open(path):
        p=line.split()
        if len(p)!=5 or p[2] not in ('read','write','trim'): continue
        off=int(p[3]); ln=int(p[4])
        b0=off//4096; b1=(off+ln+4095)//4096
        op=p[2][0]
        for b in range(b0,b1): acc.append((op,b))
    return acc
def sim(acc, cap, policy, ghost_mult=1.0, warm=True):
    c=OrderedDict(); ghost=OrderedDict(); G=int(cap*ghost_mult)
    reads=miss=0; evicted_ever=False
    for op,b in acc:
        if op=='t':
            c.pop(b,None); continue
        if op=='w':
            if b in c: c.move_to_end(b)
            else:
                c[b]=1
                if len(c)>cap: c.popitem(last=False); evicted_ever=True
            continue
        reads+=1
        if b in c:
            c.move_to_end(b); continue
        miss+=1
        admit=True
        if policy=='filter':
            if warm and not evicted_ever: admit=True
            elif b in ghost: del ghost[b]; admit=True
            else:
                admit=False; ghost[b]=1
                if len(ghost)>G: ghost.popitem(last=False)
        if admit:
            c[b]=1
            if len(c)>cap: c.popitem(last=False); evicted_ever=True
    return miss/reads
if __name__=='__main__':
    acc=load(sys.argv[1])
    print(len(acc),'block accesses', sum(1 for o,_ in acc if o=='r'),'reads')
    for cap in [int(x) for x in sys.argv[2].split(',')]:
        res=[('lru',sim(acc,cap,'lru'))]
        for g in (0.5,1,2,4):
            res.append((f'filter g{g}',sim(acc,cap,'filter',g)))
        print(cap, '  '.join(f'{n} {r*100:.1f}%' for n,r in res), flush=True)

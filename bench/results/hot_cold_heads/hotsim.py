"""Hot/cold separation of client writes in logsim's model: a write to a block written within the
last D client block-writes goes to a head of its own ('h'), so copies that die young share
segments and empty them together.

    python3 hotsim.py IOLOG SEGMENTS THRESHOLD D_IN_CACHE_FRACTIONS [KEYWORDS]
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'eviction_policy_trials'))
import logsim  # noqa: E402

class HSim(logsim.Sim):
    def __init__(s, *a, dfrac=0.25, movesep=False, **kw):
        super().__init__(*a, **kw)
        s.heads['h'] = None
        s.lastw = {}
        s.wn = 0
        s.D = int(dfrac * s.N * s.S) if dfrac > 0 else -1
        s.movesep = movesep
        s.hot_writes = 0

    def head_for(s, which):
        if which == 'm' and not s.movesep:
            return 'c'
        return which

    def step(s, i, o):
        if o < 0:
            s.t = i
            lba = -o - 1
            s.wn += 1
            prev = s.lastw.get(lba)
            s.lastw[lba] = s.wn
            hot = prev is not None and s.wn - prev <= s.D
            s.hot_writes += hot
            s.append(lba, 'h' if hot else 'c', ref=s.refw)
            return None
        return super().step(i, o)

if __name__ == '__main__':
    ops = logsim.load(sys.argv[1])
    nseg = int(sys.argv[2]); thr = float(sys.argv[3])
    kw = eval('dict(' + (sys.argv[5] if len(sys.argv) > 5 else '') + ')')
    for d in [float(x) for x in sys.argv[4].split(',')]:
        sim = HSim(nseg, 1024, thr, 'single', dfrac=d, **kw)
        mr, avg, end, mv, ev = sim.run(ops)
        print(kw, f"nseg={nseg} thr={thr} D={d}: miss {mr:.3f} live avg {avg:.3f} moves/op {mv/len(ops):.2f} evicts {ev} hot writes {sim.hot_writes}", flush=True)

"""Stop 50's model of compaction keeping only frequently accessed blocks (see ../README.md).

    python3 freqsim.py IOLOG SEGMENTS THRESHOLD [KEYWORDS]

e.g. `python3 freqsim.py /var/tmp/oltp.iolog 76 0.75 "fmin=2,where='comp'"`; KEYWORDS: fmin (the
count kept from), where ('comp': compaction drops what is counted less; 'pol': policy victims also
keep what is counted at least fmin; 'both'; 'none': the base), window (halving period in cache
sizes, default 10), countw (writes count, default True), compref (compaction also keeps blocks
with the referenced bit).

logsim.Sim plus a decayed frequency count per block (TinyLFU-style, exact here): reclaim keeps
a block by its frequency over a long window instead of (or beside) the one-trip referenced bit."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'eviction_policy_trials'))
import logsim  # noqa: E402

class FSim(logsim.Sim):
    def __init__(s, *a, fmin=2, window=10.0, where='both', countw=True, compref=False, **kw):
        super().__init__(*a, **kw)
        s.freq = {}
        s.fmin, s.where, s.countw, s.compref = fmin, where, countw, compref
        s.window = int(window * s.N * s.S)
        s.since = 0

    def touch(s, lba):
        s.freq[lba] = min(s.freq.get(lba, 0) + 1, 15)
        s.since += 1
        if s.since >= s.window:
            s.since = 0
            s.freq = {k: v >> 1 for k, v in s.freq.items() if v >> 1}

    def step(s, i, o):
        lba = (-o if o < 0 else o) - 1
        if o > 0 or s.countw:
            s.touch(lba)
        return super().step(i, o)

    def keep(s, l):
        return s.freq.get(l, 0) >= s.fmin

    def compaction_keeps(s, l):
        return (s.where not in ('comp', 'both') or s.keep(l) or (s.compref and s.ref[l]))

    def policy_keeps(s, l):
        return s.ref[l] or (s.where in ('pol', 'both') and s.keep(l))

if __name__ == '__main__':
    ops = logsim.load(sys.argv[1])
    nseg = int(sys.argv[2]); thr = float(sys.argv[3])
    kw = eval('dict(' + (sys.argv[4] if len(sys.argv) > 4 else '') + ')')
    sim = FSim(nseg, 1024, thr, 'single', **kw)
    mr, avg, end, mv, ev = sim.run(ops)
    print(kw, f"nseg={nseg} thr={thr}: miss {mr:.3f} live avg {avg:.3f} moves/op {mv/len(ops):.2f} evicts {ev} compdrops {sim.compaction_drops}", flush=True)

"""A rough model of flashtier's log on a block trace, used to guess which reclaim changes might
lower the miss ratio before building them (see README.md: its guesses did not hold in the engine).

    python3 logsim.py IOLOG SEGMENTS BLOCKS_PER_SEGMENT THRESHOLDS MODES [KEYWORDS]

IOLOG is `flashtier trace to-fio`'s output; THRESHOLDS the compaction thresholds (e.g. 0.75,0.9);
MODES `single` (one log head) and/or `sep` (reclaim's moves in a second head); KEYWORDS e.g.
`refw=True,keepcap=0.75` (a write sets the referenced bit; a policy victim copies up to that
share of a segment), `cclear=True` (compaction clears the bit), `admit=True` (promote on a
second miss only), `lowdiv=64` (reserve of 3 + segments/64). Reclaim is instantaneous and
quarantine free (no checkpoints), every block clean, time counted in block accesses.
"""
import sys, collections, array

def load(path):
    ops = array.array('q')  # +lba+1 read, -(lba+1) write
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) != 5 or p[2] not in ('read', 'write'):
                continue
            off, ln = int(p[3]), int(p[4])
            a, b = off // 4096, (off + ln - 1) // 4096
            for blk in range(a, b + 1):
                ops.append(blk + 1 if p[2] == 'read' else -(blk + 1))
    return ops

class Sim:
    def __init__(s, nseg, S, thr, mode, K=4, keepcap=0.5, refw=False, cclear=False, admit=False, lowdiv=32):
        s.keepcap, s.refw, s.admit, s.cclear = keepcap, refw, admit, cclear
        s.ghost = collections.OrderedDict()
        s.N, s.S, s.thr, s.mode, s.K = nseg, S, thr, mode, K
        s.loc = {}  # lba -> slot (seg*S+i)
        s.slot_lba = [-1] * (nseg * S)
        s.live = [0] * nseg
        s.ref = {}  # lba -> referenced
        s.state = ['F'] * nseg
        s.free = collections.deque(range(nseg))
        s.heads = {'c': None, 'm': None}  # seg, used
        s.last = [0] * nseg
        s.t = 0
        s.RES = 2
        s.low = 3 + nseg // lowdiv
        s.target = s.low + 1 + nseg // 64
        s.moves = s.appends = s.evicts = s.compaction_drops = 0
        s.pending = []
        s.in_reclaim = False

    def open_head(s, which):
        seg = s.free.popleft()
        s.state[seg] = 'O'
        s.last[seg] = s.t
        s.heads[which] = [seg, 0]
        if len(s.free) <= s.low and not s.in_reclaim:
            s.reclaim()

    def kill(s, lba):
        old = s.loc.pop(lba, None)
        if old is not None:
            s.slot_lba[old] = -1
            s.live[old // s.S] -= 1

    def head_for(s, which):
        """The head a block asked for `which` ('c' client, 'm' reclaim's moves) goes to."""
        return which if s.mode == 'sep' else 'c'

    def append(s, lba, which='c', ref=False):
        which = s.head_for(which)
        h = s.heads[which]
        while h is None or h[1] == s.S:
            if h is not None:
                s.state[h[0]] = 'S'
            s.open_head(which)
            h = s.heads[which]
        s.kill(lba)
        slot = h[0] * s.S + h[1]
        h[1] += 1
        s.loc[lba] = slot
        s.slot_lba[slot] = lba
        s.live[h[0]] += 1
        s.ref[lba] = ref
        s.appends += 1

    def blocks(s, seg):
        base = seg * s.S
        return [l for l in s.slot_lba[base:base + s.S] if l >= 0]

    def reclaim(s):
        s.in_reclaim = True
        while len(s.free) < s.target:
            sealed = [g for g in range(s.N) if s.state[g] == 'S']
            if not sealed:
                break
            sp = min(sealed, key=lambda g: s.live[g])
            if s.live[sp] <= s.thr * s.S and len(s.free) > s.RES:
                for l in s.blocks(sp):
                    if s.compaction_keeps(l):
                        s.move(l, s.ref[l] and not s.cclear)
                    else:
                        s.kill(l); s.evicts += 1; s.compaction_drops += 1
                s.state[sp] = 'F'; s.free.append(sp)
                continue
            v = min(sealed, key=lambda g: (s.live[g] > 0, s.last[g]))
            kept = 0
            for l in s.blocks(v):
                if s.policy_keeps(l) and kept < s.S * s.keepcap and len(s.free) > 0:
                    s.move(l, False); kept += 1
                else:
                    s.kill(l); s.evicts += 1
            s.state[v] = 'F'; s.free.append(v)
        s.in_reclaim = False

    def compaction_keeps(s, l):
        """Whether compaction copies `l` forward (else evicts it): always, here."""
        return True

    def policy_keeps(s, l):
        """Whether a policy victim copies `l` forward, room allowing: read since cached."""
        return s.ref[l]

    def move(s, l, r):
        s.moves += 1
        s.append(l, 'm', r)

    def step(s, i, o):
        """Access number i: +(lba+1) a read, -(lba+1) a write. A read's hit (True) or miss
        (False); None for a write."""
        s.t = i
        if o < 0:
            s.append(-o - 1, ref=s.refw)
            return None
        lba = o - 1
        slot = s.loc.get(lba)
        if slot is None:
            if s.admit and lba not in s.ghost:
                s.ghost[lba] = 1
                if len(s.ghost) > s.N * s.S:
                    s.ghost.popitem(last=False)
            else:
                s.append(lba)
            return False
        s.ref[lba] = True
        s.last[slot // s.S] = i
        return True

    def run(s, ops, sample=20000):
        reads = misses = 0
        lives = []
        n = len(ops)
        for i in range(n):
            hit = s.step(i, ops[i])
            if hit is not None:
                reads += 1
                misses += not hit
            if i % sample == 0 and i > n // 4:
                lives.append(len(s.loc) / (s.N * s.S))
        return misses / reads, sum(lives) / len(lives), len(s.loc) / (s.N * s.S), s.moves, s.evicts

if __name__ == '__main__':
    ops = load(sys.argv[1])
    print(len(ops), 'block ops', file=sys.stderr)
    nseg = int(sys.argv[2]); S = int(sys.argv[3])
    kw = eval('dict(' + (sys.argv[6] if len(sys.argv) > 6 else '') + ')')
    for mode in sys.argv[5].split(','):
        for thr in [float(x) for x in sys.argv[4].split(',')]:
            sim = Sim(nseg, S, thr, mode, **kw)
            mr, avg, end, mv, ev = sim.run(ops)
            print(kw, f"nseg={nseg} S={S} mode={mode} thr={thr}: miss {mr:.3f} live avg {avg:.3f} end {end:.3f} moves/op {mv/len(ops):.2f} evicts {ev}", flush=True)

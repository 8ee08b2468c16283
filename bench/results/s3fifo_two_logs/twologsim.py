"""S3-FIFO on two logs of segments: a simulation of a reclaim design for flashtier's cache device,
beside exact LRU, exact S3-FIFO and stop 39's one-log model, on the same block accesses.

    python3 twologsim.py gen-zipf THETA OUT.npy [--blocks 1048576] [--accesses 5500000]
                                                [--read-pct 70] [--seed 1]
    python3 twologsim.py run TRACE --segments N [--bps 1024] [--warm W] [--cold C]
                                   [--out RESULTS.jsonl] VARIANT [VARIANT ...]

TRACE is a `flashtier trace to-fio` iolog (every 4 KiB block a request touches is one access, as
in `../eviction_policy_trials/logsim.py`) or an .npy array from gen-zipf (+(block+1) a read,
-(block+1) a write). The capacity is N segments of --bps blocks. Read misses are counted from
access W on (--warm; 0 counts the whole trace, as the engine's and `flashtier advise`'s figures
do); --cold C also reports the miss ratio over the first C accesses from an empty cache.

VARIANTs:
  lru[:frac=F]        exact LRU of N*bps blocks (F times that); a write is an access (as
                      `flashtier advise`)
  s3fifo[:frac=F]     exact S3-FIFO of N*bps blocks (F times that), a port of `flashtier advise`'s
                      (crates/flashtier/src/advise/policies.rs): small FIFO 10%, ghost of the main
                      FIFO's size, 2-bit frequency; a write is an access
  onelog[:k=v,...]    stop 39's one-log model, `../eviction_policy_trials/logsim.py`'s Sim class
                      unchanged (default keywords: keepcap=0.5, refw=False; thr=0.75, mode single),
                      driven access by access (its `step`), counting from --warm and sampling the
                      live share like the two-log model
  two[:k=v,...]       the two-log design below; keywords (defaults in brackets):
      s=0.1           S's share of the segments (rounded, at least 1; its open head counts)
      refw=0          1: a client write over a cached block counts as an access (the new copy
                      gets the old copy's frequency + 1), and so does a write of a block in the
                      ghost (frequency 1); 0: a written copy starts at frequency 0
      victim=fifo     M's victim when free segments run low: fifo (oldest sealed M segment),
                      greedy (least live), cb (cost-benefit: max (1-u)*age/(1+u), age in accesses
                      since the segment was opened)
      cap=0.75        a victim of M copies forward at most cap*bps referenced blocks; the rest of
                      its referenced blocks are dropped with the unreferenced ones
      fmax=1          frequency ceiling (1 = a referenced bit; 3 = S3-FIFO's 2-bit counter; M
                      reinsertion decrements it, S->M copies reset it to 0)
      ghost=1.0       ghost FIFO entries, as a share of the capacity in blocks
      mghost=0        1: blocks M drops also enter the ghost (S3-FIFO's don't)
      mcompact=0      >0: before a policy victim, compact the sparsest sealed M segment if it is
                      at most this share live (copy all its blocks, bits kept), as the engine's
                      reclaim_compact_pct does
      hdr=0           >0: one log slot per hdr client-appended blocks goes to a batch header
                      (stale space); reclaim's copies are left without headers
      sfill=0         1: S may grow past its share while free segments last (as exact S3-FIFO
                      evicts nothing before the cache is full); S's oldest segment is reclaimed,
                      while S is over its share, when free segments run low, before M's victims
      lowdiv=32       the reserve: reclaim of M starts when a segment opened leaves at most
                      low = 3 + N//lowdiv free (RESERVE 2 + 1 + N/32) and stops at
                      target = low + 1 + N//64 free, as logsim.py's low/target

The two-log design. Every segment is free, or belongs to the small log S or the main log M, each
with its own open head. Every client write and every read miss is appended to S's head, except a
read miss of a block in the ghost FIFO, which goes to M's head. A read hit raises the block's
frequency (to fmax). When S's head fills and S would hold more than its share, S's oldest sealed
segment is reclaimed whole: blocks with frequency >= 1 are copied to M's head (frequency reset),
the others dropped into the ghost, and the segment is free at once (FREE records: freeing costs
nothing). When a segment opened leaves `low` or fewer free, M reclaims victims until `target` are
free: a victim's referenced blocks (up to the cap) go to M's head with their frequency less one,
the rest are dropped. A write over a cached block makes the old copy stale wherever it is.

Modelled: slot-level occupancy of the device (live, stale, free segments, the unused rest of the
two open heads), so the live share is what the layout leaves; copies and appends as device
writes. Not modelled: time (reclaim is instant, no checkpoint or quarantine waits, no reclaim
speed, no queue depth; time is the access count), dirty data (every block is clean and may be
dropped; the report counts the dropped blocks whose last copy came from a client write, i.e.
how many copies dirty data would force if nothing had been written back), partial-block writes
(a block a write touches is written whole), trims, the RAM tier, promotion=auto/nhit (every read
miss is admitted), and, unless hdr is set, batch headers. The one-log model has the same limits
(see its docstring).

Each run prints and appends one JSON object to --out: miss ratio (from --warm), the cold-start
ratio (--cold), for the log models the mean live share of the capacity and its complement
(free segments, open heads' unused slots, stale slots) sampled every 4096 accesses from
max(--warm, a quarter of the trace) on, and device writes (client writes + read-miss admissions +
copies [+ headers]) per client block written.
"""
import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'eviction_policy_trials'))
import logsim  # noqa: E402  stop 39's one-log model, used unchanged

SAMPLE = 4096


def load(path):
    """The access list: +(block+1) a read, -(block+1) a write."""
    if path.endswith('.npy'):
        import numpy as np
        return np.load(path).tolist()
    return logsim.load(path).tolist()


def gen_zipf(theta, nblocks, n, read_pct, seed):
    """fio-like 4K randrw: zipf(theta) ranks over nblocks blocks, ranks mapped to blocks by a
    random permutation (fio hashes them), each access a read with probability read_pct%."""
    import numpy as np
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, nblocks + 1, dtype=np.float64) ** theta
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n), side='right')
    ranks = np.minimum(ranks, nblocks - 1)
    perm = rng.permutation(nblocks)
    blocks = perm[ranks].astype(np.int64) + 1
    reads = rng.random(n) < read_pct / 100.0
    return np.where(reads, blocks, -blocks)


def drive(ops, warm, cold, step, sample=None, samp_from=0):
    """Runs `step(i, o)` over the accesses (a read's hit or miss as True or False, None for a
    write) and counts read misses from access `warm` on, and over the first `cold` accesses
    (`cold_miss`); calls `sample()` every SAMPLE accesses from `samp_from` on."""
    reads = misses = r0 = m0 = cr = cm = 0
    for i, o in enumerate(ops):
        if i == cold:
            cr, cm = reads, misses
        if i == warm:
            r0, m0 = reads, misses
        hit = step(i, o)
        if hit is not None:
            reads += 1
            misses += not hit
        if sample is not None and i >= samp_from and i % SAMPLE == 0:
            sample()
    if cold >= len(ops):
        cr, cm = reads, misses
    res = {'miss': (misses - m0) / max(1, reads - r0), 'reads': reads - r0, 'misses': misses - m0}
    if cold:
        res['cold_miss'] = cm / max(1, cr)
    return res


def run_lru(ops, cap, warm, cold):
    d = collections.OrderedDict()

    def step(i, o):
        lba = o if o > 0 else -o
        if lba in d:
            d.move_to_end(lba)
            hit = True
        else:
            d[lba] = 1
            if len(d) > cap:
                d.popitem(last=False)
            hit = False
        return hit if o > 0 else None

    return drive(ops, warm, cold, step)


class S3Fifo:
    """A port of flashtier advise's S3Fifo (policies.rs), with per-block stamps."""

    def __init__(s, capacity):
        s.capacity = capacity
        s.small_cap = max(1, capacity // 10)
        s.small = collections.deque()
        s.main = collections.deque()
        s.small_len = s.main_len = 0
        s.held = {}  # block -> [stamp, freq, main]
        s.ghost = collections.deque()
        s.ghosts = {}
        s.ghost_cap = max(1, capacity - s.small_cap)
        s.stamp = 0

    def insert(s, b, main):
        s.stamp += 1
        s.held[b] = [s.stamp, 0, main]
        if main:
            s.main.append((b, s.stamp))
            s.main_len += 1
        else:
            s.small.append((b, s.stamp))
            s.small_len += 1

    def pop_live(s, q):
        held = s.held
        while q:
            b, st = q.popleft()
            e = held.get(b)
            if e is not None and e[0] == st:
                return b
        return None

    def remember(s, b):
        s.stamp += 1
        s.ghosts[b] = s.stamp
        s.ghost.append((b, s.stamp))
        while len(s.ghosts) > s.ghost_cap:
            g, st = s.ghost.popleft()
            if s.ghosts.get(g) == st:
                del s.ghosts[g]

    def evict(s):
        if s.small_len >= s.small_cap or s.main_len == 0:
            b = s.pop_live(s.small)
            if b is None:
                return
            s.small_len -= 1
            e = s.held[b]
            if e[1] >= 1:
                s.insert(b, True)
            else:
                del s.held[b]
                s.remember(b)
        else:
            b = s.pop_live(s.main)
            if b is None:
                return
            s.stamp += 1
            e = s.held[b]
            if e[1] > 0:
                e[1] -= 1
                e[0] = s.stamp
                s.main.append((b, s.stamp))
            else:
                del s.held[b]
                s.main_len -= 1

    def access(s, b):
        e = s.held.get(b)
        if e is not None:
            if e[1] < 3:
                e[1] += 1
            return True
        while len(s.held) >= s.capacity:
            s.evict()
        ghost = s.ghosts.pop(b, None) is not None
        s.insert(b, ghost)
        return False


def run_s3fifo(ops, cap, warm, cold):
    c = S3Fifo(cap)

    def step(i, o):
        hit = c.access(o if o > 0 else -o)
        return hit if o > 0 else None

    return drive(ops, warm, cold, step)


def run_onelog(ops, nseg, bps, warm, cold, thr=0.75, mode='single', **kw):
    """logsim.Sim unchanged, driven access by access (its `step`), counting from `warm`, with the
    cold-start ratio and the live share and its complement sampled like the two-log model's."""
    s = logsim.Sim(nseg, bps, thr, mode, **kw)
    C = nseg * bps
    acc = [0.0, 0.0, 0.0, 0]

    def sample():
        heads = sum(s.S - h[1] for h in s.heads.values() if h is not None)
        acc[0] += len(s.loc) / C
        acc[1] += len(s.free) * bps / C
        acc[2] += heads / C
        acc[3] += 1

    res = drive(ops, warm, cold, s.step, sample, max(warm, len(ops) // 4))
    ns = acc[3]
    writes = sum(1 for o in ops if o < 0)
    res.update({'live': acc[0] / ns, 'free': acc[1] / ns, 'heads': acc[2] / ns,
                'stale': 1 - (acc[0] + acc[1] + acc[2]) / ns,
                # logsim counts appends (client writes + admissions + its moves) and moves
                'dev_per_write': s.appends / max(1, writes),
                'copies_per_write': s.moves / max(1, writes)})
    return res


class TwoLog:
    def __init__(s, nseg, bps, nblk, s_frac=0.1, refw=0, victim='fifo', cap=0.75, fmax=1,
                 ghost=1.0, mghost=0, mcompact=0.0, hdr=0, lowdiv=32, sfill=0):
        s.N, s.B = nseg, bps
        s.C = nseg * bps
        s.smax = max(1, int(round(s_frac * nseg)))
        s.refw, s.victim, s.fmax = refw, victim, fmax
        s.capn = int(cap * bps)
        s.mghost, s.mcompact, s.hdr, s.sfill = mghost, mcompact, hdr, sfill
        s.RES = 2
        s.low = 3 + nseg // lowdiv
        s.target = s.low + 1 + nseg // 64
        s.slot = [-1] * s.C
        s.live = [0] * nseg
        s.owner = [0] * nseg  # 0 free, 1 S, 2 M
        s.opened = [0] * nseg
        s.free = collections.deque(range(nseg))
        s.sfifo = collections.deque()  # sealed S segments, oldest first
        s.mlist = collections.deque()  # sealed M segments, oldest first
        s.loc = [-1] * nblk
        s.freq = bytearray(nblk)
        s.dirty = bytearray(nblk)
        s.gseq = [0] * nblk
        s.gcount = 0
        s.G = int(ghost * s.C)
        s.heads = [None, None, None]  # index 1: S's [seg, used], 2: M's
        s.in_m = False
        s.t = 0
        s.nlive = 0
        s.client_appends = 0
        s.copies_s = s.copies_m = s.copies_c = 0
        s.drops_s = s.drops_m = 0
        s.dirty_drops = 0
        s.ghost_hits = 0
        s.headers = 0
        s.mreclaims = 0
        s.capped = 0

    def new_head(s, log):
        h = s.heads[log]
        if h is not None:
            (s.sfifo if log == 1 else s.mlist).append(h[0])
            s.heads[log] = None
        if log == 1 and not s.sfill:
            while s.sfifo and len(s.sfifo) + 1 > s.smax:
                s.reclaim_s()
        assert s.free, 'no free segment'
        seg = s.free.popleft()
        s.owner[seg] = log
        s.opened[seg] = s.t
        h = [seg, 0]
        s.heads[log] = h
        if len(s.free) <= s.low and not s.in_m:
            s.reclaim_m()
        return s.heads[log]

    def append(s, lba, log, f):
        h = s.heads[log]
        while h is None or h[1] >= s.B:
            # (a reclaim that opening a head started may have filled the next head already)
            h = s.new_head(log)
        old = s.loc[lba]
        if old >= 0:
            s.slot[old] = -1
            s.live[old // s.B] -= 1
        else:
            s.nlive += 1
        seg = h[0]
        sl = seg * s.B + h[1]
        h[1] += 1
        s.slot[sl] = lba
        s.loc[lba] = sl
        s.live[seg] += 1
        s.freq[lba] = f

    def client_append(s, lba, log, f):
        s.append(lba, log, f)
        s.client_appends += 1
        if s.hdr and s.client_appends % s.hdr == 0:
            h = s.heads[log]
            if h[1] < s.B:
                h[1] += 1
                s.headers += 1

    def drop(s, lba, to_ghost):
        sl = s.loc[lba]
        s.slot[sl] = -1
        s.live[sl // s.B] -= 1
        s.loc[lba] = -1
        s.nlive -= 1
        if s.dirty[lba]:
            s.dirty_drops += 1
            s.dirty[lba] = 0
        if to_ghost:
            s.gcount += 1
            s.gseq[lba] = s.gcount

    def free_seg(s, seg):
        assert s.live[seg] == 0
        s.owner[seg] = 0
        s.free.append(seg)

    def reclaim_s(s):
        seg = s.sfifo.popleft()
        base = seg * s.B
        slot, freq = s.slot, s.freq
        for i in range(base, base + s.B):
            lba = slot[i]
            if lba < 0:
                continue
            if freq[lba] >= 1:
                s.copies_s += 1
                s.append(lba, 2, 0)
            else:
                s.drops_s += 1
                s.drop(lba, True)
        s.free_seg(seg)

    def pick_m(s):
        ml = s.mlist
        if s.victim == 'fifo':
            return ml.popleft()
        live = s.live
        if s.victim == 'greedy':
            v = min(ml, key=lambda g: live[g])
        else:  # cost-benefit
            B, t, opened = s.B, s.t, s.opened
            v = max(ml, key=lambda g: (1 - live[g] / B) * (t - opened[g] + 1) / (1 + live[g] / B))
        ml.remove(v)
        return v

    def reclaim_m(s):
        s.in_m = True
        slot, freq, B = s.slot, s.freq, s.B
        while len(s.free) < s.target and (s.mlist or s.sfifo):
            if s.sfill and s.sfifo and (len(s.sfifo) + 1 > s.smax or not s.mlist):
                s.reclaim_s()
                continue
            if not s.mlist:
                break
            if s.mcompact:
                sp = min(s.mlist, key=lambda g: s.live[g])
                if s.live[sp] <= s.mcompact * B and len(s.free) > s.RES:
                    s.mlist.remove(sp)
                    for i in range(sp * B, sp * B + B):
                        lba = slot[i]
                        if lba >= 0:
                            s.copies_c += 1
                            s.append(lba, 2, freq[lba])
                    s.free_seg(sp)
                    continue
            v = s.pick_m()
            s.mreclaims += 1
            kept = 0
            for i in range(v * B, v * B + B):
                lba = slot[i]
                if lba < 0:
                    continue
                f = freq[lba]
                if f >= 1 and kept < s.capn:
                    kept += 1
                    s.copies_m += 1
                    s.append(lba, 2, f - 1)
                else:
                    if f >= 1:
                        s.capped += 1
                    s.drops_m += 1
                    s.drop(lba, s.mghost)
            s.free_seg(v)
        s.in_m = False

    def check(s):
        """The bookkeeping agrees with itself."""
        B = s.B
        assert sum(s.live) == s.nlive == sum(1 for x in s.slot if x >= 0)
        for g in range(s.N):
            assert s.live[g] == sum(1 for x in s.slot[g * B:(g + 1) * B] if x >= 0)
        for sl, lba in enumerate(s.slot):
            assert lba < 0 or s.loc[lba] == sl
        assert len(s.free) + len(s.sfifo) + len(s.mlist) + sum(h is not None for h in s.heads) == s.N
        assert all(s.live[g] == 0 for g in s.free)

    def step(s, i, o):
        """Access number i: +(lba+1) a read, -(lba+1) a write. A read's hit (True) or miss
        (False); None for a write."""
        loc, freq, gseq, fmax, G = s.loc, s.freq, s.gseq, s.fmax, s.G
        s.t = i
        if o > 0:
            lba = o - 1
            if loc[lba] >= 0:
                if freq[lba] < fmax:
                    freq[lba] += 1
                return True
            g = gseq[lba]
            if g and g > s.gcount - G:
                gseq[lba] = 0
                s.ghost_hits += 1
                s.client_append(lba, 2, 0)
            else:
                s.client_append(lba, 1, 0)
            return False
        lba = -o - 1
        f = 0
        if s.refw:
            if loc[lba] >= 0:
                f = min(freq[lba] + 1, fmax)
            else:
                g = gseq[lba]
                if g and g > s.gcount - G:
                    gseq[lba] = 0
                    f = 1
        s.dirty[lba] = 1
        s.client_append(lba, 1, f)
        return None

    def run(s, ops, warm, cold):
        C, B = s.C, s.B
        acc = [0.0, 0.0, 0.0, 0]

        def sample():
            heads = sum(B - h[1] for h in s.heads[1:] if h is not None)
            acc[0] += s.nlive / C
            acc[1] += len(s.free) * B / C
            acc[2] += heads / C
            acc[3] += 1

        res = drive(ops, warm, cold, s.step, sample, max(warm, len(ops) // 4))
        s.check()
        ns = acc[3]
        writes = sum(1 for o in ops if o < 0)
        copies = s.copies_s + s.copies_m + s.copies_c
        res.update({'live': acc[0] / ns, 'free': acc[1] / ns, 'heads': acc[2] / ns,
                    'stale': 1 - (acc[0] + acc[1] + acc[2]) / ns,
                    'dev_per_write': (s.client_appends + copies + s.headers) / max(1, writes),
                    'copies_per_write': copies / max(1, writes),
                    'copies_s': s.copies_s, 'copies_m': s.copies_m, 'copies_c': s.copies_c,
                    'drops_s': s.drops_s, 'drops_m': s.drops_m, 'capped': s.capped,
                    'dirty_drops': s.dirty_drops,
                    'dirty_drops_per_write': s.dirty_drops / max(1, writes),
                    'ghost_hits': s.ghost_hits, 'headers': s.headers, 'mreclaims': s.mreclaims,
                    'smax': s.smax, 'low': s.low, 'target': s.target})
        return res


def parse_variant(v):
    name, _, rest = v.partition(':')
    kw = {}
    for part in filter(None, rest.split(',')):
        k, _, val = part.partition('=')
        try:
            val = int(val)
        except ValueError:
            try:
                val = float(val)
            except ValueError:
                pass
        kw[k] = val
    return name, kw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='cmd', required=True)
    g = sub.add_parser('gen-zipf')
    g.add_argument('theta', type=float)
    g.add_argument('out')
    g.add_argument('--blocks', type=int, default=1 << 20)
    g.add_argument('--accesses', type=int, default=5_500_000)
    g.add_argument('--read-pct', type=float, default=70)
    g.add_argument('--seed', type=int, default=1)
    r = sub.add_parser('run')
    r.add_argument('trace')
    r.add_argument('--segments', type=int, required=True)
    r.add_argument('--bps', type=int, default=1024)
    r.add_argument('--warm', type=int, default=0)
    r.add_argument('--cold', type=int, default=0)
    r.add_argument('--out')
    r.add_argument('variants', nargs='+')
    a = ap.parse_args()
    if a.cmd == 'gen-zipf':
        import numpy as np
        ops = gen_zipf(a.theta, a.blocks, a.accesses, a.read_pct, a.seed)
        np.save(a.out, ops)
        print(f'{a.out}: {len(ops)} accesses, {(ops > 0).sum()} reads, '
              f'{len(np.unique(np.abs(ops)))} distinct blocks', file=sys.stderr)
        return
    t0 = time.time()
    ops = load(a.trace)
    nblk = max(abs(o) for o in ops) + 1
    print(f'{a.trace}: {len(ops)} accesses loaded in {time.time() - t0:.0f} s', file=sys.stderr)
    cap = a.segments * a.bps
    for v in a.variants:
        name, kw = parse_variant(v)
        t0 = time.time()
        if name == 'lru':
            res = run_lru(ops, int(cap * kw.get('frac', 1.0)), a.warm, a.cold)
        elif name == 's3fifo':
            res = run_s3fifo(ops, int(cap * kw.get('frac', 1.0)), a.warm, a.cold)
        elif name == 'onelog':
            res = run_onelog(ops, a.segments, a.bps, a.warm, a.cold, **kw)
        elif name == 'two':
            if 's' in kw:
                kw['s_frac'] = kw.pop('s')
            res = TwoLog(a.segments, a.bps, nblk, **kw).run(ops, a.warm, a.cold)
        else:
            sys.exit(f'unknown variant {v}')
        res.update(trace=os.path.basename(a.trace), segments=a.segments, bps=a.bps, warm=a.warm,
                   cold=a.cold, variant=v, seconds=round(time.time() - t0, 1))
        line = json.dumps(res)
        print(line, flush=True)
        if a.out:
            with open(a.out, 'a') as f:
                f.write(line + '\n')


if __name__ == '__main__':
    main()

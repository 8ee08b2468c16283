import json,sys
for p in sys.argv[1:]:
    d=json.load(open(p+'/eviction.json'))
    for r in d['rows']:
        c=r['counters']
        print(p.split('/')[-1], r['workload'][:14], 'miss %.1f live %.1f evict %d moved %d ckpt %s devWA %.2f secs %.0f segs_freed %s' % (100*r['flashtier_miss_ratio'], 100*r['live_fraction'], r['evicted_blocks'], r['moved_blocks'], c.get('checkpoints'), r['device_write_amplification'], r['seconds'], c.get('freed_segments')))

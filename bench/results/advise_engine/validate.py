import json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "/work/main/bench")
import benchlib as bl
binary = Path(sys.argv[1]); dist = sys.argv[2]; d = Path(sys.argv[3])
d.mkdir(parents=True, exist_ok=True)
backing = d / "backing.img"
with open(backing, "wb") as f: f.truncate(4 << 30)
cache = d / "cache.img"
if cache.exists(): cache.unlink()
trace = d / "trace.ft"
if trace.exists(): trace.unlink()
bl.flashtier_format(binary, cache, str(backing), 1 << 30)
sock, ctl = d / "nbd.sock", d / "ctl.sock"
srv = bl.flashtier_serve(binary, str(backing), sock, d / "serve.log",
    extra=["--cache", str(cache), "--control-socket", str(ctl), "--trace", str(trace)])
t0 = time.time()
subprocess.run(["fio", "--name=w", "--ioengine=nbd", f"--uri={srv.uri}", "--bs=4k", "--iodepth=16",
    "--norandommap", "--randrepeat=1", "--rw=randrw", "--rwmixread=70", f"--random_distribution={dist}",
    "--size=4g", "--number_ios=1000000", "--output=/dev/null"], check=True)
secs = time.time() - t0
st = json.loads(subprocess.run([str(binary), "stats", "--json", "--control", str(ctl)], capture_output=True, text=True, check=True).stdout)
srv.stop()
c = st["windows"]["total"]; s = st["status"]
reads = c["read_hit_blocks"] + c["read_miss_blocks"]
print(f"server: miss {c['read_miss_blocks']/reads:.4f} live {s['cached_blocks']/s['capacity_blocks']:.3f} capacity {s['capacity_blocks']} batches {c['batches']} records {c['records']} ghost {c.get('ghost_hit_blocks')} {secs:.0f}s", flush=True)
out = subprocess.run([str(binary), "advise", str(trace), "--sample", "1", "--json", "--engine",
    "--sizes", str(s["capacity_blocks"] * 4096), "--scratch-dir", str(d)], capture_output=True, text=True, check=True).stdout
row = json.loads(out)["curve"][0]
print("advise:", json.dumps(row))

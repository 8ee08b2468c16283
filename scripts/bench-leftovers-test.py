#!/usr/bin/env python3
"""The benchmarks' work-directory claim (bench/benchlib.py, claim_workdir), against the failure it
exists for: a run killed with its storage stack up (nbdkit, nbdfuse, a loop device, ext4 mounted)
leaves the mounts behind, and the next run on that directory must take them down and go on, while a
run still alive must keep a second one out. Needs root, nbdkit, nbdfuse, losetup and mkfs.ext4.

Usage: scripts/bench-leftovers-test.py (exit status 0 when both hold). With --child DIR it is the
run that gets killed: it claims DIR, brings its stack up, prints "up" and sleeps."""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import benchlib as bl  # noqa: E402


def child(work: Path):
    bl.claim_workdir(work)
    run = work / "run"
    run.mkdir()
    sock = run / "nbd.sock"
    server = bl.Server("nbdkit", ["nbdkit", "-U", sock, "-f", "--exit-with-parent", "memory", "64M"],
                       sock, f"nbd+unix:///?socket={sock}", run / "nbdkit.log")
    stack = bl.FuseLoop(server.uri, run / "fuse", 64 << 20, run / "nbdfuse.log")
    subprocess.run(["mkfs.ext4", "-q", stack.dev], check=True)
    stack.mount(run / "mnt")
    print("up", flush=True)
    time.sleep(600)


def main():
    if sys.argv[1:2] == ["--child"]:
        return child(Path(sys.argv[2]))
    bl.require("nbdkit", "nbdfuse", "fusermount3", "losetup", "mkfs.ext4")
    work = Path(tempfile.mkdtemp(prefix="flashtier-leftovers-", dir="/var/tmp"))
    failures = []
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(work)], stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "up":
            sys.exit(f"the child run did not bring its stack up (exit status {proc.wait()})")
        second = subprocess.run([sys.executable, "-c", f"import benchlib; benchlib.claim_workdir("
                                 f"__import__('pathlib').Path({str(work)!r}))"],
                                cwd=Path(bl.__file__).parent, capture_output=True, text=True)
        if second.returncode == 0 or "another benchmark is running" not in second.stderr:
            failures.append(f"a second claim while the first run lives: exit {second.returncode}, "
                            f"{second.stderr.strip()!r}")
    finally:
        proc.kill()  # SIGKILL: no cleanup runs, as when a session is lost
        proc.wait()
    before = (bl._mounts_under(work), bl._loops_under(work))
    if not before[0] or not before[1]:
        failures.append(f"the killed run left no mount or loop device to clear: {before}")
    bl.claim_workdir(work)
    after = (bl._mounts_under(work), bl._loops_under(work))
    if after[0] or after[1]:
        failures.append(f"left after the claim: {after}")
    else:
        subprocess.run(["rm", "-rf", str(work)], check=True)
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    if failures:
        sys.exit(1)
    print(f"ok: a killed run's {len(before[0])} mounts and {len(before[1])} loop device(s) cleared; "
          "a live run's directory refused")


if __name__ == "__main__":
    main()

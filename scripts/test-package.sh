#!/usr/bin/env bash
# The Debian package, end to end: builds it (scripts/build-deb.sh), installs it with dpkg -i,
# checks the installed binary, man pages, completions, config and systemd unit, then purges it
# and checks that nothing it installed is left. Needs root; refuses to run where flashtier is
# already installed (from a package or by hand), so it never clobbers a real installation.
# ./test.sh runs it after the Rust tests.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "test-package.sh: FAILED: $*" >&2; exit 1; }
check() { printf '  %-68s' "$1"; shift; if out=$("$@" 2>&1); then echo ok; else echo FAILED; printf '%s\n' "$out" >&2; exit 1; fi; }

[ "$(id -u)" -eq 0 ] || fail "needs root (dpkg -i)"
if grep -Eqs '^path-exclude[= ]+/usr/share/man' /etc/dpkg/dpkg.cfg /etc/dpkg/dpkg.cfg.d/*; then
    fail "dpkg is configured not to install man pages (path-exclude in /etc/dpkg/dpkg.cfg.d, as in slim container images): the man page checks cannot pass here"
fi
if dpkg-query -W -f='${db:Status-Abbrev}' flashtier 2>/dev/null | grep -q '^.[^n]'; then
    fail "the flashtier package is installed on this machine; this test installs and purges its own (dpkg -P flashtier first, if that one can go)"
fi
for p in /usr/bin/flashtier /etc/flashtier /usr/lib/systemd/system/flashtier@.service /lib/systemd/system/flashtier@.service; do
    [ ! -e "$p" ] || fail "$p exists (flashtier installed by hand?); this test would overwrite and then remove it"
done

deb=$(./scripts/build-deb.sh | tail -1)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "package: $deb"

files=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ { sub(/^\./, "", $6); print $6 }')
purge() { dpkg -P flashtier >/dev/null 2>&1 || true; }
trap purge EXIT
dpkg -i "$deb" >/dev/null

echo "installed; checking:"
check "Depends: shared libraries only, not the test tools" bash -c '
    deps=$(dpkg-query -W -f="\${Depends}" flashtier)
    echo "Depends: $deps"
    grep -q "libc6" <<<"$deps" && grep -q "libssl3" <<<"$deps" &&
    ! grep -Eq "nbdkit|qemu|fio|mariadb|sysbench|prometheus|libnbd" <<<"$deps"'
check "/usr/bin/flashtier --version names commit $commit" bash -c \
    "/usr/bin/flashtier --version | tee /dev/stderr | grep -q '(git $commit, built '"
check "man -w flashtier, flashtier-serve, flashtier-config-check" \
    man -w flashtier flashtier-serve flashtier-config-check
check "man flashtier-serve documents --endurance-tbw" bash -c \
    'MANWIDTH=80 man flashtier-serve 2>/dev/null | grep -q -- "--endurance-tbw"'
check "man pages gzipped, one per subcommand" bash -c '
    n=$(ls /usr/share/man/man1/flashtier*.1.gz | wc -l); echo "$n pages"; [ "$n" -ge 17 ]'
check "bash completion loads and completes 'flashtier se'" bash -c '
    source /usr/share/bash-completion/completions/flashtier
    complete -p flashtier
    COMP_WORDS=(flashtier se); COMP_CWORD=1; COMP_LINE="flashtier se"; COMP_POINT=12
    _flashtier flashtier se flashtier
    [ "${COMPREPLY[*]}" = "serve set" ]'
check "zsh completion parses, in zsh's vendor fpath" bash -c '
    zsh -n /usr/share/zsh/vendor-completions/_flashtier &&
    zsh -fc "print -l \$fpath" | grep -qx /usr/share/zsh/vendor-completions'
check "fish completes 'flashtier se' from vendor_completions.d" bash -c '
    fish -n /usr/share/fish/vendor_completions.d/flashtier.fish &&
    fish -c "complete -C \"flashtier se\"" | cut -f1 | sort | tr "\n" " " | grep -q "^serve set $"'
check "/etc/flashtier/example.toml: a conffile, config check passes" bash -c '
    dpkg-query -W -f="\${Conffiles}" flashtier | grep -q " /etc/flashtier/example.toml " &&
    /usr/bin/flashtier config check /etc/flashtier/example.toml >/dev/null'
# verify needs an instance of the template; the unit's ExecStart binary and Documentation man
# pages must exist (they are checked). Any message at all fails the check.
check "Grafana dashboard and alert rules in /usr/share/flashtier" bash -c '
    python3 -m json.tool /usr/share/flashtier/grafana/flashtier.json >/dev/null &&
    promtool check rules /usr/share/flashtier/prometheus/flashtier-rules.yml'
check "systemd-analyze verify flashtier@pkgtest.service" bash -c '
    out=$(systemd-analyze verify flashtier@pkgtest.service 2>&1); rc=$?
    printf "%s\n" "$out"; [ $rc -eq 0 ] && [ -z "$out" ]'
check "the unit: Type=notify, the instance's config, hardening" bash -c '
    u=$(systemctl cat flashtier@pkgtest.service 2>/dev/null || cat /usr/lib/systemd/system/flashtier@.service)
    grep -qx "Type=notify" <<<"$u" &&
    grep -q "^ExecStart=/usr/bin/flashtier serve --config /etc/flashtier/%i.toml " <<<"$u" &&
    grep -qx "CapabilityBoundingSet=CAP_DAC_OVERRIDE CAP_CHOWN" <<<"$u" &&
    grep -qx "RuntimeDirectory=flashtier/%i" <<<"$u"'

# What systemd would run for flashtier@pkgtest, run here (this machine has no running systemd
# to start it): ExecStart from the installed unit, %i expanded, its RuntimeDirectory made as
# systemd would, NOTIFY_SOCKET a socket of ours. READY=1 must come, `flashtier status` must show
# the installed version, and SIGTERM must bring STOPPING=1 and exit 0.
work=$(mktemp -d /var/tmp/flashtier-pkgtest.XXXXXX)
run_made=0; [ -e /run/flashtier ] || run_made=1
cleanup_instance() {
    rm -f /etc/flashtier/pkgtest.toml
    rm -rf /run/flashtier/pkgtest "$work"
    if [ "$run_made" = 1 ]; then rmdir /run/flashtier 2>/dev/null || true; fi
}
trap 'cleanup_instance; purge' EXIT
truncate -s 16M "$work/backing"
printf '[serve]\nbacking = "%s"\nlisten = "/run/flashtier/pkgtest/nbd.sock"\n' "$work/backing" \
    > /etc/flashtier/pkgtest.toml
mkdir -p -m 0755 /run/flashtier/pkgtest
check "the unit's ExecStart: READY=1, status shows the version, STOPPING=1" \
    python3 - "$work" <<'PY'
import os, re, shlex, signal, socket, subprocess, sys
work = sys.argv[1]
unit = open("/usr/lib/systemd/system/flashtier@.service").read()
cmd = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1).replace("%i", "pkgtest"))
print("ExecStart:", cmd)
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.bind(os.path.join(work, "notify"))
notify.settimeout(20)
env = dict(os.environ, NOTIFY_SOCKET=os.path.join(work, "notify"))
server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "log"), "w"))
try:
    ready = notify.recv(4096).decode()
    assert "READY=1" in ready.splitlines(), ready
    version = subprocess.run(["/usr/bin/flashtier", "--version"], capture_output=True, text=True, check=True).stdout.split(" ", 1)[1].strip()
    status = subprocess.run(["/usr/bin/flashtier", "status", "--control", "/run/flashtier/pkgtest/control.sock"], capture_output=True, text=True, check=True).stdout
    assert any(l.split(None, 1) == ["version", version] for l in status.splitlines()), status
    server.send_signal(signal.SIGTERM)
    stopping = notify.recv(4096).decode()
    assert "STOPPING=1" in stopping.splitlines(), stopping
    assert server.wait(timeout=30) == 0, open(os.path.join(work, "log")).read()
finally:
    if server.poll() is None:
        server.kill()
        server.wait()
PY
cleanup_instance
trap purge EXIT

dpkg -P flashtier >/dev/null
trap - EXIT
echo "purged; checking nothing is left:"
check "dpkg knows no flashtier package" bash -c \
    '! dpkg-query -W -f="\${db:Status-Abbrev}" flashtier 2>/dev/null | grep -q "^.[^n]"'
check "no file the package installed remains, nor /etc/flashtier" bash -c '
    left=0
    for f in $0; do [ ! -e "$f" ] || { echo "left: $f"; left=1; }; done
    [ ! -e /etc/flashtier ] || { echo "left: /etc/flashtier"; left=1; }
    exit $left' "$files"
echo "test-package.sh: all checks passed"

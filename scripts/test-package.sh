#!/usr/bin/env bash
# The Debian package, end to end: builds it (scripts/build-deb.sh), installs it with dpkg -i,
# checks the installed binary, man pages, completions, config and systemd unit, then purges it
# and checks that nothing it installed is left. Needs root; refuses to run where flashtier is
# already installed (from a package or by hand), so it never clobbers a real installation.
# ./test.sh runs it after the Rust tests.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "test-package.sh: FAILED: $*" >&2; exit 1; }
check() { printf '  %-62s' "$1"; shift; if out=$("$@" 2>&1); then echo ok; else echo FAILED; printf '%s\n' "$out" >&2; exit 1; fi; }

[ "$(id -u)" -eq 0 ] || fail "needs root (dpkg -i)"
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

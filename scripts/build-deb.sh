#!/usr/bin/env bash
# Builds flashtier's Debian package with cargo-deb and prints its path (the last line):
# TARGET/debian/flashtier_VERSION-1_ARCH.deb, TARGET being cargo's target directory.
#
#   ./scripts/build-deb.sh && sudo dpkg -i "$(./scripts/build-deb.sh | tail -1)"
#
# The release build is reused when current (./test.sh has made it by then). The man pages and
# completions are generated from the binary's own command line definition
# (`flashtier generate`) into TARGET/release/flashtier-generated/, where the package metadata
# (crates/flashtier/Cargo.toml, [package.metadata.deb]) takes them from. Needs cargo-deb
# (scripts/install-deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."

target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target" ] || { echo "build-deb.sh: cannot find cargo's target directory" >&2; exit 1; }

cargo build --release --locked -p flashtier >&2
bin="$target/release/flashtier"
gen="$target/release/flashtier-generated"
rm -rf "$gen"
"$bin" generate man "$gen/man" >/dev/null
# Debian policy: man pages gzipped (cargo-deb compresses only assets it did not build); -n
# keeps names and times out, for a reproducible package.
gzip -9n "$gen"/man/*.1
"$bin" generate completions "$gen/completions" >/dev/null

# --strip: the release profile keeps line tables for the tests' backtraces; the installed
# binary does without them (a quarter of the size).
out=$(cargo deb -p flashtier --no-build --locked --strip --quiet)
deb=$(printf '%s\n' "$out" | grep '\.deb$' | tail -1)
[ -f "$deb" ] || { printf 'build-deb.sh: cargo deb made no package:\n%s\n' "$out" >&2; exit 1; }
echo "$deb"

#!/usr/bin/env bash
# flashtier's whole test suite, from a fresh machine: installs what the tests need (Debian
# packages, cargo-fuzz, cargo-deb), then checks formatting and lints, runs unit and integration
# tests against real tools (nbdinfo, qemu-img, qemu-io, nbdcopy, fio, nbdfuse + loop + ext4),
# runs the OLTP benchmark briefly (bench/oltp.py --quick: MariaDB + sysbench on each storage
# stack), builds, installs, checks and purges the Debian package, and fuzzes the protocol parsers
# briefly.
#
#   ./test.sh           the default run (CI runs exactly this)
#   ./test.sh --long    also the long soak and crash runs
#
# Integration tests need root (loop devices, mount) and /dev/fuse.
set -euo pipefail
cd "$(dirname "$0")"

long=0
for arg in "$@"; do
    case "$arg" in
        --long) long=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "test.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done

step() { printf '\n==> %s\n' "$*"; }

step "installing test dependencies"
./scripts/install-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "engine modules without circles (scripts/module-cycles.py)"
./scripts/module-cycles.py --self-test
./scripts/module-cycles.py --allow scripts/module-cycles.allow

step "unit and integration tests"
export FLASHTIER_LONG=$long
cargo test --workspace --locked --release -- --test-threads="${FLASHTIER_TEST_THREADS:-2}"

step "benchmarks clear what a killed run left in their work directory (scripts/bench-leftovers-test.py)"
./scripts/bench-leftovers-test.py

step "OLTP benchmark, quick validation: MariaDB + sysbench on ext4 over each storage stack (bench/oltp.py --quick)"
# The release binary the tests just built; results go to /tmp/flashtier-bench-quick, never bench/results.
FLASHTIER_BIN="${CARGO_TARGET_DIR:-target}/release/flashtier" ./bench/oltp.py --quick

step "Debian package: build, install, check binary, man pages, completions, unit; purge"
./scripts/test-package.sh

step "fuzzing the protocol parsers and on-device decoders briefly"
./fuzz/run.sh "${FLASHTIER_FUZZ_SECONDS:-20}"

step "all tests passed"

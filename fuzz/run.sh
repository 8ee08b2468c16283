#!/usr/bin/env bash
# Fuzzes flashtier's NBD protocol code and on-device format decoders briefly: builds every cargo-fuzz
# target, then runs each for its share of SECONDS (SECONDS / number of targets, at least 5),
# starting from the committed seeds in fuzz/corpus/<target>/.
# Fails if any target crashes, printing where libFuzzer saved the input that did it.
#
#   ./fuzz/run.sh [SECONDS]     default 60
#
# Toolchain: cargo-fuzz needs nightly features. A nightly toolchain is used when rustup has one;
# otherwise the default (stable) toolchain with RUSTC_BOOTSTRAP=1, which is what a fresh machine
# with only stable does. FLASHTIER_FUZZ_TOOLCHAIN=NAME forces `cargo +NAME` (plus RUSTC_BOOTSTRAP=1
# unless NAME starts with "nightly"); FLASHTIER_FUZZ_SANITIZER=none|address|... picks the sanitizer
# (default address, falling back to none if that build fails).
#
# New inputs the fuzzer finds go to a temporary corpus that is deleted afterwards, so runs leave
# the repository as it was; set FLASHTIER_FUZZ_KEEP_CORPUS=1 to grow fuzz/corpus/<target>/ instead
# (the hash-named files are ignored by git). Crash inputs land in fuzz/artifacts/<target>/ (also
# ignored); copy one worth keeping to fuzz/artifacts-found/. Reproduce a crash with
#   cargo +nightly fuzz run --fuzz-dir fuzz TARGET fuzz/artifacts/TARGET/crash-...
# Regenerate the seeds with
#   cargo run --release --manifest-path fuzz/Cargo.toml --example gen_seeds
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
if ! [[ $seconds =~ ^[0-9]+$ ]]; then
    echo "usage: fuzz/run.sh [SECONDS]" >&2
    exit 2
fi

# target:max_len. The transmission and handshake targets need room for a payload just over 64 KiB
# (the oversized-WRITE and ERR_TOO_BIG paths); the header and payload parsers need a 4 KiB name;
# on_device needs a selector byte and two 4 KiB superblock copies, and gets room for a checkpoint
# body of a few hundred entries; memcached_reply needs room for two values of a block and a header.
targets=(request_header:8192 handshake:70000 transmission:70000 on_device:16384 memcached_reply:16384)
per_target=$((seconds / ${#targets[@]}))
((per_target >= 5)) || per_target=5

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz/run.sh: cargo-fuzz is not installed (scripts/install-deps.sh installs it)" >&2
    exit 1
fi

toolchain=${FLASHTIER_FUZZ_TOOLCHAIN:-}
if [[ -z $toolchain ]] && command -v rustup >/dev/null 2>&1 &&
    rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=nightly
fi
cargo_fuzz=(cargo)
if [[ -n $toolchain ]]; then
    cargo_fuzz+=("+$toolchain")
fi
cargo_fuzz+=(fuzz)
if [[ $toolchain != nightly* ]]; then
    # cargo-fuzz passes -Z flags (sanitizer, coverage instrumentation); a stable compiler accepts
    # them when told it is building itself.
    export RUSTC_BOOTSTRAP=1
fi
if [[ -n $toolchain ]]; then rustc_version=$(rustc "+$toolchain" --version); else rustc_version=$(rustc --version); fi
echo "fuzz: $rustc_version${RUSTC_BOOTSTRAP:+ (RUSTC_BOOTSTRAP=1)}"

sanitizer=${FLASHTIER_FUZZ_SANITIZER:-address}
build() { "${cargo_fuzz[@]}" build --fuzz-dir fuzz --sanitizer "$sanitizer"; }
if ! build; then
    if [[ $sanitizer == none || -n ${FLASHTIER_FUZZ_SANITIZER:-} ]]; then
        echo "fuzz/run.sh: building the fuzz targets failed" >&2
        exit 1
    fi
    echo "fuzz/run.sh: the build with AddressSanitizer failed; retrying without a sanitizer" >&2
    sanitizer=none
    build
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/flashtier-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

failed=()
for entry in "${targets[@]}"; do
    target=${entry%%:*}
    max_len=${entry#*:}
    if [[ ${FLASHTIER_FUZZ_KEEP_CORPUS:-0} == 1 ]]; then
        corpus=fuzz/corpus/$target
    else
        corpus=$work/corpus/$target
        mkdir -p "$corpus"
        cp fuzz/corpus/"$target"/seed-* "$corpus"/
    fi
    log=$work/$target.log
    echo
    echo "==> fuzz: $target for ${per_target}s (max_len $max_len, $(ls "$corpus" | wc -l) inputs)"
    status=0
    "${cargo_fuzz[@]}" run --fuzz-dir fuzz --sanitizer "$sanitizer" "$target" "$corpus" -- \
        -max_total_time="$per_target" -max_len="$max_len" -timeout=20 -rss_limit_mb=4096 \
        -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    # Progress (coverage, executions) on success; on failure, from the first sign of trouble on.
    grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
        "$log" || true
    if ((status != 0)); then
        echo "--- $target FAILED (exit $status):"
        trouble=$(awk '/panicked at|==ERROR|ERROR: libFuzzer|ERROR: AddressSanitizer/ { p = 1 } p' "$log" |
            grep -v -E '^ +#[0-9]+ 0x[0-9a-f]+ in (fuzzer::|std::|core::|__rust|rust_fuzzer|LLVMFuzzer|main|_start|__libc)' |
            head -n 80 || true)
        if [[ -n $trouble ]]; then echo "$trouble"; else tail -n 40 "$log"; fi
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        failed+=("$target${artifact:+ $artifact}")
    fi
done

echo
if ((${#failed[@]})); then
    echo "fuzz: FAILED"
    for f in "${failed[@]}"; do
        echo "  $f"
    done
    echo "reproduce: ${RUSTC_BOOTSTRAP:+RUSTC_BOOTSTRAP=1 }${cargo_fuzz[*]} run --fuzz-dir fuzz --sanitizer $sanitizer TARGET ARTIFACT"
    exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${per_target}s each without a crash"

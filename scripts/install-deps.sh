#!/usr/bin/env bash
# Installs the Debian packages and cargo tools flashtier's tests and benchmarks use, if missing.
set -euo pipefail

packages=(
    libssl-dev      # OpenSSL for TLS (the openssl crate builds against it)
    pkg-config      # how the openssl crate finds it
    openssl         # the CLI: TLS tests make their certificates and keys with it
    nbdkit          # reference NBD server; emulated slow/faulty backing stores
    libnbd-bin      # nbdinfo, nbdcopy, nbdfuse
    python3-libnbd  # libnbd from Python (/usr/bin/python3)
    python3-prometheus-client  # a real Prometheus text-format parser for the metrics test
    qemu-utils      # qemu-img, qemu-io
    fio             # workloads with verification, nbd engine
    fuse3           # fusermount3 for nbdfuse
    e2fsprogs       # mkfs.ext4, e2fsck
    xfsprogs        # mkfs.xfs, btrfs-progs mkfs.btrfs, fdisk sfdisk, lvm2 pvcreate: signatures
    btrfs-progs     #   that `flashtier format` must refuse to overwrite
    fdisk
    lvm2
    util-linux      # mount, blkid, fincore (benchmarks)
    mount           # losetup
    python3-matplotlib  # the benchmarks' plots (bench/*.py re-run under /usr/bin/python3 for it)
    linux-perf      # perf stat: bench/cache_writes.py counts the log writer's batches with it
    mariadb-server  # mariadbd, mariadb-install-db, mysqlcheck: a real database crashed on flashtier
    sysbench        # OLTP load for that database
    man-db          # man: the generated man pages render (and the package test's man -w)
    zsh             # zsh -n, fish -n: the generated completions parse
    fish
    dpkg-dev        # dpkg-shlibdeps: the package's Depends (cargo-deb's $auto)
    binutils        # strip, for the packaged binary
    systemd         # systemd-analyze verify of the packaged unit
    memcached       # the remote memory tier's tests and benchmarks run real servers
    prometheus      # promtool: the alert rules load and fire (installed without starting it)
)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
    $sudo apt-get update -qq
    # Installing a server package starts it (prometheus, mariadb); the tests start what they
    # need themselves. Where no policy-rc.d says otherwise, one forbids starting services for
    # the duration of the install (Debian's documented mechanism, as in containers).
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\n# scripts/install-deps.sh: no service starts during its install\nexit 101\n' | $sudo tee "$policy" >/dev/null
        $sudo chmod 755 "$policy"
        trap '$sudo rm -f "$policy"' EXIT
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz"
    cargo install --locked cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
fi

if ! cargo deb --version >/dev/null 2>&1; then
    echo "installing cargo-deb"
    cargo install --locked cargo-deb >/dev/null 2>&1 || cargo install cargo-deb
fi

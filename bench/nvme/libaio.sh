#!/usr/bin/env bash
# Fill DIR (default .aio) with libaio's header and shared library, for a machine that lacks them
# (the H200 image, no package index there): DeepSpeed's async_io op, which ZeRO-Infinity's optimizer
# swapper uses, compiles against them. Debian bookworm's libaio 0.3.113-4 (libc only, SONAME
# libaio.so.1), from `apt-get download` or, where apt is not Debian's, deb.debian.org.
#
#   bash bench/nvme/libaio.sh [.aio]      # here; git ignores /.aio/ (~40 KB)
#   source bench/nvme/aio_env.sh .aio     # there, before DeepSpeed builds or loads async_io
#
# Regular files only (a carry may not keep symlinks): lib/libaio.so (to link) and lib/libaio.so.1
# (what the built op loads), both copies of libaio.so.1.0.2.
set -euo pipefail
dir=${1:-.aio}
ver=0.3.113-4
pool=http://deb.debian.org/debian/pool/main/liba/libaio
declare -A sha=([libaio1]=d1476e4beab3d85f8a7d31de94c27472711ed3ef399ce70708e24b259426125b
                [libaio-dev]=2d5a31e04e7471e71288832e004a8f8db78c2017ba11fa202f3e36e3ea21b2eb)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for pkg in libaio1 libaio-dev; do
  deb=$tmp/${pkg}_${ver}_amd64.deb
  (cd "$tmp" && apt-get download -q "$pkg=$ver" >/dev/null 2>&1) \
    || curl -fsSL -o "$deb" "$pool/${pkg}_${ver}_amd64.deb"
  echo "${sha[$pkg]}  $deb" | sha256sum -c --quiet -
  dpkg-deb -x "$deb" "$tmp/root" 2>/dev/null || (cd "$tmp" && ar x "$deb" data.tar.xz \
    && mkdir -p root && tar -xJf data.tar.xz -C root)
done
rm -rf "$dir" && mkdir -p "$dir/include" "$dir/lib"
cp "$tmp/root/usr/include/libaio.h" "$dir/include/"
so=$tmp/root/usr/lib/x86_64-linux-gnu/libaio.so.1.0.2
cp "$so" "$dir/lib/libaio.so" && cp "$so" "$dir/lib/libaio.so.1"
ls -la "$dir/include" "$dir/lib"

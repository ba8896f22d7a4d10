#!/usr/bin/env bash
# Build what flash-attn-4 (the CuTe DSL FlashAttention, `flash_attn.cute`) needs on the project's
# GPU machine, which has no package index (Python 3.12, torch 2.11+cu130, x86_64), in pieces that
# each fit one device call (64 MiB carried per call):
#
#   bash scripts/fa4_payload.sh
#
# - .fa4/: the wheels flash-attn-4 4.0.0b36 needs beyond torch, for cp312 / manylinux x86_64,
#   except the CUDA-13 libraries wheel (about 10 MB in all);
# - .fa4libs/libs.tar.xz: the files of that wheel, nvidia-cutlass-dsl-libs-cu13 (92 MB as a wheel,
#   237 MB unpacked), laid out as in site-packages and packed with xz -9 (about 58.5 MiB; packing
#   takes about 4 minutes). It must stay under 62 MiB: when it does not, it is packed again
#   without what only ahead-of-time export uses (the aarch64 link stubs, the static runtime
#   library, the C header), and the script fails if it is still over.
#
# Both folders are git-ignored. On the GPU machine (see docs/contributing.md):
#   call 1 carries [".fa4libs"] and runs `bash scripts/gpu_suite.sh --unpack-fa4libs`;
#   call 2, while the machine is warm, carries [".whl", ".fa4"] and runs the suite, which installs
#   .fa4/*.whl into /tmp/site, copies the unpacked libraries over it and puts
#   /tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH.
#
# The list below was resolved by hand from each wheel's METADATA (Requires-Dist, no extras); the
# check after the download fails when a requirement is neither in .fa4 nor accounted for:
# - torch and cuda-bindings (>=13.0.3, which nvidia-cutlass-dsl-libs-* want >=12.8) come with
#   torch 2.11+cu130 on the GPU machine;
# - nvidia-cutlass-dsl-libs-cu12 (a hard requirement of nvidia-cutlass-dsl) is left out: the DSL
#   loads whichever _cutlass_ir.cu<N> flavour is present, and the cu13 one comes in .fa4libs;
# - protobuf (required by the libs wheels) is left out: no Python file of these packages imports
#   it (the libraries link their own), and a newer copy in /tmp/site would shadow the machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
dsl=4.8.1
wheels=(flash-attn-4==4.0.0b36 "nvidia-cutlass-dsl==$dsl" "nvidia-cutlass-dsl-libs-base==$dsl"
        "nvidia-cutlass-dsl-libs-core==$dsl" quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2
        torch-c-dlpack-ext==0.1.5 einops==0.8.2 typing-extensions==4.16.0)
libs_wheel=nvidia-cutlass-dsl-libs-cu13==$dsl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
limit=$((62 * 1024 * 1024))

# 1. the wheels (a fresh folder, so no wheel of an earlier pin stays behind)
rm -rf .fa4
python3 -m pip download -q --no-deps "${plat[@]}" -d .fa4 "${wheels[@]}"
python3 - .fa4 <<'EOF'
import sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
elsewhere = {
    "torch": "on the GPU machine",
    "cuda-bindings": "on the GPU machine (a dependency of torch 2.11+cu130)",
    "nvidia-cutlass-dsl-libs-cu12": "replaced by nvidia-cutlass-dsl-libs-cu13 (.fa4libs)",
    "nvidia-cutlass-dsl-libs-cu13": "in .fa4libs",
    "protobuf": "not imported by any Python file of these packages",
}
env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
have, reqs = {}, []
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    field = lambda key: [l.split(":", 1)[1].strip() for l in lines if l.startswith(key + ":")]
    have[canonicalize_name(field("Name")[0])] = field("Version")[0]
    reqs += [(whl.name, Requirement(r)) for r in field("Requires-Dist")]
bad = 0
for owner, r in reqs:
    if r.marker is not None and not r.marker.evaluate(env):
        continue
    name = canonicalize_name(r.name)
    if name in have:
        if not r.specifier.contains(have[name], prereleases=True):
            print(f"fa4_payload: {owner} wants {r}, .fa4 has {have[name]}", file=sys.stderr)
            bad = 1
    elif name in elsewhere:
        print(f"fa4_payload: {owner}: {r} {elsewhere[name]}")
    else:
        print(f"fa4_payload: {owner} wants {r}, which is not in .fa4", file=sys.stderr)
        bad = 1
sys.exit(bad)
EOF

# 2. the CUDA-13 libraries wheel, unpacked and packed again (skipped when the archive is of it:
#    .fa4libs/libs.version names the wheel)
mkdir -p .fa4libs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -f .fa4libs/libs.tar.xz ] && [ "$(cat .fa4libs/libs.version 2>/dev/null)" = "$libs_wheel" ]; then
  echo "fa4_payload: .fa4libs/libs.tar.xz is already of $libs_wheel"
else
  rm -f .fa4libs/libs.tar.xz .fa4libs/libs.version
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "$libs_wheel"
  python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/files"
  pack() {  # the wheel's files, paths relative to site-packages, minus the patterns given
    tar -C "$tmp/files" --sort=name --owner=0 --group=0 --numeric-owner "$@" -cf - . \
      | xz -9 -T1 > .fa4libs/libs.tar.xz.part
    mv .fa4libs/libs.tar.xz.part .fa4libs/libs.tar.xz
  }
  pack
  if [ "$(stat -c %s .fa4libs/libs.tar.xz)" -ge "$limit" ]; then
    echo "fa4_payload: over 62 MiB; packing again without the AOT-export-only files" >&2
    pack --exclude='./nvidia_cutlass_dsl/cu13/lib/stubs' --exclude='*.a' \
      --exclude='./nvidia_cutlass_dsl/cu13/include'
  fi
  echo "$libs_wheel" > .fa4libs/libs.version
fi

# 3. sizes
ls -l .fa4 | awk 'NR > 1 {printf "%12d  %s\n", $5, $9}'
size=$(stat -c %s .fa4libs/libs.tar.xz)
echo "libs.tar.xz: $size bytes ($(awk -v s="$size" 'BEGIN {printf "%.2f", s / 1048576}') MiB)"
du -sh .fa4 .fa4libs
if [ "$size" -ge "$limit" ]; then
  echo "fa4_payload: .fa4libs/libs.tar.xz is still over 62 MiB" >&2
  exit 1
fi

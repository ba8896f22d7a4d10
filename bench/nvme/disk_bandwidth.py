"""Read and write bandwidth of the disk under a directory, as ZeRO-Infinity's optimizer swapper sees it.

    python bench/nvme/disk_bandwidth.py DIR [--size-gib 4] [--out disk.json] [--engine auto]

engine ds_io (auto's first choice): DeepSpeed's own benchmark (`ds_io`, deepspeed.nvme) on the same
async_io op and with the swapper's default aio settings (block 1 MiB, queue depth 8, one thread per
request; DeepSpeed's "aio" config section, which longft does not set), O_DIRECT, pinned host buffers.
engine direct (auto's fallback where async_io cannot be built or ds_io fails): one Python thread,
sequential 1 MiB O_DIRECT writes (fsync'd) then reads; a filesystem that refuses O_DIRECT (tmpfs)
is measured buffered, with fsync and the page cache dropped for the file before the read, and the
JSON says so. The direct engine has queue depth 1, so it can read lower than ds_io on an NVMe drive.

Both write SIZE into a fresh folder under DIR and remove it, --loops times each way, and report
each way's median GiB/s with the least and the most (`*_gib_s`, `*_gib_s_min`, `*_gib_s_max`;
ds_io is called once a loop, since its own figure is a mean). GiB/s are 2^30 bytes a second (ds_io
prints them as "GB/sec"). The JSON also records the filesystem of DIR and its free space, so a
row measured on this disk can be scaled to another: the swapper reads and writes every optimizer
state once a step, so a step's disk time is about disk_bytes / read + disk_bytes / write.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
BLOCK = 2**20
AIO = {"block_size": BLOCK, "queue_depth": 8, "intra_op_parallelism": 1}
"""DeepSpeed 0.19.8's aio defaults (runtime/swap_tensor/constants.py), what the swapper uses."""


def filesystem(path: Path) -> dict:
    """The mount that holds path (/proc/mounts, longest prefix), its type, total and free bytes."""
    p, best = os.path.realpath(path), ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, kind = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, kind, dev)
    except OSError:
        pass
    du = shutil.disk_usage(path)
    return {"path": str(path), "mount": best[0], "fstype": best[1], "device": best[2],
            "total_gib": round(du.total / GIB, 2), "free_gib": round(du.free / GIB, 2)}


def spread(gib_s: list[float], op: str) -> dict:
    """One op's GiB/s over the loops: the median, the least and the most, each engine alike."""
    xs = sorted(gib_s)
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return {f"{op}_gib_s": round(median, 3), f"{op}_gib_s_min": round(xs[0], 3),
            f"{op}_gib_s_max": round(xs[-1], 3)}


def ds_io(folder: Path, size: int, loops: int) -> dict:
    """DeepSpeed's ds_io, write then read, one loop a call (its own figure is the mean over its
    loops); raises RuntimeError with its output's tail on failure."""
    speeds = {}
    for op in ("write", "read"):
        speeds.update(spread([_ds_io_once(folder, size, op) for _ in range(loops)], op))
    return {"engine": "ds_io", "aio": AIO, "loops": loops, **speeds}


def _ds_io_once(folder: Path, size: int, op: str) -> float:
    """One ds_io call of one loop: GiB/s of `op` (write or read)."""
    cmd = [sys.executable, "-c", "from deepspeed.nvme import ds_io_main; ds_io_main()",
           "--folder", str(folder), "--io_size", str(size), "--loops", "1",
           "--block_size", str(AIO["block_size"]), "--queue_depth", str(AIO["queue_depth"]),
           "--io_parallel", str(AIO["intra_op_parallelism"])] + (["--read"] if op == "read" else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(rf"E2E {op.capitalize()} Speed = ([0-9.eE+-]+) GB/sec", p.stdout)
    if p.returncode or not m:
        tail = (p.stdout + p.stderr)[-2000:]
        raise RuntimeError(f"ds_io {op} exited {p.returncode}: {tail}")
    return float(m.group(1))


def _open(path: Path, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600), hasattr(os, "O_DIRECT")
    except OSError:  # EINVAL: the filesystem has no O_DIRECT (tmpfs)
        return os.open(path, flags, 0o600), False


def direct(folder: Path, size: int, loops: int) -> dict:
    """Sequential 1 MiB blocks, O_DIRECT where the filesystem allows it; each loop timed (spread)."""
    buf = mmap.mmap(-1, BLOCK)          # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(BLOCK))
    f, n = folder / "bandwidth.bin", size // BLOCK
    got: dict[str, list[float]] = {"write": [], "read": []}
    o_direct = True
    for _ in range(loops):
        fd, od = _open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        got["write"].append(n * BLOCK / (time.perf_counter() - t) / GIB)
        os.close(fd)
        fd, od2 = _open(f, os.O_RDONLY)
        o_direct = o_direct and od and od2
        if not od2:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        while os.readv(fd, [buf]) == BLOCK:
            pass
        got["read"].append(n * BLOCK / (time.perf_counter() - t) / GIB)
        os.close(fd)
    return {"engine": "direct", "o_direct": o_direct, "block_size": BLOCK, "queue_depth": 1,
            "loops": loops, **spread(got["write"], "write"), **spread(got["read"], "read")}


def aio_buildable() -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op can be built here (its own libaio check), and why not."""
    code = ("import sys\nfrom deepspeed.ops.op_builder import AsyncIOBuilder\n"
            "sys.exit(0 if AsyncIOBuilder().is_compatible() else 3)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode == 0:
        return True, ""
    return False, ("libaio not found by DeepSpeed's check" if p.returncode == 3
                   else f"deepspeed not importable: {(p.stderr or p.stdout)[-300:]}")


def measure(path: Path, size: int, engine: str, loops: int) -> dict:
    out = {"filesystem": filesystem(path), "size_gib": round(size / GIB, 3),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    folder = Path(path) / f".longft-bandwidth-{os.getpid()}"
    folder.mkdir()
    try:
        if engine in ("auto", "ds_io"):
            ok, why = aio_buildable()
            try:
                if not ok:
                    raise RuntimeError(why)
                out.update(ds_io(folder, size, loops))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if engine == "ds_io":
                    raise
                out["ds_io_error"] = str(e)[-2000:]
        if "engine" not in out:
            out.update(direct(folder, size, loops))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a directory on the disk to measure (the swap path)")
    ap.add_argument("--size-gib", type=float, default=4.0, help="bytes per pass (default 4 GiB)")
    ap.add_argument("--loops", type=int, default=3, help="timed passes (ds_io adds one warm-up)")
    ap.add_argument("--engine", choices=("auto", "ds_io", "direct"), default="auto")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    if not a.dir.is_dir():
        print(f"disk_bandwidth: {a.dir} is not a directory", file=sys.stderr)
        return 2
    size = max(BLOCK, int(a.size_gib * GIB) // BLOCK * BLOCK)
    res = measure(a.dir, size, a.engine, a.loops)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

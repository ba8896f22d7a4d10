"""Bytes of the files under a directory and the free space of its disk, sampled during a run.

With `zero.offload_optimizer: nvme` the optimizer states live in files under zero.nvme_path (the
swap directory, engine/ds_config.py: nvme_dir). `HostSampler` takes a `DiskWatch` of that
directory beside host memory, so a run measures the disk it used as it measures RAM and VRAM:
the peak of the files' bytes above what was there at the start (files of other runs stay out),
and the free space at the start, its minimum and at the end (after the run removed its files).

Sizes are the files' lengths (`du --apparent-size`), the bytes the swapper wrote, which the
estimator's disk item predicts; a directory listing costs microseconds for the few dozen swap
files, so it is re-read every `every_s` seconds, not at the memory sampler's rate.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional


def tree_bytes(path: Path) -> int:
    """Sum of the lengths of the regular files under path (links not followed); 0 if absent.
    Files that vanish while it is read (a run removing its swap files) count nothing."""
    total, stack = 0, [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:  # absent, gone meanwhile, or not readable
            pass
    return total


def free_bytes(path: Path) -> Optional[int]:
    """Free bytes (for this user) of the filesystem that holds path, or of its nearest existing
    ancestor while path does not exist yet; None when none can be read."""
    p = Path(os.path.abspath(path))
    for q in (p, *p.parents):
        try:
            return int(shutil.disk_usage(q).free)
        except OSError:
            continue
    return None


class DiskWatch:
    """Peak bytes under `path` above its size at start(), and free space at start, minimum, end."""

    def __init__(self, path: Path, every_s: float = 0.5):
        self.path = Path(path)
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._base = 0
        self._peak, self._peak_t = 0, None
        self._free_start = self._free_min = self._free_end = None

    def start(self) -> None:
        self._base = tree_bytes(self.path)
        self._free_start = self._free_min = free_bytes(self.path)

    def sample(self, force: bool = False) -> None:
        """Re-read the directory, at most every every_s seconds unless forced."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        t, size, free = time.time(), tree_bytes(self.path) - self._base, free_bytes(self.path)
        with self._lock:
            if size > self._peak or self._peak_t is None:
                self._peak, self._peak_t = max(size, 0), t
            if free is not None and (self._free_min is None or free < self._free_min):
                self._free_min = free

    def stop(self) -> None:
        self.sample(force=True)
        self._free_end = free_bytes(self.path)

    def summary(self) -> dict:
        with self._lock:
            return {"disk_path": str(self.path), "disk_swap_baseline_bytes": self._base,
                    "disk_swap_peak_bytes": self._peak, "disk_swap_peak_t": self._peak_t,
                    "disk_free_start_bytes": self._free_start,
                    "disk_free_min_bytes": self._free_min, "disk_free_end_bytes": self._free_end}

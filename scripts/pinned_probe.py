"""Probe torch's pinned host allocator on a GPU machine: does it round every block up to a power of
two, and do `pinned_max_round_threshold_mb` / `pinned_max_cached_size_mb` (set at run time through
torch._C._accelerator_setAllocatorSettings) make large blocks exact? Prints one JSON line per case.

    python scripts/pinned_probe.py            # runs every case, each in its own process

Seen on the H200 machine (torch 2.11.0+cu130, 2026-11-30): the settings do not exist there (no
torch._C._accelerator_getAllocatorSettings, no pinned_max_round_threshold in libc10), so every
pinned block is rounded up to a power of two; torch 2.13 has them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

GIB = 1 << 30


def case(settings: str) -> dict:
    import psutil
    import torch

    rss0 = psutil.Process().memory_info().rss
    torch.zeros(1, device="cuda")                       # CUDA context first: not counted below
    if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        return {"torch": torch.__version__, "settings": settings, "supported": False}
    if settings:
        cur = torch._C._accelerator_getAllocatorSettings()
        torch._C._accelerator_setAllocatorSettings(f"{cur},{settings}" if cur else settings)
    rss1 = psutil.Process().memory_info().rss
    n = int(2.5 * GIB)
    t0 = time.perf_counter()
    a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    rss2 = psutil.Process().memory_info().rss
    small = [torch.empty(1_000_000_000, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    del small
    t0 = time.perf_counter()
    again = torch.empty(1_000_000_000, dtype=torch.uint8, pin_memory=True)   # reused from the cache?
    reuse_s = time.perf_counter() - t0
    del again
    x = torch.empty(64 << 20, device="cuda")
    snap = torch.cuda.memory._snapshot()
    expandable = any(s.get("is_expandable") for s in snap.get("segments", []))
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    del a, x
    return {"torch": torch.__version__, "settings": settings,
            "env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
            "now": torch._C._accelerator_getAllocatorSettings(),
            "requested_gib": n / GIB, "rss_rise_gib": round((rss2 - rss1) / GIB, 3),
            "ctx_rss_gib": round((rss1 - rss0) / GIB, 3), "alloc_s": round(alloc_s, 3),
            "reuse_1gb_s": round(reuse_s, 4), "expandable_segments": expandable,
            "host_allocated_gib": round(stats.get("allocated_bytes.current", 0) / GIB, 3)}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(case(sys.argv[1] if sys.argv[1] != "-" else "")), flush=True)
    else:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        for s in ("-", "pinned_max_round_threshold_mb:2048,pinned_max_cached_size_mb:2048"):
            subprocess.run([sys.executable, __file__, s], env=env, check=False)

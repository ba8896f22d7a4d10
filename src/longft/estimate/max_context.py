"""The longest context that fits, by the estimator: a binary search over sequence lengths, and the
lengths around its answer that `longft max-context --confirm` (longft.run.confirm) tries on a GPU."""

from __future__ import annotations

import dataclasses

from longft.estimate.estimator import Setup, estimate, fits
from longft.hardware.policy import TILED_MLP_FROM

SEQ_STEP = 1024
"""Sequence lengths are searched in multiples of this."""


def candidates_for_confirmation(max_seq: int, rel_error: float = 0.10, step: int = SEQ_STEP,
                                n: int = 2, limit: int | None = None) -> list[int]:
    """Sequence lengths to try on the real GPU around the estimator's longest fitting one.

    The estimator is good to about `rel_error`, so the true boundary lies within
    max_seq x (1 +- rel_error): 2n + 1 points across that band, multiples of `step`, ascending.
    Run each for a few iterations from the longest down; the first that completes is the maximum.
    `limit` (the model's max_position_embeddings) caps the list.
    """
    pts = {max(step, round(max_seq * (1 + rel_error * i / n) / step) * step) for i in range(-n, n + 1)}
    return sorted(p for p in pts if limit is None or p <= limit)


def max_context(arch: dict, base: Setup, *, gpu_mem_gib: float | None, host_mem_gib: float | None,
                vram_limit_gib: float | None = None, max_seq: int = 1 << 20,
                step: int = SEQ_STEP) -> int:
    """The longest seq (a multiple of `step`, <= max_seq) that fits; 0 if even `step` does not.
    Binary search: memory grows with the sequence length."""
    def ok(k: int) -> bool:
        e = estimate(arch, base.at_length(k * step))
        return fits(e, gpu_mem_gib, host_mem_gib, vram_limit_gib).ok

    lo, hi = 0, max_seq // step            # ok(lo) holds (vacuously for 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _max_context_auto_tiled(arch: dict, base: Setup, gpu_mem_gib, host_mem_gib, vram_limit_gib,
                            top: int) -> tuple[int, bool]:
    """max_context under kernels.tiled_mlp auto, which tiles from TILED_MLP_FROM tokens on: memory
    drops where tiling starts, so search the tiled lengths first, then the untiled ones below.
    Returns (longest fitting length, whether it runs tiled)."""
    if top >= TILED_MLP_FROM:
        tiled = max_context(arch, dataclasses.replace(base, tiled_mlp=True), gpu_mem_gib=gpu_mem_gib,
                            host_mem_gib=host_mem_gib, vram_limit_gib=vram_limit_gib, max_seq=top)
        if tiled >= TILED_MLP_FROM:
            return tiled, True
    return max_context(arch, dataclasses.replace(base, tiled_mlp=False), gpu_mem_gib=gpu_mem_gib,
                       host_mem_gib=host_mem_gib, vram_limit_gib=vram_limit_gib,
                       max_seq=min(top, TILED_MLP_FROM - 1)), False

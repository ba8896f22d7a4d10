"""train.json's `peak_disk`, for a run with offload_optimizer nvme: the swap files' peak bytes
(monitor.json, measure/disk.py) against the estimator's disk item, and the disk's free space."""

from __future__ import annotations

import math
from typing import Any, Optional

from longft.estimate.estimator import rel_error

GIB = 1024**3


def _bytes(x: Any) -> Optional[int]:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return int(x)


def _gib(x: Optional[int]) -> Optional[float]:
    return None if x is None else round(x / GIB, 3)


def peak_disk(mon: dict, estimate: dict | None) -> dict:
    """{"peak_disk": {...}} when the sampler watched a swap directory, else {}. estimate: the
    plan's memory estimate (its "disk" item holds the predicted bytes). rel_error is
    (predicted - measured) / measured, as for VRAM and host RAM."""
    peak = _bytes(mon.get("disk_swap_peak_bytes"))
    if peak is None:
        return {}
    est = (estimate or {}).get("estimate", estimate or {})
    pred = _bytes((est.get("disk") or {}).get("bytes"))
    t0, t = mon.get("t_start"), mon.get("disk_swap_peak_t")
    return {"peak_disk": {
        "swap_peak_bytes": peak, "swap_gib": _gib(peak),
        "swap_peak_t": round(t - t0, 2) if _bytes(t) is not None and _bytes(t0) is not None else None,
        "predicted_gib": _gib(pred),
        "rel_error": rel_error(pred, peak),
        "free_start_gib": _gib(_bytes(mon.get("disk_free_start_bytes"))),
        "free_min_gib": _gib(_bytes(mon.get("disk_free_min_bytes"))),
        "free_end_gib": _gib(_bytes(mon.get("disk_free_end_bytes")))}}

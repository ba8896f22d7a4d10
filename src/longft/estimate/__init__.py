"""Predict before running: itemised peak VRAM and host RAM (`estimator`, with its items in `gpu`,
`host`, `arch`, `types`), model FLOPs and MFU (`flops`), the fastest placement that fits
(`placement`, behind `longft placement`) and the longest context that fits (`max_context`).
Formulas and calibration: docs/estimator.md."""

from longft.estimate.estimator import compare, estimate, estimate_for_plan, fits, setup_from_config

__all__ = ["estimate", "estimate_for_plan", "setup_from_config", "fits", "compare"]

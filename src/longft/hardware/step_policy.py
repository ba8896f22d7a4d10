"""Where the optimizer step runs during the next forward (zero.overlap_step, engine/overlap_step.py):
the one rule that hardware/policy.py resolves and the DeepSpeed config follows."""

from __future__ import annotations

from longft.config.params import Config
from longft.config.plan import Choice

WHY = ("each step's CPU Adam runs during the next forward, sub-group by sub-group, before their "
       "parameters are fetched (engine/overlap_step.py; the same bits)")


def why_not_overlap_step(cfg: Config, device: str) -> list[str]:
    """What zero.overlap_step needs that this setup lacks ([] = it applies)."""
    z = cfg.zero
    stage = z.stage  # QLoRA runs on ZeRO-2 (config/qlora.py refuses it on 3)
    processes = cfg.hardware.num_gpus * cfg.hardware.num_nodes
    return [why for why, bad in (
        ("a GPU", device != "cuda"), ("zero.stage 3", stage != 3),
        ("zero.offload_optimizer: cpu", z.offload_optimizer != "cpu"),
        ("optim.name: adamw (DeepSpeed's CPU Adam)", cfg.optim.name != "adamw"),
        ("one process (hardware.num_gpus x num_nodes = 1: tested on one)", processes != 1))
        if bad]


def resolve_overlap_step(cfg: Config, device: str) -> tuple[Choice, list[str]]:
    """auto: on wherever it applies, unless param_persistence_threshold keeps parameters gathered
    (each would be gathered with the GPU synchronized after its sub-group); else off."""
    z = cfg.zero
    why_not = why_not_overlap_step(cfg, device)
    if z.overlap_step == "on":
        if why_not:
            return Choice("on", "set in params"), [
                f"zero.overlap_step: on runs CPU Adam during the next forward and needs "
                f"{', '.join(why_not)}. Set zero.overlap_step: auto"]
        return Choice("on", "set in params: " + WHY), []
    if z.overlap_step == "off":
        return Choice("off", "set in params"), []
    if why_not:
        return Choice("off", f"auto: off (needs {', '.join(why_not)})"), []
    if z.param_persistence_threshold:
        return Choice("off", "auto: off (zero.param_persistence_threshold keeps parameters "
                      "gathered, which the overlap would gather with the GPU synchronized; set it "
                      "to null or 0, or zero.overlap_step: on)"), []
    return Choice("on", "auto: " + WHY), []


def persistence_threshold(cfg: Config, overlap: bool, hidden_size: int) -> int:
    """stage3_param_persistence_threshold: zero.param_persistence_threshold, else 0 with the
    overlap (every parameter fetched, so gated) and 10 x hidden_size without."""
    t = cfg.zero.param_persistence_threshold
    return t if t is not None else (0 if overlap else 10 * hidden_size)

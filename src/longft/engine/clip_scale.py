"""Skip DeepSpeed ZeRO-3's gradient rescaling pass when its factor is exactly 1.

Before each sub-group's optimizer step, DeepSpeed's ZeRO-3 (`unscale_and_clip_grads`) multiplies
the sub-group's fp32 gradients by 1 / (loss scale x clip coefficient), even when that factor is 1:
under bf16 (no loss scale) whenever the gradient norm is within `optim.max_grad_norm`, which is
most of a finetune of pretrained weights. With CPU offload that is a pass over every host gradient
(0.46 s a step on the H200's 8B row, where the norm was over the limit: `BENCHMARKS.md`). A
product with exactly 1.0 leaves every value as it was, so skipping it trains the same bits.

The factor is computed as DeepSpeed 0.19 computes it (`combined_scale` below, the same tensor
operations); whenever it is not exactly 1, DeepSpeed's own method runs. tests/test_clip_scale.py
holds the two side by side on DeepSpeed's class, so an upgrade that changes the formula fails there.
"""

from __future__ import annotations

from longft.compat import deepspeed as ds
from longft.compat.deepspeed import CLIP_SCALE_PARTS, RESCALE


def combined_scale(loss_scale, clip_grad: float, total_norm):
    """What DeepSpeed's ZeRO-3 divides the gradients by: the loss scale, times the clip coefficient
    (at least 1) when clipping is on. `total_norm` is the loss-scaled global norm (a tensor)."""
    import torch

    combined = loss_scale
    if clip_grad > 0.:
        clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined = clip * loss_scale
    return combined


def install(optimizer) -> bool:
    """Wrap the ZeRO-3 optimizer's `unscale_and_clip_grads` so that it returns at once when its
    factor is exactly 1 (the factor is checked once a step: every sub-group gets the same norm).
    False (nothing changed) for an optimizer without that method or without the attributes the
    factor is computed from (ZeRO-1/2 skip a factor of 1 themselves only without clipping)."""
    if any(not hasattr(optimizer, a) for a in CLIP_SCALE_PARTS):
        return False
    original = getattr(optimizer, RESCALE)
    checked, one = None, False          # the norm last checked, and whether its factor is 1

    def unscale_and_clip_grads(sub_group_id, total_norm):
        nonlocal checked, one
        if checked is not total_norm:
            checked = total_norm
            one = bool(combined_scale(*ds.loss_scale_and_clip(optimizer), total_norm) == 1.0)
        if one:
            return None                 # x * 1.0 == x: the pass would change nothing
        return original(sub_group_id, total_norm)

    setattr(optimizer, RESCALE, unscale_and_clip_grads)
    return True

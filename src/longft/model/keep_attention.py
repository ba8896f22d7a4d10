"""`checkpointing.keep_attention`: the last N checkpointed decoder layers keep their attention
kernel's outputs (output and log-sum-exp) from the forward, so the recompute in backward skips the
attention forward, the costliest op at long context (a quarter of a layer's attention time at
128K). Each kept layer costs micro x seq x heads x (head_dim x 2 B + 4 B) of GPU memory from its
forward until its backward.

This is selective activation checkpointing through the checkpoint's `context_fn`, like PyTorch's
`create_selective_checkpoint_contexts` with the kernels MUST_SAVE, but tracking only the kernels:
PyTorch's version requires every op of the recompute to match the forward's, which the tiled
MLP's skipped recompute (tiled.py) and ZeRO-3's parameter fetches (prefetched during the forward,
fetched during the recompute) do not.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from longft.compat import torch as torch_compat
from longft.compat import transformers as tf_compat
from longft.compat.torch import TorchDispatchMode, tree_map_only


def kernel_ops() -> set:
    """The attention kernels whose outputs are kept: SDPA's fused kernels (CUDA and CPU), torch's
    varlen_attn (packed rows, model/packed_attention.py), flash-attn-4's as longft registers them
    (model/flash_attn_4_op.py) and flash-attn's, where flash-attn registers them as torch ops (2.7
    and later)."""
    from longft.model import flash_attn_4_op  # registers longft::fa4_forward

    ops = torch_compat.sdpa_ops()
    ops.add(flash_attn_4_op.fa4_forward._opoverload)
    varlen = torch_compat.varlen_attn_op()
    if varlen is not None:
        ops.add(varlen)
    for n in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        try:
            ops.add(getattr(torch.ops.flash_attn, n).default)
        except (AttributeError, RuntimeError):  # flash-attn missing, or too old to register ops
            pass
    return ops


class KeptKernels(TorchDispatchMode):
    """Forward (replay=False): run every op, keep the attention kernels' outputs in `kept`.
    Recompute (replay=True): hand those outputs back, in order, instead of running the kernels
    (only to the same kernel that made them); every other op runs as usual."""

    replayed_total = 0
    """Kernel calls skipped so far in this process (the trainer checks it after the first step)."""

    def __init__(self, ops: set, kept: deque, replay: bool):
        super().__init__()
        self.ops, self.kept, self.replay = ops, kept, replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops and self.replay and self.kept and self.kept[0][0] is func:
            KeptKernels.replayed_total += 1
            return self.kept.popleft()[1]
        out = func(*args, **(kwargs or {}))
        if func in self.ops and not self.replay:
            self.kept.append((func, tree_map_only(torch.Tensor, lambda t: t.detach(), out)))
        return out


def contexts(ops: set):
    """A checkpoint `context_fn`: the forward's and the recompute's modes, sharing one queue."""
    kept: deque = deque()
    return KeptKernels(ops, kept, replay=False), KeptKernels(ops, kept, replay=True)


def flash_attn_ops() -> bool:
    """Whether flash-attn's kernels are torch ops here (flash-attn 2.7 or later)."""
    return any(getattr(op, "namespace", None) == "flash_attn" for op in kernel_ops())


def keep_outputs(layers, n: int) -> int:
    """Make the last `n` of these checkpointed layers keep their attention outputs; returns how
    many were set up. Call after checkpointing is on (each layer's checkpoint function is wrapped)."""
    if n <= 0:
        return 0
    context_fn = functools.partial(contexts, kernel_ops())
    for layer in layers[-n:]:
        base = tf_compat.checkpoint_function(layer)
        tf_compat.set_checkpoint_function(layer, functools.partial(base, context_fn=context_fn))
    return min(n, len(layers))

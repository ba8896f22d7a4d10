"""torch internals longft uses, and the helpers that use them.

- `torch._C._current_graph_task_id()`: -1 outside a backward; tells a checkpoint's recompute from
  the forward (the tiled MLP skips its recompute, the progress bar counts forwards only).
- the private aten ops of SDPA's fused kernels, `torch.utils._python_dispatch.TorchDispatchMode` and
  `torch.utils._pytree.tree_map_only`: keep_attention sees those kernels run and keeps their outputs.
"""

from __future__ import annotations

from longft.compat import Access

SDPA_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""SDPA's fused kernels as aten ops (CUDA, and the CPU's flash kernel)."""

ACCESSES = (
    Access("recompute_check", "torch._C", "_current_graph_task_id"),
    *(Access("keep_attention", "torch", n, owner="ops.aten") for n in SDPA_OPS),
    Access("keep_attention", "torch.utils._python_dispatch", "TorchDispatchMode"),
    Access("keep_attention", "torch.utils._pytree", "tree_map_only"),
)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint's recompute)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def sdpa_ops() -> set:
    """SDPA's fused-kernel ops this torch has."""
    import torch

    aten = torch.ops.aten
    return {getattr(aten, n).default for n in SDPA_OPS if hasattr(aten, n)}


def __getattr__(name: str):
    """TorchDispatchMode and tree_map_only, imported when first asked for (after the plan's check)."""
    if name == "TorchDispatchMode":
        from torch.utils._python_dispatch import TorchDispatchMode

        return TorchDispatchMode
    if name == "tree_map_only":
        from torch.utils._pytree import tree_map_only

        return tree_map_only
    raise AttributeError(name)

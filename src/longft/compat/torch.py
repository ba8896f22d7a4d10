"""torch internals longft uses, and the helpers that use them.

- `torch._C._current_graph_task_id()`: -1 outside a backward; tells a checkpoint's recompute from
  the forward (the tiled MLP skips its recompute, the progress bar counts forwards only).
- `torch.ops.torch_attn._varlen_attn` (registered by importing torch.nn.attention.varlen, torch 2.10
  and later): varlen_attn's kernel as an op, which keep_attention keeps on packed rows.
- `torch._C._host_emptyCache` (CUDA builds): empties the pinned-host cache (engine/host_cache.py);
  where it is gone, torch.accelerator.empty_host_cache (torch 2.10 and later, public) does the same.
- the private aten ops of SDPA's fused kernels, `torch.utils._python_dispatch.TorchDispatchMode` and
  `torch.utils._pytree.tree_map_only`: keep_attention sees those kernels run and keeps their outputs.
"""

from __future__ import annotations

from longft.compat import Access

SDPA_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""SDPA's fused kernels as aten ops (CUDA, and the CPU's flash kernel)."""

VARLEN_MODULE = "torch.nn.attention.varlen"
"""Importing it registers torch_attn::_varlen_attn (the Access reaches the op through its `torch`)."""

ACCESSES = (
    Access("recompute_check", "torch._C", "_current_graph_task_id"),
    *(Access("keep_attention", "torch", n, owner="ops.aten") for n in SDPA_OPS),
    Access("keep_attention", "torch.utils._python_dispatch", "TorchDispatchMode"),
    Access("keep_attention", "torch.utils._pytree", "tree_map_only"),
    Access("keep_attention_varlen", VARLEN_MODULE, "_varlen_attn", owner="torch.ops.torch_attn"),
    Access("host_empty_cache", "torch._C", "_host_emptyCache"),
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


def varlen_attn_op():
    """varlen_attn's kernel op, or None where this torch has none (before 2.10, or moved: the patch
    stage refused keep_attention on varlen rows then, compat/gate.py)."""
    import importlib

    try:
        mod = importlib.import_module(VARLEN_MODULE)
        return mod.torch.ops.torch_attn._varlen_attn.default
    except (ImportError, AttributeError, RuntimeError):
        return None


def empty_host_cache() -> bool:
    """Give torch's cached pinned-host blocks back to the OS; False where this torch cannot (a CPU
    build has no pinned cache; plan.json's compat record says so)."""
    import torch

    private = getattr(torch._C, "_host_emptyCache", None)
    public = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    call = private or public
    if call is None:
        return False
    call()
    return True


def __getattr__(name: str):
    """TorchDispatchMode and tree_map_only, imported when first asked for (after the plan's check)."""
    if name == "TorchDispatchMode":
        from torch.utils._python_dispatch import TorchDispatchMode

        return TorchDispatchMode
    if name == "tree_map_only":
        from torch.utils._pytree import tree_map_only

        return tree_map_only
    raise AttributeError(name)

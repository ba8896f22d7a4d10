"""Which SDPA kernel runs, pinned and recorded (PyTorch's default choice changes between releases).

`kernels.sdpa_backend` picks the first kernel to try; the others follow as fallbacks for inputs the
first one cannot take (a packed-document mask, an odd head size), in the order below. On an H200
the cuDNN kernel is 1.6-1.9x faster than the flash kernel for Llama shapes at 16K-128K
(../shared/device/NOTES.md); on Ampere the flash kernel is the fast one; a V100 (sm_70) has only
the memory-efficient and math kernels.
"""

from __future__ import annotations

from contextlib import nullcontext

NAMES = ("flash", "cudnn", "efficient", "math")
FALLBACKS = ("efficient", "math")


def priority(first: str) -> list[str]:
    """`first`, then the fallbacks it is not already."""
    return [first, *(b for b in FALLBACKS if b != first)]


def context(first: str):
    """A context manager that makes SDPA try `first`, then the fallbacks; 'default' = no pinning."""
    if first == "default":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enum = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([enum[b] for b in priority(first)], set_priority=True)


def expand_kv_heads() -> None:
    """Make transformers repeat K/V heads instead of passing enable_gqa to SDPA.

    The memory-efficient kernel (the V100 path) rejects enable_gqa=True and SDPA would then fall
    back to the math kernel, which materialises the full [seq x seq] score matrix.
    """
    from transformers.integrations import sdpa_attention

    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False


def fused_kernel(implementation: str | None, sdpa_backend: str) -> bool:
    """Whether attention runs on a fused kernel whose outputs `checkpointing.keep_attention` can
    keep: flash_attention_2, flash_attn_4, or SDPA with any first choice but the math path."""
    return implementation in ("flash_attention_2", "flash_attn_4") or (
        implementation == "sdpa" and sdpa_backend != "math")

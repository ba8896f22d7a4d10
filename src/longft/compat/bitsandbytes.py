"""bitsandbytes internals longft uses (QLoRA, lora.quantize):

- `functional.dequantize_4bit` is replaced by a wrapper that dequantizes on the CPU through the
  flat shape (model/quantize.py says why); bitsandbytes, peft and longft look it up at each call.
- `Linear4bit.support_avx512bf16_for_cpu`: set False so the no-grad CPU forward does not repack the
  weight (its gemv then fails on widths that are not whole blocks).
- the op `bitsandbytes::gemm_4bit` (the 4-bit layers' forward, with and without grad, since 0.50)
  gets a CPU kernel that dequantizes through the flat shape too (model/quantize.py); bitsandbytes
  registers only its device-independent one, which a CPU kernel overrides for CPU tensors.
"""

from __future__ import annotations

from longft.compat import Access

ACCESSES = (
    Access("quantize", "bitsandbytes.functional", "dequantize_4bit"),
    Access("quantize", "bitsandbytes.nn.modules", "support_avx512bf16_for_cpu", owner="Linear4bit",
           kind="instance"),
    Access("quantize", "bitsandbytes", "gemm_4bit", owner="torch.ops.bitsandbytes"),
)

GEMM_4BIT = "bitsandbytes::gemm_4bit"


def replace_dequantize_4bit(functional, wrap) -> bool:
    """functional.dequantize_4bit = wrap(original), once; False when it is wrapped already."""
    original = functional.dequantize_4bit
    if getattr(original, "_longft_flat_on_cpu", False):
        return False
    new = wrap(original)
    new._longft_flat_on_cpu = True
    functional.dequantize_4bit = new
    return True


def no_cpu_repack(layer) -> None:
    """Keep a Linear4bit on the plain dequantize path on AVX512-BF16 CPUs."""
    layer.support_avx512bf16_for_cpu = False


_registered: list = []


def register_cpu_gemm_4bit(kernel) -> bool:
    """`kernel` serves bitsandbytes::gemm_4bit on CPU tensors, once (torch keeps the registration
    for the process); False when registered already."""
    if _registered:
        return False
    import torch

    torch.library.register_kernel(GEMM_4BIT, "cpu", kernel)
    _registered.append(kernel)
    return True

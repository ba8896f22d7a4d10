"""bitsandbytes internals longft uses (QLoRA, lora.quantize):

- `functional.dequantize_4bit` is replaced by a wrapper that dequantizes on the CPU through the
  flat shape (model/quantize.py says why); bitsandbytes, peft and longft look it up at each call.
- `Linear4bit.support_avx512bf16_for_cpu`: set False so the no-grad CPU forward does not repack the
  weight (its gemv then fails on widths that are not whole blocks).
"""

from __future__ import annotations

from longft.compat import Access

ACCESSES = (
    Access("quantize", "bitsandbytes.functional", "dequantize_4bit"),
    Access("quantize", "bitsandbytes.nn.modules", "support_avx512bf16_for_cpu", owner="Linear4bit",
           kind="instance"),
)


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

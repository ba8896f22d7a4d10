"""Real bytes of bitsandbytes' quantized base weights (QLoRA: `lora.quantize` nf4 / int8) and 8-bit
Adam states (`optim.name` adamw_8bit / paged_adamw_8bit), and the ZeRO stage QLoRA runs on.

Pure functions; the formulas and where each byte comes from are in docs/estimator.md ("QLoRA and
8-bit optimizer states"). The rows measured against it (NF4 on an emulated 24 GiB card) are in
bench/LOG.md.
"""

from __future__ import annotations

from longft.config import qlora

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder linears that QLoRA replaces with bitsandbytes' Linear4bit / Linear8bitLt (all seven,
whatever lora.target_modules adapts); embeddings, lm_head and norms stay in the training dtype."""
NF4_BLOCK = 64
"""bitsandbytes quantize_4bit's blocksize: one absmax per 64 weights."""
NF4_NESTED_BLOCK = 256
"""Double quantization: the absmax values in 8 bits, one fp32 scale per 256 of them."""
NF4_CONSTANTS = 4 + 16 * 4 + 256 * 4
"""Per quantized weight: the nested absmax's fp32 offset, the 16-entry fp32 NF4 code and the
256-entry fp32 code of the nested 8-bit absmax (quantize_blockwise copies it into each state)."""
INT8_ROW_SCALE = 4
"""LLM.int8: one fp32 scale (SCB) per output row of an int8 weight."""
ADAM8_BLOCK = 256
"""bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per 256 elements and state."""
ADAM8_QMAPS = 2 * 256 * 4
"""Per tensor the 8-bit optimizer steps: the two 256-entry fp32 quantization maps (qmap1, qmap2)."""
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")



def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight in NF4 with double quantization: 4-bit codes, an 8-bit absmax per 64
    weights, an fp32 scale per 256 absmax values and the constants (~0.5159 B per weight). The
    tensors of bitsandbytes 0.50's quantize_4bit, byte for byte (tests/test_estimate_qlora.py)."""
    blocks = _ceil(numel, NF4_BLOCK)
    return _ceil(numel, 2) + blocks + 4 * _ceil(blocks, NF4_NESTED_BLOCK) + NF4_CONSTANTS


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of one LLM.int8 weight: 1 B per weight and an fp32 scale per output row."""
    return in_features * out_features + INT8_ROW_SCALE * out_features


def quantized_weight_bytes(quantize: str, in_features: int, out_features: int) -> int:
    """Bytes of one quantized linear's weight (`quantize` nf4 or int8)."""
    if quantize == "nf4":
        return nf4_bytes(in_features * out_features)
    if quantize == "int8":
        return int8_bytes(in_features, out_features)
    raise ValueError(f"quantize {quantize!r} is not nf4 or int8")


def dequant_workspace_bytes(quantize: str, numel: int, w: int) -> int:
    """The transient of one dequantization: the weight in the training dtype (`w` B each), plus,
    for NF4, the absmax values restored to fp32 first."""
    return w * numel + (4 * _ceil(numel, NF4_BLOCK) if quantize == "nf4" else 0)


def adam8_state_bytes(numel: int) -> int:
    """Adam's m and v for one optimizer tensor in bitsandbytes' blockwise 8-bit form: 1 B each per
    element, an fp32 absmax per 256 elements each (2 + 8/256 B per element) and the two
    quantization maps (AdamW8bit's state of bitsandbytes 0.50, byte for byte). DeepSpeed hands the
    optimizer flat partitions, so every element is in 8 bits (bitsandbytes keeps fp32 states only
    for tensors under 4,096 elements)."""
    return 2 * numel + 2 * 4 * _ceil(numel, ADAM8_BLOCK) + ADAM8_QMAPS


qlora_zero_stage = qlora.stage
"""The ZeRO stage a run trains on (a quantized base, QLoRA or block-sparse: ZeRO-2): config/qlora.py's
rule, not a copy of it."""

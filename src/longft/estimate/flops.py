"""Model FLOPs per token, dense peak FLOPS per GPU, and MFU. Pure functions, no GPU needed.

FLOPs per token of a decoder-only transformer (one multiply-add = 2 FLOPs), with
  h = hidden_size, L = num_hidden_layers, a = num_attention_heads, g = num_key_value_heads,
  d = head_dim (default h / a), f = intermediate_size, V = vocab_size, S = sequence length:

  matmul weights per layer   P_layer = h*a*d (q) + 2*h*g*d (k, v, grouped-query) + a*d*h (o)
                                       + 3*h*f (gated MLP: gate, up, down)
  matmul weights in total    P_mm    = L * P_layer + h*V (lm_head; a matmul even when tied)
  forward, matmuls           2 * P_mm
  forward, attention         L * 2 * 2 * S * d * a / 2 = 2*L*S*d*a
                             (QK^T and AV: 2*S*d*a FLOPs each per token and layer, halved because
                             a causal token attends on average to half the sequence)
  per token                  F_fwd = 2 * P_mm + 2*L*S*d*a
  training                   3 * F_fwd (backward = 2 x forward); activation recompute is NOT
                             counted, so MFU is *model* FLOPs utilisation, not hardware utilisation.
  training with LoRA         3 * F_fwd - 2 * P_mm + 6 * P_lora (frozen weights get no gradient
                             matmul; the adapters' own P_lora parameters train as usual)

Embedding lookups, norms, rotary embeddings, activations and the softmax are left out (they are
O(h) per token, not O(h^2)). With S << 6h this is close to the familiar 6 * n_params; at 128K tokens
attention dominates. For packed rows, where each document attends only to itself, the attention work
of a row is sum(L_i^2) / 2 pairs, so S is sum(L_i^2) / sum(L_i) over the documents' real tokens
(metrics.summary.attention_length; the trainer logs sum(L_i^2) per step): packed rows are neither
flattered nor penalised.

MFU = tokens/s x FLOPs per token / (n_gpus x dense peak FLOPS of that GPU and dtype).
PEAK_TFLOPS holds *dense* (no 2:4 sparsity) datasheet numbers; an unknown GPU gives None, never a
guess, so MFU is reported as null rather than wrong.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from longft.model.architecture import attention_dims, text_config

_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size")


def _config_numbers(cfg: Any) -> dict[str, int]:
    """Read the architecture numbers from a transformers PretrainedConfig or a plain dict."""
    cfg = text_config(cfg)  # multimodal configs nest the language model's numbers
    if isinstance(cfg, Mapping):
        get = cfg.get
    else:
        def get(key, default=None):
            return getattr(cfg, key, default)
    missing = [k for k in _CONFIG_FIELDS if get(k) is None]
    if missing:
        raise ValueError(f"model config lacks {', '.join(missing)}: cannot count FLOPs per token")
    n = {k: int(get(k)) for k in _CONFIG_FIELDS}
    n["head_dim"], n["num_key_value_heads"] = attention_dims(
        n["hidden_size"], n["num_attention_heads"], get("head_dim"), get("num_key_value_heads"))
    return n


def matmul_params(cfg: Any) -> int:
    """Weights that take part in a matmul for every token: projections, MLP and lm_head."""
    n = _config_numbers(cfg)
    h, a, g, d, f = (n["hidden_size"], n["num_attention_heads"], n["num_key_value_heads"],
                     n["head_dim"], n["intermediate_size"])
    per_layer = h * a * d + 2 * h * g * d + a * d * h + 3 * h * f
    return n["num_hidden_layers"] * per_layer + h * n["vocab_size"]


def attention_flops(cfg: Any, seq_len: float) -> float:
    """Causal attention's forward FLOPs per token in one layer: 2 * S * d * a."""
    n = _config_numbers(cfg)
    return 2 * seq_len * n["head_dim"] * n["num_attention_heads"]


def flops_per_token(cfg: Any, seq_len: float, training: bool = True,
                    lora_params: Optional[int] = None) -> float:
    """Model FLOPs per token (formula in the module docstring); x3 for a training step.

    `lora_params` (LoRA: the adapters' trainable parameter count): the frozen weights' gradients
    are never computed, so a training step is 3 x forward - 2 x P_mm (no weight-gradient matmuls)
    plus the adapters' own 6 x lora_params; the activations' gradients are still all needed."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n = _config_numbers(cfg)
    forward = 2 * matmul_params(cfg) + n["num_hidden_layers"] * attention_flops(cfg, seq_len)
    if not training:
        return float(forward)
    if lora_params is not None:
        return float(3 * forward - 2 * matmul_params(cfg) + 6 * lora_params)
    return float(3 * forward)


# Dense peak TFLOPS (tensor cores where the dtype has them), from NVIDIA datasheets; values printed
# "with sparsity" are halved. None = the GPU has no fast path for that dtype (bf16/tf32 before
# Ampere), so no MFU is reported for it.
PEAK_TFLOPS: dict[str, dict[str, Optional[float]]] = {
    # V100 datasheet: "Tensor Performance" (fp16 in, fp32 accumulate) and single precision.
    "V100-SXM2": {"fp16": 125.0, "bf16": None, "tf32": None, "fp32": 15.7},
    "V100-PCIE": {"fp16": 112.0, "bf16": None, "tf32": None, "fp32": 14.0},
    "V100S-PCIE": {"fp16": 130.0, "bf16": None, "tf32": None, "fp32": 16.4},
    # T4 datasheet: mixed precision (FP16/FP32) 65, single precision 8.1.
    "T4": {"fp16": 65.0, "bf16": None, "tf32": None, "fp32": 8.1},
    # A10 datasheet: BF16/FP16 125 | 250*, TF32 62.5 | 125*, FP32 31.2.
    "A10": {"fp16": 125.0, "bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # A10G (AWS G5; no NVIDIA datasheet): AWS/NVIDIA published 70 dense FP16/BF16, 35 TF32, 35 FP32.
    "A10G": {"fp16": 70.0, "bf16": 70.0, "tf32": 35.0, "fp32": 35.0},
    # RTX A6000 datasheet: tensor 309.7* (sparse); GA102 whitepaper: FP16/BF16 154.8, TF32 77.4.
    "A6000": {"fp16": 154.8, "bf16": 154.8, "tf32": 77.4, "fp32": 38.7},
    # L4 datasheet: FP16/BF16 242*, TF32 120*, FP32 30.3.
    "L4": {"fp16": 121.0, "bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # L40S datasheet: FP16/BF16 362.05 | 733*, TF32 183 | 366*, FP32 91.6.
    "L40S": {"fp16": 362.05, "bf16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # L40 datasheet: FP16/BF16 362.05* (sparse), TF32 181*, FP32 90.5.
    "L40": {"fp16": 181.0, "bf16": 181.0, "tf32": 90.5, "fp32": 90.5},
    # Consumer and workstation cards (Ampere / Ada whitepapers): the tensor rate with FP32
    # accumulate (what bf16 training runs), dense. RTX 3090: 71 | 142*, TF32 35.6, FP32 35.6;
    # RTX 4090: 165.2 | 330.4*, TF32 82.6, FP32 82.6; RTX 6000 Ada: 364.2 | 728.5*, TF32 182.1,
    # FP32 91.1.
    "RTX-3090": {"fp16": 71.0, "bf16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "RTX-4090": {"fp16": 165.2, "bf16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX-6000-ADA": {"fp16": 364.2, "bf16": 364.2, "tf32": 182.1, "fp32": 91.1},
    # A100 datasheet (40/80 GB, SXM and PCIe alike): BF16/FP16 312, TF32 156, FP32 19.5.
    "A100-SXM": {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A100-PCIE": {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # H100 datasheet: SXM BF16/FP16 1979*, TF32 989*, FP32 67; PCIe 1513*, 756*, 51;
    # NVL 1671*, 835*, 60.
    "H100-SXM": {"fp16": 989.5, "bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100-PCIE": {"fp16": 756.5, "bf16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100-NVL": {"fp16": 835.5, "bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # H200 datasheet: SXM as H100 SXM; NVL 1671*, 835*, 60.
    "H200-SXM": {"fp16": 989.5, "bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H200-NVL": {"fp16": 835.5, "bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
}

_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16", "tf32": "tf32", "fp32": "fp32", "float32": "fp32",
                  "float": "fp32"}


def gpu_model_key(gpu_name: Optional[str]) -> Optional[str]:
    """Map an NVML / torch device name to a PEAK_TFLOPS key, or None when not sure.

    "Tesla V100-SXM2-16GB" -> V100-SXM2, "NVIDIA A100-SXM4-40GB" -> A100-SXM,
    "NVIDIA A100 80GB PCIe" -> A100-PCIE, "NVIDIA H100 80GB HBM3" -> H100-SXM, "NVIDIA H200" ->
    H200-SXM, "NVIDIA RTX A6000" -> A6000, "NVIDIA GeForce RTX 4090" -> RTX-4090. A MIG slice,
    a 3090 Ti, a 4090 D or laptop part, "GH200" -> None.
    """
    if not gpu_name:
        return None
    words = re.split(r"[\s\-_/]+", gpu_name.upper().strip())
    words = [w for w in words if w]
    if "MIG" in words:  # a slice has a fraction of the device's peak
        return None
    has = set(words).__contains__
    sxm = any(w.startswith("SXM") for w in words)
    pcie = has("PCIE")
    nvl = has("NVL")

    if has("V100"):
        return "V100-SXM2" if "SXM2" in words else "V100-PCIE" if pcie else None
    if has("V100S"):
        return "V100S-PCIE" if pcie else None
    if has("T4"):
        return "T4"
    if has("A10"):
        return "A10"
    if has("A10G"):
        return "A10G"
    if has("A6000") and has("RTX") and not has("ADA"):
        return "A6000"
    if has("6000") and has("ADA"):
        return "RTX-6000-ADA"
    if not has("TI") and (has("3090") or has("4090")):   # a Ti, a laptop part: other rates
        return None if has("LAPTOP") or has("D") else "RTX-4090" if has("4090") else "RTX-3090"
    if has("L40"):
        return "L40"
    if has("L4"):
        return "L4"
    if has("L40S"):
        return "L40S"
    if has("A100"):
        return "A100-SXM" if sxm else "A100-PCIE" if pcie else None
    if has("H100"):
        if nvl:
            return "H100-NVL"
        if pcie:
            return "H100-PCIE"
        return "H100-SXM" if sxm or has("HBM3") else None
    if has("H200"):
        if nvl:
            return "H200-NVL"
        return None if pcie else "H200-SXM"  # "NVIDIA H200" is the SXM board
    return None


def peak_flops(gpu_name: Optional[str], dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of one GPU for a dtype (bf16/fp16/tf32/fp32); None if unknown or CPU."""
    key = gpu_model_key(gpu_name)
    dt = _DTYPE_ALIASES.get(str(dtype).lower())
    if key is None or dt is None:
        return None
    tflops = PEAK_TFLOPS[key].get(dt)
    return None if tflops is None else tflops * 1e12


def mfu(tokens_per_s: Optional[float], flops_per_token: Optional[float], n_gpus: int,
        peak_per_gpu: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1]; None when any input is unknown."""
    if tokens_per_s is None or flops_per_token is None or peak_per_gpu is None or n_gpus <= 0:
        return None
    if peak_per_gpu <= 0:
        return None
    return tokens_per_s * flops_per_token / (n_gpus * peak_per_gpu)

"""The speed heuristic that ranks `longft placement`'s candidates: predicted seconds of an optimizer
step and tokens/s for a Setup (compute at a fixed share of the peak, host copies, CPU or GPU Adam,
NVMe, QLoRA's dequantization), attention counted per document over the data's attention length.
Its constants and formula, and how far off it is on the measured rows, are in docs/estimator.md;
it ranks, its absolute numbers are rough.
"""

from __future__ import annotations

import dataclasses

from longft.estimate.arch import trainable_numels
from longft.estimate.estimator import Setup, param_numels
from longft.model.tiled_mlp import skips_recompute, tiles

ACHIEVED_FRACTION = 0.5
"""Fraction of the dense peak that matmuls reach, recompute included (H200 rows: 0.39 MFU x 4/3)."""
UNKNOWN_PEAK_FLOPS = 312e12
"""Dense bf16 peak assumed when the GPU is not in flops.PEAK_TFLOPS (an A100)."""


def peak_note(gpu_name: str | None, precision: str = "bf16") -> str | None:
    """What the speed ranking assumes where it does not know the GPU's peak (None where it does)."""
    from longft.estimate.flops import peak_flops

    if gpu_name and peak_flops(gpu_name, precision):
        return None
    which = f"{gpu_name!r} is not a GPU whose peak longft knows" if gpu_name else "no GPU named"
    return (f"{which}: tokens/s assume an A100's {UNKNOWN_PEAK_FLOPS / 1e12:.0f} TFLOP/s {precision}; "
            f"scale them by your card's dense {precision} peak / {UNKNOWN_PEAK_FLOPS / 1e12:.0f} "
            f"(--gpu-name takes e.g. 'NVIDIA GeForce RTX 4090', 'NVIDIA RTX A6000', 'NVIDIA H100 "
            f"80GB HBM3'); memory does not depend on it")


MICRO_OVERHEAD_TOKENS = 2048
"""Fixed cost of one micro-step (launches, hooks, syncs) in token-equivalents of compute."""
MIN_LAYER_SECONDS = 1e-3
"""The least time one layer takes in a micro-step, whatever its FLOPs: forward, backward and
recompute launch some 60 kernels and pass ZeRO-3's fetch and release hooks (a floor set by that
count, not fitted: it bites only models far smaller than any measured row, where MICRO_OVERHEAD_TOKENS,
scaled by the model's FLOPs, predicted millions of tokens/s for a 2-layer model of width 64)."""
HOST_LINK_BYTES_PER_S = 20e9
"""Effective PCIe bandwidth for parameter fetches, gradient and checkpoint copies."""
EXPOSED_FRACTION = 0.5
"""Share of host<->GPU copy time not hidden behind compute."""
CPU_ADAM_PARAMS_PER_S = 2.2e9
"""DeepSpeedCPUAdam speed (H200 row b: 1.24e9 parameters in 0.55 s on 16 cores)."""
GPU_ADAM_BYTES_PER_S = 1.5e12
"""Fused Adam on the GPU: 16 B read+written per parameter at about this rate."""
NVME_BYTES_PER_S = 2e9
"""offload_optimizer nvme: the read and the write bandwidth assumed for the state files (a PCIe 4
NVMe drive; DeepSpeed's aio reaches about this per drive) where the disk's own is not given
(Setup.disk_read_bps / disk_write_bps, `longft placement --disk-bandwidth`)."""
DEQUANT_BYTES_PER_S = 1.0e12
"""QLoRA, an assumption until a measured row replaces it: the rate at which bitsandbytes turns a
quantized weight back into the training dtype (its blocks read, the weight written), about the
memory bandwidth of a 24 GB card (an H200 has 4.8 TB/s). Dequantization is the only QLoRA cost
modelled: the bf16 GEMM after it is LoRA's own, so at long contexts QLoRA predicts nearly LoRA's
speed. The plan says QLoRA speeds are unmeasured."""


def step_seconds(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted seconds of one optimizer step (grad_accum micro-steps) on one rank.

    Attention is counted over `s.attention_length`, the span a token's causal attention covers:
    sum(L_i^2) / sum(L_i) over the rows' documents (packed rows attend per document; a prepared
    data set's stats.json and a run's train.json hold it); None: seq_len, one document a row."""
    from longft.estimate.flops import attention_flops, flops_per_token, peak_flops

    T = s.local_tokens  # sequence parallel: N micro-steps of seq / N tokens for each row
    w = 4 if s.precision == "fp32" else 2
    P_r = sum(n for _, n in param_numels(arch)) / s.world_size
    peak = peak_flops(gpu_name, s.precision) or UNKNOWN_PEAK_FLOPS
    recompute = 1.0 if s.checkpointing == "none" else 4 / 3
    lora = (sum(trainable_numels(arch, s)) if s.lora_rank or s.sparse_blocks  # no frozen
            else None)                                                      # weights' gradients
    # a dense [seq x seq] block mask (kernels.packed_attention: mask) computes the whole row
    span = s.seq_len if s.block_mask or not s.attention_length else s.attention_length
    micro = T * flops_per_token(arch, span, lora_params=lora) * recompute / (ACHIEVED_FRACTION * peak)
    micro *= 1 + MICRO_OVERHEAD_TOKENS / T
    skipped = skips_recompute(s.checkpointing, arch.get("model_type"))
    if s.checkpointing != "none" and s.keep_attention:  # their attention forward runs once
        kept = min(s.keep_attention, arch["num_hidden_layers"])
        micro -= T * attention_flops(arch, span) * kept / (ACHIEVED_FRACTION * peak)
    if s.tiled_mlp and tiles(T, s.tile_tokens) > 1 and not skipped:  # one more MLP forward
        mlp = 2 * 3 * arch["hidden_size"] * arch["intermediate_size"] * arch["num_hidden_layers"]
        micro += T * mlp / (ACHIEVED_FRACTION * peak)
    if s.offload_param:      # fetch every layer for forward, recompute and backward
        micro += EXPOSED_FRACTION * 3 * w * P_r / HOST_LINK_BYTES_PER_S
    if s.checkpointing == "cpu_offload":
        moved = max(0, arch["num_hidden_layers"] - s.gpu_layers)
        micro += EXPOSED_FRACTION * 2 * moved * T * arch["hidden_size"] * w / HOST_LINK_BYTES_PER_S
    if s.quantize != "none":
        micro += dequant_seconds(arch, s)
    micro = max(micro, MIN_LAYER_SECONDS * arch["num_hidden_layers"])
    return s.grad_accum * s.sequence_parallel * micro + optimizer_seconds(arch, s)


def dequant_seconds(arch: dict, s: Setup) -> float:
    """QLoRA: each quantized linear is dequantized for the forward, the recompute (with
    checkpointing) and the backward's input gradient: its blocks read and the weight written in
    the training dtype each time, at DEQUANT_BYTES_PER_S (an assumption, unmeasured)."""
    from longft.estimate.arch import numbers

    n = numbers(arch, s)
    passes = 2 if s.checkpointing == "none" else 3
    return passes * (n.quant_bytes + n.w * n.Pq) / DEQUANT_BYTES_PER_S


def optimizer_seconds(arch: dict, s: Setup) -> float:
    """Predicted seconds of the optimizer step: CPU Adam over the host's sub-groups (plus copying
    their weights back, and with NVMe reading and writing their states), GPU Adam over the rest."""
    from longft.estimate.arch import numbers

    n = numbers(arch, s)
    on_gpu, on_host = sum(n.gpu_groups), sum(n.host_groups)
    # master, gradient, m, v; 8-bit Adam reads and writes m and v in 1 B each
    per = 4 * n.ms if s.optimizer == "adamw" else 2 * n.ms + 2
    t = per * on_gpu / GPU_ADAM_BYTES_PER_S
    if on_host:
        t += on_host / CPU_ADAM_PARAMS_PER_S + n.w * on_host / HOST_LINK_BYTES_PER_S
        if s.nvme:   # every state read and written once a step, at the disk's own rates
            states = 4 * n.ms * on_host
            t += (states / (s.disk_read_bps or NVME_BYTES_PER_S)
                  + states / (s.disk_write_bps or NVME_BYTES_PER_S))
    return t


def tokens_per_second(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted tokens/s of the whole job (all ranks), padding left out (`s.padding`) as a run's
    own tokens/s leaves it out."""
    tokens = s.world_size * s.grad_accum * s.micro_batch * s.seq_len * (1 - s.padding)
    return tokens / step_seconds(arch, s, gpu_name)


def speed_prediction(estimate: dict, arch: dict, gpu_name: str | None, measured: float | None,
                     attention_length: float | None, padding: float | None) -> dict | None:
    """A run's measured tokens/s beside the heuristic's for its own plan (`estimate`: plan.json's
    itemised estimate, whose "setup" it reads), at the run's own attention length and padding
    (train.json's attention_length and padding_fraction). None on CPU or a GPU whose peak FLOPS
    flops.peak_flops does not know: the heuristic is about GPUs."""
    from longft.estimate.estimator import rel_error
    from longft.estimate.flops import peak_flops
    from longft.estimate.format import setup_from_dict

    if not measured or not estimate or "setup" not in estimate:
        return None
    s = setup_from_dict(estimate["setup"])
    if s.device != "cuda" or not peak_flops(gpu_name, s.precision):
        return None
    s = dataclasses.replace(s, attention_length=attention_length, padding=padding or 0.0)
    pred = tokens_per_second(arch, s, gpu_name)
    whole = tokens_per_second(arch, dataclasses.replace(s, attention_length=None), gpu_name)
    return {"predicted_tok_s": round(pred, 1), "measured_tok_s": measured,
            "rel_error": rel_error(pred, measured), "attention_length": attention_length,
            "whole_row_tok_s": round(whole, 1),
            "doc": "docs/estimator.md#placement-search-and-speed-heuristic"}

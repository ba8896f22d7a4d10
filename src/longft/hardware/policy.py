"""What hardware is here, and what every `auto` in params.yaml resolves to on it, with the reason.

All hardware decisions happen in `resolve()`; each returns the value *and* why. Impossible requests
(bf16 or FlashAttention-2 on a V100, a GPU asked for on a machine without one) are collected and
raised together as a `PlanError` before any model is built. Tests pass a fake `Hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass

from longft.config.params import Config, ConfigError
from longft.hardware.machine import Hardware

# Model families whose decoder layers Liger can patch (liger_kernel.transformers.monkey_patch).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
TILED_MLP_FROM = 65536
"""kernels.tiled_mlp auto turns on from this sequence length: below it the MLP intermediates are a
few GiB and tiling only costs time."""


class PlanError(ConfigError):
    """The request cannot run on this hardware; each problem says what to change."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, "params.yaml for this hardware")


@dataclass(frozen=True)
class Choice:
    value: object
    reason: str


def resolve(cfg: Config, hw: Hardware, model_type: str) -> dict[str, Choice]:
    """Resolve device, precision, attention, liger and checkpointing for `hw`; raise PlanError."""
    problems: list[str] = []
    out: dict[str, Choice] = {}
    h = cfg.hardware
    cap = hw.capability
    cap_s = f"{cap[0]}.{cap[1]}" if cap else None

    # device
    if h.device == "cuda" and hw.device != "cuda":
        problems.append("hardware.device: cuda was asked for but no CUDA GPU is visible "
                        "(check `nvidia-smi`, CUDA_VISIBLE_DEVICES, `docker run --gpus all`); "
                        "set hardware.device: auto or cpu to run on the CPU")
        device = "cpu"
    elif h.device == "auto":
        device = hw.device
        out["device"] = Choice(device, f"auto: {'a CUDA GPU is visible (' + str(hw.gpu_name) + ')' if device == 'cuda' else 'no CUDA GPU visible; DeepSpeed CPU accelerator with gloo'}")
    else:
        device = h.device
    out.setdefault("device", Choice(device, f"set in params ({h.device})"))

    if device == "cuda" and h.num_nodes == 1 and h.num_gpus > hw.gpu_count:
        problems.append(f"hardware.num_gpus: {h.num_gpus} asked for but only {hw.gpu_count} GPU(s) "
                        f"visible; set hardware.num_gpus <= {hw.gpu_count}")
    if device == "cpu" and h.num_gpus > hw.cpu_count:
        problems.append(f"hardware.num_gpus: {h.num_gpus} CPU workers asked for on {hw.cpu_count} "
                        f"cores; set hardware.num_gpus <= {hw.cpu_count}")

    # precision
    p = cfg.precision
    if device == "cpu":
        if p == "fp16":
            problems.append("precision: fp16 is not supported on CPU; use bf16 or fp32 (or auto)")
        out["precision"] = Choice("bf16" if p == "auto" else p,
                                  "auto: bf16 on CPU (fp16 has no CPU kernels)" if p == "auto"
                                  else "set in params")
    else:
        bf16_ok = cap is not None and cap >= (8, 0)
        if p == "auto":
            out["precision"] = Choice("bf16" if bf16_ok else "fp16",
                                      f"auto: compute capability {cap_s} "
                                      + ("supports bf16" if bf16_ok else "< 8.0 has no bf16; fp16 with dynamic loss scaling"))
        else:
            if p == "bf16" and not bf16_ok:
                problems.append(f"precision: bf16 needs compute capability >= 8.0 but {hw.gpu_name} "
                                f"is {cap_s}; use fp16 (dynamic loss scaling) or auto")
            out["precision"] = Choice(p, "set in params")

    # attention
    a = cfg.kernels.attention
    fa2_ok = device == "cuda" and cap is not None and cap >= (8, 0) and hw.flash_attn
    if a == "auto":
        if fa2_ok:
            out["attention"] = Choice("flash_attention_2", f"auto: flash-attn installed, capability {cap_s} >= 8.0")
        elif device == "cuda" and cap is not None and cap >= (8, 0):
            out["attention"] = Choice("sdpa", "auto: flash-attn not installed; PyTorch SDPA")
        elif device == "cuda":
            out["attention"] = Choice("sdpa", f"auto: capability {cap_s} < 8.0 cannot run FlashAttention-2; PyTorch SDPA (memory-efficient kernel)")
        else:
            out["attention"] = Choice("sdpa", "auto: CPU; PyTorch SDPA")
    else:
        if a == "flash_attention_2":
            if device != "cuda":
                problems.append("kernels.attention: flash_attention_2 needs a CUDA GPU; use sdpa")
            elif cap is not None and cap < (8, 0):
                problems.append(f"kernels.attention: flash_attention_2 needs compute capability >= 8.0 "
                                f"but {hw.gpu_name} is {cap_s}; use sdpa (or auto)")
            elif not hw.flash_attn:
                problems.append("kernels.attention: flash_attention_2 asked for but flash-attn is not "
                                "installed; `pip install longft[flash]` (the Ampere image has it) or use sdpa")
        out["attention"] = Choice(a, "set in params")

    # SDPA kernel (only meaningful when attention is sdpa)
    sb = cfg.kernels.sdpa_backend
    attn = out["attention"].value
    if attn != "sdpa":
        out["sdpa_backend"] = Choice("default", f"attention is {attn}, not sdpa")
    elif sb == "auto":
        if device != "cuda":
            out["sdpa_backend"] = Choice("default", "auto: CPU; PyTorch's own choice")
        elif cap is not None and cap >= (9, 0):
            out["sdpa_backend"] = Choice("cudnn", f"auto: capability {cap_s}: cuDNN attention is "
                                         "1.6-1.9x faster than the flash kernel on Hopper")
        elif cap is not None and cap >= (8, 0):
            out["sdpa_backend"] = Choice("flash", f"auto: capability {cap_s}: the flash kernel")
        else:
            out["sdpa_backend"] = Choice("efficient", f"auto: capability {cap_s} < 8.0 has no flash "
                                         "or cuDNN kernel; memory-efficient kernel, K/V heads expanded")
    else:
        if sb in ("cudnn", "efficient") and device != "cuda":
            problems.append(f"kernels.sdpa_backend: {sb} needs a CUDA GPU; use auto or default on CPU")
        elif sb in ("flash", "cudnn") and device == "cuda" and cap is not None and cap < (8, 0):
            problems.append(f"kernels.sdpa_backend: {sb} needs compute capability >= 8.0 but "
                            f"{hw.gpu_name} is {cap_s}; use efficient (or auto)")
        out["sdpa_backend"] = Choice(sb, "set in params")

    # liger
    lg = cfg.kernels.liger
    family_ok = model_type in LIGER_FAMILIES
    if lg == "auto":
        if device != "cuda":
            out["liger"] = Choice(False, "auto: off on CPU (Liger kernels are Triton GPU kernels)")
        elif not hw.liger:
            out["liger"] = Choice(False, "auto: liger-kernel is not installed")
        elif not family_ok:
            out["liger"] = Choice(False, f"auto: model_type {model_type!r} has no Liger patch")
        else:
            out["liger"] = Choice(True, f"auto: CUDA and Liger supports {model_type!r}")
    elif lg == "on":
        if device != "cuda":
            problems.append("kernels.liger: on needs a CUDA GPU; use auto or off")
        elif not hw.liger:
            problems.append("kernels.liger: on but liger-kernel is not installed; `pip install liger-kernel`")
        elif not family_ok:
            problems.append(f"kernels.liger: on but model_type {model_type!r} has no Liger patch "
                            f"(supported: {', '.join(LIGER_FAMILIES)}); set off")
        out["liger"] = Choice(True, "set in params")
    else:
        out["liger"] = Choice(False, "set in params")

    # sequence-tiled MLP
    tm = cfg.kernels.tiled_mlp
    # TiledMLP recomputes the MLP tile by tile in backward without restoring the RNG state: LoRA
    # dropout would draw other masks than the forward's, and the gradients would be wrong.
    dropout = cfg.lora.rank > 0 and cfg.lora.dropout > 0
    if tm == "on" and dropout:
        problems.append(f"kernels.tiled_mlp: on cannot run with lora.dropout {cfg.lora.dropout} "
                        "(its backward recomputes the MLP with new dropout masks); set "
                        "lora.dropout: 0 or kernels.tiled_mlp: off")
    if tm == "auto" and dropout:
        out["tiled_mlp"] = Choice(False, "auto: off (lora.dropout > 0: the tiled backward would "
                                         "draw new dropout masks)")
    elif tm == "auto":
        long = cfg.data.max_seq_length >= TILED_MLP_FROM
        out["tiled_mlp"] = Choice(long, f"auto: {'on' if long else 'off'} (max_seq_length "
                                        f"{cfg.data.max_seq_length} {'>=' if long else '<'} {TILED_MLP_FROM})")
    else:
        out["tiled_mlp"] = Choice(tm == "on", "set in params")

    # activation checkpointing
    m = cfg.checkpointing.mode
    if m == "auto":
        out["checkpointing"] = Choice("gpu", "auto: recompute each decoder layer in backward, layer inputs kept on the device")
    else:
        if m == "cpu_offload" and device != "cuda":
            problems.append("checkpointing.mode: cpu_offload needs a CUDA GPU; use gpu or none")
        out["checkpointing"] = Choice(m, "set in params")

    # host gradient buffer (grad_buffer.py)
    hb, z = cfg.zero.host_grad_buffer, cfg.zero
    why_not = why_not_shared_grad_buffer(z.stage, z.offload_optimizer == "cpu", cfg.grad_accum_steps,
                                  out["precision"].value)
    if hb == "shared" and why_not:
        problems.append(f"zero.host_grad_buffer: shared cannot run here: {'; '.join(why_not)}. "
                        "Set it to auto or full")
    if hb == "auto":
        out["host_grad_buffer"] = Choice("full" if why_not else "shared",
                                         f"auto: full ({why_not[0]})" if why_not else
                                         "auto: shared (ZeRO-3 offload, one micro-step per step)")
    else:
        out["host_grad_buffer"] = Choice(hb, "set in params")

    if device == "cuda" and h.vram_limit_gib is not None and hw.gpu_mem_gib is not None \
            and h.vram_limit_gib > hw.gpu_mem_gib:
        problems.append(f"hardware.vram_limit_gib: {h.vram_limit_gib} is more than the "
                        f"{hw.gpu_mem_gib} GiB of {hw.gpu_name}; lower it or set null")

    if problems:
        raise PlanError(problems)
    return out


def why_not_shared_grad_buffer(stage: int, offload_optimizer: bool, grad_accum: int, precision: str) -> list[str]:
    """Why a shared slot would not be exact for this setup ([] = it is): the one rule that
    resolve, the estimator and the planner apply."""
    return [why for why, bad in (
        (f"zero.stage is {stage}", stage != 3),
        ("zero.offload_optimizer is none", not offload_optimizer),
        (f"gradients accumulate over {grad_accum} micro-steps "
         "(train.global_batch_size > micro_batch_size x GPUs)", grad_accum > 1),
        ("precision is fp16 (DeepSpeed's overflow check reads every partition's host copy)",
         precision == "fp16")) if bad]

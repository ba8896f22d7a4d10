"""The rules of QLoRA (`lora.quantize`) and of bitsandbytes' 8-bit AdamW (`optim.name`), written once.

QLoRA runs on ZeRO-2: the frozen 4/8-bit base weights stay whole on each GPU, and only the
adapters (and their optimizer states) are partitioned. ZeRO-3 would partition the packed weights
but not bitsandbytes' quantization state that travels beside them, so a QLoRA run on zero.stage 3 is
refused with the fix (zero.stage: 2): params.yaml, the plan, the metrics and `dvc exp show` all say
the stage that runs. The plan's `quantize` choice gives the reason (hardware.policy).
"""

from __future__ import annotations

from longft.config.sections import Config

QLORA_STAGE = 2
STAGE_REASON = ("QLoRA runs on ZeRO-2: the frozen quantized base weights stay whole on each GPU "
                "(ZeRO-3 would partition the packed weights but not bitsandbytes' quantization "
                "state beside them); the adapters and their optimizer states are partitioned")
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


def is_qlora(lora_rank: int, quantize: str) -> bool:
    """LoRA adapters over quantized base weights (QLoRA)."""
    return lora_rank > 0 and quantize != "none"


def stage(zero_stage: int, lora_rank: int, quantize: str) -> int:
    """The ZeRO stage a QLoRA run needs (QLORA_STAGE), `zero_stage` otherwise. The one rule: the
    check that refuses another stage (`quantize`) and the estimator (estimate/*) take it from here."""
    return QLORA_STAGE if is_qlora(lora_rank, quantize) else zero_stage


def quantized(cfg: Config) -> bool:
    return is_qlora(cfg.lora.rank, cfg.lora.quantize)


def quantize(cfg: Config) -> list[str]:
    """What lora.quantize (QLoRA) cannot be combined with; each message names the fix
    (checks._lora runs it)."""
    p: list[str] = []
    q, z = cfg.lora.quantize, cfg.zero
    if q != "none" and cfg.lora.rank <= 0:
        p.append(f"lora.quantize: {q} quantizes the frozen base weights under LoRA adapters "
                 f"(QLoRA) and needs lora.rank > 0; set lora.rank (e.g. 16) or lora.quantize: none")
    if q != "none" and cfg.lora.rank > 0:
        why = f"lora.quantize {q} runs on ZeRO-2 (the quantized weights stay whole on each GPU)"
        if z.stage != stage(z.stage, cfg.lora.rank, q):
            p.append(f"zero.stage: {z.stage}, but {why}: ZeRO-3 would partition the packed "
                     f"weights but not bitsandbytes' quantization state beside them; set "
                     f"zero.stage: 2 (-S zero.stage=2), or lora.quantize: none")
        zero3_only = [("zero.offload_param", z.offload_param != "none", "none"),
                      ("zero.offload_optimizer", z.offload_optimizer == "nvme", "cpu or none"),
                      ("zero.offload_ratio", z.offload_ratio < 1, "1.0"),
                      ("hardware.sequence_parallel", cfg.hardware.sequence_parallel > 1, "1")]
        zero3_only += [(f"zero.{n}", getattr(z, n) is not None, "null")
                       for n in ("prefetch_bucket_size", "param_persistence_threshold",
                                 "max_live_parameters")]
        for key, on, fix in zero3_only:
            if on:
                p.append(f"{key}: a ZeRO-3 feature, but {why}; set {key}: {fix}, or "
                         f"lora.quantize: none")
        if z.host_grad_buffer == "shared":
            p.append(f"zero.host_grad_buffer: shared needs ZeRO-3, but {why}; set it to auto")
    return p


def eight_bit(cfg: Config) -> list[str]:
    """What optim.name adamw_8bit / paged_adamw_8bit cannot be combined with (checks._optim runs
    it)."""
    p: list[str] = []
    z, o = cfg.zero, cfg.optim
    if o.name in EIGHT_BIT:
        if z.offload_optimizer != "none":
            p.append(f"optim.name: {o.name} keeps Adam's states in 8 bits on the GPU "
                     f"(bitsandbytes), but zero.offload_optimizer {z.offload_optimizer} steps "
                     f"DeepSpeed's CPU Adam on the host instead; set zero.offload_optimizer: none "
                     f"(8-bit states on the GPU) or optim.name: adamw (fp32 states offloaded)")
        if z.optimizer_states != "fp32":
            p.append(f"zero.optimizer_states: {z.optimizer_states} applies to DeepSpeed's Adam; "
                     f"optim.name {o.name} keeps its own 8-bit states: set "
                     f"zero.optimizer_states: fp32")
    return p

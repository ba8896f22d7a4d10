"""The rules of a quantized base (`lora.quantize`) and of bitsandbytes' 8-bit AdamW (`optim.name`),
written once.

`lora.quantize` quantizes the frozen base weights of the linears that train something beside them:
LoRA's targets under adapters (QLoRA, `lora.rank > 0`) or block-sparse finetuning's targets under
their trained blocks (`sparse.blocks > 0`). It is one knob for both because it means one thing, the
frozen base's storage; `quantized_base` is the one rule that says whether the base is quantized, and
the ZeRO stage, the checks, the plan and the estimator all ask it.

A quantized base runs on ZeRO-2: the frozen 4/8-bit base weights stay whole on each GPU, and only
the adapters or blocks (and their optimizer states) are partitioned. ZeRO-3 would partition the
packed weights but not bitsandbytes' quantization state that travels beside them, so a quantized
run on zero.stage 3 is refused with the fix (zero.stage: 2): params.yaml, the plan, the metrics and
`dvc exp show` all say the stage that runs. The plan's `quantize` choice gives the reason
(hardware.policy).
"""

from __future__ import annotations

from longft.config.sections import Config

QLORA_STAGE = 2
STAGE_REASON = ("a quantized base runs on ZeRO-2: the frozen quantized base weights stay whole on "
                "each GPU (ZeRO-3 would partition the packed weights but not bitsandbytes' "
                "quantization state beside them); the adapters or blocks and their optimizer "
                "states are partitioned")
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


def quantized_base(lora_rank: int, quantize: str, sparse_blocks: int) -> bool:
    """The frozen base weights are quantized: lora.quantize is set and something trains beside
    them, LoRA adapters (QLoRA) or sparse blocks."""
    return quantize != "none" and (lora_rank > 0 or sparse_blocks > 0)


def stage(zero_stage: int, lora_rank: int, quantize: str, sparse_blocks: int) -> int:
    """The ZeRO stage a run over a quantized base needs (QLORA_STAGE), `zero_stage` otherwise. The
    one rule: the check that refuses another stage (`quantize`) and the estimator (estimate/*)
    take it from here."""
    return QLORA_STAGE if quantized_base(lora_rank, quantize, sparse_blocks) else zero_stage


def quantized(cfg: Config) -> bool:
    return quantized_base(cfg.lora.rank, cfg.lora.quantize, cfg.sparse.blocks)


def quantized_targets(lora_targets: tuple[str, ...], sparse_blocks: int,
                      sparse_targets: tuple[str, ...]) -> tuple[str, ...]:
    """The linears whose frozen weights a quantized base holds in bitsandbytes' blocks: those
    that train beside them (sparse.target_modules under block-sparse finetuning, else LoRA's
    lora.target_modules); the other linears stay in the training dtype, as under QLoRA."""
    return tuple(sparse_targets) if sparse_blocks > 0 else tuple(lora_targets)


def targets(cfg: Config) -> tuple[str, ...]:
    """quantized_targets of `cfg` (model/quantize.py quantizes these; export records them)."""
    return quantized_targets(cfg.lora.target_modules, cfg.sparse.blocks, cfg.sparse.target_modules)


def trained_beside(cfg: Config) -> str:
    """What trains over the quantized base, in words (the plan's reason, messages)."""
    return "the trained blocks" if cfg.sparse.blocks > 0 else "LoRA adapters (QLoRA)"


def quantize(cfg: Config) -> list[str]:
    """What lora.quantize (a quantized base under LoRA adapters or sparse blocks) cannot be
    combined with; each message names the fix (checks._lora runs it)."""
    p: list[str] = []
    q, z = cfg.lora.quantize, cfg.zero
    if q != "none" and not quantized(cfg):
        p.append(f"lora.quantize: {q} quantizes the frozen base weights under LoRA adapters or "
                 f"sparse blocks and needs lora.rank > 0 or sparse.blocks > 0; set lora.rank (e.g. "
                 f"16), sparse.blocks (e.g. 32), or lora.quantize: none")
    if quantized(cfg):
        why = f"lora.quantize {q} runs on ZeRO-2 (the quantized weights stay whole on each GPU)"
        if z.stage != stage(z.stage, cfg.lora.rank, q, cfg.sparse.blocks):
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

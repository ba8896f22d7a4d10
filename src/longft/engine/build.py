"""The model the trainer trains: built, patched and wrapped as the plan says (engine/trainer.py
hands it to DeepSpeed)."""

from __future__ import annotations

from longft.config.params import Config
from longft.config.plan import Plan
from longft.errors import TrainingError
from longft.model import patches as patch
from longft.model.loading import build_model
from longft.model.quantize import quantize_linears

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def build(cfg: Config, plan: Plan, ds: dict):
    """(model, keep, offloader): the model as the trainer trains it, from the plan: created under
    ZeRO-3's zero.Init (`keep`, the HfDeepSpeedConfig that makes transformers do so, must live as
    long as the model), patched (Liger, SDPA backend, tiled MLP, kept attention, packed attention),
    its checkpoints offloaded (`offloader`, or None), its LoRA-targeted layers quantized
    (lora.quantize, QLoRA) and LoRA-wrapped, in that order."""
    import torch

    r = plan.resolved
    dtype = getattr(torch, DTYPES[r.precision.value])
    keep = None
    if cfg.zero.stage == 3:
        # While this object lives, from_config/from_pretrained create parameters inside
        # deepspeed.zero.Init: each rank only ever holds its shard.
        from transformers.integrations import HfDeepSpeedConfig
        keep = HfDeepSpeedConfig(ds)
    model = build_model(cfg.model, r.attention.value, dtype)
    record = patch.apply_resolved(model, r, cfg)
    if record["replaced_modules"] != plan.patches.replaced_modules:
        raise TrainingError(f"patched modules differ from the plan: {record['replaced_modules']} vs "
                            f"{dict(plan.patches.replaced_modules)}; re-run `dvc repro patch`")
    if r.liger.value and cfg.zero.stage == 3:
        patch.zero3_gather_lm_head(model)
    offloader = None
    if r.checkpointing.value == "cpu_offload":
        offloader = patch.offload_checkpoints(model, cfg.checkpointing.gpu_layers,
                                              cfg.checkpointing.prefetch)
    if cfg.lora.quantize != "none":
        quantize_linears(model, cfg.lora.target_modules, cfg.lora.quantize, dtype, _device(r))
    if cfg.lora.rank > 0:
        from peft import LoraConfig, get_peft_model
        # Adapters in the training dtype: peft's default upcasts them to fp32, and DeepSpeed never
        # casts parameters of a zero.Init model, so each LoRA module copied its input to fp32 for
        # an fp32 matmul (seen on CPU, and on the H200 as memory above the estimate and a slowdown;
        # bench/LOG.md, question 3).
        # DeepSpeed's optimizer keeps the fp32 master copy of the adapters either way.
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"),
            autocast_adapter_dtype=False)
        if cfg.lora.quantize != "none":
            # peft gives adapters on a quantized layer that layer's storage dtype (or fp32):
            # QLoRA's adapters train in the training dtype, as LoRA's do
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(dtype)
    return model, keep, offloader


def _device(r):
    """Where the quantized layers go: this rank's GPU (DeepSpeed moves the rest there too)."""
    import torch

    if r.device.value == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

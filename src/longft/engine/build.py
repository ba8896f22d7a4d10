"""The model the trainer trains: built, patched and wrapped as the plan says (engine/trainer.py
hands it to DeepSpeed)."""

from __future__ import annotations

from longft.config import qlora
from longft.config.params import Config
from longft.config.plan import Plan
from longft.errors import TrainingError
from longft.model import block_sparse
from longft.model import patches as patch
from longft.model.loading import build_model
from longft.model.quantize import quantize_linears

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def build(cfg: Config, plan: Plan, ds: dict):
    """(model, keep, offloader): the model as the trainer trains it, from the plan: created under
    ZeRO-3's zero.Init (`keep`, the HfDeepSpeedConfig that makes transformers do so, must live as
    long as the model), patched (Liger, SDPA backend, tiled MLP, kept attention, packed attention),
    its checkpoints offloaded (`offloader`, or None), the linears that train beside their frozen
    weights quantized (lora.quantize: QLoRA, or block-sparse over a quantized base) and
    LoRA-wrapped or given trainable blocks (sparse.*), in that order."""
    import torch

    r = plan.resolved
    dtype = getattr(torch, DTYPES[r.precision.value])
    keep = None
    if cfg.zero.stage == 3:
        # While this object lives, from_config/from_pretrained create parameters inside
        # deepspeed.zero.Init: each rank only ever holds its shard.
        from transformers.integrations import HfDeepSpeedConfig
        keep = HfDeepSpeedConfig(ds)
    if qlora.quantized(cfg) and cfg.model.source == "random":
        model = _random_init_for_quantizing(cfg, plan, r, dtype)
    else:
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
    if qlora.quantized(cfg):  # under LoRA's adapters (QLoRA) or the sparse blocks
        quantize_linears(model, qlora.targets(cfg), cfg.lora.quantize, dtype, _device(r))
        if r.device.value == "cuda":  # a random init on the GPU: its full-precision peak is gone
            torch.cuda.reset_peak_memory_stats()
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
    if cfg.sparse.blocks > 0:  # block-sparse finetuning: trainable blocks, chosen by the warm-up
        block_sparse.attach(model, cfg.sparse.target_modules, cfg.sparse.blocks,
                            cfg.sparse.block_size, dtype)
    return model, keep, offloader


def _random_init_for_quantizing(cfg: Config, plan: Plan, r, dtype):
    """Random init of a model whose decoder Linears are about to be quantized (no zero.Init on
    ZeRO-2): on the GPU where the full-precision model fits in 80 % of it (seconds; the peak is
    then reset, since a pretrained model loads on the host instead), else on the host with all of
    this rank's cores (the launcher's one thread per rank makes an 8B init take many minutes)."""
    import os

    import torch

    dev = _device(r)
    if dev.type == "cuda":
        cap = cfg.hardware.vram_limit_gib
        room = cap * 2**30 if cap else torch.cuda.get_device_properties(dev).total_memory
        if plan.model.n_params * dtype.itemsize <= 0.8 * room:
            with torch.device(dev):
                model = build_model(cfg.model, r.attention.value, dtype)
            return model
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, cfg.hardware.num_gpus)))
    try:
        return build_model(cfg.model, r.attention.value, dtype)
    finally:
        torch.set_num_threads(threads)


def _device(r):
    """Where the quantized layers go: this rank's GPU (DeepSpeed moves the rest there too)."""
    import torch

    if r.device.value == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Hand over the finetuned model as a Hugging Face checkpoint (`output.export: true`).

At the end of a successful run, rank 0 writes export/: safetensors weights that
`AutoModelForCausalLM.from_pretrained` loads, the config and the tokenizer. Under ZeRO-3 the
weights are gathered layer by layer into host memory on rank 0 (DeepSpeed's consolidated 16-bit
state dict), so no GPU ever holds the whole model. With LoRA, `output.export_lora` decides:
- adapter (default): the peft adapter (`PeftModel.from_pretrained` on the base model);
- merged: a full model with the LoRA deltas merged into the base weights, W + scaling * B @ A
  (peft's merge_and_unload, done on the consolidated state dict on rank 0, in fp32, then cast back
  to the weights' dtype), which `AutoModelForCausalLM.from_pretrained` loads without peft; the
  adapter it was merged from goes to export/adapter/. With QLoRA (lora.quantize) the adapter is
  merged into the de-quantized base weights and the model is stored in fp32 (`merged_state_dict`).
longft_export.json records, for a LoRA export, the base the adapter was trained on (`base_record`):
with QLoRA that is the quantized base, which `longft generate` rebuilds before applying the adapter.
With block-sparse finetuning (sparse.blocks) the trained blocks are added into their weights
(model/block_sparse.merged_state_dict): a plain model, loaded like a full finetune's. Over a
quantized base (lora.quantize) the blocks are added into the de-quantized weights and the model is
stored in fp32, as QLoRA's merge is (`sparse_merged_state_dict`), and longft_export.json records
the base it was trained on (`base_record`).
export/ is written into a temporary folder beside it and swapped in only when whole (atomic.directory);
it is a persistent DVC output, so a run that is refused (a typo in params.yaml) or fails (a full
disk: WriteError, naming the folder) keeps the previous model and leaves no partial folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from longft import atomic
from longft.compat import deepspeed as compat_deepspeed
from longft.config import qlora
from longft.config.params import Config, section_digests
from longft.errors import UserError

PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


class ExportError(UserError, ValueError):
    """LoRA adapters that `output.export_lora: merged` cannot merge; the message says the fix."""


def lora_layers(model) -> dict[str, tuple[str, float, bool]]:
    """The peft LoRA layers of `model` (a PeftModel): module name -> (adapter name, scaling,
    fan_in_fan_out). The names are the state-dict prefixes of the layers."""
    out = {}
    for name, m in model.named_modules():
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer") and hasattr(m, "scaling")):
            continue
        for adapter in m.lora_A.keys():
            if getattr(m, "use_dora", {}).get(adapter):
                raise ExportError(f"{name}: DoRA adapters cannot be merged by longft; use "
                                 "output.export_lora: adapter")
            out[name] = (adapter, float(m.scaling[adapter]), bool(getattr(m, "fan_in_fan_out", False)))
    return out


def merge_lora(sd: dict, layers: dict[str, tuple[str, float, bool]], dtype=None) -> dict:
    """A peft model's full state dict -> the base model's, LoRA merged: W' = W + scaling * B @ A
    (transposed for fan_in_fan_out layers), bias' = bias + scaling * lora_B.bias. The sum is done in
    fp32 and rounded once, to `dtype` (default: W's dtype). Keys lose peft's `base_model.model.`
    and `.base_layer`."""
    merged = {}
    for mod, (adapter, scale, fan_in_fan_out) in layers.items():
        a, b = sd[f"{mod}.lora_A.{adapter}.weight"], sd[f"{mod}.lora_B.{adapter}.weight"]
        w = sd[f"{mod}.base_layer.weight"]
        delta = (b.float() @ a.float()) * scale
        merged[f"{mod}.base_layer.weight"] = (w.float() + (delta.T if fan_in_fan_out else delta)
                                              ).to(dtype or w.dtype)
        lora_bias = sd.get(f"{mod}.lora_B.{adapter}.bias")
        if lora_bias is not None:
            bias = sd.get(f"{mod}.base_layer.bias")
            if bias is None:
                raise ExportError(f"{mod}: a LoRA bias on a layer without bias cannot be merged")
            merged[f"{mod}.base_layer.bias"] = (bias.float() + scale * lora_bias.float()).to(bias.dtype)
    out = {}
    for k, v in sd.items():
        if _LORA_KEY.search(k) or ".original_module." in k:
            continue
        name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))
        out[name] = merged.get(k, v)
    return out


def merged_state_dict(model, sd: dict, quantize: str) -> dict:
    """The merged model's weights (`merge_lora`) from the peft model's state dict `sd`.

    QLoRA: the base is de-quantized exactly as training's forward saw it and the sum is stored in
    fp32, every tensor. In the training dtype (bf16: 8 significant bits) an update of ~0.2 % of a
    weight is below half its rounding step, so most of what the adapter learnt would round away;
    an int8 base would also be rounded once more on its way to bf16."""
    if quantize == "none":
        return merge_lora(sd, lora_layers(model))
    import torch

    return _merged_over_dequantized(
        model, sd, lambda full: merge_lora(full, lora_layers(model), dtype=torch.float32))


def _merged_over_dequantized(model, sd: dict, merge) -> dict:
    """`merge` of the state dict with the quantized base de-quantized in fp32 (as training's forward
    saw it), every floating tensor stored in fp32: the one rule of a merge over a quantized base."""
    import torch

    from longft.model.quantize import dequantized_state_dict

    merged = merge(dequantized_state_dict(model, sd, torch.float32))
    return {k: v.float() if v.is_floating_point() else v for k, v in merged.items()}


def sparse_merged_state_dict(model, sd: dict, quantize: str) -> dict:
    """The block-sparse model's weights with the blocks merged (model/block_sparse.merged_state_dict)
    from its state dict `sd`. Over a quantized base: W_dq + D, the base de-quantized exactly as
    training's forward saw it, summed and stored in fp32, every tensor, for QLoRA's reason
    (`merged_state_dict`): the blocks' update, a fraction of a percent of a weight, would mostly
    round away in bf16."""
    from longft.model import block_sparse

    if quantize == "none":
        return block_sparse.merged_state_dict(sd)
    return _merged_over_dequantized(model, sd, block_sparse.merged_state_dict)


def base_record(cfg: Config, dtype) -> dict:
    """Which base a LoRA adapter or sparse blocks were trained on, for longft_export.json: the
    model, and over a quantized base the quantization (lora.quantize) of the quantized modules
    (config/qlora.targets) in the training dtype, which `longft generate` applies before a LoRA
    adapter. An adapter of a QLoRA run applied to the unquantized base computes something else
    than the run trained; a block-sparse export holds its de-quantized base merged."""
    quantized = qlora.quantized(cfg)
    return {"model": cfg.model.name, "source": cfg.model.source,
            "quantize": cfg.lora.quantize if quantized else "none",
            "target_modules": list(qlora.targets(cfg) if quantized else cfg.lora.target_modules),
            "dtype": str(dtype).removeprefix("torch.")}


def state_dict(engine, zero_stage: int) -> dict | None:
    """The full 16-bit state dict on rank 0 (None on other ranks). Collective under ZeRO-3."""
    import torch.distributed as dist

    if zero_stage == 3:
        sd = compat_deepspeed.consolidated_state_dict(engine)
    else:
        sd = engine.module.state_dict()
    return sd if dist.get_rank() == 0 else None


def export(engine, cfg: Config, out_dir: Path, step: int) -> None:
    """Write the model (or LoRA adapter), its config and tokenizer to out_dir; all ranks call it."""
    sd = state_dict(engine, cfg.zero.stage)
    if sd is None:
        return
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    # Written whole into a temporary folder beside out_dir and swapped in, or not at all: a full
    # disk or a kill leaves the previous export as it was and no partial folder (atomic.directory;
    # export/ persists across runs, dvc.yaml)
    with atomic.directory(Path(out_dir)) as tmp:
        _write(engine, cfg, sd, tmp, step)


def _write(engine, cfg: Config, sd: dict, tmp: Path, step: int) -> None:
    from longft.model.loading import load_tokenizer

    dtype = engine.module.get_input_embeddings().weight.dtype
    if cfg.lora.rank and cfg.output.export_lora == "merged":
        engine.module.save_pretrained(tmp / "adapter", state_dict=sd, safe_serialization=True)
        merged = merged_state_dict(engine.module, sd, cfg.lora.quantize)
        engine.module.get_base_model().save_pretrained(tmp, state_dict=merged,
                                                       safe_serialization=True)
        if cfg.lora.quantize != "none":  # from_pretrained must not round the fp32 weights to bf16
            _set_config_dtype(tmp / "config.json", "float32")
        kind = "lora_merged"
    elif cfg.sparse.blocks:  # block-sparse: the blocks merged into the weights, a plain model
        engine.module.save_pretrained(
            tmp, state_dict=sparse_merged_state_dict(engine.module, sd, cfg.lora.quantize),
            safe_serialization=True)
        if qlora.quantized(cfg):  # fp32 weights: from_pretrained must not round them to bf16
            _set_config_dtype(tmp / "config.json", "float32")
        kind = "block_sparse_merged"
    else:
        engine.module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        kind = "lora_adapter" if cfg.lora.rank else "full"
    load_tokenizer(cfg.model).save_pretrained(tmp)
    atomic.write_json(tmp / "longft_export.json",
                      {"model": cfg.model.name, "source": cfg.model.source, "steps": step,
                       "lora_rank": cfg.lora.rank, "quantize": cfg.lora.quantize, "kind": kind,
                       # `longft generate` says so where params.yaml has changed since
                       "params_digests": section_digests(cfg),
                       **({"base": base_record(cfg, dtype)}
                          if cfg.lora.rank or qlora.quantized(cfg) else {})})


def _set_config_dtype(path: Path, dtype: str) -> None:
    """The dtype config.json declares (transformers' `dtype`, `torch_dtype` before 5)."""
    config = json.loads(path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    path.write_text(json.dumps(config, indent=2) + "\n")

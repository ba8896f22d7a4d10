"""The exported model of a run (engine/export.py) and its tokenizer, ready to generate.

export/longft_export.json says what export/ holds: "full" or "lora_merged" (a Hugging Face model
that `from_pretrained` loads) or "lora_adapter" (a peft adapter, loaded onto the base model its
adapter_config.json names: the model.name of the run). A QLoRA run's adapter was trained on the
quantized base (longft_export.json `base`, or `quantize` in exports written before it): that base
is quantized the same way (model/quantize.py) before the adapter is applied, as training saw it.
"block_sparse_merged" holds the trained blocks added into the weights; over a quantized base
(`base.quantize`) into the de-quantized weights, in fp32: a plain model, loaded as stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from longft.errors import UserError

MARKER = "longft_export.json"


class ExportMissingError(UserError, FileNotFoundError):
    """No usable exported model where one was asked for; the message says how to get one."""


@dataclass(frozen=True)
class Export:
    model: object
    tokenizer: object
    kind: str
    """full | lora_merged | lora_adapter | block_sparse_merged (sparse.*: the blocks in the weights)"""
    info: dict
    """longft_export.json: model, source, steps, lora_rank, kind (and base, for an adapter)."""
    base: str | None = None
    """For an adapter: the base it was applied to; for a merge over a quantized base (QLoRA or
    block-sparse): that base; in words (printed by `longft generate`)."""


KINDS = ("full", "lora_merged", "lora_adapter", "block_sparse_merged")
"""What engine/export.py writes as longft_export.json's kind."""


def read_info(export_dir: Path) -> dict:
    """longft_export.json of export_dir, or ExportMissingError with the fix."""
    export_dir = Path(export_dir)
    fix = ("run the pipeline with output.export: true (`dvc repro`, or `dvc exp run` in the "
           "workspace), or pass --export DIR")
    if not export_dir.is_dir():
        raise ExportMissingError(f"{export_dir}/ does not exist: no exported model; {fix}")
    try:
        info = json.loads((export_dir / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise ExportMissingError(f"{export_dir}/ is not a longft export (no readable {MARKER}: "
                                 f"{type(e).__name__}); {fix}") from None
    if not isinstance(info, dict) or info.get("kind") not in KINDS:
        raise ExportMissingError(f"{export_dir}/{MARKER}: unknown export kind "
                                 f"{info.get('kind') if isinstance(info, dict) else info!r}; {fix}")
    return info


def _weights(export_dir: Path, info: dict, device: str):
    """(the exported model, the base an adapter was applied to or None); a weights file that
    cannot be read (cut short, damaged) is refused with its name (ExportMissingError), not a
    traceback."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        if info["kind"] == "lora_adapter":
            return _adapter_on_its_base(export_dir, info, device)
        # as stored: fp32 where the export merged into a de-quantized base (config.json says so)
        return AutoModelForCausalLM.from_pretrained(str(export_dir)), _merged_base(info)
    except (SafetensorError, OSError, EOFError) as e:
        files = ", ".join(sorted(p.name for p in export_dir.glob("*.safetensors"))) or "none"
        raise ExportMissingError(
            f"{export_dir}/ holds weights that cannot be read (safetensors files: {files}; "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the file was cut "
            "short or damaged; run the train stage again (`dvc repro`) or restore it "
            "(`dvc checkout export`)") from None


def load_export(export_dir: Path, device: str = "cpu") -> Export:
    """The exported model (eval mode, on `device`) and its tokenizer."""
    from transformers import AutoTokenizer

    export_dir = Path(export_dir)
    info = read_info(export_dir)
    if info["kind"] == "lora_adapter" and info.get("source") == "random":
        raise ExportMissingError(
            f"{export_dir}/ holds a LoRA adapter of a random-init model, whose base weights "
            "were never saved; export the merged model instead (output.export_lora: merged)")
    model, base = _weights(export_dir, info, device)
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Export(model.to(device).eval(), tokenizer, info["kind"], info, base)


def expected_base(info: dict) -> dict:
    """The base an adapter export expects: longft_export.json's `base` record (engine/export.py
    base_record), or, for an export written before it, the run's model and lora.quantize."""
    base = info.get("base")
    if isinstance(base, dict):
        return base
    return {"model": info.get("model"), "quantize": info.get("quantize", "none"),
            "target_modules": None, "dtype": "bfloat16"}


def _merged_base(info: dict) -> str | None:
    """A merged export's quantized base, in words (None for any other export)."""
    base = info.get("base")
    q = base.get("quantize") if isinstance(base, dict) else None
    if info["kind"] == "lora_adapter" or q in (None, "none"):
        return None
    what = "blocks" if info["kind"] == "block_sparse_merged" else "adapter"
    return (f"{what} merged into {base.get('model')} de-quantized from {q} (the base it was "
            "trained on), in fp32")


def _adapter_on_its_base(export_dir: Path, info: dict, device: str):
    """(peft model, description): the adapter applied to the base it was trained on."""
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel

    from longft.model.loading import check_local

    base = expected_base(info)
    kind = base.get("quantize") or "none"
    peft_config = PeftConfig.from_pretrained(str(export_dir))
    # a base moved or renamed since training: said at once, not after the hub's retries
    check_local(peft_config.base_model_name_or_path,
                f"{export_dir}/adapter_config.json base_model_name_or_path")
    if kind == "none":
        return AutoPeftModelForCausalLM.from_pretrained(str(export_dir)), \
            f"adapter on {base.get('model')}"
    import torch
    from transformers import AutoModelForCausalLM

    from longft.model.quantize import quantize_linears

    dtype = getattr(torch, base.get("dtype") or "bfloat16")
    targets = tuple(base.get("target_modules") or peft_config.target_modules)
    model = AutoModelForCausalLM.from_pretrained(peft_config.base_model_name_or_path, dtype=dtype)
    quantize_linears(model, targets, kind, dtype, torch.device(device))
    model = PeftModel.from_pretrained(model, str(export_dir))
    for name, p in model.named_parameters():  # the adapters in the training dtype, as trained
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return model, f"adapter on {base.get('model')} quantized to {kind} (the base it was trained on)"

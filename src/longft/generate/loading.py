"""The exported model of a run (engine/export.py) and its tokenizer, ready to generate.

export/longft_export.json says what export/ holds: "full" or "lora_merged" (a Hugging Face model
that `from_pretrained` loads) or "lora_adapter" (a peft adapter, loaded onto the base model its
adapter_config.json names: the model.name of the run).
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
    """longft_export.json: model, source, steps, lora_rank, kind."""


KINDS = ("full", "lora_merged", "lora_adapter", "block_sparse_merged")
"""What engine/export.py writes as longft_export.json's kind."""


def read_info(export_dir: Path) -> dict:
    """longft_export.json of export_dir, or ExportMissingError with the fix."""
    export_dir = Path(export_dir)
    fix = ("run the pipeline with output.export: true (`dvc repro`, or `dvc exp run` and `dvc exp "
           "apply NAME`), or pass --export DIR")
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


def _weights(export_dir: Path, kind: str):
    """The exported model; a weights file that cannot be read (cut short, damaged) is refused
    with its name (ExportMissingError), not a traceback."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        if kind == "lora_adapter":
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(str(export_dir))
        return AutoModelForCausalLM.from_pretrained(str(export_dir))
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
    model = _weights(export_dir, info["kind"])
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Export(model.to(device).eval(), tokenizer, info["kind"], info)

"""Hand over the finetuned model as a Hugging Face checkpoint (`output.export: true`).

At the end of training, rank 0 writes export/: safetensors weights that
`AutoModelForCausalLM.from_pretrained` loads, the config and the tokenizer. Under ZeRO-3 the
weights are gathered layer by layer into host memory on rank 0 (DeepSpeed's consolidated 16-bit
state dict), so no GPU ever holds the whole model. With LoRA the adapter is saved (peft format,
loadable with `PeftModel.from_pretrained` on the base model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import Config


def state_dict(engine, zero_stage: int) -> dict | None:
    """The full 16-bit state dict on rank 0 (None on other ranks). Collective under ZeRO-3."""
    import torch.distributed as dist

    if zero_stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd = engine.module.state_dict()
    return sd if dist.get_rank() == 0 else None


def export(engine, cfg: Config, out_dir: Path, step: int) -> None:
    """Write the model (or LoRA adapter), its config and tokenizer to out_dir; all ranks call it."""
    from .model import load_tokenizer

    sd = state_dict(engine, cfg.zero.stage)
    if sd is None:
        return
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    engine.module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
    load_tokenizer(cfg.model).save_pretrained(tmp)
    (tmp / "longft_export.json").write_text(json.dumps(
        {"model": cfg.model.name, "source": cfg.model.source, "steps": step,
         "lora_rank": cfg.lora.rank, "kind": "lora_adapter" if cfg.lora.rank else "full"}, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)  # a reader never sees a half-written export

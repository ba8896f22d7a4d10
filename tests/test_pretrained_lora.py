"""Real weights go through the same path: a model saved with save_pretrained is finetuned with
LoRA (model.source: pretrained) under ZeRO-3 on CPU, and the exported adapter loads back with peft."""

import json

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow


def test_pretrained_model_with_lora_trains_and_exports_an_adapter(tmp_path, byte_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from longft.config.params import Config, ModelConfig, merge, to_dict
    from longft.model.loading import load_model_config
    from longft.run.pipeline import run_all

    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=torch.float32)
    base.save_pretrained(base_dir)
    byte_tokenizer.save_pretrained(base_dir)

    params = merge(to_dict(Config()), {
        "model": {"source": "pretrained", "name": str(base_dir)},
        "data": {"num_samples": 6},
        "train": {"iterations": 4, "warmup_iterations": 1},
        "optim": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "output": {"save_checkpoint": False, "export": True}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch", "train"))

    plan = json.loads((tmp_path / "artifacts/plan.json").read_text())
    assert plan["model"]["source"] == "pretrained"
    assert plan["model"]["n_trainable"] == 2 * 4 * ((64 + 64) + (64 + 32))  # 2 layers, q and v
    rows = [json.loads(x) for x in (tmp_path / "run/rank0.jsonl").read_text().splitlines()]
    assert rows[-1] == {**rows[-1], "type": "end", "status": "complete", "steps": 4}
    # the adapters train in the run's precision (bf16 on CPU), not peft's fp32 upcast
    env = next(r for r in rows if r["type"] == "env")
    assert plan["resolved"]["precision"]["value"] == "bf16"
    assert env["trainable_dtypes"] == ["bfloat16"], env["trainable_dtypes"]

    export = tmp_path / "export"
    assert json.loads((export / "longft_export.json").read_text())["kind"] == "lora_adapter"
    assert (export / "adapter_config.json").is_file()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), export).eval()
    ids = torch.randint(1, 250, (1, 32))
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(ids).logits
        after = tuned(ids).logits
    assert not torch.allclose(before, after)  # the adapter changed the model...
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # ...because B left its zero init

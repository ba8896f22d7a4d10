"""LoRA merged on export (output.export_lora: merged): the merged full model loads with
from_pretrained, without peft, and computes what the base model plus the adapter computes."""

import json

import pytest
import torch
import yaml

from longft.engine.export import lora_layers, merge_lora


def _randomize_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:  # B starts at zero: give it (and A) values so the merge matters
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def _llama(dtype):
    from transformers import AutoModelForCausalLM

    from longft.config.params import ModelConfig
    from longft.model.loading import load_model_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=dtype).eval()


def _gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64,
                   bos_token_id=0, eos_token_id=0),
        dtype=torch.float32).eval()


CASES = {
    "llama": (lambda: _llama(torch.float32), dict(target_modules=["q_proj", "v_proj", "down_proj"])),
    "llama-rslora": (lambda: _llama(torch.float32),
                     dict(target_modules=["k_proj", "o_proj"], use_rslora=True)),
    "gpt2-fan-in-fan-out-bias": (_gpt2, dict(target_modules=["c_attn"], fan_in_fan_out=True,
                                             lora_bias=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_state_dict_loads_into_the_plain_model_and_matches_peft(case):
    from peft import LoraConfig, get_peft_model

    build, extra = CASES[case]
    tuned = get_peft_model(build(), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **extra))
    _randomize_lora(tuned)
    merged = merge_lora(tuned.state_dict(), lora_layers(tuned))
    plain = build()
    plain.load_state_dict(merged, strict=True)  # exactly the base model's keys
    ids = torch.randint(1, 250, (2, 24))
    with torch.no_grad():
        want = tuned(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, rtol=0, atol=1e-5)
        assert not torch.allclose(build()(ids).logits, want, atol=1e-3)  # the merge did something
    # the same weights as peft's own merge
    ref = tuned.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6)


def test_bf16_merge_is_done_in_fp32_and_stays_bf16():
    from peft import LoraConfig, get_peft_model

    tuned = get_peft_model(_llama(torch.bfloat16), LoraConfig(r=4, lora_alpha=8,
                                                              target_modules=["q_proj"]))
    _randomize_lora(tuned)
    sd = tuned.state_dict()
    merged = merge_lora(sd, lora_layers(tuned))
    key = "model.layers.0.self_attn.q_proj.weight"
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    exact = (sd[f"{pre}.base_layer.weight"].float()
             + 2.0 * sd[f"{pre}.lora_B.default.weight"].float() @ sd[f"{pre}.lora_A.default.weight"].float())
    assert merged[key].dtype == torch.bfloat16
    torch.testing.assert_close(merged[key], exact.to(torch.bfloat16), rtol=0, atol=0)


def test_export_lora_is_validated():
    from longft.config.params import ConfigError, from_dict

    assert from_dict({}).output.export_lora == "adapter"
    with pytest.raises(ConfigError, match=r"output.export_lora: 'full' is not one of 'adapter' \| 'merged'"):
        from_dict({"output": {"export_lora": "full"}})


def test_lora_trained_under_zero3_exports_a_merged_model(tmp_path, byte_tokenizer):
    """A save_pretrained model finetuned with LoRA under ZeRO-3 on CPU (fp32, so that the merged
    weights are exact): export/ loads with from_pretrained and equals base + export/adapter/."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from longft.config.params import Config, ModelConfig, merge, to_dict
    from longft.model.loading import load_model_config
    from longft.run.pipeline import run_all

    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(ModelConfig()),
                                     dtype=torch.float32).save_pretrained(base_dir)
    byte_tokenizer.save_pretrained(base_dir)
    params = merge(to_dict(Config()), {
        "model": {"source": "pretrained", "name": str(base_dir)},
        "precision": "fp32",
        "data": {"num_samples": 4, "max_seq_length": 1024},
        "train": {"iterations": 3, "warmup_iterations": 1},
        "optim": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
        "output": {"save_checkpoint": False, "export": True, "export_lora": "merged"}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch", "train"))

    export = tmp_path / "export"
    assert json.loads((export / "longft_export.json").read_text())["kind"] == "lora_merged"
    assert (export / "model.safetensors").is_file() and not (export / "adapter_config.json").exists()
    assert (export / "adapter" / "adapter_config.json").is_file()
    merged, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert not hasattr(merged, "peft_config")
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), export / "adapter")
    ids = torch.randint(1, 250, (1, 48))
    with torch.no_grad():
        want = tuned.eval()(ids).logits
        torch.testing.assert_close(merged.eval()(ids).logits, want, rtol=0, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        assert not torch.allclose(base(ids).logits, want, atol=1e-3)  # training moved it


def test_a_lora_bias_on_a_layer_without_bias_is_refused():
    from longft.engine.export import ExportError

    sd = {"m.lora_A.default.weight": torch.ones(2, 4), "m.lora_B.default.weight": torch.ones(4, 2),
          "m.lora_B.default.bias": torch.ones(4), "m.base_layer.weight": torch.zeros(4, 4)}
    with pytest.raises(ExportError, match="m: a LoRA bias on a layer without bias"):
        merge_lora(sd, {"m": ("default", 0.5, False)})
    merged = merge_lora({**sd, "m.base_layer.bias": torch.zeros(4)}, {"m": ("default", 0.5, False)})
    assert torch.equal(merged["m.bias"], torch.full((4,), 0.5))
    assert torch.equal(merged["m.weight"], torch.full((4, 4), 1.0))  # 0.5 x (B @ A = 2)

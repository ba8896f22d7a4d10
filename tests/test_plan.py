"""Resolution of every `auto` against faked hardware, impossible requests, and the DeepSpeed dict."""

import pytest

from longft.config.params import from_dict
from longft.engine import ds_config
from longft.hardware import Hardware, PlanError, resolve
from longft.run.patch_stage import make_plan

V100 = Hardware(device="cuda", gpu_name="Tesla V100-SXM2-16GB", gpu_count=8, capability=(7, 0),
                gpu_mem_gib=15.8, host_mem_gib=384, cpu_count=48, flash_attn=False, liger=True)
A100 = Hardware(device="cuda", gpu_name="NVIDIA A100-SXM4-40GB", gpu_count=1, capability=(8, 0),
                gpu_mem_gib=39.4, host_mem_gib=256, cpu_count=32, flash_attn=True, liger=True)
H200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=2, capability=(9, 0),
                gpu_mem_gib=139.8, host_mem_gib=256, cpu_count=32, flash_attn=False, liger=True)
CPU = Hardware(device="cpu", host_mem_gib=24, cpu_count=2)


def values(cfg, hw, model_type="llama"):
    return {k: c.value for k, c in resolve(cfg, hw, model_type).items()}


def test_v100_resolves_fp16_sdpa():
    v = values(from_dict({}), V100)
    assert v == {"device": "cuda", "precision": "fp16", "attention": "sdpa",
                 "sdpa_backend": "efficient", "packed_attention": "per_document", "liger": True,
                 "checkpointing": "gpu", "tiled_mlp": False, "host_grad_buffer": "full",
                 "quantize": "none", "copy_back": "chunked",     # fp32 master on the CPU -> fp16
                 "overlap_step": "on"}     # ZeRO-3, CPU Adam, one GPU


def test_host_grad_buffer_auto_is_shared_only_where_exact():
    """The default params accumulate over 2 micro-steps: full (above). One micro-step, ZeRO-3 with
    the optimizer on the CPU and bf16: shared. Each other condition keeps DeepSpeed's buffer."""
    one = {"train": {"global_batch_size": 1}}
    assert values(from_dict(one), H200)["host_grad_buffer"] == "shared"
    assert values(from_dict(one), CPU)["host_grad_buffer"] == "shared"
    for extra, why in (({"zero": {"stage": 2}}, "zero.stage is 2"),
                       ({"zero": {"offload_optimizer": "none"}}, "offload_optimizer is none"),
                       ({"train": {"global_batch_size": 4}}, "accumulate over 4 micro-steps")):
        c = resolve(from_dict({**one, **extra} if "train" not in extra else extra), H200, "llama")
        assert c["host_grad_buffer"].value == "full" and why in c["host_grad_buffer"].reason
    v100 = resolve(from_dict(one), V100, "llama")
    assert v100["host_grad_buffer"].value == "full" and "fp16" in v100["host_grad_buffer"].reason
    assert values(from_dict({**one, "zero": {"host_grad_buffer": "full"}}), H200)[
        "host_grad_buffer"] == "full"


def test_host_grad_buffer_shared_where_it_cannot_run_is_refused():
    with pytest.raises(PlanError) as e:
        resolve(from_dict({"zero": {"host_grad_buffer": "shared"}}), H200, "llama")
    assert "zero.host_grad_buffer: shared cannot run here" in str(e.value)
    assert "accumulate over 2 micro-steps" in str(e.value) and "auto or full" in str(e.value)
    with pytest.raises(PlanError, match="precision is fp16"):
        resolve(from_dict({"zero": {"host_grad_buffer": "shared"},
                           "train": {"global_batch_size": 8}}), V100, "llama")


def test_a100_with_flash_attn_resolves_bf16_fa2():
    v = values(from_dict({}), A100)
    assert (v["precision"], v["attention"], v["liger"]) == ("bf16", "flash_attention_2", True)


def test_h200_without_flash_attn_falls_back_to_sdpa_with_reason():
    r = resolve(from_dict({}), H200, "llama")
    assert r["precision"].value == "bf16"
    assert r["attention"].value == "sdpa"
    assert "flash-attn not installed" in r["attention"].reason
    assert r["sdpa_backend"].value == "cudnn" and "Hopper" in r["sdpa_backend"].reason


def test_sdpa_kernel_per_generation():
    a100_no_fa = Hardware(**{**A100.to_dict(), "flash_attn": False})
    assert values(from_dict({}), a100_no_fa)["sdpa_backend"] == "flash"
    assert values(from_dict({}), A100)["sdpa_backend"] == "default"  # FA2 package, not SDPA
    assert values(from_dict({"kernels": {"sdpa_backend": "math"}}), H200)["sdpa_backend"] == "math"


def test_sdpa_kernel_impossible_requests():
    with pytest.raises(PlanError, match="sdpa_backend: cudnn needs compute capability >= 8.0"):
        resolve(from_dict({"kernels": {"sdpa_backend": "cudnn"}}), V100, "llama")
    with pytest.raises(PlanError, match="sdpa_backend: efficient needs a CUDA GPU"):
        resolve(from_dict({"kernels": {"sdpa_backend": "efficient"}}), CPU, "llama")


def test_v100_plan_expands_kv_heads_for_the_efficient_kernel(monkeypatch):
    from transformers.integrations import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)
    plan, _ = make_plan(from_dict({}), V100)
    assert plan["patches"]["sdpa_kernels"] == ["efficient", "math"]
    assert plan["patches"]["gqa"] == "repeat_kv"
    import torch
    k = torch.zeros(1, 2, 4, 16)
    assert sdpa_attention.use_gqa_in_sdpa(None, k, k) is False


def test_cpu_resolves_bf16_sdpa_no_liger():
    v = values(from_dict({}), CPU)
    assert v == {"device": "cpu", "precision": "bf16", "attention": "sdpa",
                 "sdpa_backend": "default", "packed_attention": "per_document", "liger": False,
                 "checkpointing": "gpu", "tiled_mlp": False, "host_grad_buffer": "full",
                 "quantize": "none", "copy_back": "deepspeed", "overlap_step": "off"}


def test_liger_auto_off_for_unsupported_family():
    r = resolve(from_dict({}), H200, "gpt2")
    assert r["liger"].value is False and "gpt2" in r["liger"].reason


def test_impossible_requests_on_v100_listed_together():
    cfg = from_dict({"precision": "bf16", "kernels": {"attention": "flash_attention_2"},
                     "hardware": {"num_gpus": 16}, "train": {"global_batch_size": 16}})
    with pytest.raises(PlanError) as e:
        resolve(cfg, V100, "llama")
    msg = str(e.value)
    assert "bf16 needs compute capability >= 8.0" in msg and "7.0" in msg
    assert "flash_attention_2 needs compute capability >= 8.0" in msg
    assert "16 asked for but only 8 GPU(s)" in msg


def test_gpu_requested_without_gpu():
    with pytest.raises(PlanError, match="no CUDA GPU is visible"):
        resolve(from_dict({"hardware": {"device": "cuda"}}), CPU, "llama")


def test_fa2_requested_but_not_installed():
    with pytest.raises(PlanError, match=r"pip install longft\[flash\]"):
        resolve(from_dict({"kernels": {"attention": "flash_attention_2"}}), H200, "llama")


def test_vram_limit_above_card():
    with pytest.raises(PlanError, match="more than the 39.4 GiB"):
        resolve(from_dict({"hardware": {"vram_limit_gib": 80}}), A100, "llama")


def test_ds_config_zero3_full_offload():
    cfg = from_dict({"zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                     "train": {"micro_batch_size": 2, "global_batch_size": 8},
                     "hardware": {"num_gpus": 2}, "optim": {"lr": 2e-5}})
    ds = ds_config.build(cfg, "bf16", hidden_size=4096)
    assert ds["train_batch_size"] == 8
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2          # 8 / (2 x 2)
    z = ds["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["reduce_bucket_size"] == 4096 * 4096
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert z["memory_efficient_linear"] is False
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                         "weight_decay": 0.01}


def test_ds_config_zero2_fp16_no_offload():
    cfg = from_dict({"zero": {"stage": 2, "offload_optimizer": "none"}})
    ds = ds_config.build(cfg, "fp16", hidden_size=64)
    z = ds["zero_optimization"]
    assert "offload_optimizer" not in z and "offload_param" not in z
    assert "stage3_prefetch_bucket_size" not in z
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert not ds["bf16"]["enabled"]


def test_lr_schedule_by_hand():
    """Warm-up starts above 0 (step i applies (i + 1) / W), then cosine / linear reach
    min_lr_ratio at the last step, constant stays; no DeepSpeed scheduler in ds_config (the
    trainer passes torch's LambdaLR over these factors)."""
    import math

    def factors(kind, warm, steps=10):
        cfg = from_dict({"optim": {"scheduler": kind, "warmup_steps": warm, "min_lr_ratio": 0.1},
                         "train": {"iterations": steps}})
        return [ds_config.lr_factor(cfg, i) for i in range(steps)]

    assert factors("cosine", 1)[0] == 1.0                    # no warm-up: full lr at once
    c = factors("cosine", 3)
    assert c[:3] == [1 / 3, 2 / 3, 1.0]
    assert c[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 7)))
    assert c[-1] == pytest.approx(0.1) and all(x > 0 for x in c)
    assert all(a > b for a, b in zip(c[2:], c[3:]))          # decays after the warm-up
    lin = factors("linear", 2)
    assert lin[:2] == [0.5, 1.0] and lin[-1] == pytest.approx(0.1)
    assert lin[5] == pytest.approx(1 - 0.9 * 4 / 8)
    assert factors("constant", 4) == [0.25, 0.5, 0.75] + [1.0] * 7
    cfg = from_dict({})
    assert "scheduler" not in ds_config.build(cfg, "bf16", 64)


def test_make_plan_counts_params_and_records_patches_on_meta():
    cfg = from_dict({"model": {"name": "llama3.2-1b"}, "data": {"max_seq_length": 16384}})
    plan, ds = make_plan(cfg, CPU)
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings).
    assert plan["model"]["n_params"] == 1_235_814_400
    assert plan["model_config"]["head_dim"] == 64
    assert plan["patches"]["gradient_checkpointing"] is True
    assert plan["patches"]["replaced_modules"] == {}
    assert plan["batch"]["tokens_per_step"] == 2 * 16384
    states = plan["memory_estimate"]["model_states_bytes"]
    assert states["weights"] == 2 * 1_235_814_400
    assert states["optimizer"] == 12 * 1_235_814_400
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2048 * 2048


def test_make_plan_lora_counts_adapter_params():
    cfg = from_dict({"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}})
    plan, _ = make_plan(cfg, CPU)
    # tiny-llama: 2 layers; q_proj 64->64, v_proj 64->32 (2 kv heads x 16)
    assert plan["model"]["n_trainable"] == 2 * 8 * ((64 + 64) + (64 + 32))


def test_make_plan_lora_refuses_names_that_match_no_linear_layer():
    cfg = from_dict({"lora": {"rank": 8, "target_modules": ["q_proj", "v_prj", "lm_head_x"]}})
    with pytest.raises(PlanError) as e:
        make_plan(cfg, CPU)
    assert e.value.problems == [
        "lora.target_modules: some of the names match a linear layer of llama: ['v_prj', "
        "'lm_head_x'] match nothing; its linear modules are ['down_proj', 'gate_proj', 'k_proj', "
        "'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']. Remove or correct those names"]
    with pytest.raises(PlanError, match=r"none of the names match .*\['embed_tokens'\]"):
        make_plan(from_dict({"lora": {"rank": 8, "target_modules": ["embed_tokens"]}}), CPU)


def test_make_plan_refuses_a_row_longer_than_the_positions(tmp_path):
    import json

    from longft.model.loading import MODELS_DIR, ModelError
    arch = json.loads((MODELS_DIR / "tiny-llama.json").read_text())
    arch["max_position_embeddings"] = 2048
    (tmp_path / "short.json").write_text(json.dumps(arch))
    cfg = from_dict({"model": {"name": str(tmp_path / "short.json")},
                     "data": {"max_seq_length": 4096}})
    with pytest.raises(ModelError) as e:
        make_plan(cfg, CPU)
    assert str(e.value) == (
        f"data.max_seq_length (4096) is longer than the 2048 positions model "
        f"'{tmp_path / 'short.json'}' covers (max_position_embeddings 2048); lower "
        f"data.max_seq_length to at most 2048, or use a model with longer positions or RoPE "
        f"scaling (rope_scaling with rope_type yarn/linear/dynamic and a factor in its config.json)")
    arch["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}  # 4 x 2048 positions
    (tmp_path / "short.json").write_text(json.dumps(arch))
    make_plan(cfg, CPU)
    # the shipped models cover the default row length
    make_plan(from_dict({}), CPU)


def test_architecture_config_errors_name_the_file_and_field(tmp_path):
    import json

    from longft.config.params import ModelConfig
    from longft.model.loading import MODELS_DIR, ModelError, load_model_config
    arch = json.loads((MODELS_DIR / "tiny-llama.json").read_text())
    f = tmp_path / "arch.json"
    f.write_text(json.dumps({**arch, "model_type": "lama"}))
    with pytest.raises(ModelError) as e:
        load_model_config(ModelConfig(name=str(f)))
    assert str(e.value).startswith(
        f"{f}: model_type 'lama' is not an architecture this transformers knows (close: llama")
    assert str(e.value).endswith(
        "; fix model_type, or, for a model with its own code, set model.source: pretrained with "
        "model.trust_remote_code: true")
    f.write_text(json.dumps({**arch, "hidden_size": "big"}))
    with pytest.raises(ModelError) as e:
        load_model_config(ModelConfig(name=str(f)))
    assert str(e.value) == (
        f"{f}: Field 'hidden_size' expected int, got str (value: 'big'); fix it in that file "
        f"(fields and types as in transformers' LlamaConfig)")


CUSTOM_CONFIG = '''from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "longft_custom"
'''
CUSTOM_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
'''


def test_custom_code_model_needs_trust_remote_code_and_never_prompts(tmp_path, monkeypatch):
    import builtins
    import json

    from longft.config.params import ModelConfig
    from longft.model.loading import ModelError, load_model_config
    from longft.run.patch_stage import meta_model

    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "longft_custom", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 300, "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                                        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    (d / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (d / "modeling_custom.py").write_text(CUSTOM_MODEL)

    def no_prompt(*a, **k):
        raise AssertionError(f"transformers prompted: {a}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    with pytest.raises(ModelError) as e:
        load_model_config(ModelConfig(source="pretrained", name=str(d)))
    assert str(e.value) == (
        f"model.name: '{d}' contains custom code (an auto_map in its config) that must run to load "
        f"it; if you trust that code, set model.trust_remote_code: true (it then runs in every "
        f"stage)")
    mc = load_model_config(ModelConfig(source="pretrained", name=str(d), trust_remote_code=True))
    assert type(meta_model(mc, "sdpa", trust_remote_code=True)).__name__ == "CustomForCausalLM"


def test_make_plan_unknown_architecture():
    from longft.model.loading import ModelError
    with pytest.raises(ModelError, match="configs/models"):
        make_plan(from_dict({"model": {"name": "no-such-model"}}), CPU)


@pytest.mark.parametrize("over,expected", [
    ({}, "chunked"),                                                  # ZeRO-3, optimizer on the CPU
    ({"zero": {"offload_param": "cpu"}}, "zero.offload_param: none"),
    ({"zero": {"offload_optimizer": "none"}}, "zero.offload_optimizer: cpu"),
    ({"zero": {"stage": 2}}, "zero.stage 3"),
    ({"zero": {"optimizer_states": "bf16"}}, "zero.optimizer_states: fp32"),
    ({"precision": "fp32"}, "bf16 or fp16"),
    ({"lora": {"rank": 8, "quantize": "nf4"}, "zero": {"stage": 2}}, "zero.stage 3"),  # QLoRA: ZeRO-2
])
def test_copy_back_chunked_runs_only_where_the_step_converts_host_master_into_gpu_partitions(over, expected):
    from longft.config.params import merge

    base = {"precision": "bf16", "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none",
                                          "copy_back": "chunked"}}
    cfg = from_dict(merge(base, over))
    if expected == "chunked":
        assert values(cfg, H200)["copy_back"] == "chunked"
    else:
        with pytest.raises(PlanError, match=f"zero.copy_back: chunked .*needs.*{expected}"):
            resolve(cfg, H200, "llama")
    auto = resolve(from_dict(merge(merge(base, over), {"zero": {"copy_back": "auto"}})), H200, "llama")
    assert auto["copy_back"].value == ("chunked" if expected == "chunked" else "deepspeed")
    if expected != "chunked":
        assert expected in auto["copy_back"].reason                  # says what chunked would need
    on_cpu = resolve(from_dict(merge(merge(base, over), {"zero": {"copy_back": "auto"}})), CPU, "llama")
    assert on_cpu["copy_back"].value == "deepspeed" and "a GPU" in on_cpu["copy_back"].reason

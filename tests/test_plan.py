"""Resolution of every `auto` against faked hardware, impossible requests, and the DeepSpeed dict."""

import pytest

from longft.engine import ds_config
from longft.config.params import from_dict
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
                 "checkpointing": "gpu", "tiled_mlp": False, "host_grad_buffer": "full"}


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
                 "checkpointing": "gpu", "tiled_mlp": False, "host_grad_buffer": "full"}


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


@pytest.mark.parametrize("kind,typ", [("cosine", "WarmupCosineLR"), ("linear", "WarmupDecayLR"),
                                      ("constant", "WarmupLR")])
def test_scheduler_types(kind, typ):
    cfg = from_dict({"optim": {"scheduler": kind, "warmup_steps": 3}, "train": {"iterations": 10}})
    s = ds_config.scheduler(cfg)
    assert s["type"] == typ and s["params"]["warmup_num_steps"] == 3


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


def test_make_plan_unknown_architecture():
    from longft.model.loading import ModelError
    with pytest.raises(ModelError, match="configs/models"):
        make_plan(from_dict({"model": {"name": "no-such-model"}}), CPU)

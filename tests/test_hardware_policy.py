"""One rule function at a time: the CPU rules (longft.config.cpu_rules), each knob's resolver in
longft.hardware.policy, and the architecture's head_dim / K/V heads (longft.model.architecture).
tests/test_plan.py covers `resolve()` as a whole; tests/test_packed_attention_policy.py the
packed-attention kernel, flash-attn detection and what the installed torch can do."""

from types import SimpleNamespace

import pytest

from longft.config import cpu_rules
from longft.config.params import ConfigError, from_dict
from longft.hardware import Hardware, PlanError, policy, resolve
from longft.model.architecture import ARCH_KEYS, architecture, attention_dims
from test_plan import CPU, H200, V100  # noqa: E402  (tests/ is on sys.path under pytest)

A100 = Hardware(device="cuda", gpu_name="NVIDIA A100-SXM4-40GB", gpu_count=1, capability=(8, 0),
                gpu_mem_gib=39.4, host_mem_gib=256, cpu_count=32, flash_attn=True, liger=False)


def rule_text(problems):
    """The one problem a rule found."""
    (msg,) = problems
    return msg


# ------------------------------------------------------------------ CPU rules


@pytest.mark.parametrize("rule,bad,fine,says", [
    (cpu_rules.precision, "fp16", ["auto", "bf16", "fp32"], "precision: fp16 is not supported on CPU"),
    (cpu_rules.checkpointing, "cpu_offload", ["auto", "none", "gpu"], "on CPU use gpu (recompute)"),
    (cpu_rules.attention, "flash_attention_2", ["auto", "sdpa", "eager"], "use sdpa on CPU"),
    (cpu_rules.liger, "on", ["auto", "off"], "needs a CUDA GPU (Triton kernels)"),
    (cpu_rules.vram_limit, 12.0, [None], "only meaningful with hardware.device cuda"),
])
def test_cpu_rule_refuses_only_what_the_cpu_cannot_run(rule, bad, fine, says):
    (msg,) = rule(bad)
    assert says in msg
    assert all(rule(v) == [] for v in fine)


def test_cpu_rule_sdpa_backend():
    for sb in ("cudnn", "efficient"):
        assert rule_text(cpu_rules.sdpa_backend(sb)) == (
            f"kernels.sdpa_backend: {sb} needs a CUDA GPU; use auto or default on CPU")
    assert all(cpu_rules.sdpa_backend(sb) == [] for sb in ("auto", "default", "flash", "math"))


def test_config_and_policy_give_the_same_cpu_messages():
    """device: cpu is refused by the config check, device: auto on a CPU machine by the policy:
    the same rules, the same words."""
    bad = {"precision": "fp16", "checkpointing": {"mode": "cpu_offload"},
           "kernels": {"attention": "flash_attention_2", "liger": "on"}}
    with pytest.raises(ConfigError) as by_config:
        from_dict({**bad, "hardware": {"device": "cpu"}})
    with pytest.raises(PlanError) as by_policy:
        resolve(from_dict(bad), CPU, "llama")
    expected = (cpu_rules.precision("fp16") + cpu_rules.checkpointing("cpu_offload")
                + cpu_rules.attention("flash_attention_2") + cpu_rules.liger("on"))
    assert by_config.value.problems == expected
    assert sorted(by_policy.value.problems) == sorted(expected)


# ------------------------------------------------------------------ one resolver per knob


def test_resolve_device():
    assert policy.resolve_device(from_dict({}), CPU)[0].value == "cpu"
    choice, problems = policy.resolve_device(from_dict({}), H200)
    assert choice.value == "cuda" and "NVIDIA H200" in choice.reason and problems == []
    choice, problems = policy.resolve_device(from_dict({"hardware": {"device": "cuda"}}), CPU)
    assert choice.value == "cpu" and "no CUDA GPU is visible" in rule_text(problems)


def test_check_num_gpus():
    four = from_dict({"hardware": {"num_gpus": 4}, "train": {"global_batch_size": 4}})
    assert "only 2 GPU(s)" in rule_text(policy.check_num_gpus(four, H200, "cuda"))
    assert "4 CPU workers asked for on 2 cores" in rule_text(policy.check_num_gpus(four, CPU, "cpu"))
    assert policy.check_num_gpus(four, V100, "cuda") == []


def test_resolve_precision():
    auto = from_dict({})
    assert policy.resolve_precision(auto, CPU, "cpu")[0].value == "bf16"
    assert policy.resolve_precision(auto, H200, "cuda")[0].value == "bf16"
    choice, problems = policy.resolve_precision(auto, V100, "cuda")
    assert choice.value == "fp16" and "7.0 < 8.0" in choice.reason and problems == []
    _, problems = policy.resolve_precision(from_dict({"precision": "bf16"}), V100, "cuda")
    assert "bf16 needs compute capability >= 8.0" in rule_text(problems)
    _, problems = policy.resolve_precision(from_dict({"precision": "fp16"}), CPU, "cpu")
    assert problems == cpu_rules.precision("fp16")


def test_resolve_attention():
    auto = from_dict({})
    assert policy.resolve_attention(auto, A100, "cuda")[0].value == "flash_attention_2"
    assert "not installed" in policy.resolve_attention(auto, H200, "cuda")[0].reason
    assert "7.0 < 8.0" in policy.resolve_attention(auto, V100, "cuda")[0].reason
    assert policy.resolve_attention(auto, CPU, "cpu")[0].reason == "auto: CPU; PyTorch SDPA"
    fa2 = from_dict({"kernels": {"attention": "flash_attention_2"}})
    assert policy.resolve_attention(fa2, CPU, "cpu")[1] == cpu_rules.attention("flash_attention_2")
    assert "capability >= 8.0" in rule_text(policy.resolve_attention(fa2, V100, "cuda")[1])
    assert "pip install longft[flash]" in rule_text(policy.resolve_attention(fa2, H200, "cuda")[1])
    assert policy.resolve_attention(fa2, A100, "cuda")[1] == []


def test_resolve_sdpa_backend():
    auto = from_dict({})
    pick = {hw.gpu_name: policy.resolve_sdpa_backend(auto, hw, "cuda", "sdpa")[0].value
            for hw in (V100, A100, H200)}
    assert list(pick.values()) == ["efficient", "flash", "cudnn"]
    assert policy.resolve_sdpa_backend(auto, CPU, "cpu", "sdpa")[0].value == "default"
    assert policy.resolve_sdpa_backend(auto, A100, "cuda", "flash_attention_2")[0].value == "default"
    cudnn = from_dict({"kernels": {"sdpa_backend": "cudnn"}})
    assert policy.resolve_sdpa_backend(cudnn, CPU, "cpu", "sdpa")[1] == cpu_rules.sdpa_backend("cudnn")
    assert "use efficient" in rule_text(policy.resolve_sdpa_backend(cudnn, V100, "cuda", "sdpa")[1])
    assert policy.resolve_sdpa_backend(cudnn, H200, "cuda", "sdpa") == (
        policy.Choice("cudnn", "set in params"), [])


def test_resolve_liger():
    auto = from_dict({})
    assert policy.resolve_liger(auto, H200, "cuda", "llama")[0].value is True
    assert "not installed" in policy.resolve_liger(auto, A100, "cuda", "llama")[0].reason
    assert policy.resolve_liger(auto, CPU, "cpu", "llama")[0].value is False
    on = from_dict({"kernels": {"liger": "on"}})
    assert policy.resolve_liger(on, CPU, "cpu", "llama") == (policy.Choice(True, "set in params"),
                                                             cpu_rules.liger("on"))
    assert "pip install liger-kernel" in rule_text(policy.resolve_liger(on, A100, "cuda", "llama")[1])
    assert "supported: llama" in rule_text(policy.resolve_liger(on, H200, "cuda", "gpt2")[1])
    off = from_dict({"kernels": {"liger": "off"}})
    assert policy.resolve_liger(off, CPU, "cpu", "gpt2") == (policy.Choice(False, "set in params"), [])


def test_resolve_tiled_mlp():
    assert policy.resolve_tiled_mlp(from_dict({}))[0].value is False
    long = from_dict({"data": {"max_seq_length": policy.TILED_MLP_FROM}})
    assert policy.resolve_tiled_mlp(long)[0].value is True
    dropout = {"lora": {"rank": 8, "dropout": 0.1}, "data": {"max_seq_length": policy.TILED_MLP_FROM}}
    assert policy.resolve_tiled_mlp(from_dict(dropout))[0].value is False
    choice, problems = policy.resolve_tiled_mlp(from_dict({**dropout, "kernels": {"tiled_mlp": "on"}}))
    assert choice.value is True and "lora.dropout: 0" in rule_text(problems)


def test_resolve_checkpointing():
    assert policy.resolve_checkpointing(from_dict({}), "cpu")[0].value == "gpu"
    off = from_dict({"checkpointing": {"mode": "cpu_offload"}})
    assert policy.resolve_checkpointing(off, "cuda") == (
        policy.Choice("cpu_offload", "set in params"), [])
    assert policy.resolve_checkpointing(off, "cpu")[1] == cpu_rules.checkpointing("cpu_offload")


def test_resolve_host_grad_buffer():
    one = {"train": {"global_batch_size": 1}}
    assert policy.resolve_host_grad_buffer(from_dict(one), "bf16")[0].value == "shared"
    choice, problems = policy.resolve_host_grad_buffer(from_dict(one), "fp16")
    assert choice.value == "full" and "fp16" in choice.reason and problems == []
    shared = from_dict({"zero": {"host_grad_buffer": "shared"}})   # accumulates over 2 micro-steps
    assert "shared cannot run here" in rule_text(policy.resolve_host_grad_buffer(shared, "bf16")[1])


def test_check_vram_limit():
    cfg = from_dict({"hardware": {"vram_limit_gib": 80}})
    assert "more than the 39.4 GiB" in rule_text(policy.check_vram_limit(cfg, A100, "cuda"))
    assert policy.check_vram_limit(cfg, H200, "cuda") == []
    # auto on CPU: refused, not ignored
    assert "device auto found no CUDA GPU" in rule_text(policy.check_vram_limit(cfg, CPU, "cpu"))


def test_resolve_lists_problems_in_knob_order():
    cfg = from_dict({"precision": "bf16", "kernels": {"attention": "flash_attention_2", "liger": "on"},
                     "hardware": {"num_gpus": 16, "vram_limit_gib": 80},
                     "train": {"global_batch_size": 16}})
    with pytest.raises(PlanError) as e:
        resolve(cfg, V100, "gpt2")
    keys = [p.split(":")[0] for p in e.value.problems]
    assert keys == ["hardware.num_gpus", "precision", "kernels.attention", "kernels.liger",
                    "hardware.vram_limit_gib"]


# ------------------------------------------------------------------ architecture


def test_attention_dims_fill_in_what_a_config_leaves_out():
    assert attention_dims(4096, 32) == (128, 32)           # multi-head: one K/V head per head
    assert attention_dims(4096, 32, None, 8) == (128, 8)
    assert attention_dims(2048, 32, 64, 8) == (64, 8)      # given: kept
    assert attention_dims(5120, 32, 128, None) == (128, 32)  # head_dim need not be hidden / heads


def test_architecture_reads_every_key():
    mc = SimpleNamespace(model_type="llama", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, vocab_size=384)
    arch = architecture(mc)
    assert list(arch) == list(ARCH_KEYS)
    assert (arch["head_dim"], arch["num_key_value_heads"]) == (16, 4)
    assert arch["tie_word_embeddings"] is None and arch["max_position_embeddings"] is None


def test_overlap_step_auto_is_on_only_where_it_applies_and_on_is_refused_elsewhere():
    """zero.overlap_step: auto takes it with a GPU, ZeRO-3, CPU Adam and one process, and drops the
    persistence threshold to 0 there; elsewhere it is off and says why; `on` where it cannot run
    is a PlanError that names what is missing and the fix."""
    from longft.engine import ds_config

    def overlap(over, hw=H200):
        return resolve(from_dict(over), hw, "llama")["overlap_step"]

    on = overlap({})
    assert on.value == "on" and "next forward" in on.reason
    z = ds_config.build(from_dict({}), "bf16", 2048, overlap_step=True)["zero_optimization"]
    assert z["stage3_param_persistence_threshold"] == 0
    z = ds_config.build(from_dict({}), "bf16", 2048)["zero_optimization"]
    assert z["stage3_param_persistence_threshold"] == 20480
    assert overlap({}, CPU).value == "off" and "a GPU" in overlap({}, CPU).reason
    for over, missing in (({"zero": {"stage": 2}}, "zero.stage 3"),
                          ({"zero": {"offload_optimizer": "none"}}, "offload_optimizer: cpu"),
                          ({"hardware": {"num_gpus": 2}}, "one process")):
        hw = H200 if "hardware" not in over else Hardware(**{**vars(H200), "gpu_count": 2})
        off = overlap(over, hw)
        assert off.value == "off" and missing in off.reason, off
        with pytest.raises(PlanError, match=f"zero.overlap_step: on .*{missing}.*auto"):
            overlap({**over, "zero": {**over.get("zero", {}), "overlap_step": "on"}}, hw)
    kept = overlap({"zero": {"param_persistence_threshold": 100}})
    assert kept.value == "off" and "persistence" in kept.reason
    assert overlap({"zero": {"param_persistence_threshold": 100, "overlap_step": "on"}}).value == "on"
    assert overlap({"zero": {"overlap_step": "off"}}).value == "off"

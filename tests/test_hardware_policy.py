"""One rule function at a time: the CPU rules (longft.config.cpu_rules), each knob's resolver in
longft.hardware.policy, and the architecture's head_dim / K/V heads (longft.model.architecture).
tests/test_plan.py covers `resolve()` as a whole."""

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


def test_packed_attention_resolves_per_gpu_generation_by_measurement():
    """auto: on Hopper cuDNN SDPA per document from 32K-token rows and varlen_attn below
    (measured end to end on the H200), torch's varlen_attn on Ampere where torch has it, SDPA
    per document on a V100 and on CPU; none for rows of one document; flash_attention_2 reads
    the boundaries itself; impossible requests refused."""
    import dataclasses

    from longft.config import from_dict
    from longft.hardware import Hardware, PlanError, resolve

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, liger=True, varlen_attn=True)
    a100 = dataclasses.replace(h200, gpu_name="NVIDIA A100-SXM4-40GB", capability=(8, 0))
    v100 = dataclasses.replace(h200, gpu_name="Tesla V100-SXM2-16GB", capability=(7, 0))
    cpu = Hardware(device="cpu", host_mem_gib=24, cpu_count=2, varlen_attn=True)

    def packed(params, hw):
        return resolve(from_dict(params), hw, "llama")["packed_attention"]

    c = packed({"data": {"max_seq_length": 131072}}, h200)
    assert c.value == "per_document" and "cuDNN" in c.reason and "14,575" in c.reason
    assert packed({"data": {"max_seq_length": 32768}}, h200).value == "per_document"
    short = packed({"data": {"max_seq_length": 32767}}, h200)
    assert short.value == "varlen" and "39,669" in short.reason
    assert packed({"data": {"max_seq_length": 16384}},
                  dataclasses.replace(h200, varlen_attn=False)).value == "per_document"
    assert packed({}, a100).value == "varlen"
    no_varlen = packed({}, dataclasses.replace(a100, varlen_attn=False))
    assert no_varlen.value == "per_document" and "no varlen_attn" in no_varlen.reason
    assert packed({}, v100).value == "per_document"
    assert packed({}, cpu).value == "per_document"
    assert packed({"data": {"pack": False}}, h200).value == "none"
    assert packed({"data": {"source": "random"}}, h200).value == "none"
    assert packed({"kernels": {"packed_attention": "varlen"}}, h200).value == "varlen"
    assert packed({"kernels": {"packed_attention": "mask"}}, h200).value == "mask"
    assert packed({"kernels": {"attention": "eager"}}, cpu).value == "mask"
    fa2 = dataclasses.replace(a100, flash_attn=True)
    assert packed({}, fa2).value == "flash_attention_2"
    for params, hw, msg in (
            ({"kernels": {"packed_attention": "varlen"}}, v100, "compute capability >= 8.0"),
            ({"kernels": {"packed_attention": "varlen"}}, cpu, "a CUDA GPU"),
            ({"kernels": {"packed_attention": "varlen"}}, dataclasses.replace(a100, varlen_attn=False),
             "torch >= 2.10"),
            ({"kernels": {"packed_attention": "per_document", "attention": "eager"}}, cpu,
             "needs kernels.attention sdpa"),
            ({"kernels": {"packed_attention": "varlen", "attention": "flash_attention_2"}}, fa2,
             "flash-attn's variable-length kernel")):
        with pytest.raises(PlanError, match=msg):
            resolve(from_dict(params), hw, "llama")


def test_vram_limit_with_device_auto_on_a_machine_without_a_gpu_is_refused():
    """The cap would be ignored without a word: refused, with the reason, like device: cpu."""
    from longft.config.params import from_dict
    from longft.hardware import Hardware, PlanError, resolve

    cpu = Hardware(device="cpu", host_mem_gib=24, cpu_count=2)
    with pytest.raises(PlanError, match=r"vram_limit_gib: only meaningful with hardware.device "
                                        r"cuda; set it to null \(device auto found no CUDA GPU"):
        resolve(from_dict({"hardware": {"vram_limit_gib": 16}}), cpu, "llama")


def test_flash_attn_4_runs_only_where_it_can_and_keeps_nothing():
    """kernels.packed_attention flash_attn_4: resolved on a Hopper GPU with flash-attn-4
    installed; refused, naming the fix, without the package, below compute capability 9.0, on
    CPU, with checkpointing.keep_attention (its kernels are not torch ops, so nothing would be
    kept) and beside eager or flash_attention_2 attention."""
    import dataclasses

    from longft.config import from_dict
    from longft.hardware import Hardware, PlanError, resolve

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, varlen_attn=True, flash_attn_4=True)
    ask = {"kernels": {"packed_attention": "flash_attn_4"}}
    got = resolve(from_dict(ask), h200, "llama")["packed_attention"]
    assert (got.value, got.reason) == ("flash_attn_4", "set in params")
    a100 = dataclasses.replace(h200, gpu_name="NVIDIA A100-SXM4-40GB", capability=(8, 0))
    # auto: flash-attn-4 where it is installed on Hopper and newer (measured fastest at every
    # length), unless keep_attention asks for what it cannot keep; never below 9.0
    for seq in (16384, 131072):
        got = resolve(from_dict({"data": {"max_seq_length": seq}}), h200, "llama")["packed_attention"]
        assert got.value == "flash_attn_4" and "49,447" in got.reason
    kept = resolve(from_dict({"checkpointing": {"keep_attention": 4}}), h200, "llama")["packed_attention"]
    assert kept.value == "varlen" and "cannot keep its outputs" in kept.reason
    assert resolve(from_dict({}), dataclasses.replace(h200, flash_attn_4=False),
                   "llama")["packed_attention"].value == "varlen"
    assert resolve(from_dict({}), a100, "llama")["packed_attention"].value == "varlen"
    # flash-attn 2 installed too: auto attention gives packed rows to flash-attn-4 (sdpa), but only
    # where flash-attn-4 will run them
    both = dataclasses.replace(h200, flash_attn=True)
    r = resolve(from_dict({}), both, "llama")
    assert (r["attention"].value, r["packed_attention"].value) == ("sdpa", "flash_attn_4")
    assert "flash-attn-4 installed" in r["attention"].reason
    for params in ({"checkpointing": {"keep_attention": 4}}, {"data": {"pack": False}}):
        assert resolve(from_dict(params), both, "llama")["attention"].value == "flash_attention_2", params
    assert resolve(from_dict({}), dataclasses.replace(both, flash_attn_4=False),
                   "llama")["attention"].value == "flash_attention_2"
    # a pinned longft kernel with flash-attn 2 installed: auto attention makes way for it
    pin = resolve(from_dict({"kernels": {"packed_attention": "per_document"}}), both, "llama")
    assert (pin["attention"].value, pin["packed_attention"].value) == ("sdpa", "per_document")
    # fp32: flash-attn-4 runs bf16 / fp16 only; auto passes it by and says why, a pin is refused
    fp32 = resolve(from_dict({"precision": "fp32"}), h200, "llama")["packed_attention"]
    assert fp32.value == "varlen" and "runs bf16 / fp16, not fp32" in fp32.reason
    # Blackwell: not measured there, so auto leaves it to the user
    b200 = dataclasses.replace(h200, gpu_name="NVIDIA B200", capability=(10, 0))
    bw = resolve(from_dict({}), b200, "llama")["packed_attention"]
    assert bw.value == "varlen" and "set it for 10.0" in bw.reason
    assert resolve(from_dict(ask), b200, "llama")["packed_attention"].value == "flash_attn_4"
    for params, hw, msg in (
            (ask, dataclasses.replace(h200, flash_attn_4=False), "pip install flash-attn-4"),
            (ask, a100, r"Hopper or Blackwell GPU \(compute capability >= 9.0; NVIDIA A100-SXM4-40GB is 8.0\)"),
            (ask, Hardware(device="cpu", host_mem_gib=24, cpu_count=2, flash_attn_4=True), "no CUDA GPU"),
            ({**ask, "checkpointing": {"keep_attention": 2}}, h200, "keep_attention cannot keep flash-attn-4"),
            ({**ask, "precision": "fp32"}, h200, "flash_attn_4 runs bf16 or fp16, not fp32"),
            ({"kernels": {"packed_attention": "flash_attn_4", "attention": "eager"}}, h200,
             "needs kernels.attention sdpa"),
            ({"kernels": {"packed_attention": "flash_attn_4", "attention": "flash_attention_2"}},
             dataclasses.replace(h200, flash_attn=True), "flash-attn's variable-length kernel")):
        with pytest.raises(PlanError, match=msg):
            resolve(from_dict(params), hw, "llama")


def test_detect_tells_flash_attn_2_from_flash_attn_4(monkeypatch):
    """Both write into the package flash_attn: flash-attn-4 only flash_attn.cute, and flash-attn 2.8
    ships a flash_attn/cute of its own (without the CUTLASS DSL). Each is told by the distribution
    that provides flash_attn; flash-attn 2 also by its CUDA extension where a source build left no
    metadata."""
    from longft.hardware import machine

    def world(providers, modules):
        monkeypatch.setattr(machine, "_providers", lambda m: set(providers) if m == "flash_attn" else set())
        monkeypatch.setattr(machine, "_has", lambda m: m in modules)
        return machine.flash_attn_packages()

    fa2_files = {"flash_attn", "flash_attn_2_cuda", "flash_attn.cute"}  # flash-attn 2.8.3's wheel
    assert world({"flash-attn"}, fa2_files) == {"flash_attn": True, "flash_attn_4": False}
    assert world({"flash-attn-4"}, {"flash_attn", "flash_attn.cute"}) == {"flash_attn": False,
                                                                          "flash_attn_4": True}
    assert world({"flash-attn", "flash-attn-4"}, fa2_files) == {"flash_attn": True, "flash_attn_4": True}
    assert world(set(), fa2_files) == {"flash_attn": True, "flash_attn_4": False}  # source build
    assert world(set(), set()) == {"flash_attn": False, "flash_attn_4": False}
    assert world({"flash-attn-4"}, {"flash_attn"}) == {"flash_attn": False, "flash_attn_4": False}


def test_providers_reads_the_installed_metadata(tmp_path, monkeypatch):
    """_providers finds a distribution by the files its RECORD lists, with its name normalised."""
    import importlib.metadata
    import sys

    from longft.hardware import machine

    info = tmp_path / "flash_attn_4-4.0.0b36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn_4\nVersion: 4.0.0b36\n")
    (info / "RECORD").write_text("flash_attn/cute/__init__.py,,\nflash_attn_4-4.0.0b36.dist-info/METADATA,,\n")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)  # Python 3.12 lists only files that exist
    (tmp_path / "flash_attn" / "cute" / "__init__.py").touch()
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert "flash-attn-4" in machine._providers("flash_attn")
    assert importlib.metadata.version("flash-attn-4") == "4.0.0b36"


# ------------------------------------------------------------------ what this torch can do


def test_detect_finds_varlen_attn_exactly_where_torch_has_it():
    """Real, no fake: torch.nn.attention.varlen came with torch 2.10; the images pin 2.9.1
    (scripts/test_image_pins.sh runs this there), where auto must not pick it."""
    import torch
    from packaging.version import Version

    from longft.hardware import detect
    from longft.model.packed_attention import varlen_available

    has = Version(torch.__version__.split("+")[0]) >= Version("2.10")
    assert detect().varlen_attn is has and varlen_available() is has


def test_on_an_images_torch_without_varlen_auto_takes_per_document(monkeypatch):
    """torch 2.9 (the images' pin) on a Hopper and an Ampere GPU, faked: the capability as detect()
    finds it, then auto's choice: SDPA per document, never varlen (which would fail to import)."""
    import importlib.util
    from types import SimpleNamespace as NS

    import torch

    from longft.hardware import detect

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch.nn.attention.varlen" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, cap in (("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-40GB", (8, 0))):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i, n=name, c=cap: NS(name=n, major=c[0], minor=c[1], total_memory=80 * 2**30))
        hw = detect()
        assert hw.device == "cuda" and hw.capability == cap and hw.varlen_attn is False
        for seq in (4096, 16384, 131072):
            c = resolve(from_dict({"data": {"max_seq_length": seq}}), hw, "llama")["packed_attention"]
            assert c.value == "per_document", (name, seq, c)
        with pytest.raises(PlanError, match=r"torch >= 2.10"):
            resolve(from_dict({"kernels": {"packed_attention": "varlen"}}), hw, "llama")

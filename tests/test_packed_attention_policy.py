"""The packed-attention kernel per GPU generation and per torch (longft.hardware.policy's
packed_attention resolver), flash-attn-4 and flash-attn-2 told apart by detect(), and what the
installed torch can do (varlen_attn). tests/test_hardware_policy.py has the other knobs' resolvers."""

import pytest

from longft.config.params import from_dict
from longft.hardware import Hardware, PlanError, resolve


def test_packed_attention_resolves_per_gpu_generation_by_measurement():
    """auto: on Hopper cuDNN SDPA per document from 32K-token rows and varlen_attn below
    (measured end to end on the H200), torch's varlen_attn on Ampere where torch has it, SDPA
    per document on a V100 and on CPU; none for rows of one document; flash_attention_2 reads
    the boundaries itself; impossible requests refused."""
    import dataclasses

    from longft.config import from_dict
    from longft.hardware import PlanError, resolve

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
    from longft.hardware import PlanError, resolve

    cpu = Hardware(device="cpu", host_mem_gib=24, cpu_count=2)
    with pytest.raises(PlanError, match=r"vram_limit_gib: only meaningful with hardware.device "
                                        r"cuda; set it to null \(device auto found no CUDA GPU"):
        resolve(from_dict({"hardware": {"vram_limit_gib": 16}}), cpu, "llama")


def test_flash_attn_4_runs_only_where_it_can():
    """kernels.packed_attention flash_attn_4: resolved on a Hopper GPU with flash-attn-4
    installed, also with checkpointing.keep_attention (longft runs it as a torch op whose outputs
    are kept); refused, naming the fix, without the package, below compute capability 9.0, on
    CPU and beside eager or flash_attention_2 attention."""
    import dataclasses

    from longft.config import from_dict
    from longft.hardware import PlanError, resolve

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, varlen_attn=True, flash_attn_4=True)
    ask = {"kernels": {"packed_attention": "flash_attn_4"}}
    got = resolve(from_dict(ask), h200, "llama")["packed_attention"]
    assert (got.value, got.reason) == ("flash_attn_4", "set in params")
    a100 = dataclasses.replace(h200, gpu_name="NVIDIA A100-SXM4-40GB", capability=(8, 0))
    # auto: flash-attn-4 where it is installed on Hopper and newer (measured fastest at every
    # length), with keep_attention too; never below 9.0
    for params in ({"data": {"max_seq_length": 16384}}, {"data": {"max_seq_length": 131072}},
                   {"checkpointing": {"keep_attention": 4}}):
        got = resolve(from_dict(params), h200, "llama")["packed_attention"]
        assert got.value == "flash_attn_4" and "49,447" in got.reason, params
    assert resolve(from_dict({}), dataclasses.replace(h200, flash_attn_4=False),
                   "llama")["packed_attention"].value == "varlen"
    assert resolve(from_dict({}), a100, "llama")["packed_attention"].value == "varlen"
    # auto attention on Hopper with flash-attn-4 installed: flash-attn-4 for every row (measured
    # faster than cuDNN's single-sequence kernel too), also beside flash-attn 2; packed rows on its
    # varlen kernel, said so; flash-attn 2 where flash-attn-4 is missing
    both = dataclasses.replace(h200, flash_attn=True)
    for hw in (h200, both):
        for params in ({}, {"checkpointing": {"keep_attention": 4}}, {"data": {"pack": False}}):
            r = resolve(from_dict(params), hw, "llama")
            assert r["attention"].value == "flash_attn_4" and "1.13-1.23x cuDNN" in r["attention"].reason
            packed = "none" if params == {"data": {"pack": False}} else "flash_attn_4"
            assert r["packed_attention"].value == packed, params
    assert "49,447" in resolve(from_dict({}), h200, "llama")["packed_attention"].reason
    assert resolve(from_dict({}), dataclasses.replace(both, flash_attn_4=False),
                   "llama")["attention"].value == "flash_attention_2"
    # fp32 and Blackwell: not auto's (below); packed rows pinned to another kernel keep SDPA
    for params, hw in (({"precision": "fp32"}, h200), ({}, dataclasses.replace(h200, capability=(10, 0))),
                       ({"kernels": {"packed_attention": "varlen"}}, h200)):
        assert resolve(from_dict(params), hw, "llama")["attention"].value == "sdpa", params
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


def test_attention_flash_attn_4_runs_every_row_on_it_where_it_can():
    """kernels.attention flash_attn_4: resolved on a Hopper GPU with flash-attn-4 installed, packed
    rows on its varlen kernel (not SDPA's backends: sdpa_backend is moot), keep_attention allowed;
    refused, naming the fix, without the package, below 9.0, on CPU, in fp32, beside another
    pinned packed kernel and for a model that softcaps its attention logits."""
    import dataclasses

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, varlen_attn=True, flash_attn_4=True)
    ask = {"kernels": {"attention": "flash_attn_4"}}
    r = resolve(from_dict({**ask, "checkpointing": {"keep_attention": 4}}), h200, "llama")
    assert (r["attention"].value, r["attention"].reason) == ("flash_attn_4", "set in params")
    assert r["packed_attention"].value == "flash_attn_4" and "its varlen kernel" in r["packed_attention"].reason
    assert r["sdpa_backend"].value == "default"
    unpacked = resolve(from_dict({**ask, "data": {"pack": False}}), h200, "llama")
    assert (unpacked["attention"].value, unpacked["packed_attention"].value) == ("flash_attn_4", "none")
    a100 = dataclasses.replace(h200, gpu_name="NVIDIA A100-SXM4-40GB", capability=(8, 0))
    for params, hw, msg, softcap in (
            (ask, dataclasses.replace(h200, flash_attn_4=False),
             "attention: flash_attn_4 needs the flash-attn-4 package", None),
            (ask, a100, r"Hopper or Blackwell GPU \(compute capability >= 9.0; NVIDIA A100-SXM4-40GB is 8.0\)", None),
            (ask, Hardware(device="cpu", host_mem_gib=24, cpu_count=2, flash_attn_4=True), "no CUDA GPU", None),
            ({**ask, "precision": "fp32"}, h200, "kernels.attention: flash_attn_4 runs bf16 or fp16, not fp32", None),
            ({"kernels": {"attention": "flash_attn_4", "packed_attention": "varlen"}}, h200,
             "runs packed rows with its own varlen kernel", None),
            (ask, h200, "flash_attn_4 cannot apply this model's attention logit softcapping", 50.0)):
        with pytest.raises(PlanError, match=msg):
            resolve(from_dict(params), hw, "llama", softcap)



def test_auto_leaves_flash_attn_4_where_it_would_train_another_model_or_was_not_asked():
    """kernels.attention auto does not take flash-attn-4 for a model whose sliding window is
    shorter than a row (longft's attention function does not apply it; a pin is refused, naming
    the window) nor where kernels.sdpa_backend is pinned; the window comes from the model's config
    (Mistral's sliding_window, Qwen2's only with use_sliding_window)."""
    from transformers import MistralConfig, Qwen2Config

    from longft.model.patches import attention_window

    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, varlen_attn=True, flash_attn_4=True)
    assert attention_window(MistralConfig(sliding_window=4096)) == 4096
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    long = {"data": {"max_seq_length": 16384, "pack": False}}
    assert resolve(from_dict(long), h200, "mistral", window=4096)["attention"].value == "sdpa"
    assert resolve(from_dict(long), h200, "mistral", window=16384)["attention"].value == "flash_attn_4"
    with pytest.raises(PlanError, match=r"cannot apply the model's sliding window \(4096 tokens\)"):
        resolve(from_dict({**long, "kernels": {"attention": "flash_attn_4"}}), h200, "mistral", window=4096)
    pinned = resolve(from_dict({**long, "kernels": {"sdpa_backend": "flash"}}), h200, "llama")
    assert (pinned["attention"].value, pinned["sdpa_backend"].value) == ("sdpa", "flash")


def test_detect_passes_by_a_flash_attn_4_that_does_not_load(monkeypatch, capsys):
    """flash-attn-4 installed without its CUTLASS DSL libraries for this CUDA: detect() on a
    Hopper GPU calls it missing (so auto does not take it and fail at the first run) and says why."""
    import sys

    from longft.hardware import machine

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    assert machine.flash_attn_4_loads() is False
    assert "flash-attn-4 is installed but does not load (ModuleNotFoundError" in capsys.readouterr().out

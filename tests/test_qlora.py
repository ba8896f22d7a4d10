"""QLoRA (lora.quantize) and bitsandbytes' 8-bit AdamW (optim.name): the rules, the quantized
layers, and (slow tier) whole runs on CPU: QLoRA's loss curve beside LoRA's on the same rows, the
frozen 4-bit weights unchanged, exact resume, and an export that peft and from_pretrained load."""

import json
import shutil

import pytest
import torch
import yaml

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, ConfigError, ModelConfig, from_dict, merge, to_dict
from longft.model.quantize import dequantized_state_dict, quantize_linears

bnb = pytest.importorskip("bitsandbytes")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny(dtype=torch.bfloat16, seed=0):
    from transformers import AutoModelForCausalLM

    from longft.model.loading import load_model_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=dtype)


# ------------------------------------------------------------------ rules


def test_qlora_runs_on_zero2_and_the_plan_says_why():
    from longft.hardware.machine import Hardware
    from longft.hardware.policy import resolve

    cfg = from_dict({"lora": {"rank": 8, "quantize": "nf4"}, "zero": {"stage": 2}})
    assert cfg.zero.stage == 2  # what params say is what runs
    assert from_dict({"lora": {"rank": 8}}).zero.stage == 3  # plain LoRA keeps the default
    cpu = Hardware(device="cpu", gpu_name=None, gpu_count=0, capability=None, gpu_mem_gib=None,
                   host_mem_gib=24, cpu_count=2, flash_attn=False, liger=False)
    choice = resolve(cfg, cpu, "llama")["quantize"]
    assert choice.value == "nf4" and "ZeRO-2" in choice.reason


@pytest.mark.parametrize("overlay, message", [
    ({"lora": {"quantize": "nf4"}}, "lora.quantize: nf4 .* needs lora.rank > 0"),
    # params (and dvc exp show) would say 3 while it ran on 2: refused with the fix instead
    ({"lora": {"rank": 8, "quantize": "nf4"}}, r"zero.stage: 3, but lora.quantize nf4 runs on "
                                               r"ZeRO-2 .*set zero.stage: 2 \(-S zero.stage=2\)"),
    ({"lora": {"rank": 8, "quantize": "nf4"}, "zero": {"stage": 2, "offload_param": "cpu"}},
     "zero.offload_param: a ZeRO-3 feature, but lora.quantize nf4 runs on ZeRO-2"),
    ({"lora": {"rank": 8, "quantize": "int8"}, "zero": {"stage": 2, "offload_ratio": 0.5}},
     "zero.offload_ratio: a ZeRO-3 feature"),
    ({"optim": {"name": "adamw_8bit"}}, "set zero.offload_optimizer: none"),
    ({"optim": {"name": "adamw_8bit"}, "zero": {"offload_optimizer": "none",
                                                 "optimizer_states": "bf16"}, "precision": "bf16"},
     "zero.optimizer_states: bf16 applies to DeepSpeed's Adam"),
    ({"optim": {"name": "paged_adamw_8bit"}, "zero": {"offload_optimizer": "none"},
      "hardware": {"device": "cpu"}}, "needs a CUDA GPU; use adamw_8bit on CPU"),
])
def test_impossible_combinations_are_refused_with_the_fix(overlay, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(overlay)


def test_8bit_adamw_replaces_deepspeeds_adam_in_the_config():
    from longft.engine.ds_config import build
    from longft.engine.optimizer import client_optimizer

    cfg = from_dict({"optim": {"name": "adamw_8bit", "lr": 3e-4},
                     "zero": {"offload_optimizer": "none"}})
    assert "optimizer" not in build(cfg, "bf16", 64)  # DeepSpeed would build its own otherwise
    p = torch.nn.Parameter(torch.randn(8192))
    opt = client_optimizer(cfg)([p])
    assert isinstance(opt, bnb.optim.AdamW8bit) and opt.defaults["lr"] == 3e-4
    p.grad = torch.randn(8192)
    opt.step()
    assert opt.state[p]["state1"].dtype == torch.uint8  # m and v in 8 bits
    assert client_optimizer(from_dict({})) is None
    assert build(from_dict({}), "bf16", 64)["optimizer"]["type"] == "AdamW"


# ------------------------------------------------------------------ the quantized layers


@pytest.mark.parametrize("kind, cls, rel_err", [("nf4", "Linear4bit", 0.15),
                                                 ("int8", "Linear8bitLt", 0.02)])
def test_targeted_linears_are_quantized_frozen_and_dequantize_back(kind, cls, rel_err):
    from longft.model.quantize import dequantized_weight, has_quantized_layers

    model = _tiny()
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    assert not has_quantized_layers(model)
    n = quantize_linears(model, TARGETS, kind, torch.bfloat16, "cpu")
    assert n == 7 * model.config.num_hidden_layers and has_quantized_layers(model)
    q = model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == cls and not q.weight.requires_grad
    if kind == "int8":
        assert q.state.has_fp16_weights is False  # int8 weights only, no 16-bit copy kept
    with pytest.raises(TypeError, match="not a bitsandbytes quantized Linear"):
        dequantized_weight(model.lm_head, torch.float32)
    biased = torch.nn.Sequential(torch.nn.Linear(128, 64))        # a bias stays, frozen
    bias = biased[0].bias.detach().clone()
    assert quantize_linears(biased, ("0",), kind, torch.bfloat16, "cpu") == 1
    assert not biased[0].bias.requires_grad and torch.equal(biased[0].bias, bias.bfloat16())
    assert type(model.lm_head) is torch.nn.Linear  # the head stays: Liger's fused loss reads it
    sd = dequantized_state_dict(model, model.state_dict(), torch.bfloat16)
    assert set(sd) == set(plain)  # loads into the plain architecture
    key = "model.layers.1.mlp.down_proj.weight"
    assert sd[key].dtype == torch.bfloat16
    err = (sd[key].float() - plain[key].float()).norm() / plain[key].float().norm()
    assert 0 < err < rel_err, err  # quantized (not a copy), and close
    ids = torch.randint(1, 250, (1, 32))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_adapters_get_gradients_and_the_quantized_weights_do_not_change():
    from peft import LoraConfig, get_peft_model

    model = _tiny()
    quantize_linears(model, TARGETS, "nf4", torch.bfloat16, "cpu")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS)),
                           autocast_adapter_dtype=False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    packed = [n for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert len(packed) == 7 * 2
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(1, 250, (2, 32))
    for _ in range(3):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        assert lora and all(p.grad is not None for p in lora)
        assert any(p.grad.abs().sum() > 0 for p in lora)
        opt.step()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            assert torch.equal(p.detach(), frozen[n]), f"{n} changed"


def _qlora_with_update(kind="nf4", ratio=2e-3):
    """A tiny QLoRA model (base quantized to `kind`, adapters in bf16 as build.py makes them) whose
    adapters change each targeted weight by about `ratio` of its size (rms): what a finetune's
    update looks like, far below bf16's rounding step of 2^-8 of a weight."""
    from peft import LoraConfig, get_peft_model

    model = _tiny()
    quantize_linears(model, TARGETS, kind, torch.bfloat16, "cpu")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS),
                                             init_lora_weights=False), autocast_adapter_dtype=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=g))
                b.copy_(torch.randn(b.shape, generator=g))
                w = dequantize(m.base_layer)
                delta = m.scaling["default"] * (b.float() @ a.float())
                b.mul_(ratio * w.norm() / delta.norm())
                a.data, b.data = a.data.bfloat16(), b.data.bfloat16()
    return model.eval()


def dequantize(layer):
    from longft.model.quantize import dequantized_weight

    return dequantized_weight(layer, torch.float32)


def _plain(sd):
    """The tiny Llama in fp32 with these weights (strictly: every key, no extra)."""
    model = _tiny(torch.float32)
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.eval()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_merged_qlora_export_keeps_the_adapters_effect_on_the_logits(kind):
    """The merged export (engine/export.py merged_state_dict) against the adapter on the base it
    was trained on, both in fp32: the logits agree to float noise, where the old bf16 merge lost
    about half of the adapter's effect (an update of 0.2 % of |W| is below bf16's rounding)."""
    from peft import PeftModel

    from longft.engine.export import lora_layers, merge_lora, merged_state_dict

    model = _qlora_with_update(kind)
    sd = model.state_dict()
    base_sd = dequantized_state_dict(model.get_base_model(), model.get_base_model().state_dict(),
                                     torch.float32)          # W_dq: the base training saw
    base_sd = {k.replace(".base_layer.", "."): v for k, v in base_sd.items() if "lora_" not in k}
    base = _plain(base_sd)
    adapted = PeftModel(_plain(base_sd), model.peft_config["default"]).eval()
    adapted.load_state_dict({k: v.float() for k, v in sd.items() if "lora_" in k}, strict=False)
    ids = torch.randint(1, 250, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, plain = adapted(ids).logits, base(ids).logits
        merged = _plain(merged_state_dict(model, sd, kind))(ids).logits
        bf16 = merge_lora(dequantized_state_dict(model, sd, torch.bfloat16), lora_layers(model))
        old = _plain(bf16)(ids).logits                        # the earlier export: bf16 throughout
    effect = (want - plain).norm()
    lost, lost_bf16 = (merged - want).norm() / effect, (old - want).norm() / effect
    print(f"{kind}: adapter effect {effect:.4f}; lost by the fp32 merge {lost:.2e}, "
          f"by the bf16 merge {lost_bf16:.3f}")
    assert lost < 1e-3, lost                  # fp32 merge: the adapter's effect, to float noise
    assert lost_bf16 > 0.2, lost_bf16         # what the bf16 merge lost (measured ~0.5)
    assert all(v.dtype == torch.float32 for v in merged_state_dict(model, sd, kind).values()
               if v.is_floating_point())


def test_qlora_resume_loads_the_saved_adapters_strictly():
    """engine/checkpoint.py load_saved_keys, DeepSpeed's module load on QLoRA resume: a checkpoint
    written with exclude_frozen_parameters loads into a fresh model; one whose adapter keys are not
    the model's (missing, renamed, extra) is refused with the keys named, not half-loaded."""
    from longft.engine.checkpoint import CheckpointError, load_saved_keys

    saved_model = _qlora_with_update("nf4")
    frozen = {n for n, p in saved_model.named_parameters() if not p.requires_grad}
    saved = {k: v for k, v in saved_model.state_dict().items() if k not in frozen}  # as DeepSpeed
    assert any(".lora_A." in k for k in saved) and not any(k.endswith("base_layer.weight")
                                                           for k in saved)
    fresh = _qlora_with_update("nf4", ratio=1e-1)
    load_saved_keys(saved, fresh)
    got = fresh.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.items() if ".lora_" in k)
    lora_key = next(k for k in saved if ".lora_B." in k)
    for broken, named in (({k: v for k, v in saved.items() if k != lora_key}, lora_key),
                          ({**saved, lora_key.replace("q_proj", "qkv_proj"): saved[lora_key]},
                           "qkv_proj"),
                          ({k.replace(".default.", ".other."): v for k, v in saved.items()},
                           ".other.")):
        before = {k: v.clone() for k, v in fresh.state_dict().items() if ".lora_" in k}
        with pytest.raises(CheckpointError, match="do not match the model") as e:
            load_saved_keys(broken, fresh)
        assert named in str(e.value)
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())  # untouched


# ------------------------------------------------------------------ whole runs (slow tier)


def _base(tmp_path, byte_tokenizer):
    base_dir = tmp_path / "base"
    if not base_dir.is_dir():
        _tiny(torch.float32).save_pretrained(base_dir)
        byte_tokenizer.save_pretrained(base_dir)
    return base_dir


def _run(work, base_dir, overlay, stages=("prepare", "patch", "train")):
    from longft.run.pipeline import run_all

    work.mkdir(parents=True, exist_ok=True)
    params = merge(to_dict(Config()), merge({
        "model": {"source": "pretrained", "name": str(base_dir)},
        "data": {"num_samples": 6, "max_seq_length": 1024, "eval_samples": 0},
        "train": {"iterations": 6, "warmup_iterations": 1},
        "optim": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8},
        "output": {"save_checkpoint": False, "export": False}}, overlay))
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, stages)
    rows = [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["type"] == "iter"}, rows


QLORA_VS_LORA_TOL = 0.05
"""Largest |QLoRA loss - LoRA loss| per step on the tiny model (loss ~6): NF4's rounding of the
base weights moves the loss by about 1 % of its value; a broken adapter or a dequantization bug
moves it by far more."""


@pytest.mark.slow
def test_qlora_follows_lora_and_exports_an_adapter_and_a_merged_model(tmp_path, byte_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = _base(tmp_path, byte_tokenizer)
    lora, _ = _run(tmp_path / "lora", base_dir, {})
    qlora, rows = _run(tmp_path / "qlora", base_dir, {
        "lora": {"quantize": "nf4"}, "zero": {"stage": 2},
        "output": {"export": True, "export_lora": "merged"}})
    assert sorted(qlora) == sorted(lora) == [1, 2, 3, 4, 5, 6]
    assert qlora[6] < qlora[1] - 0.1  # it learns
    for s in lora:
        assert abs(qlora[s] - lora[s]) <= QLORA_VS_LORA_TOL, (s, qlora[s], lora[s])
    assert qlora != lora  # the base really was quantized
    env = next(r for r in rows if r["type"] == "env")
    assert env["trainable_dtypes"] == ["bfloat16"]  # adapters in the training dtype

    export = tmp_path / "qlora" / "export"
    info = json.loads((export / "longft_export.json").read_text())
    assert info["kind"] == "lora_merged" and info["quantize"] == "nf4"
    assert info["base"]["quantize"] == "nf4" and info["base"]["model"] == str(base_dir)
    # fp32 as stored (config.json says so): loading with transformers' default dtype keeps it
    merged, missing = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(missing.values()), missing  # plain weights: no bitsandbytes needed
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert merged.config.to_dict().get("quantization_config") is None
    # the adapter loads with peft on the base it was trained on (here: de-quantized by
    # bitsandbytes, exactly as training saw it) and computes what the merged model computes
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    quantize_linears(base, TARGETS, "nf4", torch.bfloat16, "cpu")
    deq = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    deq.load_state_dict(dequantized_state_dict(base, base.state_dict(), torch.bfloat16))
    ids = torch.randint(1, 250, (1, 48))
    with torch.no_grad():
        before = deq.float().eval()(ids).logits
    tuned = PeftModel.from_pretrained(deq, export / "adapter").eval()  # wraps deq in place
    with torch.no_grad():
        want = tuned(ids).logits
        merge_err = (merged.eval()(ids).logits - want).abs().max()
        moved = (before - want).abs().max()
    # the merged weights are W_dq + s*B@A in fp32: the same model as the adapter on its base, to
    # float noise (a bf16 merge was ~1e-2 off, of the same order as what training moved)
    assert merge_err < 1e-4, merge_err
    assert moved > 100 * merge_err, (moved, merge_err)  # what training moved, far above that


@pytest.mark.slow
def test_qlora_resume_is_exact(tmp_path, byte_tokenizer):
    from longft.run.pipeline import run_stage, stage_commands

    base_dir = _base(tmp_path, byte_tokenizer)
    work = tmp_path / "run"
    ref, _ = _run(work, base_dir, {"lora": {"quantize": "nf4"}, "zero": {"stage": 2},
                                   "output": {"checkpoint_every": 2, "keep_last": 3}})
    steps = sorted(p for p in work.glob("checkpoints/**/step-*") if p.is_dir())
    assert [p.name for p in steps] == ["step-2", "step-4"]  # the periodic ones (not the last step)
    shutil.rmtree(steps[1])  # as if the run had died in step 5 before its checkpoint: step-2
    as_killed_after_last_checkpoint(work / "checkpoints")
    module = torch.load(next(steps[0].glob("mp_rank_*_model_states.pt")), weights_only=False)["module"]
    assert any("lora_A" in k for k in module)
    assert not any(k.endswith("q_proj.base_layer.weight") for k in module)  # the frozen base is not saved
    out = run_stage("train", stage_commands(work / "params.yaml", work)["train"])
    assert "resumed from" in out and "step-2" in out
    # the run's records: steps 1-2 kept from before the checkpoint, 3-6 from the resumed run
    rows = [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]
    again = {r["step"]: r["loss"] for r in rows if r["type"] == "iter"}
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    for s in again:
        assert again[s] == ref[s], (s, again[s], ref[s])


@pytest.mark.slow
def test_8bit_adamw_trains_without_offload(tmp_path, byte_tokenizer):
    base_dir = _base(tmp_path, byte_tokenizer)
    overlay = {"lora": {"rank": 0}, "zero": {"offload_optimizer": "none"},
               "train": {"iterations": 4}, "optim": {"lr": 3e-3}}
    full, _ = _run(tmp_path / "adamw", base_dir, overlay)
    eight, rows = _run(tmp_path / "8bit", base_dir, merge(overlay, {"optim": {"name": "adamw_8bit"}}))
    # the same first forward: the same weights and rows, to float noise (on a loaded CPU the two
    # processes' thread reductions can differ in the last bits: 5.976229 against 5.976220 in a CI
    # run with two test workers)
    assert eight[1] == pytest.approx(full[1], rel=1e-5, abs=0)
    assert eight[4] < eight[1]  # it learns
    assert eight != full        # with other states than Adam's fp32 ones
    for s in full:
        assert abs(eight[s] - full[s]) < 0.1, (s, eight[s], full[s])


@pytest.mark.parametrize("zero", [{"offload_param": "cpu"}, {"offload_ratio": 0.5},
                                  {"offload_optimizer": "nvme", "nvme_path": "/tmp"},
                                  {"prefetch_bucket_size": 5}])
def test_a_zero3_knob_over_a_quantized_base_gets_one_fix_not_two_that_contradict(zero):
    """Walkthrough (2026-12-05): over an NF4 base on ZeRO-2, "set zero.stage: 3" (the generic
    ZeRO-3 rule) beside "runs on ZeRO-2" (the quantized base's): only the second, whose fix works."""
    from longft.config.params import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"sparse": {"blocks": 8}, "lora": {"quantize": "nf4"},
                   "zero": {"stage": 2, "offload_optimizer": "cpu", **zero}})
    assert "zero.stage: 3" not in str(e.value) and "runs on ZeRO-2" in str(e.value)
    with pytest.raises(ConfigError, match="zero.stage: 3"):       # no quantized base: stage 3 fixes it
        from_dict({"zero": {"stage": 2, "offload_optimizer": "cpu", **zero}})

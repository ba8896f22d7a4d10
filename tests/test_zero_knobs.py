"""The ZeRO-3 knobs issue 22's sweep turns (zero.reduce_bucket_size, prefetch_bucket_size,
param_persistence_threshold, max_live_parameters) and checkpointing.prefetch: refused when they
cannot apply, written into DeepSpeed's config in place of longft's defaults, and moved through the
memory estimate by exactly the bytes they change. The CUDA path of prefetch is in test_gpu.py."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from longft.config.params import ConfigError, from_dict
from longft.engine import ds_config
from longft.engine.environment import ZERO_KNOBS
from longft.estimate.estimator import Setup, estimate, setup_from_config
from longft.hardware import resolve
from test_offload import CpuHooks, grads, tiny_model
from test_plan import H200

REPO = Path(__file__).resolve().parents[1]
ARCH_1B = json.loads((REPO / "configs/models/llama3.2-1b.json").read_text())
H = ARCH_1B["hidden_size"]
OFFLOAD_1B = Setup(micro_batch=4, seq_len=16384, attention="sdpa", sdpa_backend="cudnn", liger=True,
                   checkpointing="gpu", offload_optimizer=True, offload_param=True)


def items(s: Setup) -> dict:
    return {i.name: i.bytes for i in estimate(ARCH_1B, s).items}


@pytest.mark.parametrize("params,needle", [
    ({"zero": {"reduce_bucket_size": 0}}, "zero.reduce_bucket_size: must be >= 1 element"),
    ({"zero": {"prefetch_bucket_size": -5}}, "zero.prefetch_bucket_size: must be >= 1 element"),
    ({"zero": {"max_live_parameters": 0}}, "zero.max_live_parameters: must be >= 1 element"),
    ({"zero": {"param_persistence_threshold": -1}}, "zero.param_persistence_threshold: must be >= 0"),
    ({"zero": {"stage": 2, "prefetch_bucket_size": 1000}}, "a ZeRO-3 setting"),
    ({"zero": {"stage": 2, "max_live_parameters": 1000}}, "zero.stage 2 would ignore it"),
    ({"checkpointing": {"mode": "gpu", "prefetch": False}}, "applies only to checkpointing.mode cpu_offload"),
])
def test_knobs_that_cannot_apply_are_refused_with_the_fix(params, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict(params)


def test_every_checkpointing_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        from_dict({"checkpointing": {"mode": "none", "keep_attention": 2, "prefetch": False}})
    assert "keep_attention: 2 needs checkpointing" in str(e.value)
    assert "prefetch: false applies only" in str(e.value)


def test_ds_config_defaults_scale_with_the_width_and_each_knob_replaces_its_default():
    z = ds_config.build(from_dict({}), "bf16", 2048)["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"],
            z["stage3_param_persistence_threshold"], z["stage3_max_live_parameters"]) == (
        2048 * 2048, int(0.9 * 2048 * 2048), 10 * 2048, 10**9)
    knobs = {"reduce_bucket_size": 123, "prefetch_bucket_size": 456, "param_persistence_threshold": 0,
             "max_live_parameters": 789}
    z = ds_config.build(from_dict({"zero": knobs}), "bf16", 2048)["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"],
            z["stage3_param_persistence_threshold"], z["stage3_max_live_parameters"]) == (123, 456, 0, 789)
    assert {"reduce_bucket_size", "stage3_prefetch_bucket_size"} <= set(ZERO_KNOBS)  # the env record keeps them
    z2 = ds_config.build(from_dict({"zero": {"stage": 2, "reduce_bucket_size": 99}}), "bf16", 64)
    assert z2["zero_optimization"]["reduce_bucket_size"] == 99


def test_config_to_setup_carries_the_knobs():
    cfg = from_dict({"zero": {"reduce_bucket_size": 5, "prefetch_bucket_size": 6,
                              "param_persistence_threshold": 7, "max_live_parameters": 8},
                     "checkpointing": {"mode": "cpu_offload", "prefetch": False}})
    s = setup_from_config(cfg, resolve(cfg, H200, "llama"))
    assert (s.reduce_bucket_size, s.prefetch_bucket_size, s.param_persistence_threshold,
            s.max_live_parameters, s.ckpt_prefetch) == (5, 6, 7, 8, False)


def test_bucket_knobs_move_their_estimate_items_by_exactly_their_bytes():
    base = items(OFFLOAD_1B)
    w = 2  # bf16
    bigger = items(dataclasses.replace(OFFLOAD_1B, reduce_bucket_size=4 * H * H))
    key = "gradients: reduce bucket + one in flight"
    assert bigger[key] - base[key] == w * 3 * H * H
    pre = items(dataclasses.replace(OFFLOAD_1B, prefetch_bucket_size=10**8))
    assert pre["ZeRO-3 prefetch bucket"] == w * 10**8
    # threshold 0: nothing stays gathered; a huge one: every parameter does (offload_param gathers)
    none = items(dataclasses.replace(OFFLOAD_1B, param_persistence_threshold=0))
    assert none["weights: persistent small params"] == 0 < base["weights: persistent small params"]
    allp = items(dataclasses.replace(OFFLOAD_1B, param_persistence_threshold=10**12))
    assert allp["weights: persistent small params"] > 100 * base["weights: persistent small params"]
    assert estimate(ARCH_1B, dataclasses.replace(OFFLOAD_1B, reduce_bucket_size=4 * H * H)).gpu_allocated > \
        estimate(ARCH_1B, OFFLOAD_1B).gpu_allocated


def test_max_live_parameters_limits_the_layers_kept_gathered():
    from longft.estimate.arch import zero_knobs
    from longft.estimate.gpu import reuse_layers

    s = dataclasses.replace(OFFLOAD_1B, checkpointing="none")
    free = reuse_layers(ARCH_1B, s, zero_knobs(s, H))
    tight = dataclasses.replace(s, max_live_parameters=1)
    assert free > 0 and reuse_layers(ARCH_1B, tight, zero_knobs(tight, H)) == 0


def test_checkpoint_prefetch_off_holds_one_checkpoint_fewer_on_the_gpu():
    s = dataclasses.replace(OFFLOAD_1B, checkpointing="cpu_offload")
    on, off = items(s), items(dataclasses.replace(s, ckpt_prefetch=False))
    ckpt = 4 * 16384 * H * 2
    assert on["activation checkpoints: in use + prefetched"] == 2 * ckpt
    assert off["activation checkpoints: in use (no prefetch)"] == ckpt


def test_hooks_without_prefetch_bring_each_tensor_back_on_demand_with_identical_gradients():
    model = tiny_model()
    ids = torch.randint(1, 300, (1, 256))
    _, g_ref = grads(model, ids)
    hooks = CpuHooks(prefetch=False)
    _, g = grads(model, ids, hooks)
    for n in g_ref:
        assert torch.equal(g[n], g_ref[n]), n
    assert hooks.prefetch_hits == 0 and len(hooks.unpacked) >= 2
    assert hooks.host == {} and hooks.prefetched == {}
    on = CpuHooks()
    grads(model, ids, on)
    assert on.prefetch_hits >= len(on.unpacked) // 2   # the same run with prefetch does prefetch

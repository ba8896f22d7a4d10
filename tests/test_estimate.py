"""The memory estimator against hand-computed numbers (against the measured H200 rows:
test_estimate_accuracy.py).

Every expected number below is written out as the arithmetic of docs/estimator.md, so a changed
formula shows up as a changed line here.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from longft.config.params import from_dict
from longft.config.plan import Resolved
from longft.estimate.estimator import (
    GIB,
    LAUNCHER_BASE_BYTES,
    RANK_BASE_BYTES,
    SETUP_LAUNCHER_BYTES,
    SETUP_RANK_BYTES,
    Setup,
    compare,
    estimate,
    estimate_for_plan,
    fits,
    format_table,
    layer_activation_bytes,
    param_numels,
    pinned,
    pinned_pool,
    reuse_layers,
    setup_from_config,
    sub_groups,
    zero_knobs,
)
from longft.hardware import Choice

REPO = Path(__file__).resolve().parents[1]
MiB, KiB = 2**20, 2**10

SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
             tie_word_embeddings=False)
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                tie_word_embeddings=True, max_position_embeddings=131072)
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                tie_word_embeddings=False, max_position_embeddings=131072)


def items(est, where="gpu"):
    return {i.name: i.bytes for i in est.items if i.where == where}


# ---------------------------------------------------------------- parameters


def test_parameter_counts():
    # small: embed 384*64; per layer q 64*64, k 64*32, v 64*32, o 64*64, gate/up/down 64*176, 2 norms
    layer = 4096 + 2048 + 2048 + 4096 + 3 * 11264 + 2 * 64
    assert layer == 46208
    assert sum(n for _, n in param_numels(SMALL)) == 24576 + 2 * layer + 64 + 24576 == 141632
    # Llama-3.2-1B (tied): the count the H200 runs report
    assert sum(n for _, n in param_numels(LLAMA_1B)) == 1_235_814_400
    assert sum(n for _, n in param_numels(LLAMA_8B)) == 8_030_261_248


def test_sub_groups_follow_deepspeed():
    # parameters are appended until a group reaches 1e9 elements: embed + 12 layers + q, k, v, o
    g = sub_groups([n for _, n in param_numels(LLAMA_1B)])
    assert g == [262_668_288 + 12 * 60_821_504 + 4_194_304 + 2 * 1_048_576 + 4_194_304,
                 1_235_814_400 - 1_003_012_096]
    assert g[0] == 1_003_012_096
    assert sub_groups([5, 5], size=100) == [10]


def test_pinned_rounding_and_pool_reuse():
    assert pinned(1) == 1 and pinned(4096) == 4096 and pinned(4097) == 8192 and pinned(0) == 0
    live, resident = pinned_pool([("alloc", "a", 3 * MiB), ("alloc", "b", 1 * MiB),
                                  ("free", "a", 0), ("alloc", "c", 4 * MiB),   # reuses a's block
                                  ("alloc", "d", 2 * MiB)])                    # new block
    assert live == {"b": MiB, "c": 4 * MiB, "d": 2 * MiB}
    assert resident == 4 * MiB + MiB + 2 * MiB


def test_reuse_distance_keeps_layers():
    knobs = zero_knobs(Setup(1, 1024, offload_param=True, offload_optimizer=True), 2048)
    assert knobs["stage3_max_reuse_distance"] == 10**9
    # 1B, checkpointing: kept while 3 x j x 60,821,504 < 1e9, i.e. j = 1..5
    assert reuse_layers(LLAMA_1B, Setup(1, 1024), knobs) == 5
    # without checkpointing 2 x j x 60,821,504 < 1e9: j = 1..8
    assert reuse_layers(LLAMA_1B, Setup(1, 1024, checkpointing="none"), knobs) == 8
    # 8B: 3 x 218,112,000 = 654,336,000 < 1e9 < 2 x that: one layer kept
    assert reuse_layers(LLAMA_8B, Setup(1, 1024), knobs) == 1
    assert reuse_layers(SMALL, Setup(1, 1024), knobs) == 1  # all but the current one: L - 1
    assert reuse_layers(LLAMA_1B, Setup(1, 1024), {**knobs, "stage3_max_reuse_distance": 0}) == 0


# ---------------------------------------------------------------- a small config, by hand


def test_small_config_by_hand():
    s = Setup(micro_batch=2, seq_len=128)              # bf16, SDPA, Liger, GPU checkpoints, ZeRO-3
    e = estimate(SMALL, s)
    T, h, I, L, V, P = 256, 64, 176, 2, 384, 141632
    Hd, kvd = 4 * 16, 2 * 16
    saved = (2 * 2 * h            # two RMSNorm outputs
             + 2 * (Hd + kvd)     # q, k (RoPE in place)
             + 2 * kvd            # v
             + 2 * Hd             # attention output = o_proj input
             + 2 * h              # residual h1
             + 3 * 2 * I          # gate, up, silu(gate)*up
             + 2 * 4 + 4 * 4)     # rstd x 2, log-sum-exp per head (fp32)
    assert saved == 1848
    assert layer_activation_bytes(SMALL, s)["peak"] == saved + 2 * I + 2 * h == 2328
    chunk = 64                    # next_pow2(ceil(256 / ceil(384 / 64)))
    want = {
        "weights: partitions": 2 * P,
        "gradients: partitions": 2 * P,
        "optimizer: fp32 master + Adam m, v": 12 * P,
        "gradients: reduce bucket + one in flight": 2 * (h * h + h * I),
        "inputs + rotary cos/sin": T * (3 * 8 + 2 * 2 * 16),
        "activation checkpoints (GPU)": L * T * h * 2,
        "saved tensors of the recomputed layer": T * saved,
        "backward transients of one layer": T * (2 * I + 2 * h),
        "final layer output + norm output": 2 * T * h * 2,
        "fused loss: grads + logits chunk": T * h * 2 + V * h * 2 + chunk * V * 2 + 4 * T,
        "step: fp32 gradient of the largest sub-group": (4 + 2) * P,
    }
    assert items(e) == want
    states = 2 * P + 2 * P + 12 * P
    assert e.gpu_phases == {
        "loss": states + want["inputs + rotary cos/sin"] + want["activation checkpoints (GPU)"]
        + want["final layer output + norm output"] + want["fused loss: grads + logits chunk"],
        "backward": states + want["gradients: reduce bucket + one in flight"]
        + want["inputs + rotary cos/sin"] + want["activation checkpoints (GPU)"]
        + T * saved + T * (2 * I + 2 * h),
        "step": states + 6 * P,
    }
    assert e.gpu_phases["step"] == 3_115_904 and e.gpu_peak_phase == "step"
    assert e.gpu_allocated == 3_115_904
    assert e.gpu_reserved == int(3_115_904 * 1.06)  # expandable segments (the default)
    classic = estimate(SMALL, dataclasses.replace(e.setup, expandable_segments=False))
    assert classic.gpu_reserved == int(3_115_904 * 1.2)
    base, setup = LAUNCHER_BASE_BYTES + RANK_BASE_BYTES, SETUP_LAUNCHER_BYTES + SETUP_RANK_BYTES
    assert items(e, "host") == {"process baseline": base,
                                "start-up peak above the baseline": setup - base,
                                "DataLoader pinned batches": 6 * 2048}   # 2 batches x 3 x T x 8
    # nothing much in host memory: the peak is the start-up one, which the batches never reach
    assert e.host_rss == setup


def test_host_peak_is_start_up_or_steady_whichever_is_larger():
    """Row (a) (nothing in host memory) peaks at start-up, row (a') (its 16 checkpoints pinned,
    16 x 4 x 16384 x 2048 x 2 B = 4 GiB) while training, at the steady baseline plus the pinned
    blocks: 7.30 GiB predicted, 7.22 measured (not the 4.94 + 4 = 8.94 of one additive baseline)."""
    base, setup = LAUNCHER_BASE_BYTES + RANK_BASE_BYTES, SETUP_LAUNCHER_BYTES + SETUP_RANK_BYTES
    a = estimate(LLAMA_1B, Setup(micro_batch=4, seq_len=16384))
    assert a.host_rss == setup
    a1 = estimate(LLAMA_1B, Setup(micro_batch=4, seq_len=16384, checkpointing="cpu_offload"))
    host = items(a1, "host")
    assert host["activation checkpoints (pinned)"] == 16 * 2**28
    assert a1.host_rss == base + 16 * 2**28 + host["DataLoader pinned batches"] > setup
    assert abs(a1.host_rss / GIB - 7.223) / 7.223 < 0.02


# ---------------------------------------------------------------- placement and modes


def test_world_size_shards_model_states():
    one = items(estimate(LLAMA_8B, Setup(1, 4096)))
    four = items(estimate(LLAMA_8B, Setup(1, 4096, world_size=4, ranks_per_node=4)))
    P = 8_030_261_248
    assert one["optimizer: fp32 master + Adam m, v"] == 12 * P
    # every parameter padded to a multiple of 4 (all are here)
    assert four["optimizer: fp32 master + Adam m, v"] == 12 * P // 4
    assert four["weights: partitions"] == 2 * P // 4
    # with 4 ranks ZeRO-3 gathers: the current layer + the one kept by the reuse distance, lm_head
    assert four["weights: gathered decoder layers"] == 2 * 218_112_000 * 2


def test_zero2_keeps_full_weights_on_every_rank():
    e = items(estimate(LLAMA_1B, Setup(1, 4096, zero_stage=2, world_size=2, ranks_per_node=2)))
    P = 1_235_814_400
    assert e["weights: full copy (ZeRO-2)"] == 2 * P
    assert e["gradients: partitions"] == 2 * P // 2
    assert e["step: fp32 gradient of the largest sub-group"] == 6 * P // 2


def test_checkpointing_modes_order_gpu_memory_and_move_host_memory():
    base = Setup(micro_batch=1, seq_len=32768, offload_optimizer=True)
    none, gpu, cpu = (estimate(LLAMA_1B, dataclasses.replace(base, checkpointing=m))
                      for m in ("none", "gpu", "cpu_offload"))
    assert none.gpu_allocated > gpu.gpu_allocated > cpu.gpu_allocated
    # cpu_offload: 16 checkpoints of 32768 x 2048 x 2 B = 128 MiB each, pinned on the host
    host = items(cpu, "host")
    assert host["activation checkpoints (pinned)"] == 16 * 128 * MiB
    # only the layers' inputs go: tensors saved outside the layers (final-norm input, the fused
    # loss's gradients) stay on the GPU (offload.CheckpointOffload)
    assert "other offloaded saved tensors (pinned)" not in host
    assert cpu.host_rss - gpu.host_rss == 16 * 128 * MiB
    # gpu_layers keeps the last layers' checkpoints on the GPU: host and GPU trade 128 MiB each
    four = estimate(LLAMA_1B, dataclasses.replace(base, checkpointing="cpu_offload", gpu_layers=4))
    assert items(four, "host")["activation checkpoints (pinned)"] == 12 * 128 * MiB
    assert items(four)["activation checkpoints kept on the GPU"] == 4 * 128 * MiB
    # the kept inputs are gone before offloaded ones come back: max(4, 2) checkpoints at a time
    assert "activation checkpoints: in use + prefetched" not in items(four)
    assert four.gpu_allocated - cpu.gpu_allocated == (4 - 2) * 128 * MiB


def test_liger_off_materialises_fp32_logits():
    on = items(estimate(LLAMA_1B, Setup(1, 8192)))
    off = items(estimate(LLAMA_1B, Setup(1, 8192, liger=False)))
    assert "fused loss: grads + logits chunk" in on
    assert off["logits: fp32 log-softmax + 2 fp32 grads"] == 12 * 8192 * 128256


def test_eager_attention_is_quadratic():
    lin = layer_activation_bytes(LLAMA_1B, Setup(1, 8192))["saved"]
    quad = layer_activation_bytes(LLAMA_1B, Setup(1, 8192, attention="eager"))["saved"]
    # + H x seq x (4 + 2) B per token (fp32 softmax + bf16 probabilities), K/V repeated to 32 heads
    assert quad - lin == 32 * 8192 * 6 + 2 * 2 * (2048 - 512)


def test_sdpa_math_is_quadratic_like_eager_and_liger_off_keeps_more_per_layer():
    quad = layer_activation_bytes(LLAMA_1B, Setup(1, 8192, attention="eager"))
    assert layer_activation_bytes(LLAMA_1B, Setup(1, 8192, sdpa_backend="math")) == quad
    on = layer_activation_bytes(SMALL, Setup(1, 1024))
    off = layer_activation_bytes(SMALL, Setup(1, 1024, liger=False))
    # h 64, I 176, Hd 64, K/V 32, bf16: norms 2 x (4 + 2 x 2) x 64 - 2 x 2 x 64 = 768; q, k
    # 2 x 3 x (64 + 32) - 2 x (64 + 32) = 384; MLP saved 4 x 2 x 176 - 3 x 2 x 176 = 352
    assert off["saved"] - on["saved"] == 768 + 384 + 352
    # its backward: d(prod), d(act), d(up) 3 x 2 x 176 against Liger's 2 x 176
    assert off["mlp_peak"] - on["mlp_peak"] == 768 + 384 + 352 + 2 * 2 * 176


def test_ulysses_and_int8_bytes_per_token_by_hand():
    from longft.estimate.gpu import int8_forward_bytes, ulysses_bytes

    assert ulysses_bytes(LLAMA_1B, Setup(1, 8192)) == {"saved": 0, "buffers": 0}
    # N = 2: q, k, v 2 x 64 x (32 + 2 x 8) = 6144 B a local token, + the output 2 x 32 x 64
    assert ulysses_bytes(LLAMA_1B, Setup(1, 8192, sequence_parallel=2)) == \
        {"saved": 6144 + 4096, "buffers": 2 * 6144}
    # N = 16 > 8 K/V heads: k, v replicated to 16: 2 x 64 x (32 + 2 x 16) = 8192
    assert ulysses_bytes(LLAMA_1B, Setup(1, 8192, sequence_parallel=16))["buffers"] == 2 * 8192
    assert int8_forward_bytes(LLAMA_1B, Setup(1, 8192)) == 0
    # the largest linear, gate / up: h + 6 x I = 2048 + 6 x 8192 (int8 in, int32 and fp16 out)
    assert int8_forward_bytes(LLAMA_1B, Setup(1, 8192, quantize="int8")) == 2048 + 6 * 8192
    # whole, not one tile's, however long the sequence, unless the MLP is tiled
    assert int8_forward_bytes(LLAMA_1B, Setup(1, 131072, quantize="int8")) == 2048 + 6 * 8192


def test_packed_rows_under_the_block_mask_add_a_mask_and_expand_kv():
    e = items(estimate(LLAMA_1B, Setup(2, 4096, block_mask=True)))
    assert e["attention mask (packed rows)"] == 2 * 4096 * 4096


def test_flash_attn_4_adds_its_host_runtime_per_rank():
    """kernels.packed_attention flash_attn_4 loads the CUTLASS DSL and compiles its kernels in the
    first step: host RSS per rank at every moment, nothing on the GPU, nothing without it."""
    from longft.estimate.types import FLASH_ATTN_4_RANK_BYTES

    base = estimate(LLAMA_1B, Setup(2, 4096, world_size=2, ranks_per_node=2))
    fa4 = estimate(LLAMA_1B, Setup(2, 4096, world_size=2, ranks_per_node=2, flash_attn_4=True))
    assert items(fa4, "host")["flash-attn-4 runtime"] == 2 * FLASH_ATTN_4_RANK_BYTES
    assert fa4.host_rss - base.host_rss == 2 * FLASH_ATTN_4_RANK_BYTES
    assert (fa4.gpu_allocated, fa4.gpu_nvml) == (base.gpu_allocated, base.gpu_nvml)
    assert "flash-attn-4 runtime" not in items(base, "host")


def test_lora_trains_only_adapters():
    s = Setup(1, 4096, lora_rank=8, lora_targets=("q_proj", "v_proj"))
    e = items(estimate(LLAMA_1B, s))
    n = 16 * 8 * ((2048 + 2048) + (2048 + 512))       # rank x (in + out) per target per layer
    assert e["gradients: partitions"] == 2 * n
    assert e["optimizer: fp32 master + Adam m, v"] == 12 * n
    assert e["weights: partitions"] == 2 * 1_235_814_400


def test_bad_setup_is_refused():
    with pytest.raises(ValueError, match="offload_param needs zero_stage 3"):
        estimate(LLAMA_1B, Setup(1, 1024, zero_stage=2, offload_param=True))


def test_reference_row_c_sanity():
    """Llama-3.1-8B, 128000 tokens, everything offloaded (the reference study's code measured
    54.2 GB allocated and 174 GiB RSS): the estimate lands in the same place, less the ~14.5 GiB
    of zero.Init's pinned blocks that longft gives back and the reference code keeps."""
    e = estimate(LLAMA_8B, Setup(1, 128000, offload_optimizer=True, offload_param=True))
    assert 45 < e.gpu_allocated / GIB < 60
    assert 150 < e.host_rss / GIB < 174


# ---------------------------------------------------------------- plumbing


def test_setup_from_config_reads_plan_and_choices():
    cfg = from_dict({"data": {"max_seq_length": 8192, "source": "random"},
                     "train": {"micro_batch_size": 2, "global_batch_size": 8},
                     "hardware": {"num_gpus": 2},
                     "zero": {"offload_optimizer": "cpu", "offload_param": "cpu"}})
    plan_style = {"device": {"value": "cuda", "reason": "x"}, "precision": {"value": "bf16"},
                  "attention": {"value": "sdpa"}, "liger": {"value": True},
                  "checkpointing": {"value": "gpu"}}
    choices = {k: Choice(v["value"], "r") for k, v in plan_style.items()}
    a, b = setup_from_config(cfg, plan_style), setup_from_config(cfg, choices)
    assert a == b == setup_from_config(cfg, Resolved.from_dict(plan_style))
    assert (a.micro_batch, a.seq_len, a.world_size, a.ranks_per_node, a.grad_accum) == (2, 8192, 2, 2, 2)
    assert a.offload_param and a.offload_optimizer and a.liger and not a.block_mask
    assert a.sdpa_backend == "default"


def test_estimate_for_plan_is_json_and_compare_handles_cpu_runs():
    cfg = from_dict({"data": {"max_seq_length": 1024}})
    d = estimate_for_plan(cfg, SMALL, {"device": "cuda", "precision": "bf16", "attention": "sdpa",
                                       "liger": False, "checkpointing": "gpu"}, 1)
    json.dumps(d)
    assert d["gpu"]["allocated_bytes"] == sum(
        i["bytes"] for i in d["gpu"]["items"] if d["gpu"]["peak_phase"] in i["phases"])
    cpu_metrics = {"peak_vram": {"max_allocated_gib": None, "max_reserved_gib": None,
                                 "nvml_used_gib": None}, "peak_dram": {"rss_tree_gib": 6.0}}
    c = compare({"estimate": d}, cpu_metrics)
    assert c["vram_max_allocated"]["rel_error"] is None
    want = round((d["host"]["rss_bytes"] / GIB - 6.0) / 6.0, 4)
    assert c["dram_rss_tree"] == {"predicted_gib": round(d["host"]["rss_bytes"] / GIB, 3),
                                  "measured_gib": 6.0, "rel_error": want}


def test_fits_and_table():
    e = estimate(LLAMA_1B, Setup(4, 16384))
    f = fits(e, gpu_mem_gib=139.8, host_mem_gib=125.9)
    assert f.ok and f.gpu_ok and f.host_ok
    small = fits(e, gpu_mem_gib=24, host_mem_gib=125.9)
    assert not small.ok and small.gpu_ok is False
    assert fits(e, None, None).ok and fits(e, None, None).gpu_ok is None
    assert not fits(e, 139.8, 125.9, vram_limit_gib=20).ok
    t = format_table(e, small)
    assert "activation checkpoints (GPU)" in t and "<- peak" in t and "does NOT fit" in t


def test_lora_with_offloaded_parameters_keeps_the_frozen_base_in_zero_inits_blocks():
    """LoRA on Llama-3.1-8B with the parameters on the CPU: zero.Init pins every parameter's
    partition on its own, and DeepSpeed's flat buffer takes only the parameters the optimizer owns
    (the adapters), so the frozen base stays in the per-parameter blocks (rounded up to powers of
    two) for the whole run (the 24 GiB LoRA row: 35.65 GiB predicted, 35.75 measured)."""
    from longft.estimate.arch import param_numels
    from longft.estimate.host import pinned

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    e = estimate(LLAMA_8B, Setup(1, 8192, offload_optimizer=True, offload_param=True, lora_rank=16,
                                 lora_targets=targets))
    host = items(e, "host")
    frozen = sum(pinned(2 * n) for _, n in param_numels(LLAMA_8B))
    assert host["weights: frozen partitions (pinned)"] == frozen > 2 * 8_030_261_248
    assert host["weights: trained partitions (pinned)"] == pinned(2 * 41_943_040)
    assert "weights: partitions (pinned)" not in host
    assert host["start-up: pinned blocks of DeepSpeed's init"] >= frozen
    setup = sum(i.bytes for i in e.host_items() if "setup" in i.phases)
    steady = sum(i.bytes for i in e.host_items() if "steady" in i.phases)
    assert e.host_rss == max(setup, steady)


def test_optimizer_offload_alone_copies_back_through_pinned_chunks():
    """ZeRO-3 with only the optimizer on the CPU: DeepSpeed's own copy of each fp32 sub-group into
    the GPU's bf16 partition goes through a pageable bf16 temporary of the whole sub-group (the
    largest: 1,003,012,096 x 2 B for Llama-3.2-1B); zero.copy_back: chunked converts into three
    pinned chunks instead (engine/param_copy_back.py), whatever the sub-group's size. With the
    parameters on the CPU too, DeepSpeed converts in place: neither."""
    from longft.engine import param_copy_back

    name, old = "step: copy-back chunks (pinned)", "step: bf16 copy of a sub-group (pageable)"
    chunks = param_copy_back.CHUNKS * param_copy_back.CHUNK_ELEMENTS * 2
    ds = estimate(LLAMA_1B, Setup(1, 16384, offload_optimizer=True))
    assert items(ds, "host")[old] == 2 * 1_003_012_096 and name not in items(ds, "host")
    opt = estimate(LLAMA_1B, Setup(1, 16384, offload_optimizer=True, copy_back="chunked"))
    assert items(opt, "host")[name] == chunks and old not in items(opt, "host")
    assert ds.host_rss - opt.host_rss == 2 * 1_003_012_096 - chunks
    for other in (dict(offload_param=True), dict(precision="fp32"), dict(device="cpu")):
        host = items(estimate(LLAMA_1B, Setup(1, 16384, offload_optimizer=True, copy_back="chunked",
                                              **other)), "host")
        assert name not in host and old not in host, other
    two = dict(world_size=2, ranks_per_node=2)
    assert items(estimate(LLAMA_1B, Setup(1, 16384, offload_optimizer=True, copy_back="chunked",
                                          **two)), "host")[name] == 2 * chunks   # one set a rank
    assert items(estimate(LLAMA_1B, Setup(1, 16384, offload_optimizer=True, **two)), "host")[old] \
        == 2 * 2 * max(sub_groups([-(-n // 2) for _, n in param_numels(LLAMA_1B)]))


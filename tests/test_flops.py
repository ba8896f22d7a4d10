"""FLOPs per token against hand-written arithmetic, peak-FLOPS name matching, MFU."""

import json
from pathlib import Path

import pytest

from longft.estimate.flops import PEAK_TFLOPS, flops_per_token, gpu_model_key, matmul_params, mfu, peak_flops

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"

LLAMA31_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
              "vocab_size": 128256, "tie_word_embeddings": False}
LLAMA32_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
              "vocab_size": 128256, "tie_word_embeddings": True}


def test_llama31_8b_by_hand():
    # per layer, weights in matmuls
    q = 4096 * 32 * 128          # 16_777_216
    k = 4096 * 8 * 128           # 4_194_304 (grouped-query: 8 kv heads)
    v = 4096 * 8 * 128           # 4_194_304
    o = 32 * 128 * 4096          # 16_777_216
    mlp = 3 * 4096 * 14336       # 176_160_768 (gate, up, down)
    layers = 32 * (q + k + v + o + mlp)   # 6_979_321_856
    lm_head = 4096 * 128256               # 525_336_576
    assert layers + lm_head == 7_504_658_432 == matmul_params(LLAMA31_8B)
    fwd_matmul = 2 * (layers + lm_head)   # 15_009_316_864
    for seq, expected_total in ((16384, 57_912_852_480), (131072, 148_107_165_696)):
        qk = 2 * seq * 128 * 32          # QK^T per token per layer, all heads, full sequence
        av = 2 * seq * 128 * 32          # AV likewise
        attn = 32 * (qk + av) // 2       # 32 layers, halved for causal
        fwd = fwd_matmul + attn
        assert 3 * fwd == expected_total
        assert flops_per_token(LLAMA31_8B, seq) == expected_total
        assert flops_per_token(LLAMA31_8B, seq, training=False) == fwd


def test_llama32_1b_by_hand_tied_lm_head_still_counts():
    q = 2048 * 32 * 64           # 4_194_304
    k = 2048 * 8 * 64            # 1_048_576
    v = 2048 * 8 * 64            # 1_048_576
    o = 32 * 64 * 2048           # 4_194_304
    mlp = 3 * 2048 * 8192        # 50_331_648
    layers = 16 * (q + k + v + o + mlp)   # 973_078_528
    lm_head = 2048 * 128256               # 262_668_288: tied to the embedding, still a matmul
    assert layers + lm_head == 1_235_746_816
    for seq, expected_total in ((16384, 10_635_706_368), (131072, 33_184_284_672)):
        attn = 16 * (2 * seq * 64 * 32 + 2 * seq * 64 * 32) // 2
        assert 3 * (2 * (layers + lm_head) + attn) == expected_total
        assert flops_per_token(LLAMA32_1B, seq) == expected_total


def _n_params(c, tied):
    """All parameters: projections, MLP, 2 norms per layer, embedding (+ lm_head), final norm."""
    h, a, g, d, f, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                        c["head_dim"], c["intermediate_size"], c["vocab_size"])
    per_layer = h * a * d + 2 * h * g * d + a * d * h + 3 * h * f + 2 * h
    return c["num_hidden_layers"] * per_layer + V * h * (1 if tied else 2) + h


def test_close_to_six_n_at_short_context_and_attention_grows_with_it():
    n8 = _n_params(LLAMA31_8B, tied=False)
    assert 8.0e9 < n8 < 8.1e9  # the published 8.03 B
    n1 = _n_params(LLAMA32_1B, tied=True)
    assert 1.2e9 < n1 < 1.3e9  # the published 1.24 B
    for cfg, n in ((LLAMA31_8B, n8), (LLAMA32_1B, n1)):
        short = flops_per_token(cfg, 2048) / (6 * n)
        assert 0.9 < short < 1.2  # same order as 6N (embedding lookups are not matmuls)
        assert flops_per_token(cfg, 16384) / (6 * n) < 2
        assert 2 < flops_per_token(cfg, 131072) / (6 * n) < 10  # attention dominates at 128K


def test_config_object_and_defaults():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(MODELS / "llama3.1-8b.json")
    assert flops_per_token(cfg, 16384) == flops_per_token(LLAMA31_8B, 16384)
    json_cfg = json.loads((MODELS / "llama3.2-1b.json").read_text())
    assert flops_per_token(json_cfg, 4096) == flops_per_token(LLAMA32_1B, 4096)
    # head_dim defaults to hidden / heads, kv heads to heads (plain multi-head attention)
    mha = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}
    per_layer = 4 * 64 * 64 + 3 * 64 * 128
    attn = 2 * 2 * 10 * 16 * 4 // 2
    assert flops_per_token(mha, 10) == 3 * (2 * (2 * per_layer + 64 * 100) + 2 * attn)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="intermediate_size"):
        flops_per_token({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "vocab_size": 100}, 16)
    with pytest.raises(ValueError):
        flops_per_token(LLAMA32_1B, 0)


@pytest.mark.parametrize("name,dtype,tflops", [
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
    ("NVIDIA H100 PCIe", "fp16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-SXM2-32GB", "float16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100S-PCIE-32GB", "fp16", 130.0),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100-PCIE-40GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "bfloat16", 312.0),
    ("NVIDIA RTX A6000", "bf16", 154.8),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA A10G", "bf16", 70.0),
    ("Tesla T4", "fp16", 65.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "bf16", 181.0),                 # not the L40S
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),    # with FP32 accumulate, as training runs
    ("NVIDIA GeForce RTX 3090", "bf16", 71.0),
    ("NVIDIA RTX 6000 Ada Generation", "bf16", 364.2),  # not the RTX A6000
])
def test_peak_flops_matches_device_names(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name,dtype", [
    ("Tesla V100-SXM2-16GB", "bf16"),          # no bf16 tensor cores before Ampere
    ("Tesla T4", "tf32"),
    ("NVIDIA GeForce RTX 3090 Ti", "bf16"),    # not in the table: no guess
    ("NVIDIA GeForce RTX 4090 D", "bf16"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "bf16"),
    ("NVIDIA GeForce RTX 5090", "bf16"),
    ("NVIDIA GH200 480GB", "bf16"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16"),  # a slice has a fraction of the peak
    ("NVIDIA H100", "bf16"),                   # form factor unknown: SXM and PCIe differ
    ("Tesla V100-SXM3-32GB", "fp16"),
    ("cpu", "fp32"), ("", "bf16"), (None, "bf16"),
    ("NVIDIA H200", "int8"), ("NVIDIA H200", "auto"),
])
def test_peak_flops_unknown_is_none(name, dtype):
    assert peak_flops(name, dtype) is None


def test_peak_table_is_dense_and_consistent():
    for key, row in PEAK_TFLOPS.items():
        assert set(row) == {"bf16", "fp16", "tf32", "fp32"}, key
        assert row["fp16"] is not None and row["fp16"] > row["fp32"], key
        if row["bf16"] is not None:
            assert row["bf16"] == row["fp16"] and row["tf32"] < row["bf16"], key
    assert gpu_model_key("NVIDIA A100-SXM4-40GB") == "A100-SXM"


def test_mfu_arithmetic():
    # 1000 tokens/s x 6e9 FLOPs/token on 2 GPUs of 100 TFLOPS = 6e12 / 2e14
    assert mfu(1000.0, 6e9, 2, 100e12) == pytest.approx(0.03)
    fpt = flops_per_token(LLAMA31_8B, 16384)
    # 8 V100s at 125 TFLOPS reaching 30 % => tokens/s = 0.3 * 8 * 125e12 / fpt
    tps = 0.3 * 8 * 125e12 / fpt
    assert mfu(tps, fpt, 8, peak_flops("Tesla V100-SXM2-16GB", "fp16")) == pytest.approx(0.3)
    assert mfu(1000.0, 6e9, 2, None) is None
    assert mfu(None, 6e9, 2, 1e12) is None
    assert mfu(1000.0, None, 2, 1e12) is None
    assert mfu(1000.0, 6e9, 0, 1e12) is None


def test_lora_skips_the_frozen_weights_gradient_matmuls():
    # Llama-3.2-1B at 16K, LoRA rank 8 on all 7 projections: 16 layers x 8 x (in + out) each
    r, h, kv, f = 8, 2048, 8 * 64, 8192
    lora = 16 * r * ((h + h) + (h + kv) + (h + kv) + (h + h) + (h + f) + (h + f) + (f + h))
    assert lora == 5_636_096
    full = flops_per_token(LLAMA32_1B, 16384)
    fwd = flops_per_token(LLAMA32_1B, 16384, training=False)
    attention_fwd = fwd - 2 * 1_235_746_816
    # forward, activation gradients (as much again), attention's backward beyond them (its dQ, dK,
    # dV: one more attention forward) and the adapters' own 6 FLOPs a parameter
    assert flops_per_token(LLAMA32_1B, 16384, lora_params=lora) == 2 * fwd + attention_fwd + 6 * lora
    assert flops_per_token(LLAMA32_1B, 16384, lora_params=lora) == full - 2 * 1_235_746_816 + 6 * lora
    assert 0.7 < flops_per_token(LLAMA32_1B, 16384, lora_params=lora) / full < 0.8


def test_the_plan_ranks_lora_by_lora_flops():
    import dataclasses

    from longft.estimate.placement import step_seconds
    from longft.estimate.types import Setup

    arch = json.loads((MODELS / "llama3.2-1b.json").read_text())
    full = Setup(micro_batch=4, seq_len=16384, liger=True, checkpointing="gpu")
    lora = dataclasses.replace(full, lora_rank=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"))
    ratio = step_seconds(arch, lora, "NVIDIA H200") / step_seconds(arch, full, "NVIDIA H200")
    assert 0.7 < ratio < 0.85   # the frozen weights' gradient matmuls are skipped

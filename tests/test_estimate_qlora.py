"""QLoRA (lora.quantize nf4 / int8) and 8-bit Adam states (optim.name adamw_8bit) in the estimator,
against hand-computed numbers (docs/estimator.md, "QLoRA and 8-bit optimizer states")."""

import dataclasses

import pytest

from longft.config.params import from_dict
from longft.estimate.estimator import GIB, Setup, estimate, setup_from_config
from longft.estimate.quantized import adam8_state_bytes, int8_bytes, nf4_bytes, qlora_zero_stage
from test_estimate import LLAMA_1B, LLAMA_8B, SMALL  # tests/ is on sys.path under pytest

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
P_8B = 8_030_261_248


def items(est, where="gpu"):
    return {i.name: i.bytes for i in est.items if i.where == where}


def qlora(quantize="nf4", rank=16, **kw):
    return Setup(**{"micro_batch": 1, "seq_len": 4096, "zero_stage": 2, "lora_rank": rank,
                    "lora_targets": ALL7, "quantize": quantize, **kw})


def test_nf4_and_int8_bytes_of_one_weight():
    # 4096 x 4096: 4-bit codes 8,388,608 B + 262,144 absmax bytes (one per 64) + 4 B per 256 of
    # those (1,024 fp32 scales) + the offset, the 16-entry NF4 code and the 256-entry code of the
    # nested absmax (4 + 64 + 1,024 B)
    assert nf4_bytes(4096 * 4096) == 8_388_608 + 262_144 + 4 * 1024 + 1092
    assert nf4_bytes(1) == 1 + 1 + 4 + 1092                # the blocks round up
    # LLM.int8: 1 B per weight + an fp32 scale per output row
    assert int8_bytes(4096, 14336) == 4096 * 14336 + 4 * 14336
    # 8-bit Adam: m and v 1 B each + an fp32 absmax per 256 elements each + two 256-entry maps
    assert adam8_state_bytes(512) == 2 * 512 + 2 * 4 * 2 + 2048
    assert adam8_state_bytes(513) == 2 * 513 + 2 * 4 * 3 + 2048


def test_qlora_runs_on_zero2():
    assert qlora_zero_stage(3, 16, "nf4", 0) == 2
    assert qlora_zero_stage(3, 16, "int8", 0) == 2
    assert qlora_zero_stage(3, 16, "none", 0) == 3
    assert qlora_zero_stage(3, 0, "nf4", 0) == 3           # no LoRA, no blocks: nothing is quantized
    assert qlora_zero_stage(3, 0, "nf4", 8) == 2           # block-sparse over a quantized base
    cfg = from_dict({"lora": {"rank": 16, "quantize": "nf4"},
                     "zero": {"stage": 2, "offload_param": "none"}})
    s = setup_from_config(cfg, {"device": "cuda", "precision": "bf16", "attention": "sdpa",
                                "sdpa_backend": "flash", "liger": True, "checkpointing": "gpu",
                                "tiled_mlp": False, "host_grad_buffer": "full",
                                "packed_attention": "per_document"})
    assert (s.zero_stage, s.quantize, s.lora_rank, s.optimizer) == (2, "nf4", 16, "adamw")


def test_small_config_nf4_by_hand():
    """h 64, I 176, 2 layers: q, o 64 x 64; k, v 64 x 32; gate, up, down 64 x 176."""
    e = items(estimate(SMALL, qlora(rank=4)))
    q = 2048 + 64 + 4 + 1092        # 4,096 weights: codes, 64 absmax, one fp32 scale, constants
    k = 1024 + 32 + 4 + 1092        # 2,048 weights
    mlp = 5632 + 176 + 4 + 1092     # 11,264 weights
    assert e["weights: base linears in nf4 (bitsandbytes)"] == 2 * (2 * q + 2 * k + 3 * mlp)
    P = 2 * 384 * 64 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 11264 + 2 * 64) + 64
    Pq = 2 * (4096 + 2 * 2048 + 4096 + 3 * 11264)
    assert e["weights: embeddings, lm_head, norms (ZeRO-2)"] == 2 * (P - Pq)
    # rank x (in + out) per linear: q, o 4 x 128; k, v 4 x 96; gate, up, down 4 x 240
    adapters = 2 * (2 * 512 + 2 * 384 + 3 * 960)
    assert e["weights: LoRA adapters"] == 2 * adapters
    assert e["gradients: partitions"] == 2 * adapters
    assert e["optimizer: fp32 master + Adam m, v"] == 12 * adapters
    assert e["dequantized weight of one linear (transient)"] == 2 * 11264 + 4 * 176
    assert "weights: full copy (ZeRO-2)" not in e


def test_llama8b_nf4_base_weights():
    """Llama-3.1-8B: 6,979,321,856 weights in the 7 x 32 decoder linears, 3.35 GiB in NF4."""
    e = items(estimate(LLAMA_8B, qlora()))
    q = 8_388_608 + 262_144 + 4 * 1024 + 1092              # 4096 x 4096 (q, o)
    kv = 2_097_152 + 65_536 + 4 * 256 + 1092               # 4096 x 1024 (k, v)
    mlp = 29_360_128 + 917_504 + 4 * 3584 + 1092           # 4096 x 14336 (gate, up, down)
    assert e["weights: base linears in nf4 (bitsandbytes)"] == 32 * (2 * q + 2 * kv + 3 * mlp)
    assert 32 * (2 * q + 2 * kv + 3 * mlp) == 3_600_661_376
    assert round(3_600_661_376 / GIB, 3) == 3.353
    # embeddings, lm_head and 65 norms of 4,096 stay in bf16
    assert e["weights: embeddings, lm_head, norms (ZeRO-2)"] == 2 * (2 * 128256 * 4096 + 65 * 4096)
    assert 2 * 128256 * 4096 + 65 * 4096 + 6_979_321_856 == P_8B
    # rank 16 x (in + out) summed over the 7 linears = 16 x 81,920 per layer
    assert e["weights: LoRA adapters"] == 2 * 32 * 16 * 81_920
    assert e["dequantized weight of one linear (transient)"] == 2 * 58_720_256 + 4 * 917_504


def test_llama8b_int8_base_weights():
    e = items(estimate(LLAMA_8B, qlora("int8")))
    rows = 3 * 4096 + 2 * 1024 + 2 * 14336                 # output rows: q, o, down; k, v; gate, up
    assert e["weights: base linears in int8 (bitsandbytes)"] == 32 * (218_103_808 + 4 * rows)
    assert 32 * (218_103_808 + 4 * rows) == 6_984_826_880
    assert e["dequantized weight of one linear (transient)"] == 2 * 58_720_256


def test_int8_forward_holds_int8_and_int32_products():
    """LLM.int8's forward (and recompute) of gate/up at 4,096 tokens: the int8 input h and the
    int32 + fp16 product 6 I per token, beside the layer's saved tensors."""
    from longft.estimate.gpu import int8_forward_bytes, layer_activation_bytes

    s = qlora("int8")
    assert int8_forward_bytes(LLAMA_8B, s) == 4096 + 6 * 14336
    nf4 = layer_activation_bytes(LLAMA_8B, qlora())
    i8 = layer_activation_bytes(LLAMA_8B, s)
    assert i8["saved"] == nf4["saved"] and i8["peak"] == nf4["saved"] + 4096 + 6 * 14336
    # the tiled MLP runs gate / up over one tile: 4096 of 131072 tokens
    t = dataclasses.replace(s, seq_len=131072, tiled_mlp=True)
    assert int8_forward_bytes(LLAMA_8B, t) == 4096 + 6 * 4096   # q / o over all tokens now


def test_qlora_shrinks_8b_weights_and_keeps_nothing_on_the_host_but_the_build():
    lora16 = estimate(LLAMA_8B, Setup(1, 4096, lora_rank=16, lora_targets=ALL7))
    q = estimate(LLAMA_8B, qlora())
    weights = sum(v for k, v in items(q).items() if k.startswith("weights:"))
    assert weights < 5.5 * GIB < items(lora16)["weights: partitions"]
    # ZeRO-2 builds the model on the host (no zero.Init) before it goes to the GPU: start-up only,
    # and not at once with the start-up peak, so only what exceeds that peak is added
    h = items(q, "host")
    assert h["start-up: the model built on the host (ZeRO-2)"] == (
        2 * P_8B - h["start-up peak above the baseline"])
    assert q.host_moments["setup"] == h["process baseline"] + 2 * P_8B
    assert q.host_moments["steady"] < 4 * GIB


def test_qlora_with_optimizer_offload_uses_adapter_sized_staging():
    e = estimate(LLAMA_8B, qlora(offload_optimizer=True))
    g, h = items(e), items(e, "host")
    # the staging buffer is the largest trainable tensor: lora_B of gate/up (14336 x 16)
    assert g["gradient staging buffer (ZeRO-2 offload)"] == 2 * 14336 * 16
    n = 32 * 16 * 81_920
    assert h["optimizer: Adam m, v (CPU Adam)"] == 8 * n


def test_8bit_adam_states_on_the_gpu_by_hand():
    """Llama-3.2-1B full-parameter, ZeRO-3 on one GPU: sub-groups 1,003,012,096 and 232,802,304
    (both multiples of 256); m and v 2 B + 8 B per 256 elements; fp32 master 4 B as usual."""
    P = 1_235_814_400
    e = items(estimate(LLAMA_1B, Setup(1, 4096, optimizer="adamw_8bit")))
    assert e["optimizer: Adam m, v in 8-bit blocks"] == 2 * P + 8 * (3_918_016 + 909_384) + 2 * 2048
    assert e["optimizer: fp32 master"] == 4 * P
    assert e["gradients: partitions"] == 2 * P
    assert "optimizer: fp32 master + Adam m, v" not in e
    adam = items(estimate(LLAMA_1B, Setup(1, 4096)))["optimizer: fp32 master + Adam m, v"]
    assert adam - e["optimizer: fp32 master"] - e["optimizer: Adam m, v in 8-bit blocks"] == \
        8 * P - 2 * P - 8 * (3_918_016 + 909_384) - 2 * 2048
    paged = items(estimate(LLAMA_1B, Setup(1, 4096, optimizer="paged_adamw_8bit")))
    assert paged["optimizer: Adam m, v in 8-bit blocks (paged: counted on the GPU)"] == \
        e["optimizer: Adam m, v in 8-bit blocks"]


@pytest.mark.parametrize("kw,msg", [
    ({"quantize": "nf4"}, "needs lora_rank > 0 or sparse_blocks > 0, and zero_stage 2"),
    ({"quantize": "nf4", "lora_rank": 8}, "needs lora_rank > 0 or sparse_blocks > 0, and zero_stage 2"),
    ({"quantize": "fp4"}, "is not none, nf4 or int8"),
    ({"optimizer": "adamw_8bit", "offload_optimizer": True}, "needs offload_optimizer none"),
    ({"optimizer": "lion"}, "is not adamw"),
])
def test_impossible_setups_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        estimate(SMALL, Setup(1, 1024, **kw))


def test_the_formulas_are_bitsandbytes_own_bytes():
    """The same bytes as bitsandbytes' own tensors (its CPU backend): quantize_4bit with double
    quantization, LLM.int8's row-wise quantization, and AdamW8bit's state after one step."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from bitsandbytes import functional as F

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    for i, o in ((64, 176), (256, 64), (300, 70)):
        w = torch.randn(o, i, dtype=torch.bfloat16)
        q, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        assert nbytes(q, st.absmax, st.offset, st.code, st.state2.absmax, st.state2.code) == \
            nf4_bytes(i * o)
        cb, scb, _ = F.int8_vectorwise_quant(w.half())
        assert nbytes(cb, scb) == int8_bytes(i, o)
    for n in (4096, 70_001):
        p = torch.nn.Parameter(torch.randn(n))
        opt = bnb.optim.AdamW8bit([p])
        p.grad = torch.randn(n)
        opt.step()
        st = opt.state[p]
        assert nbytes(*(st[k] for k in ("state1", "state2", "absmax1", "absmax2", "qmap1",
                                        "qmap2"))) == adam8_state_bytes(n)

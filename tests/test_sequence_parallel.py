"""hardware.sequence_parallel without training: what the config and the hardware policy refuse up
front (with the reason), the DeepSpeed config it makes, and how the estimator models it (a rank's
activations over N, the Ulysses all-to-all tensors, model states unchanged)."""

import dataclasses

import pytest

from longft.config.params import Config, ConfigError, from_dict
from longft.engine import ds_config
from longft.engine.ulysses import SequenceParallel
from longft.estimate.estimator import Setup, estimate, layer_activation_bytes
from longft.estimate.gpu import ulysses_bytes
from longft.hardware import Hardware, PlanError, resolve

H200x8 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=8, capability=(9, 0),
                  gpu_mem_gib=139.8, host_mem_gib=256, cpu_count=64, flash_attn=True, liger=True)
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                tie_word_embeddings=False, max_position_embeddings=131072)


def sp_cfg(n=2, gpus=2, **over):
    raw = {"hardware": {"num_gpus": gpus, "sequence_parallel": n},
           "train": {"global_batch_size": gpus}, "data": {"max_seq_length": 4096}}
    for k, v in over.items():
        raw.setdefault(k, {}).update(v) if isinstance(v, dict) else raw.__setitem__(k, v)
    return from_dict(raw)


def problems(cfg, heads=(32, 8)):
    try:
        resolve(cfg, H200x8, "llama", None, heads)
    except PlanError as e:
        return e.problems
    return []


def test_defaults_are_off_and_a_valid_request_resolves():
    assert Config().hardware.sequence_parallel == 1
    assert problems(sp_cfg(4, 8, train={"global_batch_size": 8})) == []


@pytest.mark.parametrize("raw, says", [
    ({"hardware": {"num_gpus": 4, "sequence_parallel": 3}, "train": {"global_batch_size": 4}},
     "must divide hardware.num_gpus (4)"),
    ({"hardware": {"num_gpus": 2, "sequence_parallel": 2}, "train": {"global_batch_size": 2},
      "data": {"max_seq_length": 4095}}, "must be a multiple of hardware.sequence_parallel"),
    ({"hardware": {"sequence_parallel": 0}}, "hardware.sequence_parallel: must be > 0"),
])
def test_config_refuses_splits_that_cannot_be_made(raw, says):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert says in str(e.value)


def test_policy_refuses_what_ulysses_cannot_run_with_the_reason():
    assert "not divisible by 4 (Ulysses" in " ".join(problems(sp_cfg(4, 4, train={
        "global_batch_size": 4}), heads=(6, 6)))
    assert "key/value heads" in " ".join(problems(sp_cfg(4, 4, train={"global_batch_size": 4}),
                                                  heads=(12, 6)))
    assert problems(sp_cfg(8, 8, train={"global_batch_size": 8}), heads=(32, 4)) == []  # replicated
    eager = problems(sp_cfg(kernels={"attention": "eager"}))
    assert any("eager attention" in p and "drops the [seq x seq] mask" in p for p in eager)
    mask = problems(sp_cfg(kernels={"attention": "sdpa", "packed_attention": "mask"}))
    assert any("packed_attention mask" in p for p in mask)
    assert any("ZeRO-3 only" in p for p in problems(sp_cfg(zero={"stage": 2})))
    assert any("keep_attention" in p for p in problems(sp_cfg(checkpointing={"keep_attention": 1})))
    assert problems(sp_cfg(1, 2)) == []  # off: nothing to check


def test_ds_config_counts_every_slice_as_a_micro_step():
    cfg = sp_cfg(2, 4, train={"global_batch_size": 8})
    ds = ds_config.build(cfg, "bf16", 64)
    # 8 rows a step over 2 data-parallel groups of 2: each rank loads 2 rows, trains 4 slices
    assert cfg.data_parallel_size == 2 and cfg.grad_accum_steps == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["sequence_parallel_size"] == 2
    assert ds["zero_optimization"]["reduce_scatter"] is True  # the averaging the loss matches
    assert "sequence_parallel_size" not in ds_config.build(sp_cfg(1, 2), "bf16", 64)
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"]
                                      * ds["gradient_accumulation_steps"] * cfg.data_parallel_size)


def test_host_grad_buffer_auto_is_full_as_a_row_is_several_micro_steps():
    one_row_a_rank = {"hardware": {"num_gpus": 2}, "train": {"global_batch_size": 2},
                      "zero": {"offload_optimizer": "cpu"}}
    assert resolve(from_dict(one_row_a_rank), H200x8, "llama")["host_grad_buffer"].value == "shared"
    sp = from_dict({**one_row_a_rank, "hardware": {"num_gpus": 2, "sequence_parallel": 2}})
    assert resolve(sp, H200x8, "llama")["host_grad_buffer"].value == "full"


def test_slice_counts_add_up_to_the_rows():
    batch = {"longft_real_tokens": [10, 3], "longft_doc_sq": 107}
    parts = [SequenceParallel(None, 4, r).counts(batch, 16) for r in range(4)]
    assert [p[0] for p in parts] == [4 + 3, 4, 2, 0]
    assert sum(p[0] for p in parts) == 13 and sum(p[1] for p in parts) == 107


def test_estimate_divides_activations_and_adds_the_all_to_all():
    base = Setup(1, 131072, world_size=4, ranks_per_node=4, attention="flash_attention_2",
                 tiled_mlp=True)
    sp = dataclasses.replace(base, sequence_parallel=4)
    one, four = estimate(LLAMA_8B, base), estimate(LLAMA_8B, sp)
    g1 = {i.name: i.bytes for i in one.items if i.where == "gpu"}
    g4 = {i.name: i.bytes for i in four.items if i.where == "gpu"}
    # model states do not change; token-proportional tensors are a quarter
    assert g4["weights: partitions"] == g1["weights: partitions"]
    assert g4["activation checkpoints (GPU)"] == g1["activation checkpoints (GPU)"] // 4
    assert g4["final layer output + norm output"] == g1["final layer output + norm output"] // 4
    # the layer's saved bytes per token grow by the exchanged q, k, v and the attention output
    a2a = ulysses_bytes(LLAMA_8B, sp)
    x, d = 2, 128
    assert a2a == {"saved": x * d * (32 + 2 * 8) + x * 32 * d, "buffers": 2 * x * d * (32 + 16)}
    assert layer_activation_bytes(LLAMA_8B, sp)["saved"] == \
        layer_activation_bytes(LLAMA_8B, base)["saved"] + a2a["saved"]
    assert ulysses_bytes(LLAMA_8B, base) == {"saved": 0, "buffers": 0}
    assert four.gpu_allocated < one.gpu_allocated
    # 8 ranks of a sequence with 8 K/V heads: no replication; 16 would replicate them to 16
    assert ulysses_bytes(LLAMA_8B, dataclasses.replace(sp, sequence_parallel=16,
                                                       ranks_per_node=16, world_size=16))[
        "buffers"] == 2 * x * d * (32 + 2 * 16)
    assert "sequence_parallel 3" in " ".join(dataclasses.replace(base, sequence_parallel=3).problems())


def test_after_the_all_to_all_documents_come_from_the_gathered_position_ids():
    """The attention Ulysses calls on the whole row gets no per-slice boundaries; longft's packed
    attention then reads them from the row's position ids: documents stay apart."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from longft.engine.ulysses import _positions_give_documents
    from longft.model.packed_attention import make_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # documents of 6 and 4 tokens
    fwd = _positions_give_documents(make_forward("per_document"))
    # stale boundaries of one slice (what the adapter's rank would have had) are dropped
    out, _ = fwd(module, q, k, v, None, position_ids=pos, cu_seq_lens_q=torch.tensor([0, 5]),
                 max_length_q=5)
    alone = [sdpa_attention_forward(module, q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], None,
                                    is_causal=True)[0] for a, b in ((0, 6), (6, 10))]
    assert torch.allclose(out, torch.cat(alone, dim=1), atol=1e-6)
    whole, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True)
    assert not torch.allclose(out[:, 6:], whole[:, 6:], atol=1e-3)  # a leak would show here

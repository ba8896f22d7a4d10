"""Block-sparse finetuning (sparse.*, issue 51) on CPU: the block product and its gradients equal
the dense ones, the warm-up's mass is the frozen weight's gradient summed per block and its choice
is deterministic, only the chosen blocks change, the export merges them, and the config refuses
what cannot run."""

import pytest
import torch

from longft.config.params import ConfigError, from_dict
from longft.engine import block_warmup
from longft.model import block_sparse as bs


def _linear(out_f=48, in_f=32, k=5, b=8, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(in_f, out_f, bias=False)
    bs.attach(m_wrap := torch.nn.Sequential(m), ("0",), k, b, torch.float32)
    rows, cols = out_f // b, in_f // b
    flat = torch.randperm(rows * cols)[:k].sort().values
    getattr(m, bs.INDEX).copy_(torch.stack([flat // cols, flat % cols], 1))
    with torch.no_grad():
        getattr(m, bs.DELTA).normal_()
    return m_wrap, m


def test_block_product_and_its_gradients_equal_the_dense_matrix_of_the_blocks():
    wrap, m = _linear()
    x = torch.randn(3, 7, 32, requires_grad=True)
    y = wrap(x)
    d = bs.delta_matrix(getattr(m, bs.DELTA), getattr(m, bs.INDEX), 48, 32).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = x2 @ (m.weight.detach() + d).T
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    got = bs.delta_matrix(getattr(m, bs.DELTA).grad, getattr(m, bs.INDEX), 48, 32)
    keep = bs.delta_matrix(torch.ones_like(getattr(m, bs.DELTA)), getattr(m, bs.INDEX), 48, 32)
    torch.testing.assert_close(got, d.grad * keep)  # each block's gradient is dL/dW's block
    assert not m.weight.requires_grad and m.weight.grad is None


def test_probe_mass_is_the_frozen_weights_gradient_summed_per_block():
    wrap, m = _linear()
    x = torch.randn(4, 32)
    g = torch.randn(4, 48)
    with bs.probing([m]):
        y = wrap(x.requires_grad_())
        torch.testing.assert_close(y, x @ m.weight.T)  # probing adds nothing
        y.backward(g)
        mass = getattr(m, bs.MASS).clone()
    dense = (g.T @ x.detach()).abs().view(6, 8, 4, 8).sum((1, 3))
    torch.testing.assert_close(mass, dense)
    assert getattr(m, bs.MASS) is None


def test_top_blocks_are_the_largest_ties_to_the_lower_index_in_order():
    mass = torch.tensor([[1.0, 5.0, 2.0], [5.0, 0.0, 5.0]])
    assert bs.top_blocks(mass, 3).tolist() == [[0, 1], [1, 0], [1, 2]]
    assert bs.top_blocks(mass, 4).tolist() == [[0, 1], [0, 2], [1, 0], [1, 2]]


class _Engine(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module, self.device = model, torch.device("cpu")

    def forward(self, **kw):
        return self.module(**kw)


def _tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64))


def _rows(n=12, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone(), "position_ids": torch.arange(seq)} for r in ids]


def _cfg(seed=7, blocks=3):
    return from_dict({"train": {"seed": seed, "micro_batch_size": 2, "global_batch_size": 2},
                      "sparse": {"blocks": blocks, "block_size": 8, "warmup_steps": 3}})


def _chosen(seed, blocks=3):
    model = _tiny()
    bs.attach(model, _cfg(seed).sparse.target_modules, blocks, 8, torch.float32)
    block_warmup.choose(_Engine(model), _cfg(seed, blocks), _rows(), rank=0, world=1, pad_id=-1,
                        packed=False)
    return model, {n: getattr(m, bs.INDEX).clone() for n, m in bs.targets(model, ("q_proj",
                   "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))}


def test_warmup_picks_the_blocks_of_largest_full_gradient_and_the_same_under_the_seed():
    _, a = _chosen(seed=7)
    _, again = _chosen(seed=7)
    assert all(torch.equal(a[n], again[n]) for n in a)
    # the reference: the dense weights train, their summed |gradient| over the same micro-batches
    ref = _tiny()
    rows = _rows()
    order = block_warmup.warmup_rows(len(rows), 0, 1, 7, 6)
    mass = {n: 0 for n in a}
    for i in range(3):
        b = torch.utils.data.default_collate([rows[j] for j in order[2 * i:2 * i + 2]])
        ref.zero_grad()
        ref(**b).loss.backward()
        for n, m in bs.targets(ref, tuple({k.rsplit(".", 1)[-1] for k in a})):
            o, i_ = m.weight.shape
            mass[n] = mass[n] + m.weight.grad.abs().view(o // 8, 8, i_ // 8, 8).sum((1, 3))
    for n in a:
        assert torch.equal(a[n], bs.top_blocks(mass[n], 3)), n
    _, other = _chosen(seed=8)  # other rows: another choice somewhere
    assert any(not torch.equal(a[n], other[n]) for n in a)


def test_only_the_chosen_blocks_change_and_the_export_merges_them():
    model, chosen = _chosen(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 3 * 64 * 14  # blocks x b^2 x 14 linears
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    rows = _rows()
    for i in range(3):
        b = torch.utils.data.default_collate(rows[2 * i:2 * i + 2])
        opt.zero_grad()
        model(**b).loss.backward()
        opt.step()
    assert len(opt.state) == 14  # states for the blocks alone
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in before.items() if bs.DELTA not in k)
    merged = bs.merged_state_dict(sd)
    assert not [k for k in merged if "sparse" in k] and set(merged) == {
        k for k in before if "sparse" not in k}
    for name, idx in chosen.items():
        w0, w1 = before[f"{name}.weight"], merged[f"{name}.weight"]
        o, i_ = w0.shape
        changed = (w1 != w0).view(o // 8, 8, i_ // 8, 8).any(3).any(1)
        want = torch.zeros_like(changed)
        want[idx[:, 0], idx[:, 1]] = True
        assert torch.equal(changed, want), name
    # the merged weights compute what the model with blocks computes
    plain = _tiny()
    plain.load_state_dict(merged)
    b = torch.utils.data.default_collate(rows[:2])
    with torch.no_grad():
        torch.testing.assert_close(plain(**b).logits, model(**b).logits, rtol=1e-4, atol=1e-5)


def test_config_refuses_what_cannot_run_all_at_once():
    with pytest.raises(ConfigError) as e:
        from_dict({"sparse": {"blocks": 4, "block_size": 0, "warmup_steps": 0,
                              "target_modules": []},
                   "lora": {"rank": 8}, "hardware": {"sequence_parallel": 2, "num_gpus": 2},
                   "train": {"global_batch_size": 2}})
    msg = str(e.value)
    for key in ("sparse.block_size", "sparse.warmup_steps", "sparse.target_modules",
                "lora.rank (8)", "hardware.sequence_parallel 2"):
        assert key in msg, key
    assert from_dict({"sparse": {"blocks": 4}}).sparse.blocks == 4


def test_shapes_the_blocks_do_not_fit_are_refused_before_any_weight_is_read():
    from longft.config import block_sparse as rules
    from longft.hardware import PlanError
    from longft.model.loading import load_model_config
    from longft.run.patch_stage import meta_model, sparse_trainable

    cfg = from_dict({"sparse": {"blocks": 4, "block_size": 64}})  # tiny-llama: 176 = 11 x 16
    model = meta_model(load_model_config(cfg.model), "sdpa")
    with pytest.raises(PlanError, match=r"sparse.block_size: 64 does not divide .*gate_proj \[176 x 64\]"
                                        r".*: 16 or 8 or 4 \(their largest common divisor is 16\)"):
        sparse_trainable(cfg, model)   # walkthrough: it suggested 32 or 64, neither divides 176
    ok = from_dict({"sparse": {"blocks": 4, "block_size": 16}})
    assert sparse_trainable(ok, model) == 4 * 16 * 16 * 14
    linears = {"layers.0.q_proj": (64, 64)}
    too_many = from_dict({"sparse": {"blocks": 17, "block_size": 16, "target_modules": ["q_proj",
                                                                                      "w9"]}})
    found = rules.shape_problems(too_many, linears)
    assert any("w9" in p for p in found) and any("exceeds the 16 blocks" in p for p in found)
    # the smallest target named, with the most blocks it holds
    gqa = {"layers.0.q_proj": (64, 64), "layers.0.k_proj": (64, 32)}
    assert rules.shape_problems(from_dict({"sparse": {"blocks": 46, "block_size": 16}}), gqa)[-1:] == [
        "sparse.blocks: 46 exceeds the 8 blocks of 16 x 16 of the smallest target, k_proj [32 x 64]; "
        "set sparse.blocks <= 8, or leave that module out of sparse.target_modules"]


def test_a_warmup_longer_than_the_run_is_refused():
    """Walkthrough (2026-12-05): 30 warm-up micro-batches before a 6-micro-batch run read each row
    three times and took five times the training's time, without a word."""
    with pytest.raises(ConfigError, match=r"sparse.warmup_steps: 30 micro-batches .* longer than "
                                          r"the run it picks blocks for \(3 steps x 2 micro-batch"
                                          r"\(es\) = 6\); set sparse.warmup_steps <= 6"):
        from_dict({"sparse": {"blocks": 4, "warmup_steps": 30},
                   "train": {"iterations": 3, "micro_batch_size": 1, "global_batch_size": 2}})
    assert from_dict({"sparse": {"blocks": 4, "warmup_steps": 6},
                      "train": {"iterations": 3, "micro_batch_size": 1, "global_batch_size": 2}})
    assert from_dict({"sparse": {"blocks": 4, "warmup_steps": 30},   # epochs: not known here
                      "train": {"iterations": None, "epochs": 1}})


def test_estimator_counts_the_blocks_as_the_trained_parameters_and_the_warmup_buffer():
    import dataclasses

    from longft.estimate.arch import trainable_numels
    from longft.estimate.estimator import estimate
    from longft.estimate.types import Setup

    arch = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=False)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    full = Setup(1, 32768, zero_stage=3, offload_optimizer=True)
    lora = dataclasses.replace(full, lora_rank=16, lora_targets=targets)
    # 32 blocks of 64 x 64 a matrix: 131,072, LoRA r=16 on the 8B's linears averages 86,894
    sparse = dataclasses.replace(full, sparse_blocks=32, sparse_block_size=64,
                                 sparse_targets=targets)
    assert sum(trainable_numels(arch, sparse)) == 32 * 64 * 64 * 7 * 32
    e_full, e_lora, e_sparse = (estimate(arch, s) for s in (full, lora, sparse))
    names = {i.name: i.bytes for i in e_sparse.items}
    assert names["weights: trained blocks (partitions)"] == 2 * 32 * 64 * 64 * 7 * 32
    warm = names["sparse warm-up: fp32 gradient of the largest target + block masses"]
    assert warm == 4 * (14336 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096
                                              + 3 * 4096 * 14336) // 4096)
    assert not [i for i in e_lora.items if "sparse" in i.name]
    # optimizer states for the blocks alone: host memory far below full finetuning's
    assert e_sparse.host_rss < e_full.host_rss / 3
    assert abs(e_sparse.host_rss - e_lora.host_rss) < 2**30

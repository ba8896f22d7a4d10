"""checkpointing.keep_attention: the last N checkpointed layers keep their attention kernel's
outputs, so the backward's recompute skips the attention forward; same gradients; with cpu_offload
and the tiled MLP too; clear errors; the estimate's bytes; the planner's choice. The bf16 / cuDNN
check on CUDA is in tests/test_gpu.py."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longft.config.params import Config, ConfigError, from_dict, merge, to_dict
from longft.estimate.estimator import estimate
from longft.estimate.placement import keep_on_gpu, step_seconds
from longft.estimate.types import Setup
from longft.model import patches as patch
from longft.model.keep_attention import kernel_ops
from test_offload import CpuHooks, tiny_model  # tests/ is on sys.path under pytest

KERNELS = kernel_ops()


class CountKernels(TorchDispatchMode):
    """Counts the attention kernels that really run (a kept output returns before reaching here)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in KERNELS
        return func(*args, **(kwargs or {}))


def _grads_and_recomputed(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    with CountKernels() as count:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, count.n


@pytest.mark.parametrize("keep", [1, 2])
def test_kept_layers_skip_the_attention_forward_with_the_same_gradients(keep):
    ids = torch.randint(1, 300, (2, 256))
    ref = tiny_model()
    loss_ref, g_ref, recomputed_ref = _grads_and_recomputed(ref, ids)
    assert recomputed_ref == 2  # the 2 layers' recomputes each run the kernel once
    model = tiny_model()
    record = patch.apply(model, liger=False, checkpointing="gpu", keep_attention=keep)
    assert record["attention_kept_layers"] == keep
    loss, g, recomputed = _grads_and_recomputed(model, ids)
    assert recomputed == 2 - keep
    assert torch.equal(loss, loss_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_kept_attention_with_offloaded_checkpoints_and_the_tiled_mlp():
    ids = torch.randint(1, 300, (1, 1024))
    ref = tiny_model()
    loss_ref, g_ref, _ = _grads_and_recomputed(ref, ids)
    model = tiny_model()
    patch.apply(model, liger=False, checkpointing="cpu_offload", tiled_mlp=True, tile_tokens=256,
                keep_attention=1)
    offloader = patch.offload_checkpoints(model, gpu_layers=0)
    offloader._new_hooks = CpuHooks  # CPU tensors stand in for device tensors
    hooks = offloader.new_step()
    loss, g, recomputed = _grads_and_recomputed(model, ids)
    assert hooks.offloaded_bytes == 2 * 1024 * model.config.hidden_size * 4  # both layer inputs
    assert recomputed == 1
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_patch_refuses_what_cannot_keep_attention():
    with pytest.raises(ValueError, match="nothing is recomputed"):
        patch.apply(tiny_model(), liger=False, checkpointing="none", keep_attention=1)
    with pytest.raises(ValueError, match="at most 2"):
        patch.apply(tiny_model(), liger=False, checkpointing="gpu", keep_attention=3)
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="needs a fused attention kernel.*not eager"):
        patch.apply(eager, liger=False, checkpointing="gpu", keep_attention=1)
    with pytest.raises(ValueError, match="not sdpa_backend math"):
        patch.apply(tiny_model(), liger=False, checkpointing="gpu", sdpa_backend="math",
                    keep_attention=1)
    assert patch.apply(tiny_model(), liger=False, checkpointing="gpu")["attention_kept_layers"] == 0
    dropout = tiny_model()
    dropout.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="needs attention_dropout 0"):
        patch.apply(dropout, liger=False, checkpointing="gpu", keep_attention=1)
    fa2 = tiny_model()  # flash-attn is not installed here: no flash_attn torch ops
    fa2.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash-attn 2.7"):
        patch.apply(fa2, liger=False, checkpointing="gpu", keep_attention=1)


def test_a_kept_output_goes_back_only_to_the_kernel_that_made_it():
    from collections import deque

    from longft.model.keep_attention import KeptKernels

    q = torch.randn(1, 2, 8, 4)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    kept = deque()
    with KeptKernels({flash}, kept, replay=False):
        out = flash(q, q, q)
    assert len(kept) == 1 and kept[0][0] is flash
    other = torch.ops.aten.mul.Tensor
    before = KeptKernels.replayed_total
    with KeptKernels({flash, other}, kept, replay=True):
        doubled = other(q, 2)           # another kernel: runs, the kept output stays
        again = flash(q, q, q)          # the kernel that made it: gets it back, does not run
    assert torch.equal(doubled, q * 2) and not kept
    assert again[0] is not out[0] and torch.equal(again[0], out[0])
    assert KeptKernels.replayed_total == before + 1


def test_trainer_warns_when_nothing_was_kept(capsys, monkeypatch):
    from longft.config.plan import Patches
    from longft.engine import trainer
    from longft.model.keep_attention import KeptKernels

    def kept(n):
        return Patches(replaced_modules={}, attention_kept_layers=n, record={})

    monkeypatch.setattr(KeptKernels, "replayed_total", 0)
    trainer._first_step_warnings(0, None, kept(2))
    assert "kept no attention output" in capsys.readouterr().out
    monkeypatch.setattr(KeptKernels, "replayed_total", 3)
    trainer._first_step_warnings(0, None, kept(2))
    trainer._first_step_warnings(0, None, kept(0))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("section,match", [
    ({"keep_attention": -1}, "must be >= 0"),
    ({"mode": "none", "keep_attention": 2}, "needs checkpointing"),
])
def test_config_refuses_bad_keep_attention(section, match):
    params = merge(to_dict(Config()), {"checkpointing": section})
    with pytest.raises(ConfigError, match=match):
        from_dict(params, "params.yaml")


LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}


def _setup(**kw):
    base = dict(micro_batch=1, seq_len=128000, liger=True, checkpointing="cpu_offload",
                tiled_mlp=True, offload_optimizer=True, offload_param=True, sdpa_backend="cudnn")
    return Setup(**{**base, **kw})


def test_estimate_counts_each_kept_output_until_its_backward():
    plain = estimate(LLAMA_8B, _setup(gpu_layers=16))
    kept = estimate(LLAMA_8B, _setup(gpu_layers=16, keep_attention=8))
    # 8 layers x 128,000 tokens x 32 heads x (128 x 2 B output + 4 B log-sum-exp), by hand
    per = 8 * 128000 * 32 * (128 * 2 + 4)
    assert per == 8_519_680_000
    assert kept.gpu_phases["loss"] - plain.gpu_phases["loss"] == per
    # in backward the recomputed layer's kept output is one of its saved tensors, counted there
    assert kept.gpu_phases["backward"] - plain.gpu_phases["backward"] == per * 7 // 8
    assert kept.gpu_peak_phase == "backward"
    assert kept.host_rss == plain.host_rss


def test_planner_keeps_attention_outputs_of_flash_attn_4():
    """longft runs flash-attn-4 as a torch op (model/flash_attn_4_op.py), so keep_attention keeps
    its outputs: the planner proposes as many kept layers as with SDPA (the same tensors), whether
    flash-attn-4 runs packed rows only or every row (kernels.attention flash_attn_4)."""
    import dataclasses

    s = _setup()
    sdpa = keep_on_gpu(LLAMA_8B, s, gpu_mem_gib=40, host_mem_gib=172).keep_attention
    assert sdpa > 0
    for fa4 in (dataclasses.replace(s, flash_attn_4=True),
                dataclasses.replace(s, flash_attn_4=True, attention="flash_attn_4")):
        assert keep_on_gpu(LLAMA_8B, fa4, gpu_mem_gib=40, host_mem_gib=172).keep_attention == sdpa


def test_planner_keeps_attention_before_checkpoints_and_ranks_it_faster():
    s = _setup()
    assert step_seconds(LLAMA_8B, _setup(keep_attention=8), "H200") < step_seconds(LLAMA_8B, s, "H200")
    chosen = keep_on_gpu(LLAMA_8B, s, gpu_mem_gib=40, host_mem_gib=172)
    assert chosen.keep_attention > 0
    est = estimate(LLAMA_8B, chosen)
    # it fits both, and one more kept layer of either kind would not fit the GPU less the 3 %
    # headroom (placement.NEAR_BUDGET) that what is kept for speed leaves
    assert est.gpu_nvml <= 0.97 * 40 * 2**30 and est.host_rss <= 172 * 2**30
    for more in ({"keep_attention": chosen.keep_attention + 1}, {"gpu_layers": chosen.gpu_layers + 1}):
        bigger = estimate(LLAMA_8B, Setup(**{**chosen.__dict__, **more}))
        assert bigger.gpu_nvml > 0.97 * 40 * 2**30, more
    # the host forces some checkpoints onto the GPU: fewer would not fit 172 GiB
    fewer = estimate(LLAMA_8B, Setup(**{**chosen.__dict__, "gpu_layers": chosen.gpu_layers - 8}))
    assert fewer.host_rss > 172 * 2**30


@pytest.mark.slow
def test_pipeline_keeps_attention_under_zero3_with_the_plain_losses(tmp_path):
    """Through the real stages under ZeRO-3 (DeepSpeed's CPU accelerator), where parameters are
    fetched by hooks inside each checkpointed layer, with the tiled MLP's skipped recompute too."""
    from test_tiled import pipeline_losses

    def run(work, keep):
        return pipeline_losses(work, {"kernels": {"tiled_mlp": "on", "tiled_mlp_tokens": 1000},
                                      "checkpointing": {"mode": "gpu", "keep_attention": keep},
                                      "data": {"num_samples": 3},
                                      "train": {"iterations": 2, "warmup_iterations": 1}})

    plan_kept, kept = run(tmp_path / "kept", 2)
    _, plain = run(tmp_path / "plain", 0)
    assert plan_kept["patches"]["attention_kept_layers"] == 2
    assert len(kept) == len(plain) == 2
    assert kept == pytest.approx(plain, rel=1e-5)  # step 2's loss: the updates were the same

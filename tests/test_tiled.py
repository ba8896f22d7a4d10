"""Sequence-tiled MLP (kernels.tiled_mlp): same loss and gradients as the plain MLP, on a bare
model and through the pipeline under ZeRO-3 (DeepSpeed's CPU accelerator); the plan's auto rule;
the estimate's saved bytes. The bf16 + Liger parity on CUDA is in tests/test_gpu.py."""

import json

import pytest
import torch
import yaml

from longft.config.params import Config, from_dict, merge, to_dict
from longft.estimate.arch import dims
from longft.estimate.gpu import layer_activation_bytes
from longft.estimate.types import Setup
from longft.model import tiled_mlp as tiled
from longft.run.pipeline import REPO, run_all
from test_offload import tiny_model as _model  # tests/ is on sys.path under pytest


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiles_follow_the_token_count():
    assert tiled.tiles(8192) == 1
    assert tiled.tiles(8193) == 2
    assert tiled.tiles(131072) == 16
    assert tiled.tiles(1000, tile_tokens=128) == 8


@pytest.mark.parametrize("tile_tokens", [128, 300])  # 300: the last tile is shorter
def test_tiled_mlp_gives_the_plain_loss_and_gradients(tile_tokens, monkeypatch):
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    ids = torch.randint(1, 300, (2, 512))
    loss_ref, g_ref = _loss_and_grads(_model(), ids)
    model = _model()
    assert tiled.tile_mlps(model, tile_tokens=tile_tokens) == 2
    calls, orig = [], ulysses_sp.TiledMLP.forward

    def spy(ctx, fn, self, x, shards, params):
        calls.append(shards)
        return orig(ctx, fn, self, x, shards, params)

    monkeypatch.setattr(ulysses_sp.TiledMLP, "forward", staticmethod(spy))
    loss, g = _loss_and_grads(model, ids)
    # 2 layers x (forward + recompute), each over ceil(1024 tokens / tile) tiles
    assert calls == [tiled.tiles(1024, tile_tokens)] * 4
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("skip", [False, True])
def test_recompute_skips_the_mlp_arithmetic_and_keeps_the_gradients(skip):
    """Under checkpointing the layer's recompute in backward only regenerates saved tensors; with
    skip_recompute the tiled MLP does no arithmetic there (its backward recomputes each tile)."""
    ids = torch.randint(1, 300, (1, 1024))
    loss_ref, g_ref = _loss_and_grads(_model(), ids)
    model = _model()
    calls = []
    for layer in model.model.layers:
        real = layer.mlp.forward
        layer.mlp.forward = lambda x, _real=real: calls.append(x.shape[-2]) or _real(x)
    tiled.tile_mlps(model, tile_tokens=256, skip_recompute=skip)
    loss, g = _loss_and_grads(model, ids)
    # per layer: 4 tiles in the forward, (4 in the recompute unless skipped), 4 in the backward
    assert len(calls) == 2 * (8 if skip else 12)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_patch_skips_the_recompute_only_where_it_is_safe(monkeypatch):
    from longft.model import patches as patch

    seen = []
    monkeypatch.setattr(patch, "tiled_mlps", lambda m, t, skip_recompute: seen.append(skip_recompute))
    for mode in ("gpu", "none"):
        patch.apply(_model(), liger=False, checkpointing=mode, tiled_mlp=True)
    gemma = _model()
    gemma.config.model_type = "gemma2"  # a norm after the MLP saves its output
    patch.apply(gemma, liger=False, checkpointing="gpu", tiled_mlp=True)
    assert seen == [True, False, False]


def test_no_tiling_without_grad_or_when_one_tile_is_enough(monkeypatch):
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    model = _model()
    tiled.tile_mlps(model, tile_tokens=128)
    calls, orig = [], ulysses_sp.TiledMLP.apply
    monkeypatch.setattr(ulysses_sp.TiledMLP, "apply", lambda *a: calls.append(a) or orig(*a))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 300, (1, 512)))
    model(input_ids=torch.randint(1, 300, (1, 100)))
    assert calls == []


def test_weights_get_gradients_when_the_input_needs_none():
    """TiledMLP sees the weights only through a list; with an input that does not require grad
    (frozen embeddings, no checkpointing) the tiled MLP must still give its weights gradients."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

    ref = _model().model.layers[0].mlp
    mlp = _model().model.layers[0].mlp  # same seed, same weights
    x = torch.randn(1, 512, mlp.gate_proj.in_features)  # requires_grad False
    ref(x).sum().backward()
    assert tiled.tile_mlps(torch.nn.ModuleList([Layer(mlp)]), tile_tokens=128) == 1
    mlp(x).sum().backward()
    for (n, p), q in zip(mlp.named_parameters(), ref.parameters()):
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_lora_dropout_turns_auto_off_and_refuses_on():
    from longft.hardware import PlanError

    assert _resolve(tiled_mlp="auto", seq=131072, lora={"rank": 8, "dropout": 0.1}).value is False
    assert _resolve(tiled_mlp="auto", seq=131072, lora={"rank": 8, "dropout": 0.0}).value is True
    with pytest.raises(PlanError, match="kernels.tiled_mlp: on cannot run with lora.dropout 0.1"):
        _resolve(tiled_mlp="on", seq=131072, lora={"rank": 8, "dropout": 0.1})


def _resolve(lora=None, **kernels):
    from longft.hardware import Hardware, resolve

    cfg = from_dict(merge(to_dict(Config()),
                          {"kernels": kernels, "data": {"max_seq_length": kernels.pop("seq", 4096)},
                           "lora": lora or {}}))
    cpu = Hardware(device="cpu")
    return resolve(cfg, cpu, "llama")["tiled_mlp"]


def test_auto_turns_tiling_on_for_long_sequences_only():
    assert _resolve(tiled_mlp="auto", seq=65536).value is True
    assert _resolve(tiled_mlp="auto", seq=32768).value is False
    assert _resolve(tiled_mlp="on", seq=1024).value is True
    assert _resolve(tiled_mlp="off", seq=131072).value is False


def test_estimate_drops_the_mlp_intermediates():
    arch = json.loads((REPO / "configs/models/llama3.1-8b.json").read_text())
    s = Setup(micro_batch=1, seq_len=131072, liger=True, checkpointing="gpu")
    plain = layer_activation_bytes(arch, s)["saved"]
    tiled_saved = layer_activation_bytes(arch, Setup(**{**s.__dict__, "tiled_mlp": True}))["saved"]
    # Liger's SwiGLU saves gate, up and their product: 3 x intermediate 14336 x 2 B per token
    assert dims(arch)["I"] == 14336
    assert plain - tiled_saved == 3 * 14336 * 2


def pipeline_losses(work, overlay: dict) -> tuple[dict, list[float]]:
    """Run prepare -> patch -> train on the shipped params + overlay (no checkpoints, no export) in
    work; return (artifacts/plan.json, the per-step losses of rank 0)."""
    work.mkdir()
    base = {"output": {"save_checkpoint": False, "export": False}}
    params = merge(merge(to_dict(Config()), base), overlay)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    plan = json.loads((work / "artifacts" / "plan.json").read_text())
    lines = (work / "run" / "rank0.jsonl").read_text().splitlines()
    return plan, [r["loss"] for r in map(json.loads, lines) if r["type"] == "iter"]


@pytest.mark.slow
def test_pipeline_with_tiled_mlp_matches_the_plain_run_under_zero3(tmp_path):
    def run(work, mode):
        return pipeline_losses(work, {"kernels": {"tiled_mlp": mode, "tiled_mlp_tokens": 1000},
                                      "data": {"num_samples": 4},
                                      "train": {"iterations": 3, "warmup_iterations": 1}})

    plan_off, off = run(tmp_path / "off", "off")
    plan_on, on = run(tmp_path / "on", "on")
    assert plan_on["patches"]["tiled_mlp_layers"] == 2 and plan_off["patches"]["tiled_mlp_layers"] == 0
    assert len(on) == len(off) == 3
    # 4096-token rows in 5 tiles of 1000 tokens (the last one shorter)
    assert on == pytest.approx(off, rel=1e-4)

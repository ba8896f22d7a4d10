"""Per-document attention for packed rows (model/packed_attention.py): the same losses and
gradients as the documents run one at a time, no leakage across documents, and no [seq x seq]
mask built for it or for flash_attention_2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longft.model import packed_attention as pa

REPO = Path(__file__).resolve().parents[1]
LENS = [[5, 9, 2], [16]]  # row 0: three documents; row 1: one
S = 16


def tiny(attn="sdpa", kv_heads=2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    arch = json.loads((REPO / "configs/models/tiny-llama.json").read_text())
    arch = {k: v for k, v in arch.items() if k != "architectures"}
    arch.update(num_key_value_heads=kv_heads, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**arch), attn_implementation=attn).float()


def batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(LENS), S), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENS])
    return ids, pos


def per_document_reference(model, ids):
    """Logits of every document run alone, in place."""
    rows = []
    for r, row in enumerate(LENS):
        start, pieces = 0, []
        for n in row:
            pieces.append(model(input_ids=ids[r:r + 1, start:start + n]).logits)
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def test_boundaries_and_batch_kwargs():
    _, pos = batch(100)
    cu, longest = pa.boundaries(pos)
    assert cu.tolist() == [0, 5, 14, 16, 32] and cu.dtype == torch.int32 and longest == 16
    assert pa.document_lengths(pos) == [5, 9, 2, 16]
    kw = pa.batch_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 5, 14, 16, 32] and kw["max_length_q"] == 16
    single = torch.arange(S).repeat(2, 1)
    assert pa.batch_kwargs(single) == {}  # one document a row: the single-sequence kernel


def needs_kernel(kernel):
    """Skip a GPU test of `kernel` where this machine cannot run it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if kernel == "varlen" and not pa.varlen_available():
        pytest.skip("this torch has no varlen_attn")
    if kernel == "flash_attn_4" and not pa.flash_attn_4_available():
        pytest.skip("flash-attn-4 is not installed")


@pytest.mark.parametrize("kernel", ["varlen", "per_document"])
def test_packed_loss_and_gradients_equal_the_documents_run_alone(kernel):
    """fp32 on CPU: the packed micro-batch's logits equal each document's alone; the summed
    loss's gradients equal those of the documents' losses summed. (`varlen` falls back to the
    per-document path off CUDA; the GPU suite runs the kernel itself, and flash_attn_4.)"""
    ref_model, model = tiny(), tiny()
    ids, pos = batch(model.config.vocab_size)
    pa.install(model, kernel)
    assert model.config._attn_implementation == pa.NAME
    ref = per_document_reference(ref_model, ids)
    out = model(input_ids=ids, position_ids=pos, **pa.batch_kwargs(pos)).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_changing_one_document_leaves_the_others_unchanged():
    model = tiny()
    pa.install(model, "per_document")
    ids, pos = batch(model.config.vocab_size)
    base = model(input_ids=ids, position_ids=pos, **pa.batch_kwargs(pos)).logits
    changed = ids.clone()
    changed[0, 5:14] = (changed[0, 5:14] + 7) % (model.config.vocab_size - 1) + 1  # document 2
    out = model(input_ids=changed, position_ids=pos, **pa.batch_kwargs(pos)).logits
    torch.testing.assert_close(out[0, :5], base[0, :5], rtol=0, atol=0)    # before it
    torch.testing.assert_close(out[0, 14:], base[0, 14:], rtol=0, atol=0)  # after it
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=0)            # the other row
    assert not torch.allclose(out[0, 5:14], base[0, 5:14])


@pytest.mark.parametrize("implementation", [pa.NAME, "flash_attention_2"])
def test_no_mask_is_built_for_packed_rows(implementation, monkeypatch):
    """transformers builds no mask for longft's attention (no mask function is registered for it)
    nor for flash_attention_2, which reads the same boundaries: create_causal_mask returns None
    and none of its mask builders runs."""
    from transformers import masking_utils

    model = tiny()
    pa.install(model, "per_document")
    model.config._attn_implementation = implementation
    built = []
    for name in ("sdpa_mask", "eager_mask", "flex_attention_mask"):
        real = getattr(masking_utils, name)
        monkeypatch.setattr(masking_utils, name, lambda *a, _real=real, **k: built.append(1) or _real(*a, **k))
    ids, pos = batch(model.config.vocab_size)
    emb = model.model.embed_tokens(ids)
    # (config, inputs_embeds, attention_mask, cache): the cache argument is `past_key_values` in
    # transformers 5.17 (the lock's, the images'), `cache` from 5.24 on
    mask = masking_utils.create_causal_mask(model.config, emb, None, None, position_ids=pos)
    assert mask is None and not built
    # the plain sdpa path would have built the [seq x seq] block mask: the spy can see it
    model.config._attn_implementation = "sdpa"
    mask = masking_utils.create_causal_mask(model.config, emb, None, None, position_ids=pos)
    assert mask is not None and mask.shape[-2:] == (S, S)


def test_refuses_an_explicit_mask():
    model = tiny()
    fwd = pa.make_forward("per_document")
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(RuntimeError, match="explicit attention mask"):
        fwd(model.model.layers[0].self_attn, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="one of"):
        pa.make_forward("dense")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", pa.KERNELS)
def test_packed_attention_on_cuda_matches_the_documents_alone(kernel):
    """bf16 on the GPU, each kernel (varlen: torch's varlen_attn; flash_attn_4: flash-attn-4's):
    packed logits within bf16 tolerance of each document run alone, and gradients close."""
    needs_kernel(kernel)
    ref_model, model = tiny().cuda().bfloat16(), tiny().cuda().bfloat16()
    pa.install(model, kernel)
    ids, pos = (t.cuda() for t in batch(model.config.vocab_size))
    ref = per_document_reference(ref_model, ids)
    out = model(input_ids=ids, position_ids=pos, **pa.batch_kwargs(pos)).logits
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=5e-2, atol=5e-3)


def test_trainer_hands_boundaries_once_per_micro_batch_and_counts_attention_per_document():
    """The trainer's per-micro-batch work: the boundaries (on the device) only where the attention
    reads them, and sum(L_i^2) over real tokens: the tail padding, which continues the last
    document's positions, is left out. metrics' attention_length turns it into the S of the
    FLOPs formula."""
    from longft.engine.batches import doc_kwargs
    from longft.metrics.summary import attention_length

    pad = 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 3, pad], [4, 4, 4, 4, 4, 4, 4, 4]])
    labels = torch.tensor([[-100, 6, 7, -100, 9, 3, 3, -100], [-100, 4, 4, 4, 4, 4, 4, 4]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])  # docs 3 + 4 (+1 pad), then 8
    kw, sq = doc_kwargs({"input_ids": ids, "labels": labels, "position_ids": pos}, pad, "cpu", True)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 8, 16] and kw["max_length_q"] == 8
    assert sq == 3 * 3 + 4 * 4 + 8 * 8
    kw, sq2 = doc_kwargs({"input_ids": ids, "labels": labels, "position_ids": pos}, pad, "cpu", False)
    assert kw == {} and sq2 == sq
    rows = [{"doc_sq_tokens": sq, "tokens": 15}]
    assert attention_length(rows, 8) == pytest.approx(89 / 15)
    assert attention_length([{"doc_sq_tokens": None, "tokens": 15}], 8) == 8.0  # older runs


def _keep_run(model, ids, pos, counter):
    """Loss, gradients and the attention kernels the backward's recompute ran, on packed rows."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, position_ids=pos, **pa.batch_kwargs(pos)).loss
    with counter() as count:
        loss.backward()
    return loss.detach(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}, count.n


@pytest.mark.parametrize("keep", [1, 2])
def test_keep_attention_on_packed_rows_skips_the_kept_documents_kernels(keep):
    """checkpointing.keep_attention on packed rows (per_document, CPU, fp32): every document's
    kernel call in a kept layer is kept, in order, and handed back to the recompute: the backward
    runs (2 - keep) layers x 4 documents of attention, and the gradients are those without it."""
    from longft.model import patches as patch
    from test_keep_attention import CountKernels

    model_ref, model = tiny(), tiny()
    ids, pos = batch(model.config.vocab_size)
    patch.apply(model_ref, liger=False, checkpointing="gpu", packed="per_document")
    record = patch.apply(model, liger=False, checkpointing="gpu", keep_attention=keep,
                         packed="per_document")
    assert record["attention_kept_layers"] == keep
    loss_ref, g_ref, n_ref = _keep_run(model_ref, ids, pos, CountKernels)
    assert n_ref == 2 * 4  # 2 layers' recomputes, each one call per document (3 + 1)
    loss, g, n = _keep_run(model, ids, pos, CountKernels)
    assert n == (2 - keep) * 4
    assert torch.equal(loss, loss_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "per_document"])
def test_keep_attention_on_packed_rows_on_cuda(kernel):
    """The same on the GPU in bf16 with each packed kernel (varlen: one varlen_attn call a layer;
    per_document: one SDPA call per document): the kept layer's recompute runs no attention
    kernel, the loss is bit-identical and the gradients stay within run-to-run noise.
    (flash_attn_4 is refused with keep_attention: test_packed_attention_policy.)"""
    needs_kernel(kernel)
    from longft.model import patches as patch
    from test_keep_attention import CountKernels

    def model(keep):
        m = tiny().cuda().bfloat16()
        patch.apply(m, liger=False, checkpointing="gpu", keep_attention=keep, packed=kernel)
        return m

    ids, pos = (t.cuda() for t in batch(384))
    calls = 1 if kernel == "varlen" else 4  # a layer's kernel calls for the two rows
    loss_ref, g_ref, n_ref = _keep_run(model(0), ids, pos, CountKernels)
    _, g_again, _ = _keep_run(model(0), ids, pos, CountKernels)
    assert n_ref == 2 * calls
    loss, g, n = _keep_run(model(1), ids, pos, CountKernels)
    assert n == calls
    assert torch.equal(loss, loss_ref)
    for name in g_ref:
        noise = (g_again[name] - g_ref[name]).norm()
        err = (g[name] - g_ref[name]).norm()
        assert err <= max(2 * noise, 1e-2 * g_ref[name].norm()), (name, float(err), float(noise))


def test_per_document_turns_on_cudnn_ragged_plans_unless_the_environment_says(monkeypatch):
    """install(per_document) sets CUDNN_RAGGED_ENV (one cuDNN plan per power-of-two length, not one
    per document length), leaves a value the user set alone, and varlen leaves it unset; the patch
    record says what the run got."""
    from longft.model import patches as patch

    monkeypatch.setenv(pa.CUDNN_RAGGED_ENV, "")  # recorded, so teardown restores the original
    monkeypatch.delenv(pa.CUDNN_RAGGED_ENV)
    pa.install(tiny(), "varlen")
    assert pa.cudnn_ragged() is None
    assert patch.apply(tiny(), liger=False, checkpointing="none", packed="per_document")["cudnn_ragged"] == "1"
    monkeypatch.setenv(pa.CUDNN_RAGGED_ENV, "0")
    assert patch.apply(tiny(), liger=False, checkpointing="none", packed="per_document")["cudnn_ragged"] == "0"


RAGGED_SCRIPT = r"""
import json, warnings, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from longft.model import packed_attention as pa

class Mod(torch.nn.Module):
    num_key_value_groups, is_causal = 4, True

worst = {"out": 0.0, "grad": 0.0}
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for seed, lens in enumerate([[700, 1300, 2044], [2500, 1544], [4096], [333, 3000, 763]]):
        torch.manual_seed(seed)
        s = sum(lens)
        pos = torch.cat([torch.arange(n) for n in lens])[None].cuda()
        cu, _ = pa.boundaries(pos)
        # BSHD memory seen as [b, heads, s, d], as the Llama projections leave it
        q = torch.randn(1, s, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, s, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        go = torch.randn(1, s, 16, 64, device="cuda", dtype=torch.bfloat16)
        res = []
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([backend]):
                o = pa.per_document(Mod(), qq, kk, vv, cu, 0.0, None)
                o.backward(go)
            res.append((o.float(), [t.grad.float() for t in (qq, kk, vv)]))
        (o1, g1), (o2, g2) = res
        worst["out"] = max(worst["out"], float((o1 - o2).abs().max()))
        worst["grad"] = max(worst["grad"], max(float((a - b).abs().max()) for a, b in zip(g1, g2)))
worst["ragged_warning"] = any(pa.CUDNN_RAGGED_ENV in str(w.message) for w in seen)
print(json.dumps(worst))
"""


@pytest.mark.gpu
def test_per_document_cudnn_ragged_path_matches_flash_on_new_lengths():
    """Under CUDNN_RAGGED_ENV (set before the process's first cuDNN call, as a training run sets
    it), cuDNN per document takes PyTorch's ragged path (its one-time warning says so) and gives
    flash's outputs and gradients on four micro-batches of new document lengths."""
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {**os.environ, pa.CUDNN_RAGGED_ENV: "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RAGGED_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert worst["ragged_warning"], worst
    assert worst["out"] < 2e-2 and worst["grad"] < 5e-2, worst


def test_flash_attn_4_refuses_to_install_without_the_package(monkeypatch):
    """Where flash_attn.cute cannot be imported, installing the kernel fails at once, naming the
    package and the way out, instead of at the first forward of a long run."""
    monkeypatch.setattr(pa, "flash_attn_4_available", lambda: False)
    model = tiny()
    with pytest.raises(pa.PackedAttentionError, match="pip install flash-attn-4"):
        pa.install(model, "flash_attn_4")
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_attention_flash_attn_4_builds_on_sdpa_and_installs_for_every_row(monkeypatch):
    """transformers builds the model with SDPA (flash_attn_4 is not one of its implementations);
    the patches then install longft's attention function with flash-attn-4 for single documents,
    and keep_attention is set up on it."""
    from longft.model import patches
    from longft.model.loading import transformers_attention

    assert [transformers_attention(a) for a in ("flash_attn_4", "sdpa", "eager", "flash_attention_2")] == [
        "sdpa", "sdpa", "eager", "flash_attention_2"]
    monkeypatch.setattr(pa, "flash_attn_4_available", lambda: True)
    model = tiny()
    record = patches.apply(model, liger=False, checkpointing="gpu", keep_attention=1,
                           attention_kernel="flash_attn_4")
    assert model.config._attn_implementation == pa.NAME
    from transformers import AttentionInterface

    fn = AttentionInterface()[pa.NAME]
    assert (fn.kernel, fn.single_documents) == ("flash_attn_4", True)
    assert record["attention_kept_layers"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attn_4_matches_per_document_at_llama_head_dims(head_dim):
    """flash-attn-4's varlen kernel at the Llama-3.2-1B / 3.1-8B attention shapes (32 query and 8
    K/V heads, head_dim 64 / 128) on two rows of documents of uneven lengths: output and q/k/v
    gradients within bf16 tolerance of SDPA run once per document."""
    needs_kernel("flash_attn_4")
    lens = [[1000, 2900, 96, 100], [4096]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens]).cuda()
    cu, longest = pa.boundaries(pos)
    g = torch.Generator(device="cuda").manual_seed(0)

    def qkv():
        return [torch.randn(2, 4096, h, head_dim, device="cuda", generator=g,
                            dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for h in (32, 8, 8)]

    q, k, v = qkv()
    go = torch.randn(2, 4096, 32, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)

    class Mod(torch.nn.Module):
        num_key_value_groups, is_causal = 4, True

    outs, grads = [], []
    for fn in (lambda: pa.flash_attn_4(Mod(), q, k, v, cu, longest, None),
               lambda: pa.per_document(Mod(), q, k, v, cu, 0.0, None)):
        o = fn()
        o.backward(go)
        outs.append(o.float())
        grads.append([t.grad.float() for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b, name in zip(*grads, "qkv"):
        assert (a - b).norm() <= 2e-2 * b.norm(), (name, float((a - b).norm()), float(b.norm()))


def test_kernels_without_dropout_say_that_training_falls_back_per_document(capsys):
    """A model with attention dropout: varlen / flash_attn_4 cannot apply it, so training runs SDPA
    per document (exact, with dropout); install says so rather than switching silently."""
    model = tiny()
    model.config.attention_dropout = 0.1
    pa.install(model, "varlen")
    assert "attention_dropout is 0.1; varlen has no dropout" in capsys.readouterr().out
    pa.install(tiny(), "varlen")
    assert "attention_dropout" not in capsys.readouterr().out

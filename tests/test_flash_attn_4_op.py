"""flash-attn-4 as torch ops (model/flash_attn_4_op.py): the ops' autograd, layouts and fake
kernels, and checkpointing.keep_attention keeping the forward op's outputs, on CPU with a float32
reference in flash-attn-4's place (`ReferenceKernels`: its entry points' signatures and layouts,
causal attention in plain torch). The real kernels on a Hopper GPU: the gpu-marked tests at the end.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longft.model import flash_attn_4_op as fa4op
from longft.model import packed_attention as pa
from longft.model.keep_attention import KeptKernels, contexts, kernel_ops


def _rows(t, cu):
    """[b, s, h, d] -> per row; [tokens, h, d] with cu -> per document ([s, h, d] each)."""
    if cu is None:
        return list(t.unbind(0))
    b = cu.tolist()
    return [t[i:j] for i, j in zip(b[:-1], b[1:])]


def _join(parts, cu, dim=0):
    return torch.stack(parts, dim) if cu is None else torch.cat(parts, dim)


class ReferenceKernels:
    """flash-attn-4's `_flash_attn_fwd` / `_flash_attn_bwd` as the ops call them, in plain torch:
    causal softmax attention per row (or per document), K/V heads shared by groups of query heads;
    out in q's layout, lse [b, h, s] (dense) or [h, tokens] (varlen). Counts its forward calls."""

    def __init__(self):
        self.forwards = 0

    @staticmethod
    def _one(q, k, v, scale):
        g = q.shape[1] // k.shape[1]
        up = torch.promote_types(q.dtype, torch.float32)  # float32 as flash-attn-4; float64 stays
        qh, kh, vh = (t.to(up).transpose(0, 1) for t in (q, k.repeat_interleave(g, 1),
                                                          v.repeat_interleave(g, 1)))
        s = qh @ kh.transpose(-1, -2) * scale
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None])
        return qh, kh, vh, p, (p @ vh).transpose(0, 1), lse

    def fwd(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, softmax_scale=None, causal=False, return_lse=False):
        assert causal and return_lse and cu_seqlens_q is cu_seqlens_k
        self.forwards += 1
        outs, lses = [], []
        for qq, kk, vv in zip(_rows(q, cu_seqlens_q), _rows(k, cu_seqlens_q), _rows(v, cu_seqlens_q)):
            *_, o, lse = self._one(qq, kk, vv, softmax_scale)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        return _join(outs, cu_seqlens_q), _join(lses, cu_seqlens_q, 0 if cu_seqlens_q is None else 1), None, None, None

    def bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        assert causal
        dqs, dks, dvs = [], [], []
        for qq, kk, vv, do in zip(*(_rows(t, cu_seqlens_q) for t in (q, k, v, dout))):
            qh, kh, vh, p, o, _ = self._one(qq, kk, vv, softmax_scale)
            doh = do.to(qh.dtype).transpose(0, 1)
            dv = p.transpose(-1, -2) @ doh
            dp = doh @ vh.transpose(-1, -2)
            ds = p * (dp - (doh * o.transpose(0, 1)).sum(-1, keepdim=True))
            dq = ds @ kh * softmax_scale
            dk = ds.transpose(-1, -2) @ qh * softmax_scale
            groups = (kk.shape[1], qq.shape[1] // kk.shape[1])  # query heads -> their K/V head
            dqs.append(dq.transpose(0, 1).to(q.dtype))
            dks.append(dk.unflatten(0, groups).sum(1).transpose(0, 1).to(k.dtype))
            dvs.append(dv.unflatten(0, groups).sum(1).transpose(0, 1).to(v.dtype))
        return _join(dqs, cu_seqlens_q), _join(dks, cu_seqlens_q), _join(dvs, cu_seqlens_q)


@pytest.fixture
def ref(monkeypatch):
    kernels = ReferenceKernels()
    monkeypatch.setattr(fa4op, "kernels", lambda: (kernels.fwd, kernels.bwd))
    return kernels


def _qkv(b=2, s=24, h=4, kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, s, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _sdpa(q, k, v, scale):
    """The reference the ops must equal: SDPA, causal, [b, s, h, d] in and out."""
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def test_the_ops_are_what_keep_attention_keeps():
    assert fa4op.fa4_forward._opoverload in kernel_ops()
    assert fa4op.fa4_forward._opoverload is torch.ops.longft.fa4_forward.default


def test_dense_op_equals_sdpa_forward_and_gradients(ref):
    """Rows of one document ([b, s, h, d], fewer K/V heads than query heads): the output and the
    q / k / v gradients through the registered autograd equal SDPA's."""
    q, k, v = _qkv()
    scale = 0.3
    out = fa4op.attention(q, k, v, scale)
    want = _sdpa(q, k, v, scale)
    torch.testing.assert_close(out, want)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    exp = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)


def test_varlen_op_equals_each_document_alone(ref):
    """Packed rows as flash-attn-4 takes them ([tokens, h, d] with cu_seqlens): each document's
    output and gradients equal SDPA on that document alone (nothing crosses a boundary)."""
    q, k, v = _qkv(b=1, s=30)
    cu = torch.tensor([0, 7, 19, 30], dtype=torch.int32)
    tok = [t[0] for t in (q, k, v)]
    out = fa4op.attention(*tok, 0.25, cu, 12)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    parts = [_sdpa(q[:, i:j], k[:, i:j], v[:, i:j], 0.25)[0] for i, j in ((0, 7), (7, 19), (19, 30))]
    want = torch.cat(parts)
    torch.testing.assert_close(out, want)
    exp = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)


def test_registrations_pass_torch_opcheck(ref):
    """torch.library.opcheck: the schema, the fake kernels' shapes and dtypes (torch.compile and
    meta tensors use them) and the autograd registration agree with the real kernel."""
    q, k, v = (t.detach().float() for t in _qkv())
    torch.library.opcheck(fa4op.fa4_forward._opoverload, (q, k, v, None, None, 0.3))
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    qt, kt, vt = (t[0].detach().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(fa4op.fa4_forward._opoverload, (qt, kt, vt, cu, 19, 0.3))


def test_fake_kernels_describe_transposed_inputs_too(ref):
    """The single-document path hands the op q / k / v as transposed views of [b, h, s, d]
    tensors; `attention` makes them contiguous, so the fake kernels' strides are the real ones
    (opcheck with gradients on)."""
    q, k, v = (t.detach().float().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in _qkv())  # [b, s, h, d] shapes over [b, h, s, d] memory
    assert not q.is_contiguous()
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(fa4op.fa4_forward._opoverload, (qc, kc, vc, None, None, 0.3))
    out = fa4op.attention(q, k, v, 0.3)
    assert out.is_contiguous() and out.shape == q.shape


def test_the_attention_function_lays_rows_out_for_the_op(ref, monkeypatch):
    """pa.flash_attn_4, as transformers calls it ([b, heads, s, d] in, [b, s, heads, d] out): one
    document a row (no boundaries) and packed rows (cu_seqlens) each equal SDPA on every
    document alone, output and gradients."""
    monkeypatch.setattr(pa, "flash_attn_4_available", lambda: True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def sdpa(a, b, c):  # [b, h, s, d] -> [b, s, h, d]
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.2,
                                              enable_gqa=True).transpose(1, 2)

    cu = torch.tensor([0, 6, 20, 31, 40], dtype=torch.int32)
    for bounds, longest in ((None, None), (cu, 14)):
        out = pa.flash_attn_4(None, q, k, v, bounds, longest, 0.2)
        if bounds is None:
            want = sdpa(q, k, v)
        else:  # documents [0, 6) and [6, 20) in row 0, [0, 11) and [11, 20) in row 1
            want = torch.cat([torch.cat([sdpa(q[r:r + 1, :, i:j], k[r:r + 1, :, i:j], v[r:r + 1, :, i:j])
                                         for i, j in spans], 1)
                              for r, spans in ((0, ((0, 6), (6, 20))), (1, ((0, 11), (11, 20))))])
        assert out.shape == (2, 20, 4, 8)
        torch.testing.assert_close(out, want)
        w = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                        torch.autograd.grad((want * w).sum(), (q, k, v))):
            torch.testing.assert_close(a, b)


def _layer(x, wq, wk, wv):
    """A checkpointed 'layer': projections, flash-attn-4's op, a non-linearity."""
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, 4, 8)
    k, v = ((x @ w).view(b, s, 2, 8) for w in (wk, wv))
    return torch.tanh(fa4op.attention(q, k, v, 8 ** -0.5).reshape(b, s, 32))


@pytest.mark.parametrize("keep", [False, True])
def test_keep_attention_skips_the_recompute_of_the_op_with_the_same_gradients(ref, keep):
    """Checkpointed layers with keep_attention's context: the op's forward runs once per layer (its
    outputs handed back in the recompute), without it twice; the gradients equal a run without
    checkpointing either way."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(32, n, generator=g, dtype=torch.float64, requires_grad=True) for n in (32, 16, 16)]
    plain = _layer(_layer(x, *ws), *ws).sum()
    want = torch.autograd.grad(plain, [x, *ws])
    ref.forwards = 0
    before = KeptKernels.replayed_total
    extra = {"context_fn": functools.partial(contexts, kernel_ops())} if keep else {}
    h = checkpoint(_layer, x, *ws, use_reentrant=False, **extra)
    out = checkpoint(_layer, h, *ws, use_reentrant=False, **extra).sum()
    got = torch.autograd.grad(out, [x, *ws])
    assert ref.forwards == (2 if keep else 4)
    assert KeptKernels.replayed_total - before == (2 if keep else 0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_single_document_rows_take_the_op_only_where_asked(ref, monkeypatch):
    """kernels.attention flash_attn_4 installs the attention function with single_documents: rows
    of one document run the op on CUDA (here: the forward is called with a CUDA-looking query);
    kernels.packed_attention flash_attn_4 alone leaves them to SDPA; the flag is flash_attn_4's."""
    calls = []
    monkeypatch.setattr(pa, "flash_attn_4", lambda *a, **kw: calls.append(a[4]) or "fa4")
    monkeypatch.setattr(pa, "_sdpa", lambda: (lambda *a, **kw: ("sdpa", None)))

    class Cuda:
        is_cuda = True
        shape = (1, 4, 8, 8)

    q = Cuda()
    assert pa.make_forward("flash_attn_4", single_documents=True)(None, q, q, q, None)[0] == "fa4"
    assert calls == [None]  # no document boundaries: the dense kernel
    assert pa.make_forward("flash_attn_4")(None, q, q, q, None)[0] == "sdpa"
    assert pa.make_forward("flash_attn_4", single_documents=True)(None, q, q, q, None, dropout=0.1)[0] == "sdpa"
    with pytest.raises(ValueError, match="flash_attn_4"):
        pa.make_forward("varlen", single_documents=True)


def _needs_flash_attn_4():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper or Blackwell GPU")
    if not pa.flash_attn_4_available():
        pytest.skip("flash-attn-4 is not installed")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attn_4_ops_match_cudnn_sdpa_on_cuda(head_dim):
    """The real kernels through the ops, at the Llama-3.2-1B / 3.1-8B shapes (32 query, 8 K/V heads),
    rows of one document in bf16: output and q / k / v gradients within bf16 tolerance of SDPA's
    cuDNN kernel (the same function, another kernel), and the varlen op on the same rows as two
    documents each equal to the dense op on them."""
    _needs_flash_attn_4()
    from longft.model import attention as sdpa_choice

    g = torch.Generator(device="cuda").manual_seed(0)
    b, s = 2, 4096
    q = torch.randn(b, s, 32, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = head_dim ** -0.5
    out = fa4op.attention(q, k, v, scale)
    with sdpa_choice.context("cudnn"):
        want = _sdpa(q, k, v, scale)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).float().sum(), (q, k, v))
    exp = torch.autograd.grad((want * w).float().sum(), (q, k, v))
    assert _rel(out, want) < 1e-2
    for name, a, e in zip("qkv", got, exp):
        assert _rel(a, e) < 2e-2, name
    cu = torch.tensor([0, s, 2 * s], device="cuda", dtype=torch.int32)
    flat = fa4op.attention(*(t.detach().reshape(b * s, *t.shape[2:]) for t in (q, k, v)), scale, cu, s)
    assert torch.equal(flat.view_as(out), out.detach())


@pytest.mark.gpu
def test_keep_attention_keeps_flash_attn_4_outputs_on_cuda():
    """kernels.attention flash_attn_4 on a bf16 Llama on the GPU with 4 of 8 layers keeping their
    attention outputs: their recompute runs no flash-attn-4 forward (4 replayed, 4 run), the loss
    is the unkept run's bit for bit and the gradients are within run-to-run noise; the unkept
    run's gradients are SDPA cuDNN's within bf16 tolerance (5 % of each parameter's gradient norm:
    a wrong layout or scale is off by the whole norm)."""
    _needs_flash_attn_4()
    from torch.utils._python_dispatch import TorchDispatchMode

    from longft.model import attention as sdpa_choice
    from longft.model import patches
    from test_gpu import _mid_model  # tests/ is on sys.path under pytest

    op = fa4op.fa4_forward._opoverload

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is op
            return func(*args, **(kwargs or {}))

    ids = torch.randint(1, 380, (2, 4096), device="cuda")

    def run(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        Count.n = 0
        with Count():
            loss.backward()
        return loss.detach(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}, Count.n

    sdpa = _mid_model()
    with sdpa_choice.context("cudnn"):
        loss_sdpa, g_sdpa, _ = run(sdpa)
    del sdpa
    plain = _mid_model()
    patches.apply(plain, liger=False, checkpointing="gpu", attention_kernel="flash_attn_4")
    loss_ref, g_ref, n_ref = run(plain)
    _, g_again, _ = run(plain)
    assert n_ref == 8
    assert abs(float(loss_ref) - float(loss_sdpa)) < 2e-2 * abs(float(loss_sdpa))
    for name in g_sdpa:
        assert (g_ref[name] - g_sdpa[name]).norm() <= 5e-2 * g_sdpa[name].norm(), name
    del plain
    kept = _mid_model()
    record = patches.apply(kept, liger=False, checkpointing="gpu", keep_attention=4, attention_kernel="flash_attn_4")
    assert record["attention_kept_layers"] == 4
    before = KeptKernels.replayed_total
    loss, g, n = run(kept)
    assert n == 4 and KeptKernels.replayed_total - before == 4
    assert torch.equal(loss, loss_ref)
    for name in g_ref:
        noise = (g_again[name] - g_ref[name]).norm()
        err = (g[name] - g_ref[name]).norm()
        assert err <= max(2 * noise, 1e-2 * g_ref[name].norm()), (name, float(err), float(noise))

"""flash-attn-4's causal attention as torch ops: `longft::fa4_forward` and `longft::fa4_backward`.

flash-attn-4 (the `flash-attn-4` package, CuTe DSL kernels for Hopper and Blackwell) runs its kernels
from Python, behind an autograd Function: torch's dispatcher never sees them, so
`checkpointing.keep_attention` (model/keep_attention.py, which keeps the outputs of the attention
ops the dispatcher runs) could not keep them, and every checkpointed layer ran flash-attn-4's forward
twice. Registered as ops, with the backward in `register_autograd`, the forward is one op call that
keep_attention keeps and hands back in the recompute, as it does SDPA's cuDNN kernel.

`attention` takes q / k / v as flash-attn-4 does: [batch, seq, heads, d] for rows of one document,
or [tokens, heads, d] with `cu_seqlens` (int32 [documents + 1]) for packed rows. Always causal;
fewer K/V heads than query heads are taken as they are. The log-sum-exp the forward returns is for
the backward only: a gradient that reaches it is dropped.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

FORWARD = "longft::fa4_forward"


@lru_cache(maxsize=None)
def _interface():
    """flash-attn-4's interface module (its forward and backward entry points)."""
    from flash_attn.cute import interface

    return interface


def kernels():
    """(forward, backward): flash-attn-4's `_flash_attn_fwd` and `_flash_attn_bwd`."""
    i = _interface()
    return i._flash_attn_fwd, i._flash_attn_bwd


@torch.library.custom_op(FORWARD, mutates_args=())
def fa4_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | None,
                max_seqlen: int | None, softmax_scale: float) -> tuple[Tensor, Tensor]:
    fwd, _ = kernels()
    out, lse, *_ = fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                       softmax_scale=softmax_scale, causal=True, return_lse=True)
    return out, lse


@fa4_forward.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    out = q.new_empty(*q.shape[:-1], v.shape[-1])  # a fresh contiguous tensor, as the kernel's
    if cu_seqlens is None:  # [b, s, h, d]; lse [b, h, s]
        return out, q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longft::fa4_backward", mutates_args=())
def fa4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 cu_seqlens: Tensor | None, max_seqlen: int | None,
                 softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    _, bwd = kernels()
    dq, dk, dv = bwd(q, k, v, out, dout, lse, softmax_scale, True, cu_seqlens_q=cu_seqlens,
                     cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


@fa4_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.softmax_scale = max_seqlen, softmax_scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = fa4_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                              ctx.softmax_scale)
    return dq, dk, dv, None, None, None


fa4_forward.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, cu_seqlens: Tensor | None = None,
              max_seqlen: int | None = None) -> Tensor:
    """Causal attention through flash-attn-4's kernels; the output has q's shape. q / k / v are
    made contiguous (a no-op for the layout the Llama projections leave), so the ops' fake kernels
    (torch.compile, meta tensors) describe the real outputs' strides."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return fa4_forward(q, k, v, cu_seqlens, max_seqlen, float(softmax_scale))[0]

"""Per-document attention for packed rows, with no [seq x seq] tensor anywhere.

A packed row holds several documents; their position ids restart at 0 where each document starts.
Left to itself, transformers turns restarting position ids into a dense block-diagonal
[seq x seq] mask (16 GiB at 128K), and SDPA given an explicit mask leaves its fast causal kernel:
on the H200 packed rows trained far slower than unpacked ones (bench/LOG.md). Instead, longft registers an
attention function of its own with transformers' attention interface (`NAME`). No mask function
is registered for it, so transformers builds no mask at all, and the function runs each document
as its own causal sequence from the document boundaries:

- `varlen`: torch.nn.attention.varlen.varlen_attn (torch 2.10 and later, CUDA, FlashAttention-2
  kernels inside torch): one call for all documents of the micro-batch.
- `per_document`: transformers' own SDPA function once per document (`is_causal`, so the pinned
  SDPA kernel runs: cuDNN or flash on Ampere and newer, the memory-efficient kernel on a V100,
  PyTorch's CPU kernel on CPU). cuDNN builds an execution plan for every new (batch, heads,
  length) it sees, and each micro-batch of packed rows brings new document lengths: `install`
  therefore turns on PyTorch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE` (`CUDNN_RAGGED_ENV`), under
  which cuDNN runs such calls through its ragged-offset path with the lengths rounded up to powers
  of two in the plan key, so a handful of plans serve every document (unless the environment
  already sets the variable; PyTorch reads it once, at the process's first cuDNN attention call).
- `flash_attn_4`: flash-attn-4's varlen kernel (the `flash-attn-4` package, CuTe DSL kernels for
  Hopper and Blackwell): one call for all documents, like varlen. longft runs it as a torch op
  (model/flash_attn_4_op.py), so checkpointing.keep_attention keeps its outputs.

The boundaries are worked out once per micro-batch (`batch_kwargs`, from the position ids) and
reach every layer as the `cu_seq_lens_q` / `max_length_q` keyword arguments, the names
transformers' flash-attention path reads too: with `kernels.attention: flash_attention_2` the same
keywords select flash-attn's variable-length kernel, and no mask is built either. A micro-batch
whose rows each hold one document (`cu_seq_lens_q` absent) takes the single-sequence path: SDPA
`is_causal`, or flash-attn-4's dense causal kernel where `kernels.attention` is flash_attn_4
(`install(..., single_documents=True)`).
"""

from __future__ import annotations

import inspect
import os
from functools import lru_cache

from longft.compat import transformers as tf_compat
from longft.config.sections import LONGFT_PACKED_KERNELS
from longft.errors import UserError

NAME = "longft_packed"
"""The attention implementation name longft registers (config._attn_implementation)."""
KERNELS = LONGFT_PACKED_KERNELS
CUDNN_RAGGED_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
"""PyTorch's opt-in (2.9 and later) to cuDNN SDPA's ragged path for BSHD-contiguous q/k/v without
a bias: one plan per power-of-two length instead of one per length (aten/src/ATen/native/cudnn/MHA.cpp)."""


@lru_cache(maxsize=None)
def varlen_available() -> bool:
    """Whether this torch has torch.nn.attention.varlen.varlen_attn (2.10 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=None)
def flash_attn_4_available() -> bool:
    """Whether flash-attn-4's kernels can load here (the package, and the nvidia-cutlass-dsl
    libraries for this CUDA that its CuTe DSL needs)."""
    try:
        from longft.model import flash_attn_4_op

        flash_attn_4_op.kernels()
    except Exception:  # noqa: BLE001 - not installed, or its CUDA libraries missing
        return False
    return True


def boundaries(position_ids):
    """(cu_seqlens int32 [n_docs + 1] over the flattened micro-batch, longest document) from
    position ids that restart at 0 where each document starts; rows never share a document."""
    import torch

    pos = position_ids.reshape(-1)
    starts = (pos == 0)
    row_starts = torch.zeros_like(starts)
    row_starts[::position_ids.shape[-1]] = True  # a row's first token starts a document
    starts = starts | row_starts
    idx = torch.nonzero(starts, as_tuple=False).flatten()
    cu = torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def batch_kwargs(position_ids) -> dict:
    """The keyword arguments a packed micro-batch hands to the model (computed once, read by every
    layer); {} when each row holds a single document, so the single-sequence kernel runs."""
    cu, longest = boundaries(position_ids)
    if cu.numel() - 1 == position_ids.shape[0]:  # one document a row
        return {}
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def document_lengths(position_ids) -> list[int]:
    """The length of every document of the micro-batch, row by row."""
    cu, _ = boundaries(position_ids)
    return (cu[1:] - cu[:-1]).tolist()


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def per_document(module, query, key, value, cu, dropout: float, scaling, **kwargs):
    """Transformers' SDPA function on each document alone (causal); [b, s, heads, d]."""
    import torch

    b, _, s, _ = query.shape
    if query.is_cuda and cudnn_ragged() == "1":
        # cuDNN's ragged path takes only BSHD-contiguous q/k/v: one copy a layer if the rotary
        # embedding left them otherwise, not one cuDNN plan per document length
        query, key, value = (_bshd(t) for t in (query, key, value))
    bounds = cu.tolist()
    rows = []
    for r in range(b):
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if start < r * s or end > (r + 1) * s:
                continue
            i, j = start - r * s, end - r * s
            out, _ = _sdpa()(module, query[r:r + 1, :, i:j], key[r:r + 1, :, i:j],
                             value[r:r + 1, :, i:j], None, dropout=dropout, scaling=scaling,
                             is_causal=True)
            pieces.append(out)
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _bshd(t):
    """`t` [b, heads, s, d] with [b, s, heads, d] memory (a copy only where it has another)."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def _tokens(t):
    """[b, heads, s, d] as the [b * s, heads, d] token rows the varlen kernels take."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


@lru_cache(maxsize=None)
def _varlen_signature() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen(module, query, key, value, cu, longest: int, scaling):
    """torch's varlen_attn over all documents at once; [b, s, heads, d]."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, s, d = query.shape
    params = _varlen_signature()
    extra = {}
    # Fewer K/V heads than query heads: torch 2.13 asks for enable_gqa; torch 2.11's flash kernel
    # takes them as they are (H200, 32 q / 8 kv heads: identical to repeated K/V,
    # bench/results/h200-packed-attention-probe.json).
    if getattr(module, "num_key_value_groups", 1) > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    if "is_causal" in params:  # the torch 2.10 signature
        extra["is_causal"] = True
    else:  # torch 2.11 and later: causal is the window (-1, 0)
        extra["window_size"] = (-1, 0)
    q, k, v = _tokens(query), _tokens(key), _tokens(value)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
    return out.view(b, s, h, d)


def flash_attn_4(module, query, key, value, cu, longest: int | None, scaling):
    """flash-attn-4's causal kernel (model/flash_attn_4_op.py; fewer K/V heads than query heads
    taken as they are): with `cu`, its varlen kernel over all documents at once; without, its
    dense kernel over each row as one document. [b, s, heads, d]."""
    if not flash_attn_4_available():
        raise PackedAttentionError(
            "flash_attn_4 attention needs the flash-attn-4 package (pip install flash-attn-4 on a "
            "Hopper or Blackwell GPU); set kernels.attention: sdpa and kernels.packed_attention: auto")
    from longft.model.flash_attn_4_op import attention

    b, h, s, d = query.shape
    if scaling is None:
        scaling = d ** -0.5
    if cu is None:
        return attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling)
    out = attention(_tokens(query), _tokens(key), _tokens(value), scaling, cu, longest)
    return out.view(b, s, h, d)


class PackedAttentionError(UserError, RuntimeError):
    """The model asks of its attention what longft's packed attention cannot do."""


def _refuse_what_it_cannot_apply(query, cu_seq_lens_q, max_length_q, kwargs) -> None:
    """Softcapped logits (Gemma 2) and sliding windows shorter than a document: neither SDPA per
    document nor varlen_attn applies them, and no mask does it for them (none is built); training
    on would silently train a different model. The hardware policy keeps softcapping models off
    this path (kernels.attention auto: eager or flash_attention_2); this is the last guard."""
    cap = kwargs.get("softcap")
    if cap is not None:
        raise PackedAttentionError(
            f"{NAME} attention cannot apply attention logit softcapping ({cap:g}); set "
            "kernels.attention: auto (eager or flash_attention_2) and re-run the patch stage")
    window = kwargs.get("sliding_window")
    longest = int(max_length_q) if cu_seq_lens_q is not None else query.shape[2]
    if window is not None and 0 < window < longest:
        raise PackedAttentionError(
            f"{NAME} attention cannot apply the model's sliding window ({window} tokens) to a "
            f"{longest}-token document; set kernels.packed_attention: mask (or "
            "kernels.attention: flash_attention_2), or data.max_seq_length <= the window")


def make_forward(kernel: str, single_documents: bool = False):
    """The attention function registered as NAME for `kernel` (one of KERNELS); with
    `single_documents` (flash_attn_4 only), rows of one document run its dense kernel too."""
    if kernel not in KERNELS:
        raise ValueError(f"packed attention kernel must be one of {KERNELS}, got {kernel!r}")
    if single_documents and kernel != "flash_attn_4":
        raise ValueError(f"single_documents is flash_attn_4's, not {kernel!r}'s")

    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                is_causal=None, cu_seq_lens_q=None, max_length_q=None, **kwargs):
        if attention_mask is not None:
            raise RuntimeError(f"{NAME} attention got an explicit attention mask; longft's packed "
                               "attention takes document boundaries, not masks")
        _refuse_what_it_cannot_apply(query, cu_seq_lens_q, max_length_q, kwargs)
        if cu_seq_lens_q is None:  # one document a row: the single-sequence kernel
            if single_documents and query.is_cuda and not dropout:
                return flash_attn_4(module, query, key, value, None, None, scaling), None
            return _sdpa()(module, query, key, value, None, dropout=dropout, scaling=scaling,
                           is_causal=is_causal)
        if kernel == "varlen" and query.is_cuda and not dropout:
            return varlen(module, query, key, value, cu_seq_lens_q, int(max_length_q), scaling), None
        if kernel == "flash_attn_4" and query.is_cuda and not dropout:
            return flash_attn_4(module, query, key, value, cu_seq_lens_q, int(max_length_q),
                                scaling), None
        return per_document(module, query, key, value, cu_seq_lens_q, dropout, scaling), None

    forward.kernel, forward.single_documents = kernel, single_documents
    return forward


def cudnn_ragged() -> str | None:
    """The CUDNN_RAGGED_ENV value this process runs with (None: unset, cuDNN's plan per length)."""
    return os.environ.get(CUDNN_RAGGED_ENV)


def install(model, kernel: str, single_documents: bool = False) -> None:
    """Register NAME for `kernel` and make `model` use it (its config._attn_implementation);
    per_document also turns on CUDNN_RAGGED_ENV unless the environment sets it already;
    flash_attn_4 refuses to install where flash-attn-4 cannot be loaded. `single_documents`
    (kernels.attention flash_attn_4): rows of one document run flash-attn-4 too."""
    from transformers import AttentionInterface

    if kernel == "per_document":
        os.environ.setdefault(CUDNN_RAGGED_ENV, "1")
    if kernel == "flash_attn_4" and not flash_attn_4_available():
        raise PackedAttentionError(
            "flash_attn_4 attention: flash_attn.cute (the flash-attn-4 package) cannot be loaded "
            "here; pip install flash-attn-4 (with its nvidia-cutlass-dsl libraries for this CUDA), "
            "or set kernels.attention: sdpa and kernels.packed_attention: auto")

    dropout = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    if kernel in ("varlen", "flash_attn_4") and dropout > 0:
        print(f"longft: notice: the model's attention_dropout is {dropout:g}; {kernel} has no "
              "dropout, so packed rows run SDPA per document while training (exact, slower)"
              + (" and single documents SDPA" if single_documents else "")
              + "; set the model's attention_dropout to 0 for the one-call kernel", flush=True)
    AttentionInterface.register(NAME, make_forward(kernel, single_documents))
    for m in model.modules():  # the model and its sub-configs (one for a decoder-only LM)
        cfg = getattr(m, "config", None)
        if cfg is not None and tf_compat.attn_implementation(cfg) == "sdpa":
            tf_compat.set_attn_implementation(cfg, NAME)

"""Time attention forward+backward on one packed row of real-shaped documents, per kernel (GPU).

    PYTHONPATH=src python3 scripts/packed_attention_probe.py [--out FILE] [--iters 5]

For the Llama-3.2-1B (32 q / 8 kv heads, head_dim 64) and Llama-3.1-8B (32 / 8, 128) attention
shapes at 16K, 32K, 64K and 128K tokens, a row is packed from documents whose lengths follow
data.sample_lengths: mixed (log-uniform from 1,024 tokens to the row length, the synthetic
generator's distribution, seed 0), and each kernel runs fwd+bwd on it:
  unpacked_cudnn     SDPA cuDNN, is_causal over the whole row (what an unpacked row gets; also at
                     128,000 tokens, the 8B rows' length, which is not a power of two)
  varlen             torch.nn.attention.varlen.varlen_attn over the documents (one call)
  per_document_cudnn / per_document_flash   SDPA (is_causal) once per document
  *_fresh            the same with new document lengths every call (seed = the call's index), as
                     training brings them: cuDNN builds a plan for every new shape unless
                     TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (run the probe once with it, once without)
  fa4_varlen         flash-attn-4's flash_attn_varlen_func (CuTe DSL), where it is installed,
                     through model/packed_attention.py's flash_attn_4 (training's call)
  mask_sdpa          SDPA with the dense block-diagonal [seq x seq] mask (16K only)
Median of --iters (3 from 64K) after 2 warm-up calls; TFLOP/s counts causal attention per document
(4 x d x heads x sum L_i^2 / 2, x 3.5 for fwd+bwd incl. the backward's recompute-free 2.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from longft.data.synthetic import sample_length
from longft.model import packed_attention as pa

SHAPES = {"llama3.2-1b": (32, 8, 64), "llama3.1-8b": (32, 8, 128)}


def doc_lengths(seq: int, seed: int = 0) -> list[int]:
    """Documents drawn until the row is full; the last is cut to fit (as packing would pad)."""
    out, i = [], 0
    while sum(out) < seq:
        out.append(min(sample_length(i, seed, seq), seq - sum(out)))
        i += 1
    return out


def timed(fn, iters: int) -> tuple[float, list[float]]:
    ts = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        if i >= 2:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts), ts


class _Mod(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    rows = []
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    sig = sorted(inspect.signature(varlen_attn).parameters)
    print(json.dumps({"varlen_attn_params": sig}), flush=True)
    # does varlen_attn take fewer K/V heads than query heads as they are (flash-attn's GQA)?
    qq = torch.randn(4096, 32, 64, device="cuda", dtype=torch.bfloat16)
    kk, vv = (torch.randn(4096, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu0 = torch.tensor([0, 1000, 4096], device="cuda", dtype=torch.int32)
    causal = {"is_causal": True} if "is_causal" in sig else {"window_size": (-1, 0)}
    try:
        native = varlen_attn(qq, kk, vv, cu0, cu0, 3096, 3096, **causal)
        ref = varlen_attn(qq, kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1), cu0, cu0, 3096, 3096, **causal)
        gqa = {"native_gqa_runs": True, "max_abs_diff_vs_expanded": float((native - ref).abs().max())}
    except Exception as e:  # noqa: BLE001
        gqa = {"native_gqa_runs": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(gqa), flush=True)
    fa4 = pa.flash_attn_4_available()  # training's own call (pa.flash_attn_4) is timed
    if not fa4:
        print(json.dumps({"fa4": "flash_attn.cute cannot be imported: fa4_varlen not timed"}), flush=True)
    for model, (h, g, d) in SHAPES.items():
        for seq in (16384, 32768, 65536, 128000, 131072):
            lens = doc_lengths(seq)
            fresh = [doc_lengths(seq, seed=1 + i) for i in range(a.iters + 2)]
            bounds = {tuple(x): pa.boundaries(torch.cat([torch.arange(n) for n in x])[None].cuda())
                      for x in [lens, *fresh]}
            # BSHD memory seen as [b, heads, s, d], as the Llama projections leave it
            q = torch.randn(1, seq, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            k = torch.randn(1, seq, g, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            v = torch.randn(1, seq, g, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            go = torch.randn(1, seq, h, d, device="cuda", dtype=torch.bfloat16)
            mod = _Mod(h // g)

            def run(kind, i):
                docs = fresh[i] if kind.endswith("_fresh") else lens
                cu, longest = bounds[tuple(docs)]
                if kind == "unpacked_cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    o = o.transpose(1, 2)
                elif kind.startswith("varlen"):
                    o = pa.varlen(mod, q, k, v, cu, longest, None)
                elif kind.startswith("fa4"):
                    o = pa.flash_attn_4(mod, q, k, v, cu, longest, None)
                elif kind.startswith("per_document"):
                    backend = SDPBackend.FLASH_ATTENTION if "flash" in kind else SDPBackend.CUDNN_ATTENTION
                    with sdpa_kernel([backend]):
                        o = pa.per_document(mod, q, k, v, cu, 0.0, None)
                else:
                    doc = torch.repeat_interleave(torch.arange(len(docs), device="cuda"),
                                                  torch.tensor(docs, device="cuda"))
                    mask = (doc[:, None] == doc[None, :]).tril()[None, None]
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
                o.backward(go)

            if seq == 128000:  # the 8B rows' length: the unpacked kernel only
                kinds = ["unpacked_cudnn"]
            else:
                kinds = ["unpacked_cudnn", "varlen", "varlen_fresh", "per_document_cudnn",
                         "per_document_cudnn_fresh", "per_document_flash_fresh"]
                kinds += ["fa4_varlen", "fa4_varlen_fresh"] if fa4 else []
                kinds += ["mask_sdpa"] if seq <= 16384 else []
            iters = a.iters if seq <= 32768 else min(a.iters, 3)
            for kind in kinds:
                docs = lens if not kind.endswith("_fresh") else None
                pairs = (sum(n * n for n in docs) if docs else
                         statistics.median(sum(n * n for n in x) for x in fresh[2:2 + iters]))
                try:
                    med, ts = timed(lambda i: run(kind, i), iters)
                    work = seq * seq if kind == "unpacked_cudnn" else pairs
                    row = {"model": model, "seq": seq, "docs": len(docs) if docs else
                           [len(x) for x in fresh[2:2 + iters]], "kernel": kind,
                           "median_ms": round(med * 1e3, 2), "times_ms": [round(t * 1e3, 2) for t in ts],
                           "tflops": round(3.5 * 4 * d * h * work / 2 / med / 1e12, 1)}
                except Exception as e:  # noqa: BLE001 - a kernel this torch/GPU cannot run
                    row = {"model": model, "seq": seq, "kernel": kind,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
                q.grad = k.grad = v.grad = None
            q = k = v = go = None  # free before the next length
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), pa.CUDNN_RAGGED_ENV: os.environ.get(pa.CUDNN_RAGGED_ENV),
           "varlen_attn_params": sig, "varlen_gqa": gqa, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

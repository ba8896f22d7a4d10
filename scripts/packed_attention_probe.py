"""Time attention forward+backward on one packed row of real-shaped documents, per kernel (GPU).

    PYTHONPATH=src python3 scripts/packed_attention_probe.py [--out FILE] [--iters 5]

For the Llama-3.2-1B (32 q / 8 kv heads, head_dim 64) and Llama-3.1-8B (32 / 8, 128) attention
shapes at 16K and 128K tokens, a row is packed from documents whose lengths follow
data.sample_lengths: mixed (log-uniform from 1,024 tokens to the row length, the synthetic
generator's distribution, seed 0), and each kernel runs fwd+bwd on it:
  unpacked_cudnn     SDPA cuDNN, is_causal over the whole row (what an unpacked row gets)
  varlen             torch.nn.attention.varlen.varlen_attn over the documents (one call)
  per_document_cudnn / per_document_flash   SDPA (is_causal) once per document
  mask_sdpa          SDPA with the dense block-diagonal [seq x seq] mask (16K only)
Median of --iters after 2 warm-up calls; TFLOP/s counts causal attention per document
(4 x d x heads x sum L_i^2 / 2, x 3.5 for fwd+bwd incl. the backward's recompute-free 2.5x).
"""

from __future__ import annotations

import argparse
import json
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
        fn()
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
    for model, (h, g, d) in SHAPES.items():
        for seq in (16384, 131072):
            lens = doc_lengths(seq)
            pos = torch.cat([torch.arange(n) for n in lens])[None].cuda()
            cu, longest = pa.boundaries(pos)
            q = torch.randn(1, h, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, g, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, g, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            go = torch.randn(1, seq, h, d, device="cuda", dtype=torch.bfloat16)
            mod = _Mod(h // g)
            pairs = sum(n * n for n in lens)
            flops = 3.5 * 4 * d * h * pairs / 2

            def run(kind):
                if kind == "unpacked_cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    o = o.transpose(1, 2)
                elif kind == "varlen":
                    o = pa.varlen(mod, q, k, v, cu, longest, None)
                elif kind.startswith("per_document"):
                    backend = SDPBackend.CUDNN_ATTENTION if kind.endswith("cudnn") else SDPBackend.FLASH_ATTENTION
                    with sdpa_kernel([backend]):
                        o = pa.per_document(mod, q, k, v, cu, 0.0, None)
                else:
                    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                                  torch.tensor(lens, device="cuda"))
                    mask = (doc[:, None] == doc[None, :]).tril()[None, None]
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
                o.backward(go)

            kinds = ["unpacked_cudnn", "varlen", "per_document_cudnn", "per_document_flash"]
            if seq <= 16384:
                kinds.append("mask_sdpa")
            for kind in kinds:
                try:
                    med, ts = timed(lambda: run(kind), a.iters)
                    tflops = (4 * d * h * seq * seq / 2 * 3.5 if kind == "unpacked_cudnn" else flops) / med / 1e12
                    row = {"model": model, "seq": seq, "docs": len(lens), "kernel": kind,
                           "median_ms": round(med * 1e3, 2), "times_ms": [round(t * 1e3, 2) for t in ts],
                           "tflops": round(tflops, 1)}
                except Exception as e:  # noqa: BLE001 - a kernel this torch/GPU cannot run
                    row = {"model": model, "seq": seq, "docs": len(lens), "kernel": kind,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
                q.grad = k.grad = v.grad = None
            torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "varlen_attn_params": sig, "varlen_gqa": gqa, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

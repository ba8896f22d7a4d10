"""Time causal attention forward + backward on one GPU: SDPA's cuDNN kernel against flash-attn-4
through longft's op (model/flash_attn_4_op.py), rows of one document, Llama-3.2-1B and 3.1-8B
shapes (32 query / 8 K/V heads, head_dim 64 / 128). Median of 5 timed calls after 2 warm-ups;
fresh random inputs (never zeros). Prints a table; the JSON goes to $OUT/results (or ./).

    PYTHONPATH=src python3 scripts/attention_kernel_probe.py
"""
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from longft.model import attention
from longft.model import packed_attention as pa

SHAPES = {"llama3.2-1b": 64, "llama3.1-8b": 128}
ROWS = {16384: 4, 131072: 1}  # tokens a row: rows a call


def cudnn(q, k, v, scale):
    with attention.context("cudnn"):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                              scale=scale, enable_gqa=True).transpose(1, 2)


def fa4(q, k, v, scale):
    from longft.model.flash_attn_4_op import attention as op

    return op(q, k, v, scale)


def time_it(fn, b, s, d):
    ts = []
    for i in range(7):
        q = torch.randn(b, s, 32, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        dout = torch.randn(b, s, 32, d, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(q, k, v, d ** -0.5).backward(dout)
        torch.cuda.synchronize()
        if i >= 2:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    kernels = {"sdpa_cudnn": cudnn}
    if pa.flash_attn_4_available():
        kernels["flash_attn_4"] = fa4
    rows = []
    for model, d in SHAPES.items():
        for s, b in ROWS.items():
            flops = 3.5 * 2 * b * s * s * 32 * d  # causal fwd (4 b s^2 h d / 2) x 3.5 for fwd + bwd
            for name, fn in kernels.items():
                sec = time_it(fn, b, s, d)
                rows.append({"model": model, "seq": s, "rows": b, "kernel": name,
                             "ms": round(sec * 1e3, 2), "tflops": round(flops / sec / 1e12, 1)})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention-kernel-probe.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
         "cudnn": torch.backends.cudnn.version(), "rows": rows}, indent=1))
    print(f"{'model':12} {'seq':>7} {'rows':>4} {'kernel':13} {'ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['model']:12} {r['seq']:>7} {r['rows']:>4} {r['kernel']:13} {r['ms']:>9} {r['tflops']:>8}")


if __name__ == "__main__":
    main()

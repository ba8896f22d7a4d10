"""Where does the 8B estimate's surplus beyond 128K tokens come from? (issue 33; docs/estimator.md,
"8B beyond 128K tokens".) The estimate's backward peak per token is the attention backward's
(90,248 B on Llama-3.1-8B, 45,056 of it transients: dQ, its fp32 accumulator, dK/dV and, with
GQA, dK/dV expanded to every query head). The 256K and 512K confirmations came out ~30,600 B a
token under it, the 128K rows on it. This probe measures, at each length, torch's peak allocated
memory above the inputs:

  - `sdpa`: scaled_dot_product_attention alone, Llama-3.1-8B's heads (q 32 x 128, k/v 8 x 128,
    causal, enable_gqa as transformers calls it), forward + backward, under each SDPA kernel
    longft can pin (cudnn, flash);
  - `layer`: one Llama-3.1-8B decoder layer with Liger's RMSNorm and SwiGLU and the tiled MLP, as
    longft patches it, forward + backward under cuDNN attention.

One JSON line per case and length, with the bytes per token; the estimate's numbers beside them.

    PYTHONPATH=src python3 scripts/attention_memory_probe.py [--seqs 65536 131072 262144]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

H, KV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336


def measure(step) -> int:
    """Peak allocated bytes above the start of `step()` (its second call: workspaces and plans
    exist by then)."""
    import torch

    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def sdpa_peak(seq: int, backend: str) -> int:
    import torch
    import torch.nn.functional as F

    from longft.model import attention

    q = torch.randn(1, H, seq, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(1, KV, seq, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    g = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        with attention.context(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)
    # the gradients of q, k, v outlive the step: they are the layer's input gradients, not
    # transients of the kernel
    return measure(step) - 2 * seq * (H * D + 2 * KV * D)


def one_layer_model(hidden=HIDDEN, inter=INTER, heads=H, kv=KV, head_dim=D):
    """A one-layer Llama (Llama-3.1-8B's layer shape), patched as longft patches it: Liger's
    RMSNorm, RoPE and SwiGLU, the tiled MLP, no checkpointing (one layer's backward is what is
    measured)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from longft.model.patches import apply

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=head_dim, num_hidden_layers=1,
                      vocab_size=256, max_position_embeddings=1 << 20)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    apply(model, liger=True, checkpointing="none", sdpa_backend="cudnn", tiled_mlp=True)
    return model


def layer_peak(seq: int) -> int:
    import torch

    from longft.model import attention

    model = one_layer_model().cuda()
    layer, rot = model.model.layers[0], model.model.rotary_emb
    x = torch.randn(1, seq, HIDDEN, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    pe = tuple(t.to(torch.bfloat16) for t in rot(x, torch.arange(seq, device="cuda")[None]))
    g = torch.randn_like(x)

    def step():
        x.grad = None
        model.zero_grad(set_to_none=True)
        with attention.context("cudnn"):
            out = layer(x, position_embeddings=pe)
            (out[0] if isinstance(out, tuple) else out).backward(g)
    return measure(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=(65536, 131072, 262144))
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("attention_memory_probe: needs a CUDA GPU")
    from longft.estimate.estimator import Setup
    from longft.estimate.gpu import layer_activation_bytes

    arch = dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=32, num_attention_heads=H, num_key_value_heads=KV, head_dim=D,
                vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=1 << 20)
    for seq in a.seqs:
        est = layer_activation_bytes(arch, Setup(micro_batch=1, seq_len=seq, liger=True,
                                                 tiled_mlp=True, attention="sdpa",
                                                 sdpa_backend="cudnn"))
        cases = [("sdpa", b, lambda b=b: sdpa_peak(seq, b)) for b in ("cudnn", "flash")]
        cases.append(("layer", "cudnn", lambda: layer_peak(seq)))
        for case, backend, run in cases:
            try:
                peak = run()
                row = {"peak_gib": round(peak / 2**30, 3), "per_token_bytes": round(peak / seq)}
            except Exception as e:  # a kernel that refuses the shape: say so, go on
                row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            torch.cuda.empty_cache()
            if case == "sdpa":  # the output and log-sum-exp it keeps, + the estimate's workspace
                kept, work = 2 * H * D + 4 * H, 4 * H * D + 2 * 2 * H * D
                said = {"output_and_lse": kept, "dq_fp32_and_expanded_dkdv": work,
                        "sdpa_total": kept + work}
            else:
                said = {"layer_peak": est["peak"], "attention_peak": est["attn_peak"],
                        "mlp_peak": est["mlp_peak"], "saved": est["saved"]}
            print(json.dumps({"case": case, "backend": backend, "seq": seq, **row,
                              "estimate_per_token": said}), flush=True)


if __name__ == "__main__":
    main()

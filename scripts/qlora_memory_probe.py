"""Where does QLoRA's activation surplus come from? (issue 31; `FROZEN_BASE_SURPLUS_H` in
src/longft/estimate/quantized.py.) One Llama-3.1-8B decoder layer (h 4096, MLP 14336, 32 / 8 heads)
on the GPU, LoRA r16 on all seven projections, forward and backward at two lengths: the slope of
torch's peak allocated memory per token, in units of x·h (2 B x 4096), for plain LoRA, NF4 QLoRA and
int8, each with and without Liger's SwiGLU MLP. Prints one JSON line per case.

    python scripts/qlora_memory_probe.py [--seqs 8192 16384]

The difference between the nf4 and the lora rows is the surplus a whole step shows per layer
recomputed; the estimator counts 4.9 x·h per token for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_peak(kind: str, liger: bool, seq: int) -> int:
    """Peak allocated bytes above the start of one layer's forward + backward."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from longft.model.quantize import quantize_linears

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, num_hidden_layers=1, vocab_size=256)
    cfg._attn_implementation = "sdpa"

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = LlamaDecoderLayer(cfg, 0)

        def forward(self, x, pe):
            out = self.layer(x, position_embeddings=pe)
            return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(0)
    m = One().to(torch.bfloat16)
    if liger:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        mlp = LigerSwiGLUMLP(cfg).to(torch.bfloat16)
        mlp.load_state_dict(m.layer.mlp.state_dict())
        m.layer.mlp = mlp
    if kind in ("nf4", "int8"):
        quantize_linears(m, TARGETS, kind, torch.bfloat16, "cuda")
    m = m.cuda()
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS),
                                     lora_dropout=0.0))
    for n, p in m.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
    rot = LlamaRotaryEmbedding(cfg).cuda()
    x = torch.randn(1, seq, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    pe = tuple(t.to(torch.bfloat16) for t in rot(x, torch.arange(seq, device="cuda")[None]))
    g = torch.randn_like(x)
    for _ in range(2):  # the second pass is measured: workspaces and caches exist by then
        x.grad = None
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(x, pe).backward(g)
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs=2, default=(8192, 16384))
    a = ap.parse_args()
    import importlib.util

    ligers = (False, True) if importlib.util.find_spec("liger_kernel") else (False,)
    xh = 2 * 4096
    for liger in ligers:
        for kind in ("lora", "nf4", "int8"):
            lo, hi = (layer_peak(kind, liger, s) for s in a.seqs)
            per_token = (hi - lo) / (a.seqs[1] - a.seqs[0])
            print(json.dumps({"kind": kind, "liger_swiglu": liger, "seqs": list(a.seqs),
                              "peak_gib": [round(lo / 2**30, 3), round(hi / 2**30, 3)],
                              "per_token_bytes": per_token,
                              "per_token_xh": round(per_token / xh, 3)}), flush=True)


if __name__ == "__main__":
    main()

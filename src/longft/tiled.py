"""Sequence-tiled MLP (`kernels.tiled_mlp`): each decoder layer's MLP runs over tiles of
TILE_TOKENS tokens, through DeepSpeed's `TiledMLP` autograd function (Arctic Long Sequence
Training). Its forward keeps no intermediate; its backward recomputes one tile at a time, so the
MLP's gate/up/activation tensors (3 x intermediate_size x 2 B per token: 84 KiB per token for
Llama-3.1-8B, 10.5 GiB at 128K tokens) never exist for the whole sequence at once. Under ZeRO-3,
`ds_grad_is_ready` keeps DeepSpeed from reducing a weight's gradient before its last tile.

The MLP module's own forward (Hugging Face's, or Liger's SwiGLU after the Liger patch) is what each
tile runs, so this composes with Liger, LoRA (peft wraps the projections) and checkpointing.
"""

from __future__ import annotations

import math

TILE_TOKENS = 8192
"""Tokens per tile: large enough for efficient matmuls, small enough that a tile's intermediates
(8192 x intermediate_size x ~5 x 2 B: 1.1 GiB for Llama-3.1-8B) stay small."""


def tiles(tokens: int, tile_tokens: int = TILE_TOKENS) -> int:
    """Tiles for a micro-batch of `tokens` tokens (a function of the shape only, so every rank,
    which sees the same padded shape, runs the same number of ZeRO-3 gathers)."""
    return max(1, math.ceil(tokens / tile_tokens))


def _mlps(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.mlp for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp")]


def _run(mlp_forward):
    # TiledMLP calls fn(self, x_shard); the module's original (bound) forward does the work
    return lambda _self, x: mlp_forward(x)


def tile_mlps(model, tile_tokens: int = TILE_TOKENS) -> int:
    """Make every decoder layer's MLP tiled; returns how many were patched."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlps = _mlps(model)
    for mlp in mlps:
        fn = _run(mlp.forward)

        def forward(x, _mlp=mlp, _fn=fn):
            n = tiles(x.numel() // x.shape[-1], tile_tokens)
            if n == 1 or not torch.is_grad_enabled():
                return _fn(_mlp, x)
            params = list(_mlp.parameters())
            if not x.requires_grad and any(p.requires_grad for p in params):
                # TiledMLP sees the weights only through a list: autograd would not track them
                # unless the input requires grad (LoRA without checkpointing: frozen embeddings)
                x = x.detach().requires_grad_()
            return TiledMLP.apply(_fn, _mlp, x, n, params)

        mlp.forward = forward
    return len(mlps)

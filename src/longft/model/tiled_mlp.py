"""Sequence-tiled MLP (`kernels.tiled_mlp`): each decoder layer's MLP runs over tiles of
TILE_TOKENS tokens, through DeepSpeed's `TiledMLP` autograd function (Arctic Long Sequence
Training). Its forward keeps no intermediate; its backward recomputes one tile at a time, so the
MLP's gate/up/activation tensors (3 x intermediate_size x 2 B per token: 84 KiB per token for
Llama-3.1-8B, 10.5 GiB at 128K tokens) never exist for the whole sequence at once. Under ZeRO-3,
`ds_grad_is_ready` keeps DeepSpeed from reducing a weight's gradient before its last tile.

The MLP module's own forward (Hugging Face's, or Liger's SwiGLU after the Liger patch) is what each
tile runs, so this composes with Liger, LoRA (peft wraps the projections) and checkpointing.

Under non-reentrant checkpointing the layer's forward runs again in backward only to regenerate its
saved tensors, and the tiled MLP saves nothing but its input. Where the MLP's output feeds nothing
that saves tensors (`skip_recompute`: Llama, Mistral, Qwen2/3, whose layers end with the residual
add), that recompute skips the MLP's arithmetic: the tiled backward recomputes each tile anyway. The
backward runs on the original forward's graph, so what the skipped call returns is never used.
"""

from __future__ import annotations

import math

from longft.compat import torch as torch_compat

TILE_TOKENS = 8192
"""Tokens per tile: large enough for efficient matmuls, small enough that a tile's intermediates
(8192 x intermediate_size x ~5 x 2 B: 1.1 GiB for Llama-3.1-8B) stay small."""


SKIP_RECOMPUTE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Decoder layers whose MLP output only meets the residual add (no norm after it, unlike Gemma 2)."""


def tiles(tokens: int, tile_tokens: int = TILE_TOKENS) -> int:
    """Tiles for a micro-batch of `tokens` tokens (a function of the shape only, so every rank,
    which sees the same padded shape, runs the same number of ZeRO-3 gathers)."""
    return max(1, math.ceil(tokens / tile_tokens))


def decoder_layers(model) -> list:
    """The model's decoder layers, in order (transformers' GradientCheckpointingLayer instances;
    the same objects under a peft wrapper)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def skips_recompute(checkpointing: str, model_type: str | None) -> bool:
    """Whether a tiled MLP skips its arithmetic in the layer's recompute: with (always
    non-reentrant) checkpointing, in SKIP_RECOMPUTE_FAMILIES."""
    return checkpointing in ("gpu", "cpu_offload") and model_type in SKIP_RECOMPUTE_FAMILIES


def _mlps(model) -> list:
    return [m.mlp for m in decoder_layers(model) if hasattr(m, "mlp")]


def _run(mlp_forward):
    # TiledMLP calls fn(self, x_shard); the module's original (bound) forward does the work
    return lambda _self, x: mlp_forward(x)


def _skip(_self, x):
    import torch

    return torch.empty_like(x)  # an MLP's output has its input's shape


def tile_mlps(model, tile_tokens: int = TILE_TOKENS, skip_recompute: bool = False) -> int:
    """Make every decoder layer's MLP tiled; returns how many were patched. skip_recompute: see the
    module doc (only with non-reentrant checkpointing and SKIP_RECOMPUTE_FAMILIES)."""
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
            if skip_recompute and torch_compat.in_backward():
                return TiledMLP.apply(_skip, _mlp, x, n, params)  # a checkpoint's recompute
            return TiledMLP.apply(_fn, _mlp, x, n, params)

        mlp.forward = forward
    return len(mlps)

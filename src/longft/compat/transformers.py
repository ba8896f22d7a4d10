"""transformers internals longft uses, and the helpers that use them.

- `config._attn_implementation`: which attention function the model runs (read everywhere; set by
  the loader and by longft's packed attention).
- `layer._gradient_checkpointing_func`: the checkpoint function transformers' checkpointed layers
  call; longft wraps it (checkpoint offload, keep_attention).
- `modeling_utils.ALL_ATTENTION_FUNCTIONS`: the registered attention functions (Ulysses wraps
  longft's packed one).
- a model module's `apply_rotary_pos_emb`: recorded in the plan (which RoPE runs). From 5.25 (with
  the `kernels` package installed) `@use_kernel_forward_from_hub` makes it an nn.Module instance
  that calls the function as its `forward`.
"""

from __future__ import annotations

import importlib

from longft.compat import Access

ACCESSES = (
    Access("always", "transformers.configuration_utils", "_attn_implementation",
           owner="PreTrainedConfig"),
    Access("checkpoint_function", "transformers.modeling_utils", "_gradient_checkpointing_func",
           kind="source"),
    Access("sequence_parallel", "transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
)


def attn_implementation(config) -> str | None:
    """The attention implementation a model config runs (None for a config without one)."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config, name: str) -> None:
    config._attn_implementation = name


def attention_function(name: str):
    """The attention function registered under `name`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def checkpoint_function(layer):
    """The function a checkpointed layer runs its forward through."""
    return layer._gradient_checkpointing_func


def set_checkpoint_function(layer, fn) -> None:
    layer._gradient_checkpointing_func = fn


def function_name(fn) -> str:
    """module.qualname of a function, of the function an nn.Module wraps as its forward (a
    `@use_kernel_forward_from_hub` function, transformers 5.25), or of any other callable's type."""
    import torch

    if isinstance(fn, torch.nn.Module):
        fn = type(fn).forward
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', type(fn).__module__)}.{name}"


def rotary_function(model) -> str:
    """Which RoPE function the model's module calls (Liger replaces it), or "n/a"."""
    mod = importlib.import_module(type(model).__module__)
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    return function_name(fn) if fn is not None else "n/a"

"""The architecture numbers of a model config that the plan, the estimator and the FLOPs count
read, and the one rule for the two a config may leave out (head_dim, num_key_value_heads)."""

from __future__ import annotations

from typing import Optional

ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "tie_word_embeddings", "max_position_embeddings", "attention_bias", "mlp_bias")


def attention_dims(hidden_size: int, num_attention_heads: int, head_dim: Optional[int] = None,
                   num_key_value_heads: Optional[int] = None) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of a config. Left out, head_dim is hidden_size / heads
    (how transformers' Llama, Mistral and Qwen2 build their projections) and there is one K/V head
    per query head (multi-head attention, no grouping)."""
    d = int(head_dim) if head_dim is not None else int(hidden_size) // int(num_attention_heads)
    kv = int(num_key_value_heads) if num_key_value_heads is not None else int(num_attention_heads)
    return d, kv


def text_config(model_config):
    """The language model's config: a multimodal config's nested text config, else the config."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def architecture(model_config) -> dict:
    """ARCH_KEYS of a transformers config (None where it has no such attribute), with head_dim and
    num_key_value_heads filled in by `attention_dims` (plan.json's model_config)."""
    arch = {k: getattr(model_config, k, None) for k in ARCH_KEYS}
    arch["head_dim"], arch["num_key_value_heads"] = attention_dims(
        arch["hidden_size"], arch["num_attention_heads"], arch["head_dim"],
        arch["num_key_value_heads"])
    return arch


def is_lora_target(name: str, targets) -> bool:
    """LoRA's target rule, written once (patch stage, QLoRA's quantizer, the estimator): the module
    whose last name part is one of `targets` (peft's target_modules given as a list of names)."""
    return name.rsplit(".", 1)[-1] in targets

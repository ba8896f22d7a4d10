"""Apply the resolved kernels and checkpointing to a model instance, and record what changed.

The patch stage runs `apply()` on a meta-device copy of the model (no memory) to write the record
into artifacts/plan.json; the train stage runs the same function on the real model and checks that
the same modules were replaced.
"""

from __future__ import annotations

from collections import Counter
from types import MethodType

from longft.compat import liger as liger_compat
from longft.compat import transformers as tf_compat
from longft.config.plan import Resolved
from longft.config.sections import Config
from longft.errors import UserError
from longft.model import attention, packed_attention
from longft.model.architecture import text_config
from longft.model.tiled_mlp import decoder_layers, skips_recompute
from longft.model.tiled_mlp import tile_mlps as tiled_mlps


class PatchError(UserError, ValueError):
    """A knob this model or checkpointing mode cannot take; the message says what to change."""


def _replaced_modules(model) -> dict[str, int]:
    """Modules whose forward now comes from somewhere else, counted by 'Original->New' name."""
    seen: Counter = Counter()
    for _, m in model.named_modules():
        new = m._get_name()
        old = type(m).__name__
        if new != old:
            seen[f"{old}->{new}"] += 1
    return dict(sorted(seen.items()))


def _forward_owner(model) -> str:
    fwd = model.forward
    return tf_compat.function_name(fwd.__func__ if isinstance(fwd, MethodType) else fwd)


def apply_liger(model) -> None:
    """Liger RMSNorm, RoPE, SwiGLU and fused linear cross-entropy on this instance."""
    liger_compat.apply_to_instance(model)


def attention_window(model_config) -> int | None:
    """The model's sliding attention window in tokens (Mistral v0.1, Gemma 3's local layers, Qwen2
    with use_sliding_window), or None: flash-attn-4 through longft's attention function does not
    apply it, transformers' own SDPA path does (with its mask)."""
    text = text_config(model_config)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def attention_softcap(model_config) -> float | None:
    """The model's attention logit softcapping (Gemma 2: attn_logit_softcapping = 50), or None.
    scores = cap * tanh(scores / cap) before the softmax: eager and FlashAttention-2 apply it;
    SDPA and longft's packed attention (which runs SDPA or varlen_attn) cannot."""
    text = text_config(model_config)
    cap = getattr(text, "attn_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and cap else None


def _check_softcap(model, packed: str) -> None:
    """A softcapping model never runs on a kernel that drops the cap (a plan.json written before
    the attention policy knew about it, or a model that changed under it)."""
    cap = attention_softcap(model.config)
    impl = tf_compat.attn_implementation(model.config)
    if cap and (packed in packed_attention.KERNELS or impl in ("sdpa", packed_attention.NAME)):
        what = (f"kernels.packed_attention {packed} (SDPA per document / varlen_attn / flash-attn-4)"
                if packed in packed_attention.KERNELS else f"attention {impl}")
        raise PatchError(f"the model softcaps attention logits (attn_logit_softcapping {cap:g}), "
                         f"which {what} cannot apply; set kernels.attention: auto (eager or "
                         "flash_attention_2) and kernels.packed_attention: auto, and re-run the "
                         "patch stage")


def rope_function(model) -> str:
    """Which RoPE function the model runs (compat/transformers.py: a function, or from
    transformers 5.25 a hub-kernel module wrapping it)."""
    return tf_compat.rotary_function(model)


def apply_resolved(model, resolved: Resolved, cfg: Config) -> dict:
    """`apply` as a run does it: each `auto` as resolved (plan.resolved in the train stage,
    hardware.resolve's choices in the patch stage), the other knobs from params."""
    return apply(model, liger=resolved.liger.value, checkpointing=resolved.checkpointing.value,
                 sdpa_backend=resolved.sdpa_backend.value, tiled_mlp=resolved.tiled_mlp.value,
                 tile_tokens=cfg.kernels.tiled_mlp_tokens,
                 keep_attention=cfg.checkpointing.keep_attention,
                 packed=resolved.packed_attention.value, attention_kernel=resolved.attention.value)


def apply(model, *, liger: bool, checkpointing: str, sdpa_backend: str = "default",
          tiled_mlp: bool = False, tile_tokens: int = 8192, keep_attention: int = 0,
          packed: str = "none", attention_kernel: str = "sdpa") -> dict:
    """Patch `model` in place; return the record of what was actually replaced. The knobs are the
    resolved values (`apply_resolved` reads them from the plan). `packed` is the resolved
    kernels.packed_attention: varlen / per_document / flash_attn_4 install longft's per-document
    attention (model/packed_attention.py); the other values leave attention as it is.
    `attention_kernel` is the resolved kernels.attention: flash_attn_4 installs flash-attn-4 for
    every row."""
    _check_softcap(model, packed)
    if liger:
        apply_liger(model)
    # after Liger: tiles run Liger's SwiGLU MLP; checkpointing here is always non-reentrant
    skip = skips_recompute(checkpointing, getattr(model.config, "model_type", None))
    tiled = tiled_mlps(model, tile_tokens, skip_recompute=skip) if tiled_mlp else 0
    if sdpa_backend == "efficient":
        attention.expand_kv_heads()
    model.config.use_cache = False
    if checkpointing in ("gpu", "cpu_offload"):
        # Non-reentrant: works with transformers 5 layers that return tensors, and with ZeRO-3.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kept = _keep_attention(model, checkpointing, keep_attention, sdpa_backend)
    if attention_kernel == "flash_attn_4":
        packed_attention.install(model, "flash_attn_4", single_documents=True)
    elif packed in packed_attention.KERNELS:
        packed_attention.install(model, packed)
    return {
        "liger": liger,
        "replaced_modules": _replaced_modules(model),
        "forward": _forward_owner(model),
        "rotary": rope_function(model),
        "loss": "liger_fused_linear_cross_entropy" if liger else "transformers_cross_entropy",
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "sdpa_kernels": attention.priority(sdpa_backend) if sdpa_backend != "default" else "default",
        "gqa": "repeat_kv" if sdpa_backend == "efficient" else "enable_gqa",
        "tiled_mlp_layers": tiled,
        "attention_kept_layers": kept,
        "packed_attention": packed,
        # cuDNN's ragged path for per-document calls (packed_attention.CUDNN_RAGGED_ENV)
        "cudnn_ragged": packed_attention.cudnn_ragged(),
        "attn_implementation": tf_compat.attn_implementation(model.config),
    }


def _keep_attention(model, checkpointing: str, n: int, sdpa_backend: str = "default") -> int:
    """checkpointing.keep_attention (keep_attention.py), with its preconditions checked."""
    if n <= 0:
        return 0
    layers = decoder_layers(model)
    impl = tf_compat.attn_implementation(model.config)
    if checkpointing not in ("gpu", "cpu_offload"):
        raise PatchError(f"checkpointing.keep_attention is {n} but checkpointing is {checkpointing}:"
                         " nothing is recomputed; set it to 0 or checkpoint (gpu or cpu_offload)")
    if n > len(layers):
        raise PatchError(f"checkpointing.keep_attention is {n} but the model has {len(layers)} "
                         f"decoder layers; use at most {len(layers)}")
    if not attention.fused_kernel(impl, sdpa_backend):
        what = "sdpa_backend math" if impl == "sdpa" else impl
        raise PatchError(f"checkpointing.keep_attention needs a fused attention kernel (kernels."
                         f"attention sdpa with sdpa_backend other than math, flash_attn_4 or "
                         f"flash_attention_2) "
                         f"whose outputs can be kept, not {what}; set it to 0 or change the kernel")
    from longft.model.keep_attention import flash_attn_ops, keep_outputs

    if getattr(model.config, "attention_dropout", 0.0):
        raise PatchError(f"checkpointing.keep_attention needs attention_dropout 0 (the model's is "
                         f"{model.config.attention_dropout}): a skipped kernel would not advance the "
                         "random state, and the recompute's later dropout masks would differ; set "
                         "it to 0 or set attention_dropout 0 in the model config")
    if impl == "flash_attention_2" and not flash_attn_ops():
        raise PatchError("checkpointing.keep_attention with flash_attention_2 needs flash-attn 2.7 "
                         "or later (its kernels as torch ops); upgrade flash-attn, use kernels."
                         "attention sdpa, or set it to 0")
    return keep_outputs(layers, n)


def offload_checkpoints(model, gpu_layers: int = 0, prefetch: bool = True):
    """For checkpointing cpu_offload: route the decoder layers' checkpoints through pinned host
    memory (all but the last `gpu_layers`); returns the `offload.CheckpointOffload` to step."""
    from longft.model.checkpoint_offload import CheckpointOffload

    layers = decoder_layers(model)
    if gpu_layers > len(layers):
        raise PatchError(f"checkpointing.gpu_layers is {gpu_layers} but the model has "
                         f"{len(layers)} decoder layers; use at most {len(layers)}")
    return CheckpointOffload(layers, gpu_layers, prefetch=prefetch)


def zero3_gather_lm_head(model) -> bool:
    """Let the fused loss see lm_head's weight under ZeRO-3.

    Liger's fused linear cross-entropy reads `lm_head.weight` inside the model's forward without
    calling lm_head's own forward, so ZeRO-3 never gathers it (a zero-element weight, a crash).
    Registering it as an external parameter of the top module makes ZeRO-3 gather it for the whole
    forward and backward of that module.
    """
    import deepspeed

    head = model.get_output_embeddings()
    if head is None or not hasattr(head.weight, "ds_id"):
        return False
    deepspeed.zero.register_external_parameter(model, head.weight)
    return True

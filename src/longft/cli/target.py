"""What `longft estimate`, `placement` and `max-context` estimate for: the model's architecture numbers,
and every `auto` resolved for a GPU (this machine's, or an Ampere-or-newer one when estimating from a
machine without one)."""

from __future__ import annotations

import dataclasses


def architecture_of(model_cfg) -> dict:
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config

    return architecture(load_model_config(model_cfg))


def within_positions(model_cfg, seq: int, arg: str) -> None:
    """Refuse (UserError) a sequence length the model's positions do not cover, with the range
    and the way to longer positions (RoPE scaling in the model's config), before any search."""
    from longft.errors import UserError
    from longft.model.loading import load_model_config, position_limit

    limit = position_limit(load_model_config(model_cfg))
    if limit is not None and seq > limit:
        raise UserError(
            f"{arg} {seq:,} is past the {limit:,} positions model {model_cfg.name!r} covers: give "
            f"{arg} from 1 to {limit:,}, or use a model with longer positions or RoPE scaling "
            f"(rope_scaling with rope_type yarn/linear/dynamic and a factor in its config.json); "
            f"the patch stage refuses a longer data.max_seq_length")


def blocks_fit(cfg, arch: dict) -> None:
    """Refuse (UserError) sparse.* blocks the model's linears cannot be cut into (a block size
    that does not divide them, more blocks than the smallest holds), as the patch stage would,
    before an estimate or a search plans for them."""
    from longft.config.block_sparse import shape_problems
    from longft.errors import UserError
    from longft.estimate.arch import linear_shapes

    bad = shape_problems(cfg, linear_shapes(arch))
    if bad:
        raise UserError("; ".join(bad) + " (the patch stage refuses these blocks)")


def target_hardware(hw, num_gpus: int):
    """The hardware to resolve `auto` against: this machine's GPU, or, estimating from a machine
    without one, an Ampere-or-newer GPU with Liger installed (said in the output)."""
    from longft.hardware import Hardware

    if hw.device == "cuda":
        return dataclasses.replace(hw, gpu_count=max(hw.gpu_count, num_gpus)), None
    return (Hardware(device="cuda", gpu_name=None, gpu_count=num_gpus, capability=(8, 0),
                     host_mem_gib=hw.host_mem_gib, cpu_count=hw.cpu_count,
                     flash_attn=hw.flash_attn, liger=True),
            "no GPU here: auto values resolved for an Ampere-or-newer GPU with Liger installed")


def resolve_on_gpu(cfg, hw, model_type: str) -> tuple[dict, list[str]]:
    """hardware.resolve's values for cfg on a GPU (see target_hardware)."""
    from longft.hardware import resolve

    target, note = target_hardware(hw, cfg.hardware.num_gpus)
    notes = [note] if note else []
    c = cfg
    if cfg.hardware.device == "cpu":
        notes.append("hardware.device is cpu: estimated as the same run on a GPU")
        c = dataclasses.replace(c, hardware=dataclasses.replace(c.hardware, device="auto"))
    # a softcapping model (Gemma 2) resolves to the attention the run will take (not SDPA)
    # hardware.sequence_parallel must divide the model's heads (refused here as in the patch stage)
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config
    from longft.model.patches import attention_softcap, attention_window

    mc = load_model_config(cfg.model)
    arch = architecture(mc)
    choices = resolve(c, target, model_type, attention_softcap(mc),
                      (arch["num_attention_heads"], arch["num_key_value_heads"]),
                      window=attention_window(mc))
    return {k: ch.value for k, ch in choices.items()}, notes

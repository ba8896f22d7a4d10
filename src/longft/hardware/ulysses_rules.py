"""What hardware.sequence_parallel (DeepSpeed Ulysses, engine/ulysses.py) can run with,
checked up front with the resolved kernels and the model's head counts; each problem says why and
what to change. The range checks (N divides num_gpus and max_seq_length) are in config/checks.py (_hardware).
"""

from __future__ import annotations

from longft.config.params import Config


def problems(cfg: Config, attention: str, packed: str, heads: int | None = None,
             kv_heads: int | None = None) -> list[str]:
    """Why hardware.sequence_parallel N > 1 cannot run as asked ([] = it can). attention / packed:
    the resolved kernels.attention and kernels.packed_attention; heads / kv_heads: the model's
    attention and key/value head counts (None: not known here, checked when they are)."""
    n = cfg.hardware.sequence_parallel
    if n <= 1:
        return []
    out: list[str] = []
    key = f"hardware.sequence_parallel {n}"
    if heads is not None and heads % n:
        out.append(f"{key}: the model has {heads} attention heads, not divisible by {n} (Ulysses "
                   f"gives each rank heads / N of them); set sequence_parallel to a divisor of {heads}")
    if kv_heads is not None and kv_heads % n and n % kv_heads:
        out.append(f"{key}: the model has {kv_heads} key/value heads; Ulysses needs them divisible by "
                   f"{n} or {n} divisible by them (then they are replicated); change sequence_parallel")
    if attention == "eager" or packed == "mask":
        what = "eager attention" if attention == "eager" else "kernels.packed_attention mask"
        out.append(f"{key} cannot run with {what}: Ulysses drops the [seq x seq] mask (DeepSpeed "
                   "refuses eager, ulysses_sp.py register_with_transformers); use kernels.attention "
                   "sdpa or flash_attention_2 and kernels.packed_attention auto")
    if cfg.zero.stage != 3:
        out.append(f"{key} is built and tested with ZeRO-3 only (zero.stage is {cfg.zero.stage}); "
                   "set zero.stage: 3")
    if cfg.checkpointing.keep_attention:
        out.append(f"{key} with checkpointing.keep_attention {cfg.checkpointing.keep_attention} is "
                   "not supported yet (the kept kernels would replay across the all-to-all, "
                   "untested); set keep_attention: 0")
    return out

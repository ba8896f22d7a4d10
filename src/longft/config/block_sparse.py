"""The rules of block-sparse finetuning (`sparse.*`), written once: what its knobs must be and what
it cannot be combined with. checks._sparse runs `problems`; the patch stage runs `shape_problems`
on the meta model (before any weight is read)."""

from __future__ import annotations

import math

from longft.config.sections import Config


def enabled(cfg: Config) -> bool:
    return cfg.sparse.blocks > 0


def problems(cfg: Config) -> list[str]:
    """Ranges of sparse.*, and the combinations that cannot run; each message names the fix."""
    s, p = cfg.sparse, []
    if s.blocks < 0:
        p.append(f"sparse.blocks: must be >= 0 (0 = off), got {s.blocks}")
    if s.block_size < 1:
        p.append(f"sparse.block_size: must be >= 1, got {s.block_size}")
    if s.warmup_steps < 1:
        p.append(f"sparse.warmup_steps: must be >= 1 (micro-batches of full gradients that pick "
                 f"the blocks), got {s.warmup_steps}")
    if not enabled(cfg):
        return p
    if not s.target_modules:
        p.append("sparse.target_modules: must name at least one module when sparse.blocks > 0")
    if cfg.lora.rank > 0:
        p.append(f"sparse.blocks ({s.blocks}) and lora.rank ({cfg.lora.rank}) are two ways of "
                 "training a few parameters; pick one: set sparse.blocks: 0 or lora.rank: 0")
    if cfg.hardware.sequence_parallel > 1:
        p.append(f"sparse.blocks: block-sparse finetuning does not run with "
                 f"hardware.sequence_parallel {cfg.hardware.sequence_parallel} (the warm-up reads "
                 "whole rows); set hardware.sequence_parallel: 1 or sparse.blocks: 0")
    if cfg.output.export_lora != "adapter":
        p.append(f"output.export_lora: {cfg.output.export_lora} applies to LoRA; block-sparse "
                 "finetuning always exports the blocks merged into the weights: set it to adapter")
    return p + warmup_problems(cfg)


def shape_problems(cfg: Config, linears: dict[str, tuple[int, int]]) -> list[str]:
    """What sparse.* asks of the model's linear layers: `linears` maps each module name of the
    model to its (in_features, out_features). Every target name must match, block_size must
    divide both sides, and blocks must not exceed the blocks of the smallest target."""
    s = cfg.sparse
    if not enabled(cfg) or s.block_size < 1:
        return []
    p = []
    hit = {n: io for n, io in linears.items() if n.rsplit(".", 1)[-1] in s.target_modules}
    missing = sorted(set(s.target_modules) - {n.rsplit(".", 1)[-1] for n in hit})
    if missing:
        p.append(f"sparse.target_modules: {', '.join(missing)} match(es) no linear layer of the "
                 f"model; use names of its linear layers (e.g. "
                 f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears})[:8])})")
    b = s.block_size
    bad = sorted({f"{n.rsplit('.', 1)[-1]} [{o} x {i}]" for n, (i, o) in hit.items()
                  if i % b or o % b})
    if bad:
        common = math.gcd(*(d for io in hit.values() for d in io))
        sizes = [d for d in (128, 64, 32, 16, 8, 4, 2, 1) if common % d == 0][:3]
        p.append(f"sparse.block_size: {b} does not divide the shape of {', '.join(bad)}; pick a "
                 f"block size that divides every target's in and out features: "
                 f"{' or '.join(map(str, sizes))} (their largest common divisor is {common})")
    elif hit:
        name, (i, o) = min(hit.items(), key=lambda kv: (kv[1][0] // b) * (kv[1][1] // b))
        fewest = (i // b) * (o // b)
        if s.blocks > fewest:
            p.append(f"sparse.blocks: {s.blocks} exceeds the {fewest} blocks of {b} x {b} of the "
                     f"smallest target, {name.rsplit('.', 1)[-1]} [{o} x {i}]; set sparse.blocks "
                     f"<= {fewest}, or leave that module out of sparse.target_modules")
    return p


def warmup_problems(cfg: Config) -> list[str]:
    """A warm-up longer than the run it picks blocks for (train.iterations set): it would read
    rows again and take longer than the training."""
    s, t = cfg.sparse, cfg.train
    if not enabled(cfg) or not t.iterations:
        return []
    micro = t.iterations * max(1, cfg.grad_accum_steps)
    if s.warmup_steps > micro:
        return [f"sparse.warmup_steps: {s.warmup_steps} micro-batches of full gradients is longer "
                f"than the run it picks blocks for ({t.iterations} steps x "
                f"{micro // t.iterations} micro-batch(es) = {micro}); set sparse.warmup_steps "
                f"<= {micro}, or train longer"]
    return []


def trainable(cfg: Config, n_matrices: int) -> int:
    """Parameters block-sparse finetuning trains over `n_matrices` target matrices."""
    return cfg.sparse.blocks * cfg.sparse.block_size ** 2 * n_matrices

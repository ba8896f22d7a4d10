"""Predict before you run: `longft estimate`, `longft plan` and `longft max-context`.

    longft estimate [--params params.yaml] [--gpu-mem GiB] [--host-mem GiB]
    longft plan --gpu-mem 80 --host-mem 256 --gpus 1 --model llama3.1-8b --seq 65536 [--out overlay.yaml]
    longft max-context [--params params.yaml] [--gpu-mem GiB] [--host-mem GiB]

(`longft` is the console script of longft.cli, which hands these commands to `main(command, argv)`;
`python -m longft.cli estimate ...` works without installing it.)

estimate: the itemised memory table of a params file; exit 0 when it fits, 1 when it does not.
plan: the fastest placement that fits (offload x checkpointing x micro-batch), written as a params
overlay; exit 1 with the closest candidate's numbers when nothing fits.
max-context: the longest sequence (a multiple of 1024) that fits, by binary search; the lead
confirms it with short real runs at `candidates_for_confirmation()`.
GPU and host sizes default to the detected hardware; the flags override. Formulas, calibration and
the speed heuristic: docs/estimator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from .estimate import GIB, Estimate, Fit, Setup, describe, estimate, fits, format_table, setup_from_config

SEQ_STEP = 1024

# ---------------------------------------------------------------- speed heuristic (plan ranking)
ACHIEVED_FRACTION = 0.5
"""Fraction of the dense peak that matmuls reach, recompute included (H200 rows: 0.39 MFU x 4/3)."""
UNKNOWN_PEAK_FLOPS = 312e12
"""Dense bf16 peak assumed when the GPU is not in flops.PEAK_TFLOPS (an A100)."""
MICRO_OVERHEAD_TOKENS = 2048
"""Fixed cost of one micro-step (launches, hooks, syncs) in token-equivalents of compute."""
HOST_LINK_BYTES_PER_S = 20e9
"""Effective PCIe bandwidth for parameter fetches, gradient and checkpoint copies."""
EXPOSED_FRACTION = 0.5
"""Share of host<->GPU copy time not hidden behind compute."""
CPU_ADAM_PARAMS_PER_S = 2.2e9
"""DeepSpeedCPUAdam speed (H200 row b: 1.24e9 parameters in 0.55 s on 16 cores)."""
GPU_ADAM_BYTES_PER_S = 1.5e12
"""Fused Adam on the GPU: 16 B read+written per parameter at about this rate."""


def step_seconds(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted seconds of one optimizer step (grad_accum micro-steps) on one rank."""
    from .flops import flops_per_token, peak_flops

    T = s.micro_batch * s.seq_len
    w = 4 if s.precision == "fp32" else 2
    P_r = sum(n for _, n in _params(arch)) / s.world_size
    peak = peak_flops(gpu_name, s.precision) or UNKNOWN_PEAK_FLOPS
    recompute = 1.0 if s.checkpointing == "none" else 4 / 3
    micro = T * flops_per_token(arch, s.seq_len) * recompute / (ACHIEVED_FRACTION * peak)
    micro *= 1 + MICRO_OVERHEAD_TOKENS / T
    if s.offload_param:      # fetch every layer for forward, recompute and backward
        micro += EXPOSED_FRACTION * 3 * w * P_r / HOST_LINK_BYTES_PER_S
    if s.checkpointing == "cpu_offload":
        micro += EXPOSED_FRACTION * 2 * arch["num_hidden_layers"] * T * arch["hidden_size"] * w \
            / HOST_LINK_BYTES_PER_S
    if s.offload_optimizer:
        opt = P_r / CPU_ADAM_PARAMS_PER_S + w * P_r / HOST_LINK_BYTES_PER_S
    else:
        opt = 16 * P_r / GPU_ADAM_BYTES_PER_S
    return s.grad_accum * micro + opt


def tokens_per_second(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted tokens/s of the whole job (all ranks)."""
    return s.world_size * s.grad_accum * s.micro_batch * s.seq_len / step_seconds(arch, s, gpu_name)


def _params(arch):
    from .estimate import param_numels
    return param_numels(arch)


# ---------------------------------------------------------------- shared pieces


def candidates_for_confirmation(max_seq: int, rel_error: float = 0.10, step: int = SEQ_STEP,
                                n: int = 2, limit: int | None = None) -> list[int]:
    """Sequence lengths to try on the real GPU around the estimator's longest fitting one.

    The estimator is good to about `rel_error`, so the true boundary lies within
    max_seq x (1 +- rel_error): 2n + 1 points across that band, multiples of `step`, ascending.
    Run each for a few iterations from the longest down; the first that completes is the maximum.
    `limit` (the model's max_position_embeddings) caps the list.
    """
    pts = {max(step, round(max_seq * (1 + rel_error * i / n) / step) * step) for i in range(-n, n + 1)}
    return sorted(p for p in pts if limit is None or p <= limit)


def _architecture(model_cfg) -> dict:
    from .model import load_model_config
    from .plan import architecture

    return architecture(load_model_config(model_cfg))


def _target_hardware(hw, num_gpus: int):
    """The hardware to resolve `auto` against: this machine's GPU, or, planning from a machine
    without one, an Ampere-or-newer GPU with Liger installed (said in the output)."""
    from .hardware import Hardware

    if hw.device == "cuda":
        return dataclasses.replace(hw, gpu_count=max(hw.gpu_count, num_gpus)), None
    return (Hardware(device="cuda", gpu_name=None, gpu_count=num_gpus, capability=(8, 0),
                     host_mem_gib=hw.host_mem_gib, cpu_count=hw.cpu_count,
                     flash_attn=hw.flash_attn, liger=True),
            "no GPU here: auto values resolved for an Ampere-or-newer GPU with Liger installed")


def _resolve(cfg, hw, model_type: str) -> tuple[dict, list[str]]:
    """hardware.resolve's values for cfg on a GPU (see _target_hardware). A checkpointing mode this
    version refuses to run (cpu_offload) is still estimated; the note says so."""
    from .hardware import PlanError, resolve

    target, note = _target_hardware(hw, cfg.hardware.num_gpus)
    notes = [note] if note else []
    c = cfg
    if cfg.hardware.device == "cpu":
        notes.append("hardware.device is cpu: estimated as the same run on a GPU")
        c = dataclasses.replace(c, hardware=dataclasses.replace(c.hardware, device="auto"))
    try:
        choices = resolve(c, target, model_type)
    except PlanError:
        if c.checkpointing.mode != "cpu_offload":
            raise
        c = dataclasses.replace(c, checkpointing=dataclasses.replace(c.checkpointing, mode="gpu"))
        choices = resolve(c, target, model_type)
        choices["checkpointing"] = dataclasses.replace(choices["checkpointing"], value="cpu_offload")
        notes.append("checkpointing cpu_offload is estimated, but this version's patch stage refuses it")
    return {k: ch.value for k, ch in choices.items()}, notes


def _cpu_offload_refusal(cfg, hw, model_type: str) -> str | None:
    """Why the patch stage would refuse checkpointing cpu_offload here, or None if it runs."""
    from .hardware import PlanError, resolve

    target, _ = _target_hardware(hw, cfg.hardware.num_gpus)
    c = dataclasses.replace(cfg, checkpointing=dataclasses.replace(cfg.checkpointing, mode="cpu_offload"),
                            hardware=dataclasses.replace(cfg.hardware, device="auto"))
    try:
        resolve(c, target, model_type)
    except PlanError as e:
        return "; ".join(p for p in e.problems if "cpu_offload" in p) or None
    return None


def _sizes(a, hw) -> tuple[float | None, float | None]:
    gpu = a.gpu_mem if a.gpu_mem is not None else hw.gpu_mem_gib
    host = a.host_mem if a.host_mem is not None else (hw.host_mem_gib or None)
    return gpu, host


def _load(params: str):
    from .config import load

    return load(params)


# ---------------------------------------------------------------- estimate


def cmd_estimate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longft estimate",
                                 description="Itemised peak VRAM / DRAM prediction for a params file.")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu-mem", type=float, help="GiB of one GPU (default: detected)")
    ap.add_argument("--host-mem", type=float, help="GiB of host RAM per node (default: detected)")
    a = ap.parse_args(argv)
    from .hardware import detect

    cfg = _load(a.params)
    hw = detect()
    arch = _architecture(cfg.model)
    resolved, notes = _resolve(cfg, hw, arch["model_type"])
    est = estimate(arch, setup_from_config(cfg, resolved))
    gpu_mem, host_mem = _sizes(a, hw)
    fit = fits(est, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)
    print(f"longft estimate: {cfg.model.name} ({a.params})")
    for n in notes:
        print(f"note: {n}")
    if gpu_mem is None:
        print("note: no GPU size to compare with; pass --gpu-mem")
    print(format_table(est, fit))
    return 0 if fit.ok else 1


# ---------------------------------------------------------------- plan

OFFLOADS = {"none": (False, False), "opt": (True, False), "opt+param": (True, True)}
MODES = ("none", "gpu", "cpu_offload")


@dataclasses.dataclass(frozen=True)
class Candidate:
    setup: Setup
    est: Estimate
    fit: Fit
    tokens_per_s: float
    offload: str

    @property
    def gpu_need(self) -> int:
        return self.est.gpu_nvml

    def overshoot(self, gpu_mem_gib: float, host_mem_gib: float) -> float:
        """How far over the memory it is (1.0 = exactly full); the larger of GPU and host."""
        return max(self.est.gpu_nvml / (gpu_mem_gib * GIB), self.est.host_rss / (host_mem_gib * GIB))


def search(arch: dict, base: Setup, gpu_mem_gib: float, host_mem_gib: float, gpu_name: str | None,
           max_micro: int = 64, modes: tuple[str, ...] = MODES) -> list[Candidate]:
    """Every ZeRO-3 candidate (offload x checkpointing x micro-batch 1..max_micro) that fits, and
    for each offload x mode that fits at no micro-batch its micro-batch-1 candidate (not fitting).
    Memory grows with the micro-batch, so each scan stops at the first that does not fit."""
    out = []
    for off, (opt, param) in OFFLOADS.items():
        for mode in modes:
            for m in range(1, max_micro + 1):
                s = dataclasses.replace(base, micro_batch=m, checkpointing=mode, zero_stage=3,
                                        offload_optimizer=opt, offload_param=param, grad_accum=1)
                e = estimate(arch, s)
                f = fits(e, gpu_mem_gib, host_mem_gib)
                if f.ok or m == 1:
                    out.append(Candidate(s, e, f, tokens_per_second(arch, s, gpu_name), off))
                if not f.ok:
                    break
    return out


def best(cands: list[Candidate], within: float = 0.02) -> Candidate | None:
    """The fastest fitting candidate; among those within `within` of the fastest, the one needing
    the least GPU memory (a larger micro-batch only helps up to a point, headroom always does)."""
    ok = [c for c in cands if c.fit.ok]
    if not ok:
        return None
    top = max(c.tokens_per_s for c in ok)
    near = [c for c in ok if c.tokens_per_s >= (1 - within) * top]
    return min(near, key=lambda c: (c.gpu_need, -c.tokens_per_s))


def overlay(model: str, c: Candidate, gpus: int, shipped: bool) -> dict:
    """The params overlay for a candidate (merge onto params.yaml)."""
    s = c.setup
    opt, param = OFFLOADS[c.offload]
    model_sec = {"name": model, **({"source": "random"} if shipped else {})}
    return {
        "model": model_sec,
        "data": {"max_seq_length": s.seq_len},
        "hardware": {"num_gpus": gpus},
        "checkpointing": {"mode": s.checkpointing},
        "zero": {"stage": 3, "offload_optimizer": "cpu" if opt else "none",
                 "offload_param": "cpu" if param else "none"},
        "train": {"micro_batch_size": s.micro_batch, "global_batch_size": s.micro_batch * gpus},
    }


def cmd_plan(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longft plan",
                                 description="Fastest placement that fits, as a params overlay.")
    ap.add_argument("--gpu-mem", type=float, required=True, help="GiB of one GPU")
    ap.add_argument("--host-mem", type=float, required=True, help="GiB of host RAM")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--model", required=True, help="a name in configs/models or a config path")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--out", help="write the overlay YAML here")
    ap.add_argument("--params", default="params.yaml",
                    help="base params (precision, kernels, LoRA); defaults if the file is absent")
    ap.add_argument("--max-micro", type=int, default=64)
    ap.add_argument("--gpu-name", help="GPU model for the peak-FLOPS lookup of the speed ranking "
                    "(default: the detected one)")
    a = ap.parse_args(argv)
    import yaml

    from .config import ConfigError, from_dict, merge
    from .hardware import detect
    from .model import shipped_architectures

    base_raw = {}
    if Path(a.params).is_file():
        base_raw = yaml.safe_load(Path(a.params).read_text()) or {}
    # an architecture (shipped name or config.json) is a random-init run; anything else keeps the
    # base params' model.source (a pretrained hub id or directory)
    shipped = a.model in shipped_architectures() or Path(a.model).suffix == ".json"
    over = {"model": {"name": a.model, **({"source": "random"} if shipped else {})},
            "data": {"max_seq_length": a.seq}, "hardware": {"num_gpus": a.gpus},
            "train": {"micro_batch_size": 1, "global_batch_size": a.gpus}}
    try:
        cfg = from_dict(merge(base_raw, over), a.params)
    except ConfigError as e:
        print(f"longft plan: {e}", file=sys.stderr)
        return 2
    hw = detect()
    arch = _architecture(cfg.model)
    resolved, notes = _resolve(cfg, hw, arch["model_type"])
    modes = MODES
    refusal = _cpu_offload_refusal(cfg, hw, arch["model_type"])
    if refusal:
        modes = tuple(m for m in MODES if m != "cpu_offload")
        notes.append(f"checkpointing cpu_offload left out of the search: {refusal}")
    base = setup_from_config(cfg, resolved)
    gpu_name = a.gpu_name or (hw.gpu_name if hw.device == "cuda" else None)
    cands = search(arch, base, a.gpu_mem, a.host_mem, gpu_name, a.max_micro, modes)
    print(f"longft plan: {a.model}, seq {a.seq:,}, {a.gpus} GPU(s) of {a.gpu_mem:g} GiB, "
          f"host {a.host_mem:g} GiB")
    for n in notes:
        print(f"note: {n}")
    ok = sorted((c for c in cands if c.fit.ok), key=lambda c: -c.tokens_per_s)
    print(f"{len(ok)} fitting candidate(s); fastest per offload x checkpointing:")
    seen = set()
    for c in ok:
        if (c.offload, c.setup.checkpointing) not in seen:
            seen.add((c.offload, c.setup.checkpointing))
            print(f"  offload {c.offload:9s} checkpointing {c.setup.checkpointing:11s} micro-batch "
                  f"{c.setup.micro_batch:3d}: ~{c.tokens_per_s:,.0f} tok/s, GPU "
                  f"{c.est.gpu_nvml / GIB:.1f} GiB, host {c.est.host_rss / GIB:.1f} GiB")
    choice = best(cands)
    if choice is None:
        closest = min(cands, key=lambda c: c.overshoot(a.gpu_mem, a.host_mem))
        print(f"\nnothing fits. Closest: offload {closest.offload}, checkpointing "
              f"{closest.setup.checkpointing}, micro-batch 1:")
        print(format_table(closest.est, closest.fit))
        return 1
    print(f"\nchosen: offload {choice.offload}, checkpointing {choice.setup.checkpointing}, "
          f"micro-batch {choice.setup.micro_batch} (~{choice.tokens_per_s:,.0f} tok/s predicted)")
    print(format_table(choice.est, choice.fit))
    ov = overlay(a.model, choice, a.gpus, shipped)
    if a.out:
        from .atomic import write_text

        head = (f"# longft plan: {describe(choice.setup)}\n"
                f"# predicted: VRAM {choice.est.gpu_allocated / GIB:.2f} GiB allocated, "
                f"{choice.est.gpu_nvml / GIB:.2f} GiB NVML; host {choice.est.host_rss / GIB:.2f} GiB; "
                f"~{choice.tokens_per_s:,.0f} tok/s\n")
        write_text(Path(a.out), head + yaml.safe_dump(ov, sort_keys=False))
        print(f"\nwrote {a.out}")
    else:
        print("\n" + yaml.safe_dump(ov, sort_keys=False))
    return 0


# ---------------------------------------------------------------- max-context


def max_context(arch: dict, base: Setup, gpu_mem_gib: float | None, host_mem_gib: float | None,
                vram_limit_gib: float | None = None, max_seq: int = 1 << 20,
                step: int = SEQ_STEP) -> int:
    """The longest seq (a multiple of `step`, <= max_seq) that fits; 0 if even `step` does not.
    Binary search: memory grows with the sequence length."""
    def ok(k: int) -> bool:
        e = estimate(arch, dataclasses.replace(base, seq_len=k * step))
        return fits(e, gpu_mem_gib, host_mem_gib, vram_limit_gib).ok

    lo, hi = 0, max_seq // step            # ok(lo) holds (vacuously for 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def cmd_max_context(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longft max-context",
                                 description="Longest context (multiple of 1024) that fits.")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu-mem", type=float, help="GiB of one GPU (default: detected)")
    ap.add_argument("--host-mem", type=float, help="GiB of host RAM per node (default: detected)")
    ap.add_argument("--max-seq", type=int, default=None,
                    help="upper end of the search (default: the model's max_position_embeddings)")
    a = ap.parse_args(argv)
    from .hardware import detect

    cfg = _load(a.params)
    hw = detect()
    arch = _architecture(cfg.model)
    resolved, notes = _resolve(cfg, hw, arch["model_type"])
    gpu_mem, host_mem = _sizes(a, hw)
    if gpu_mem is None:
        print("longft max-context: no GPU here; pass --gpu-mem", file=sys.stderr)
        return 2
    top = a.max_seq or arch.get("max_position_embeddings") or 1 << 20
    base = setup_from_config(cfg, resolved)
    best_seq = max_context(arch, base, gpu_mem, host_mem, cfg.hardware.vram_limit_gib, top)
    print(f"longft max-context: {cfg.model.name}, micro-batch {base.micro_batch}, "
          f"{base.world_size} rank(s), GPU {gpu_mem:g} GiB, host {host_mem} GiB, search up to {top:,}")
    for n in notes:
        print(f"note: {n}")
    if best_seq == 0:
        e = estimate(arch, dataclasses.replace(base, seq_len=SEQ_STEP))
        print(f"even {SEQ_STEP} tokens do not fit:")
        print(format_table(e, fits(e, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)))
        return 1
    e = estimate(arch, dataclasses.replace(base, seq_len=best_seq))
    print(f"longest context that fits: {best_seq:,} tokens "
          f"(VRAM {e.gpu_nvml / GIB:.1f} GiB NVML-level, host {e.host_rss / GIB:.1f} GiB)")
    if best_seq + SEQ_STEP <= top:
        nxt = estimate(arch, dataclasses.replace(base, seq_len=best_seq + SEQ_STEP))
        print(f"  {best_seq + SEQ_STEP:,} would need VRAM {nxt.gpu_nvml / GIB:.1f} GiB, "
              f"host {nxt.host_rss / GIB:.1f} GiB")
    else:
        print("  that is the upper end of the search: memory is not the limit (--max-seq to go on)")
    print("confirm on the GPU with short runs at data.max_seq_length = "
          + ", ".join(f"{s:,}" for s in candidates_for_confirmation(best_seq, limit=top)))
    print(format_table(e, fits(e, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)))
    return 0


COMMANDS = {"estimate": cmd_estimate, "plan": cmd_plan, "max-context": cmd_max_context}


def main(command: str, argv: list[str]) -> int:
    """Run one of `estimate`, `plan`, `max-context` with its arguments; returns the exit code
    (0 fits / found, 1 does not fit / nothing found, 2 bad params or arguments)."""
    from .config import ConfigError
    from .model import ModelError

    if command not in COMMANDS:
        print(f"longft: unknown command {command!r} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](argv)
    except (ConfigError, ModelError) as e:
        print(f"longft {command}: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:      # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)

"""Placement search for `longft plan`: every ZeRO-3 offload x checkpointing x micro-batch that
fits (with checkpointing, the GPU memory left filled by `keep_on_gpu`: attention outputs kept,
`checkpointing.keep_attention`, then checkpoints kept, `checkpointing.gpu_layers`), ranked by a
speed heuristic, and the params overlay of the chosen one.

    from longft.estimate.placement import best, search
    choice = best(search(arch, base_setup, gpu_mem_gib=80, host_mem_gib=256, gpu_name=None))

The command itself (arguments, output, the overlay file) is estimate_cli.cmd_plan; the heuristic's
constants and formula are in docs/estimator.md.
"""

from __future__ import annotations

import dataclasses

from longft.estimate.arch import trainable_numels
from longft.estimate.estimator import GIB, Estimate, Fit, Setup, estimate, fits, param_numels
from longft.hardware.policy import why_not_shared_grad_buffer as why_not
from longft.model.attention import fused_kernel
from longft.model.tiled_mlp import skips_recompute, tiles

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
NVME_BYTES_PER_S = 2e9
"""offload_optimizer nvme: read + write bandwidth assumed for the state files (a PCIe 4 NVMe drive;
DeepSpeed's aio reaches about this per drive)."""
RATIO_STEPS = 16
"""At most this many offload_ratio values per placement in the search (evenly over the sub-groups)."""


def step_seconds(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted seconds of one optimizer step (grad_accum micro-steps) on one rank."""
    from longft.estimate.flops import attention_flops, flops_per_token, peak_flops

    T = s.local_tokens  # sequence parallel: N micro-steps of seq / N tokens for each row
    w = 4 if s.precision == "fp32" else 2
    P_r = sum(n for _, n in param_numels(arch)) / s.world_size
    peak = peak_flops(gpu_name, s.precision) or UNKNOWN_PEAK_FLOPS
    recompute = 1.0 if s.checkpointing == "none" else 4 / 3
    lora = sum(trainable_numels(arch, s)) if s.lora_rank else None  # no frozen weights' gradients
    micro = T * flops_per_token(arch, s.seq_len, lora_params=lora) * recompute / (ACHIEVED_FRACTION * peak)
    micro *= 1 + MICRO_OVERHEAD_TOKENS / T
    skipped = skips_recompute(s.checkpointing, arch.get("model_type"))
    if s.checkpointing != "none" and s.keep_attention:  # their attention forward runs once
        kept = min(s.keep_attention, arch["num_hidden_layers"])
        micro -= T * attention_flops(arch, s.seq_len) * kept / (ACHIEVED_FRACTION * peak)
    if s.tiled_mlp and tiles(T, s.tile_tokens) > 1 and not skipped:  # one more MLP forward
        mlp = 2 * 3 * arch["hidden_size"] * arch["intermediate_size"] * arch["num_hidden_layers"]
        micro += T * mlp / (ACHIEVED_FRACTION * peak)
    if s.offload_param:      # fetch every layer for forward, recompute and backward
        micro += EXPOSED_FRACTION * 3 * w * P_r / HOST_LINK_BYTES_PER_S
    if s.checkpointing == "cpu_offload":
        moved = max(0, arch["num_hidden_layers"] - s.gpu_layers)
        micro += EXPOSED_FRACTION * 2 * moved * T * arch["hidden_size"] * w / HOST_LINK_BYTES_PER_S
    return s.grad_accum * s.sequence_parallel * micro + optimizer_seconds(arch, s)


def optimizer_seconds(arch: dict, s: Setup) -> float:
    """Predicted seconds of the optimizer step: CPU Adam over the host's sub-groups (plus copying
    their weights back, and with NVMe reading and writing their states), GPU Adam over the rest."""
    from longft.estimate.arch import numbers

    n = numbers(arch, s)
    on_gpu, on_host = sum(n.gpu_groups), sum(n.host_groups)
    t = 4 * n.ms * on_gpu / GPU_ADAM_BYTES_PER_S
    if on_host:
        t += on_host / CPU_ADAM_PARAMS_PER_S + n.w * on_host / HOST_LINK_BYTES_PER_S
        if s.nvme:
            t += 2 * 4 * n.ms * on_host / NVME_BYTES_PER_S
    return t


def offload_ratios(arch: dict, s: Setup) -> list[float]:
    """The offload_ratio values worth trying for `s`: one per count of sub-groups kept on the GPU
    (all on the host = 1.0 first), at most RATIO_STEPS of them, each the round number that gives
    that count under DeepSpeed's int((1 - ratio) x groups)."""
    from longft.estimate.arch import numbers

    groups = len(numbers(arch, dataclasses.replace(s, offload_ratio=1.0)).groups)
    ks = sorted({round(i * (groups - 1) / max(1, RATIO_STEPS - 1))
                 for i in range(min(groups, RATIO_STEPS))})
    return [ratio_for(k, groups) for k in ks]


def ratio_for(k: int, groups: int) -> float:
    """The roundest offload_ratio that keeps exactly k of `groups` sub-groups on the GPU: a ratio
    in ((groups - k - 1) / groups, (groups - k) / groups], checked with DeepSpeed's own expression."""
    import math

    lo, hi = (groups - k - 1) / groups, (groups - k) / groups
    for digits in range(1, 7):
        top = math.floor(hi * 10**digits + 1e-9)   # the largest such number <= hi, and the next
        for r in (top / 10**digits, (top - 1) / 10**digits):
            if lo < r <= 1 and int((1 - r) * groups) == k:
                return r
    return (groups - k - 0.5) / groups


def tokens_per_second(arch: dict, s: Setup, gpu_name: str | None) -> float:
    """Predicted tokens/s of the whole job (all ranks)."""
    return s.world_size * s.grad_accum * s.micro_batch * s.seq_len / step_seconds(arch, s, gpu_name)


# ---------------------------------------------------------------- search

OFFLOADS = {"none": (False, False), "opt": (True, False), "opt+param": (True, True),
            "opt(nvme)": (True, False)}
"""Placements by name: (optimizer off the GPU, parameters off the GPU). opt(nvme) only where the
search is given a disk (an NVMe path's free space)."""
MODES = ("none", "gpu", "cpu_offload")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One placement: its Setup, estimate, fit, predicted speed and offload name (OFFLOADS key)."""
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


def _largest(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ok(n), for ok true up to some n and false above; lo - 1 when
    not even ok(lo)."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def keep_on_gpu(arch: dict, s: Setup, gpu_mem_gib: float, host_mem_gib: float | None = None) -> Setup:
    """What to keep on the GPU with checkpointing, in the order of the time it saves per GiB:
    first the attention outputs of as many layers as fit (`keep_attention`: each skips an attention
    forward), with cpu_offload while keeping just enough checkpoints on the GPU for the host to fit;
    then, with cpu_offload, as many more layers' checkpoints as still fit (`gpu_layers`: each saves
    two copies and its host RAM)."""
    L = arch["num_hidden_layers"]

    def gpu_ok(**kw) -> bool:
        return bool(fits(estimate(arch, dataclasses.replace(s, **kw)), gpu_mem_gib, None).gpu_ok)

    g = 0
    if s.checkpointing == "cpu_offload" and host_mem_gib is not None:
        def host_over(n: int) -> bool:   # host RAM falls as layers stay on the GPU
            return not fits(estimate(arch, dataclasses.replace(s, gpu_layers=n, keep_attention=0)),
                            None, host_mem_gib).host_ok
        g = min(_largest(host_over, 0, L) + 1, L)   # the fewest kept that the host needs
    k = 0
    # flash-attn-4's kernels are not torch ops: keep_attention cannot keep them (hardware/packed_policy.py)
    if (s.checkpointing in ("gpu", "cpu_offload") and fused_kernel(s.attention, s.sdpa_backend)
            and not s.flash_attn_4):
        k = max(0, _largest(lambda n: gpu_ok(gpu_layers=g, keep_attention=n), 0, L))
    if s.checkpointing == "cpu_offload":
        g = max(g, _largest(lambda n: gpu_ok(gpu_layers=n, keep_attention=k), g, L))
    return dataclasses.replace(s, gpu_layers=g, keep_attention=k)


def search(arch: dict, base: Setup, gpu_mem_gib: float, host_mem_gib: float, gpu_name: str | None,
           max_micro: int = 64, modes: tuple[str, ...] = MODES,
           share_grads: bool = True, states: tuple[str, ...] = ("fp32",),
           disk_gib: float | None = None) -> list[Candidate]:
    """Every ZeRO-3 candidate (offload x offload_ratio x optimizer states x checkpointing x
    micro-batch 1..max_micro) that fits, and for each offload x ratio x states x mode that fits at
    no micro-batch its micro-batch-1 candidate (not fitting). Memory grows with the micro-batch, so
    each scan stops at the first that does not fit. `states`: the optimizer-state precisions the
    params allow (bf16 changes numerics: only when asked). `disk_gib`: free space under an NVMe
    path; None leaves NVMe out. Candidates have one micro-step per step: with the optimizer on
    the CPU they share the host gradient buffer (zero.host_grad_buffer) unless `share_grads` is
    off or the precision is fp16."""
    out = []
    for off, (opt, param) in OFFLOADS.items():
        nvme = off == "opt(nvme)"
        if nvme and disk_gib is None:
            continue
        shared = share_grads and not why_not(3, "nvme" if nvme else opt, 1, base.precision)
        for st in states:
            first = dataclasses.replace(base, zero_stage=3, offload_optimizer=opt, offload_param=param,
                                        nvme=nvme, optimizer_states=st, offload_ratio=1.0)
            ratios = offload_ratios(arch, first) if off == "opt" else [1.0]
            for ratio in ratios:
                for mode in modes:
                    for m in range(1, max_micro + 1):
                        s = dataclasses.replace(first, micro_batch=m, checkpointing=mode,
                                                offload_ratio=ratio, grad_accum=1,
                                                gpu_layers=0, keep_attention=0,
                                                host_grad_buffer="shared" if shared else "full")
                        if mode != "none":
                            s = keep_on_gpu(arch, s, gpu_mem_gib, host_mem_gib)
                        e = estimate(arch, s)
                        f = fits(e, gpu_mem_gib, host_mem_gib, disk_gib=disk_gib)
                        if f.ok or m == 1:
                            out.append(Candidate(s, e, f, tokens_per_second(arch, s, gpu_name), off))
                        if not f.ok:
                            break
    return out


def best(cands: list[Candidate], within: float = 0.02, gpu_mem_gib: float | None = None,
         host_mem_gib: float | None = None) -> Candidate | None:
    """The fastest fitting candidate; among those within `within` of the fastest, the one that uses
    the least of the machine: the smallest sum of the GPU's and the host's shares used when both
    sizes are given (so a near-tie is not won by filling host RAM to spare GPU memory nothing
    needs), else the least GPU memory (a larger micro-batch only helps up to a point, headroom
    always does)."""
    ok = [c for c in cands if c.fit.ok]
    if not ok:
        return None
    top = max(c.tokens_per_s for c in ok)
    near = [c for c in ok if c.tokens_per_s >= (1 - within) * top]
    if gpu_mem_gib and host_mem_gib:
        def used(c: Candidate) -> float:
            return c.est.gpu_nvml / (gpu_mem_gib * GIB) + c.est.host_rss / (host_mem_gib * GIB)
        return min(near, key=lambda c: (round(used(c), 3), c.gpu_need, -c.tokens_per_s))
    return min(near, key=lambda c: (c.gpu_need, -c.tokens_per_s))


def overlay(model: str, c: Candidate, gpus: int, shipped: bool, nvme_path: str | None = None) -> dict:
    """The params overlay for a candidate (merge onto params.yaml)."""
    s = c.setup
    opt, param = OFFLOADS[c.offload]
    model_sec = {"name": model, **({"source": "random"} if shipped else {})}
    return {
        "model": model_sec,
        # packed or not: per-document attention needs no mask (kernels.packed_attention)
        "data": {"max_seq_length": s.seq_len},
        "hardware": {"num_gpus": gpus},
        # both always written: the overlay is merged onto the user's params, whose values would
        # otherwise survive where the plan chose none
        "checkpointing": {"mode": s.checkpointing, "gpu_layers": s.gpu_layers,
                          "keep_attention": s.keep_attention},
        "zero": {"stage": 3, "offload_optimizer": s.offload_device,
                 "offload_param": "cpu" if param else "none",
                 "offload_ratio": s.offload_ratio, "optimizer_states": s.optimizer_states,
                 "host_grad_buffer": s.host_grad_buffer,
                 **({"nvme_path": nvme_path} if s.nvme else {"nvme_path": None})},
        "train": {"micro_batch_size": s.micro_batch, "global_batch_size": s.micro_batch * gpus},
    }

"""Placement search for `longft placement`: what trains (`Tuning`: all parameters, LoRA, QLoRA, 8-bit
Adam) x offload x checkpointing x micro-batch, every candidate that fits (with checkpointing, the
GPU memory left filled by `keep_on_gpu`: attention outputs kept, `checkpointing.keep_attention`,
then checkpoints kept, `checkpointing.gpu_layers`), ranked by the speed heuristic (`speed`), the
choice among near-ties with its reason, and the params overlay of the chosen one.

    from longft.estimate.placement import best, search
    choice = best(search(arch, base_setup, gpu_mem_gib=80, host_mem_gib=256, gpu_name=None))

The command itself (arguments, output, the overlay file) is cli/placement.py; what fits when nothing
does is advice.py; the heuristic's constants and formula are in docs/estimator.md.
"""

from __future__ import annotations

import dataclasses

from longft.estimate.estimator import GIB, Estimate, Fit, Setup, estimate, fits
from longft.estimate.speed import (  # noqa: F401 - re-exported: the plan's speed heuristic
    DEQUANT_BYTES_PER_S,
    dequant_seconds,
    optimizer_seconds,
    step_seconds,
    tokens_per_second,
)
from longft.estimate.types import DS_SUB_GROUP_SIZE
from longft.hardware.policy import why_not_chunked_copy_back
from longft.hardware.policy import why_not_shared_grad_buffer as why_not
from longft.model.attention import fused_kernel

NEAR_BUDGET = 0.03
"""A candidate within this share of the GPU or host budget gets a warning (the estimator is good
to a few per cent on measured rows, and uncalibrated paths are less sure), and loses near-ties.
What keep_on_gpu keeps on the GPU only for speed stops this far below the card."""
NEAR_TIE = 0.02
"""Candidates within this share of the fastest count as equally fast (the speed model ranks; its
absolute numbers are low by 8-14 %)."""
RATIO_STEPS = 16
"""At most this many offload_ratio values per placement in the search (evenly over the sub-groups)."""


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


def fewest_kept(arch: dict, s: Setup, host_mem_gib: float | None) -> int:
    """With cpu_offload, the fewest decoder layers' checkpoints kept on the GPU (gpu_layers) for
    the host RAM to fit (all of them when it never does); 0 otherwise."""
    if s.checkpointing != "cpu_offload" or host_mem_gib is None:
        return 0
    L = arch["num_hidden_layers"]

    def host_over(n: int) -> bool:   # host RAM falls as layers stay on the GPU
        return not fits(estimate(arch, dataclasses.replace(s, gpu_layers=n, keep_attention=0)),
                        None, host_mem_gib).host_ok
    return min(_largest(host_over, 0, L) + 1, L)


def keep_on_gpu(arch: dict, s: Setup, gpu_mem_gib: float, host_mem_gib: float | None = None,
                headroom: float = NEAR_BUDGET) -> Setup:
    """What to keep on the GPU with checkpointing, in the order of the time it saves per GiB:
    first the attention outputs of as many layers as fit (`keep_attention`: each skips an attention
    forward), with cpu_offload while keeping just enough checkpoints on the GPU for the host to fit;
    then, with cpu_offload, as many more layers' checkpoints as still fit (`gpu_layers`: each saves
    two copies and its host RAM). What is kept only for speed stops `headroom` below the card:
    each is worth a few per cent of speed, and a plan filled to the last GiB is one estimate error
    from running out of memory."""
    L = arch["num_hidden_layers"]
    room = gpu_mem_gib * (1 - headroom)

    def gpu_ok(**kw) -> bool:
        return bool(fits(estimate(arch, dataclasses.replace(s, **kw)), room, None).gpu_ok)

    g = fewest_kept(arch, s, host_mem_gib)
    k = 0
    if s.checkpointing in ("gpu", "cpu_offload") and fused_kernel(s.attention, s.sdpa_backend):
        k = max(0, _largest(lambda n: gpu_ok(gpu_layers=g, keep_attention=n), 0, L))
    if s.checkpointing == "cpu_offload":
        g = max(g, _largest(lambda n: gpu_ok(gpu_layers=n, keep_attention=k), g, L))
    return dataclasses.replace(s, gpu_layers=g, keep_attention=k)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What trains: all parameters (lora_rank 0), LoRA adapters, LoRA on quantized base weights
    (QLoRA: quantize nf4 / int8, on ZeRO-2), or sparse blocks (sparse_blocks, over a bf16 base or,
    with quantize, a quantized one on ZeRO-2), and the optimizer (adamw, or bitsandbytes' 8-bit
    AdamW with its states on the GPU)."""
    lora_rank: int = 0
    quantize: str = "none"
    optimizer: str = "adamw"
    sparse_blocks: int = 0           # block-sparse finetuning (sparse.*): blocks per target linear
    sparse_block_size: int = 64

    @classmethod
    def of(cls, s: Setup) -> Tuning:
        from longft.config import qlora

        q = s.quantize if qlora.quantized_base(s.lora_rank, s.quantize, s.sparse_blocks) else "none"
        return cls(s.lora_rank, q, s.optimizer, s.sparse_blocks, s.sparse_block_size)

    @property
    def name(self) -> str:
        kind = ("full-parameter" if not self.lora_rank else f"LoRA r={self.lora_rank}"
                if self.quantize == "none" else f"QLoRA {self.quantize} r={self.lora_rank}")
        if self.sparse_blocks:
            kind = f"block-sparse {self.sparse_blocks} x {self.sparse_block_size}^2" + (
                "" if self.quantize == "none" else f" over {self.quantize}")
        return kind + ("" if self.optimizer == "adamw" else f", {self.optimizer}")

    def apply(self, s: Setup) -> Setup:
        """`s` training this way (ZeRO-2 over a quantized base; LoRA or blocks on the seven decoder
        linears where `s` names no targets)."""
        from longft.config import qlora
        from longft.estimate.quantized import QUANTIZED_LINEARS

        targets = s.lora_targets or (QUANTIZED_LINEARS if self.lora_rank else ())
        sparse = s.sparse_targets or (QUANTIZED_LINEARS if self.sparse_blocks else ())
        return dataclasses.replace(
            s, lora_rank=self.lora_rank, quantize=self.quantize, optimizer=self.optimizer,
            lora_targets=targets,
            zero_stage=qlora.stage(3, self.lora_rank, self.quantize, self.sparse_blocks),
            sparse_blocks=self.sparse_blocks, sparse_block_size=self.sparse_block_size,
            sparse_targets=sparse if self.sparse_blocks else ())


NVME_SUB_GROUP_SIZE = 10**8
"""offload_optimizer nvme: the sub-group size searched beside the params' zero.sub_group_size. The
host holds 6 states' worth of the largest sub-group (the swapper's 4 buffers and the first step's
m and v, docs/estimator.md), so smaller sub-groups shrink it (Llama-3.2-3B at 32K: 35.7 GiB at
1e9, 20.8 at 1e8, where the embedding is the largest); the disk moves the same bytes a step, so
the speed model sees no difference and the placement that uses less of the machine wins."""


def placements(t: Tuning, disk_gib: float | None) -> list[str]:
    """The OFFLOADS a tuning can use: a quantized base (QLoRA, block-sparse over nf4 / int8) runs
    on ZeRO-2 (no parameter offload, no NVMe, no offload_ratio); 8-bit optimizer states live on
    the GPU (no optimizer offload)."""
    names = [k for k in OFFLOADS if k != "opt(nvme)" or disk_gib is not None]
    if t.quantize != "none":
        names = [k for k in names if k in ("none", "opt")]
    if t.optimizer != "adamw":
        names = ["none"]
    return names


def search(arch: dict, base: Setup, *, gpu_mem_gib: float, host_mem_gib: float, gpu_name: str | None,
           max_micro: int = 64, modes: tuple[str, ...] = MODES,
           share_grads: bool = True, states: tuple[str, ...] = ("fp32",),
           disk_gib: float | None = None, tunings: tuple[Tuning, ...] | None = None,
           offloads: tuple[str, ...] | None = None, chunked_copy_back: bool = True,
           global_batch: int | None = None) -> list[Candidate]:
    """Every candidate (tuning x offload x offload_ratio x optimizer states x checkpointing x
    micro-batch 1..max_micro) that fits, and for each tuning x offload x ratio x states x mode that
    fits at no micro-batch its micro-batch-1 candidate (not fitting). Memory grows with the
    micro-batch, so each scan stops at the first that does not fit. `tunings`: what may train
    (default: as `base` says); QLoRA candidates run on ZeRO-2, the others on ZeRO-3. `states`: the
    optimizer-state precisions the params allow (bf16 changes numerics: only when asked).
    `disk_gib`: free space under an NVMe path; None leaves NVMe out. `offloads`: a subset of
    OFFLOADS to try. `global_batch` (a multiple of the world size): only the micro-batches that
    divide it, the rest accumulated; None: one micro-step per step. With the optimizer on the CPU
    under ZeRO-3 and one micro-step they share the host gradient buffer (zero.host_grad_buffer)
    unless `share_grads` is off or the precision is fp16, and copy the updated weights back
    through pinned chunks where zero.copy_back auto would (`copy_back_for`) unless
    `chunked_copy_back` is off."""
    out = []
    for t in tunings or (Tuning.of(base),):
        tuned = t.apply(base)
        for off in placements(t, disk_gib):
            if offloads is not None and off not in offloads:
                continue
            opt, param = OFFLOADS[off]
            nvme = off == "opt(nvme)"
            stage = tuned.zero_stage
            for st in states:
                first = dataclasses.replace(tuned, offload_optimizer=opt, offload_param=param,
                                            nvme=nvme, optimizer_states=st, offload_ratio=1.0)
                first = dataclasses.replace(first, copy_back=copy_back_for(first, chunked_copy_back))
                ratios = offload_ratios(arch, first) if off == "opt" and stage == 3 else [1.0]
                for ratio in ratios:
                    for mode in modes:
                        start = dataclasses.replace(first, checkpointing=mode, offload_ratio=ratio,
                                                    grad_accum=1, gpu_layers=0, keep_attention=0)
                        kw = dict(gpu_mem_gib=gpu_mem_gib, host_mem_gib=host_mem_gib, gpu_name=gpu_name,
                                  max_micro=max_micro, disk_gib=disk_gib, share=share_grads,
                                  batch=global_batch)
                        for sg in sub_group_sizes(start):
                            out += _scan(arch, dataclasses.replace(start, sub_group_size=sg), off,
                                         **kw)
    return out


def sub_group_sizes(s: Setup) -> tuple[int, ...]:
    """The zero.sub_group_size values to search for `s`: the params' own, and with NVMe also
    NVME_SUB_GROUP_SIZE where it is smaller (the same disk time, less host RAM; `best` chooses)."""
    if s.nvme and s.sub_group_size > NVME_SUB_GROUP_SIZE:
        return (s.sub_group_size, NVME_SUB_GROUP_SIZE)
    return (s.sub_group_size,)


def copy_back_for(s: Setup, chunked: bool = True) -> str:
    """zero.copy_back as auto resolves it for `s` (chunked where its rule allows, when `chunked`;
    hardware.policy.why_not_chunked_copy_back), so that a candidate's host estimate is the run's."""
    off = "nvme" if s.nvme else s.offload_optimizer
    ok = chunked and not why_not_chunked_copy_back(s.device, s.zero_stage, off, s.offload_param,
                                                   s.precision, s.optimizer_states)
    return "chunked" if ok else "deepspeed"


def _scan(arch: dict, s: Setup, off: str, *, gpu_mem_gib: float, host_mem_gib: float,
          gpu_name: str | None, max_micro: int, disk_gib: float | None, share: bool,
          batch: int | None) -> list[Candidate]:
    """One placement's candidates over micro-batches 1.. until one does not fit (that one too when
    it is the first); with a global `batch`, those that divide it (accumulating the rest) until one
    does not fit the GPU (accumulation's host buffers go where it ends)."""
    out = []
    for m in (m for m in range(1, max_micro + 1) if not batch or batch % (m * s.world_size) == 0):
        accum = batch // (m * s.world_size) if batch else 1
        shared = share and not why_not(s.zero_stage, "nvme" if s.nvme else s.offload_optimizer, accum,
                                       s.precision)
        c = dataclasses.replace(s, micro_batch=m, grad_accum=accum, host_grad_buffer="shared" if shared else "full")
        if c.checkpointing != "none":
            c = keep_on_gpu(arch, c, gpu_mem_gib, host_mem_gib)
        e = estimate(arch, c)
        f = fits(e, gpu_mem_gib, host_mem_gib, disk_gib=disk_gib)
        if f.ok or not out:
            out.append(Candidate(c, e, f, tokens_per_second(arch, c, gpu_name), off))
        if f.gpu_ok is False or (not f.ok and not batch):
            break
    return out


def near_budget(c: Candidate, gpu_mem_gib: float, host_mem_gib: float,
                margin: float = NEAR_BUDGET) -> list[str]:
    """Warnings for a candidate whose GPU or host need is within `margin` of its budget."""
    out = []
    for what, need, have in (("GPU", c.est.gpu_nvml, gpu_mem_gib), ("host", c.est.host_rss,
                                                                   host_mem_gib)):
        if have and need > (1 - margin) * have * GIB:
            out.append(f"{what} need {need / GIB:.2f} GiB is within {margin:.0%} of the "
                       f"{have:g} GiB budget ({(have * GIB - need) / GIB:.2f} GiB left): the "
                       "estimate is good to a few per cent; leave more room, or confirm with "
                       "`longft max-context --confirm`")
    return out


def _used(c: Candidate, gpu_mem_gib: float, host_mem_gib: float) -> float:
    """The share of the machine a candidate uses: GPU share + host share."""
    return c.est.gpu_nvml / (gpu_mem_gib * GIB) + c.est.host_rss / (host_mem_gib * GIB)


def changes(s: Setup) -> tuple[str, ...]:
    """What a candidate changes about the training itself, in the order the plan avoids it among
    near-ties: LoRA instead of all parameters, quantized base weights, 8-bit Adam states, bf16
    optimizer states (LoRA's few states gain nothing from the last two)."""
    return tuple(name for name, on in (
        ("LoRA", s.lora_rank > 0), (f"{s.quantize} base weights", s.quantize != "none"),
        (s.optimizer, s.optimizer != "adamw"), ("bf16 optimizer states", s.optimizer_states == "bf16"))
        if on)


def _fidelity(c: Candidate) -> tuple[bool, ...]:
    s = c.setup
    return (s.lora_rank > 0, s.quantize != "none", s.optimizer != "adamw",
            s.optimizer_states == "bf16")


def best(cands: list[Candidate], within: float = NEAR_TIE, gpu_mem_gib: float | None = None,
         host_mem_gib: float | None = None) -> Candidate | None:
    """The fastest fitting candidate; among those within `within` of the fastest (the speed model
    cannot tell them apart), the ones that change the training least (`changes`: all parameters
    before LoRA, before quantized weights, before 8-bit Adam, before bf16 states), then one not
    within NEAR_BUDGET of a budget where there is one, then the one that uses the least of the
    machine: the smallest sum of the GPU's and the host's shares used when both sizes are given
    (so a near-tie is not won by filling host RAM to spare GPU memory nothing needs), else the
    least GPU memory (a larger micro-batch only helps up to a point, headroom always does).
    `why_chosen` says in words why the choice is not the fastest."""
    ok = [c for c in cands if c.fit.ok]
    if not ok:
        return None
    top = max(c.tokens_per_s for c in ok)
    near = [c for c in ok if c.tokens_per_s >= (1 - within) * top]
    least = min(_fidelity(c) for c in near)
    near = [c for c in near if _fidelity(c) == least]
    if gpu_mem_gib and host_mem_gib:
        roomy = [c for c in near if not near_budget(c, gpu_mem_gib, host_mem_gib)]
        near = roomy or near
        return min(near, key=lambda c: (round(_used(c, gpu_mem_gib, host_mem_gib), 3), c.gpu_need,
                                        -c.tokens_per_s))
    return min(near, key=lambda c: (c.gpu_need, -c.tokens_per_s))


def why_chosen(choice: Candidate, cands: list[Candidate], gpu_mem_gib: float | None = None,
               host_mem_gib: float | None = None) -> str | None:
    """Why `choice` (best's answer) is not the fastest fitting candidate; None when it is."""
    ok = [c for c in cands if c.fit.ok]
    fastest = max(ok, key=lambda c: c.tokens_per_s)
    if fastest.tokens_per_s <= choice.tokens_per_s:
        return None

    def faster(c: Candidate) -> str:
        return (f"{describe_placement(c)} (~{c.tokens_per_s:,.0f} tok/s) is "
                f"{c.tokens_per_s / choice.tokens_per_s - 1:.1%} faster")

    why = []
    if _fidelity(fastest) != _fidelity(choice):
        more = [x for x in changes(fastest.setup) if x not in changes(choice.setup)]
        why.append(f"{faster(fastest)} but changes the training more ({', '.join(more)})")
    peer = max((c for c in ok if _fidelity(c) == _fidelity(choice)), key=lambda c: c.tokens_per_s)
    if peer.tokens_per_s > choice.tokens_per_s:
        mem = (f"GPU {choice.est.gpu_nvml / GIB:.1f} + host {choice.est.host_rss / GIB:.1f} GiB "
               f"against {peer.est.gpu_nvml / GIB:.1f} + {peer.est.host_rss / GIB:.1f} GiB")
        tight = gpu_mem_gib and host_mem_gib and near_budget(peer, gpu_mem_gib, host_mem_gib)
        why.append(f"{faster(peer)} but " + ("is within 3 % of a budget; this one leaves room ("
                                               if tight else "this one uses less of the machine (")
                   + mem + ")")
    return "; ".join(why) + f". Within {NEAR_TIE:.0%} the speed model cannot tell them apart."


def describe_placement(c: Candidate, tuning: bool = True) -> str:
    """A candidate in one phrase: tuning (unless `tuning` is off), offload, checkpointing, kept
    layers, micro-batch."""
    s = c.setup
    off = c.offload + (f"(ratio {s.offload_ratio:g})" if s.offload_ratio < 1 else "")
    off += " bf16-states" if s.optimizer_states == "bf16" else ""
    off += f" sub-groups {s.sub_group_size:,}" if s.nvme and (
        s.sub_group_size != DS_SUB_GROUP_SIZE) else ""
    kept = (f" ({s.gpu_layers} on GPU, {s.keep_attention} attention kept)"
            if s.checkpointing == "cpu_offload" else f" ({s.keep_attention} attention kept)"
            if s.keep_attention else "")
    return ((f"{Tuning.of(s).name}, " if tuning else "") + f"ZeRO-{s.zero_stage} offload {off}, checkpointing "
            f"{s.checkpointing}{kept}, micro-batch {s.micro_batch}")

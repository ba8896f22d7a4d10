"""What fits when the asked run does not: the longest context that fits for full-parameter, LoRA and
QLoRA training, and the smallest changes that make the asked run fit (bf16 or 8-bit optimizer
states, NVMe, LoRA, QLoRA, more GPUs, a shorter context), each as the fastest placement that fits,
from `placement.search`.

    from longft.estimate.advice import alternatives, longest_contexts
    alts = alternatives(arch, base, ask)      # ask: Ask (machine, budgets, what the search allowed)

Pure functions of the estimator; `longft placement` prints them (cli/placement_advice.py).
"""

from __future__ import annotations

import dataclasses
import itertools

from longft.estimate.estimator import Setup, estimate, fits
from longft.estimate.placement import OFFLOADS, Candidate, Tuning, best, fewest_kept, placements, search
from longft.hardware.policy import TILED_MLP_FROM

SEQ_STEP = 1024
"""Context lengths are searched in multiples of this (as `longft max-context`)."""
DEFAULT_LORA_RANK = 16
"""The LoRA rank suggested when the base params train all parameters (lora.rank 0)."""
MORE_GPUS = (2, 4, 8)
"""GPU counts (of the same card, on one node with the same host RAM) tried as a change."""
ASSUMED_DISK_GIB = 1e6
"""NVMe as a suggestion, without --nvme-path: the disk is assumed large enough, and its need said."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """The asked run's machine and what its search allowed (the plan's flags and params)."""
    gpu_mem_gib: float
    host_mem_gib: float
    gpus: int
    gpu_name: str | None
    states: tuple[str, ...]          # optimizer-state precisions searched
    tunings: tuple[Tuning, ...]      # what may train
    disk_gib: float | None = None    # free space under --nvme-path; None: NVMe not searched
    max_micro: int = 64
    share_grads: bool = True
    chunked_copy_back: bool = True   # zero.copy_back is not deepspeed (placement.copy_back_for)
    tiled_auto: bool = True          # kernels.tiled_mlp auto: on from TILED_MLP_FROM tokens
    lora_dropout: float = 0.0        # lora.dropout: auto never tiles LoRA with dropout
    top: int = 1 << 20               # the model's max_position_embeddings
    global_batch: int | None = None  # the params' global batch, kept (None: one micro-step a step)

    def search(self, arch: dict, base: Setup, **kw) -> list[Candidate]:
        args = dict(gpu_mem_gib=self.gpu_mem_gib, host_mem_gib=self.host_mem_gib,
                    gpu_name=self.gpu_name, max_micro=self.max_micro, share_grads=self.share_grads,
                    chunked_copy_back=self.chunked_copy_back, states=self.states,
                    disk_gib=self.disk_gib, tunings=self.tunings, global_batch=self.global_batch)
        return search(arch, base, **{**args, **kw})


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One change to the asked run and the fastest candidate that fits with it (None: none does)."""
    change: str                      # what changes, in words
    flags: str                       # the `longft placement` flags that search it
    candidate: Candidate | None
    gpus: int = 1
    note: str = ""                   # why it does not fit, or what else it needs


def _tiled(base: Setup, seq: int, t: Tuning, ask: Ask) -> Setup:
    """`base` at `seq`, with the tiled MLP as kernels.tiled_mlp auto would resolve it there for
    `t` (hardware.policy.resolve_tiled_mlp: from TILED_MLP_FROM tokens, never LoRA with dropout)."""
    s = base.at_length(seq)
    if not ask.tiled_auto:
        return s
    return dataclasses.replace(s, tiled_mlp=seq >= TILED_MLP_FROM
                               and not (t.lora_rank and ask.lora_dropout > 0))


def fits_somewhere(arch: dict, s: Setup, t: Tuning, ask: Ask, states: tuple[str, ...] | None = None,
                   disk_gib: float | None = None) -> bool:
    """Whether `s` trained as `t` fits at micro-batch 1 in any placement: each offload, state
    precision and checkpointing mode (gpu, or cpu_offload with the fewest checkpoints on the GPU
    that the host needs; no checkpointing needs more of both), nothing kept beyond that."""
    from longft.estimate.placement import copy_back_for, offload_ratios, sub_group_sizes
    from longft.hardware.policy import why_not_shared_grad_buffer as why_not

    gb = ask.global_batch   # kept: micro-batch 1 accumulates the rest (the search's micro-batch 1)
    accum = gb // s.world_size if gb and gb % s.world_size == 0 else 1
    tuned = t.apply(dataclasses.replace(s, micro_batch=1, grad_accum=accum, gpu_layers=0,
                                        keep_attention=0))
    for off in placements(t, disk_gib):
        opt, param = OFFLOADS[off]
        nvme = off == "opt(nvme)"
        shared = ask.share_grads and not why_not(tuned.zero_stage, "nvme" if nvme else opt, accum,
                                                 s.precision)
        for st in states or ask.states:
            first = dataclasses.replace(tuned, offload_optimizer=opt, offload_param=param, nvme=nvme,
                                        optimizer_states=st, offload_ratio=1.0,
                                        host_grad_buffer="shared" if shared else "full")
            first = dataclasses.replace(first, copy_back=copy_back_for(first, ask.chunked_copy_back))
            ratios = offload_ratios(arch, first) if off == "opt" and first.zero_stage == 3 else [1.0]
            for ratio, sg, mode in itertools.product(ratios, sub_group_sizes(first),
                                                     ("gpu", "cpu_offload")):
                c = dataclasses.replace(first, offload_ratio=ratio, sub_group_size=sg,
                                        checkpointing=mode)
                if mode == "cpu_offload":
                    c = dataclasses.replace(c, gpu_layers=fewest_kept(arch, c, ask.host_mem_gib))
                if fits(estimate(arch, c), ask.gpu_mem_gib, ask.host_mem_gib, disk_gib=disk_gib).ok:
                    return True
    return False


def longest_context(arch: dict, base: Setup, t: Tuning, ask: Ask, top: int | None = None) -> int:
    """The longest context (a multiple of SEQ_STEP, up to `top` or the model's limit) at which `t`
    fits in some placement; 0 if not even SEQ_STEP does. Memory grows with the length, except
    where kernels.tiled_mlp auto starts tiling: the tiled lengths are searched first."""
    top = top or ask.top

    def ok(k: int) -> bool:
        return fits_somewhere(arch, _tiled(base, k * SEQ_STEP, t, ask), t, ask,
                              disk_gib=ask.disk_gib)

    def largest(lo: int, hi: int) -> int:   # ok(lo - 1) holds or lo - 1 == 0
        lo -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo

    k_top = top // SEQ_STEP
    k_tiled = -(-TILED_MLP_FROM // SEQ_STEP)
    if _tiled(base, k_top * SEQ_STEP, t, ask).tiled_mlp != _tiled(base, SEQ_STEP, t, ask).tiled_mlp \
            and k_top >= k_tiled:
        k = largest(k_tiled, k_top) if ok(k_tiled) else 0
        if k:
            return k * SEQ_STEP
        k_top = k_tiled - 1
    return largest(1, k_top) * SEQ_STEP


def best_at(arch: dict, base: Setup, seq: int, ask: Ask, t: Tuning, **kw) -> Candidate | None:
    """The plan's choice for `base` at `seq` trained as `t` (kw: search's arguments to change)."""
    cands = ask.search(arch, _tiled(base, seq, t, ask), tunings=(t,), **kw)
    return best(cands, gpu_mem_gib=ask.gpu_mem_gib, host_mem_gib=ask.host_mem_gib)


def kinds(base: Setup) -> tuple[Tuning, Tuning, Tuning]:
    """Full-parameter, LoRA and QLoRA (nf4) training, at the base params' LoRA rank (else
    DEFAULT_LORA_RANK) and with the base params' optimizer where it allows (8-bit states need
    none of the optimizer offloads, which is the same for all three)."""
    r = base.lora_rank or DEFAULT_LORA_RANK
    return (Tuning(0, "none", base.optimizer), Tuning(r, "none", base.optimizer),
            Tuning(r, "nf4", base.optimizer))


def sparse_like(arch: dict, lora: Tuning, block_size: int = 64) -> Tuning:
    """Block-sparse training with as many trained parameters as `lora` on the seven decoder
    linears: blocks per matrix = LoRA's r x (in + out) summed over them / (7 x block_size^2)."""
    from longft.estimate.arch import _linear_shapes, dims

    shapes = _linear_shapes(dims(arch)).values()
    per = sum(lora.lora_rank * (i + o) for i, o in shapes) / (len(shapes) * block_size ** 2)
    return Tuning(0, "none", lora.optimizer, max(1, round(per)), block_size)


def longest_contexts(arch: dict, base: Setup, ask: Ask) -> list[tuple[Tuning, int, Candidate | None]]:
    """For full-parameter, LoRA and QLoRA training: the longest context that fits and the plan's
    choice there (None where not even SEQ_STEP tokens fit)."""
    out = []
    for t in kinds(base):
        seq = longest_context(arch, base, t, ask)
        out.append((t, seq, best_at(arch, base, seq, ask, t) if seq else None))
    return out


def alternatives(arch: dict, base: Setup, ask: Ask) -> list[Alternative]:
    """The smallest changes that make the asked run (`base` at its length, trained as the first of
    ask.tunings) fit, smallest first: bf16 optimizer states and 8-bit optimizer states (still all
    parameters), NVMe for the optimizer states, LoRA, block-sparse (over a bf16 or an nf4 base),
    QLoRA, more GPUs, a shorter context. Each
    with the fastest placement that fits, or None and why not. Changes the search already
    allowed are left out, and so are those about optimizer states for a LoRA run."""
    t = ask.tunings[0]
    _, lora, qlora = kinds(base)
    r = lora.lora_rank
    out: list[Alternative] = []

    def add(change: str, flags: str, c: Candidate | None, gpus: int = ask.gpus, note: str = ""):
        out.append(Alternative(change, flags, c, gpus, note))

    seq = base.seq_len
    full = not t.lora_rank       # LoRA's optimizer states are small: bf16, 8-bit or NVMe save little
    if full and "bf16" not in ask.states and base.precision == "bf16":
        add("bf16 optimizer states", "--optimizer-states bf16",
            best_at(arch, base, seq, ask, t, states=("bf16",)))
    searched = set(ask.tunings)
    eight = dataclasses.replace(t, optimizer="adamw_8bit")
    if full and t.optimizer == "adamw" and eight not in searched:
        add("8-bit optimizer states (adamw_8bit)", "--optimizer adamw_8bit",
            best_at(arch, base, seq, ask, eight))
    if full and ask.disk_gib is None and t.optimizer == "adamw":
        c = best_at(arch, base, seq, ask, t, disk_gib=ASSUMED_DISK_GIB, offloads=("opt(nvme)",))
        add("optimizer states on NVMe", "--nvme-path DIR", c,
            note=f"needs {c.est.disk_bytes / 2**30:.0f} GiB of NVMe; --nvme-path checks the free "
            "space" if c else "")
    if full and lora not in searched:
        add(f"LoRA r={r}", f"--lora {r}", best_at(arch, base, seq, ask, lora))
    if full and not t.sparse_blocks:
        sparse = sparse_like(arch, lora)
        flags = (f"--sparse-blocks {sparse.sparse_blocks} --sparse-block-size "
                 f"{sparse.sparse_block_size}")
        note = f"as many trained parameters as LoRA r={r} (sparse.*: docs/models-and-lora.md)"
        add(sparse.name, flags, best_at(arch, base, seq, ask, sparse), note=note)
        over_nf4 = dataclasses.replace(sparse, quantize="nf4")   # the base as QLoRA holds it
        add(over_nf4.name, flags + " --quantize nf4", best_at(arch, base, seq, ask, over_nf4),
            note=note + "; speed unmeasured (speed.DEQUANT_BYTES_PER_S)")
    if t.quantize == "none" and qlora not in searched:
        add(f"QLoRA nf4 r={r}", f"--lora {r} --quantize nf4",
            best_at(arch, base, seq, ask, qlora),
            note="QLoRA speed unmeasured (speed.DEQUANT_BYTES_PER_S)")
    out.append(_more_gpus(arch, base, ask))
    shorter = longest_context(arch, base, t, ask, top=seq - SEQ_STEP) if seq > SEQ_STEP else 0
    add(f"shorter context ({t.name})", f"--seq {shorter}" if shorter else "",
        best_at(arch, base, shorter, ask, t) if shorter else None,
        note="" if shorter else f"{t.name} fits at no length")
    return out


def _more_gpus(arch: dict, base: Setup, ask: Ask) -> Alternative:
    """The fewest GPUs (MORE_GPUS, more than asked) of the same card on one node, with the same
    host RAM, on which the asked run fits."""
    for n in (g for g in MORE_GPUS if g > ask.gpus):
        wider = dataclasses.replace(base, world_size=n, ranks_per_node=n)
        gb = ask.global_batch   # kept where n GPUs divide it; else one micro-step a step
        c = best_at(arch, wider, base.seq_len, ask, ask.tunings[0],
                    global_batch=gb if gb and gb % n == 0 else None)
        if c is not None:
            return Alternative(f"{n} GPUs", f"--gpus {n}", c, n)
    most = max(MORE_GPUS)
    return Alternative("more GPUs", f"--gpus {most}", None, most,
                       f"not even {most} GPUs of {ask.gpu_mem_gib:g} GiB on one node with "
                       f"{ask.host_mem_gib:g} GiB of host RAM")


def recommended(alts: list[Alternative], nvme_checked: bool = False) -> Alternative | None:
    """The smallest change that fits: the first in `alternatives`' order with a candidate, the
    suggestion "optimizer states on NVMe" left out until --nvme-path has checked the disk
    (`nvme_checked`; without it no other change is searched on NVMe)."""
    return next((a for a in alts if a.candidate is not None
                 and (nvme_checked or "NVMe" not in a.change)), None)

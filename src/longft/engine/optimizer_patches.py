"""longft's changes to DeepSpeed's ZeRO-3 optimizer, installed after `deepspeed.initialize` (and a
resume) as the plan resolved them: the shared host gradient slot (grad_buffer), the GPU share's LR
schedule (partial_offload), the skipped rescaling pass (clip_scale), the chunked copy back
(param_copy_back) and the step overlapped with the next forward (overlap_step)."""

from __future__ import annotations

from longft.config.params import Config
from longft.config.plan import Plan
from longft.engine import clip_scale, grad_buffer, overlap_step, param_copy_back, partial_offload
from longft.errors import TrainingError

FEW_SUB_GROUPS = 4
"""zero.overlap_step with fewer sub-groups than this says that a smaller zero.sub_group_size would
overlap more (the first sub-group's update waits for the whole of it)."""


def patch_optimizer(engine, cfg: Config, plan: Plan, rank: int):
    """Install what the plan turned on; the overlap_step.DeferredStep (None when off)."""
    if plan.resolved.host_grad_buffer.value == "shared":
        _share_grad_slot(engine, rank)
    if cfg.zero.offload_ratio < 1:
        if not partial_offload.follow_schedule(engine.optimizer):
            # DeepSpeed builds the GPU share's optimizer whenever the ratio is below 1 with CPU
            # offload; none here means a DeepSpeed whose GPU share would train at the first lr
            raise TrainingError("zero.offload_ratio < 1 but DeepSpeed's ZeRO-3 optimizer has no "
                                "backup_optimizer for its GPU share: not the DeepSpeed longft was "
                                "written for (requirements/common.txt); install it or set "
                                "zero.offload_ratio: 1.0")
        if rank == 0:
            print("longft: zero.offload_ratio: the optimizer's GPU sub-groups follow the LR schedule "
                  "(DeepSpeed's own GPU AdamW keeps the first step's lr; engine/partial_offload.py)",
                  flush=True)
    clip_scale.install(engine.optimizer)    # ZeRO-3's gradient rescaling pass only where it changes a bit
    installed = None
    if plan.resolved.copy_back.value == "chunked":
        installed = param_copy_back.install(engine.optimizer)
        if rank == 0:
            print("longft: updated weights go to the GPU through pinned chunks (engine/param_copy_back.py)"
                  if installed else "longft: DeepSpeed's own copy of the updated weights kept: its "
                  "optimizer is not the ZeRO-3 one engine/param_copy_back.py knows", flush=True)
    return _defer_step(engine, rank, installed) if plan.resolved.overlap_step.value == "on" else None


def _share_grad_slot(engine, rank: int) -> None:
    """zero.host_grad_buffer shared: one host gradient slot for all partitions (grad_buffer.py)."""
    try:
        freed = grad_buffer.share(engine.optimizer)
    except grad_buffer.GradBufferError as e:
        raise TrainingError(str(e)) from None
    if rank == 0:
        print(f"longft: host gradient buffer shared: {freed / 2**30:.2f} GiB of host RAM per rank "
              "given back (zero.host_grad_buffer)", flush=True)


def _defer_step(engine, rank: int, copier=None):
    """zero.overlap_step on: each step's sub-group updates run in the next forward (overlap_step.py)."""
    deferred = overlap_step.install(engine, copier)
    if deferred is None:
        raise TrainingError("zero.overlap_step: on, but DeepSpeed's optimizer is not the ZeRO-3 one "
                            "engine/overlap_step.py knows (requirements/common.txt pins it); install "
                            "it or set zero.overlap_step: off")
    groups = deferred.groups
    if rank == 0:
        print(f"longft: the optimizer step's {groups} sub-groups update during the next forward, "
              "each before its parameters are fetched (zero.overlap_step; engine/overlap_step.py)"
              + (f"; with {groups} little of the update can overlap: a smaller zero.sub_group_size "
                 "(1e8 gives Llama-3.2-1B 11) overlaps more" if groups < FEW_SUB_GROUPS else ""),
              flush=True)
    return deferred

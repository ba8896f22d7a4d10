"""One optimizer step on one rank: its micro-steps (forward, backward), the optimizer step, and
what the run log records of it (loss, lr, gradient norm, tokens, the time split)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from longft.engine.batches import doc_kwargs, real_tokens
from longft.measure.time_split import RANGE


@dataclass
class StepRecord:
    """What one optimizer step measured: the fields of its "iter" record in runs/train/rank<r>.jsonl
    (the trainer adds the step number, the memory peaks and the epoch)."""

    loss: float  # the mean over the step's micro-batches
    lr: float  # the lr this step applied
    grad_norm: float | None  # before clipping; None when the step was skipped or none was computed
    tokens: int  # real (not padding) tokens of this rank's micro-batches
    time_s: float  # the whole step, GPU work included
    fwd_s: float
    bwd_s: float
    opt_s: float
    skipped: bool  # fp16 overflow: DeepSpeed skipped the update
    offloaded_bytes: int  # checkpointing.mode cpu_offload: activations moved to the host
    doc_sq_tokens: int  # sum of squared document lengths (the packed rows' attention FLOPs)

    def fields(self) -> dict:
        return asdict(self)


def step(engine, batches, *, accum: int, pad_id: int, now, offloader=None, packed: bool = False,
         sp=None) -> StepRecord:
    """One optimizer step of `accum` micro-steps; times forward, backward and the optimizer.
    `packed`: hand each micro-batch's document boundaries to the attention. `sp`: a
    ulysses.SequenceParallel (each micro-step one slice of a row; the loss logged is the whole
    row's mean), or None. Each phase runs in a torch.profiler range (measure/time_split.RANGE) that
    ends after the clock's synchronization: its GPU work lies inside (output.profile_steps)."""
    from torch.profiler import record_function

    fwd = bwd = 0.0
    losses, tokens, offloaded, doc_sq = [], 0, 0, 0
    skipped_before = engine.skipped_steps
    t0 = now()
    for micro in range(accum):
        cpu_batch = next(batches)
        if sp is not None:
            n, sq = sp.counts(cpu_batch, cpu_batch["input_ids"].shape[1] * sp.size)
        else:
            n = real_tokens(cpu_batch["input_ids"], cpu_batch["labels"], pad_id)
            b = {k: v.to(engine.device, non_blocking=True) for k, v in cpu_batch.items()}
            docs, sq = doc_kwargs(cpu_batch, pad_id, engine.device, packed)
        tokens, doc_sq = tokens + n, doc_sq + sq
        a = now()
        with record_function(RANGE["forward"]):
            hooks = offloader.new_step() if offloader else None
            if sp is not None:
                loss, whole = sp.forward(engine, cpu_batch)
            else:
                loss = engine(input_ids=b["input_ids"], labels=b["labels"],
                              position_ids=b["position_ids"], **docs).loss
                whole = None
            offloaded = max(offloaded, hooks.offloaded_bytes if hooks else 0)
            c = now()
        with record_function(RANGE["backward"]):
            engine.backward(loss)
            if micro < accum - 1:
                engine.step()  # DeepSpeed only counts the micro-step here
            d = now()
        fwd, bwd = fwd + c - a, bwd + d - c
        losses.append(loss.detach().float().item() if whole is None else whole)
    lr = engine.get_lr()[0]  # the lr this optimizer step applies (engine.step() advances it)
    e = now()
    with record_function(RANGE["optimizer"]):
        engine.step()
        f = now()
    return StepRecord(loss=sum(losses) / len(losses), lr=lr, grad_norm=grad_norm(engine),
                      tokens=tokens, time_s=f - t0, fwd_s=fwd, bwd_s=bwd, opt_s=f - e,
                      skipped=engine.skipped_steps > skipped_before, offloaded_bytes=offloaded,
                      doc_sq_tokens=doc_sq)


def grad_norm(engine) -> float | None:
    """The global L2 norm of this step's gradients, before clipping (DeepSpeed computes it in its
    optimizer step, under ZeRO-3 over all partitions, CPU offload included); None when the step
    was skipped (fp16 overflow) or DeepSpeed did not compute one."""
    n = engine.get_global_grad_norm()
    n = float(n.item() if hasattr(n, "item") else n) if n is not None else None
    return n if n is not None and math.isfinite(n) else None

"""The optimizer step run during the next forward, sub-group by sub-group (`zero.overlap_step`).

DeepSpeed's ZeRO-3 step with CPU offload, after the backward: check for overflow, take the global
gradient norm, then for each optimizer sub-group (zero.sub_group_size elements, in parameter order)
scale its gradients, run CPU Adam on it and copy its master weights into the 16-bit partition the
model computes with. The GPU waits all that time (W2 on the H200: 0.53 s of an 8.1 s step).

Nothing in the next forward needs sub-group i until it fetches a parameter of i. So `DeferredStep`
runs the step's first part (overflow check, loss scale, global norm, the clip factor) in `step()`
as DeepSpeed does, and leaves the sub-groups pending. ZeRO-3's parameter coordinator fetches every
parameter before use (the module's own, and the next few ahead: prefetch); just before it does,
the pending sub-groups up to the last one that fetch needs are updated, in order, on this thread.
The GPU meanwhile runs the forward work already queued. After the last sub-group DeepSpeed's
`_post_step` runs. Anything that reads weights otherwise (the backward, a checkpoint save, the end
of training) calls `finish()` first.

The update is DeepSpeed's own, the same calls in the same order with the same arguments: the
gradients have not changed (the next backward has not run), the clip factor is the one the step
computed (on a CPU copy of the norm: the same IEEE operations, no GPU sync per sub-group), and each
sub-group steps with the lr, betas, eps and weight decay the step was called with (the scheduler
moves them when step() returns). tests/test_overlap_step.py holds the bits against DeepSpeed's
step, and the calls of its sub-group loop against DeepSpeed's. Parameters that ZeRO-3 keeps
gathered (`stage3_param_persistence_threshold`) are released at the step's start and gathered
again at its end, as DeepSpeed does; here right after their sub-group, with the GPU synchronized
as DeepSpeed's all-gather does; the policy sets the threshold to 0 where it turns this on. Every
DeepSpeed internal is reached through compat/deepspeed.py (its names and thin helpers).
"""

from __future__ import annotations

from collections import deque

from longft.compat import deepspeed as ds
from longft.compat.deepspeed import ALLGATHER_STREAM, CACHE_FLUSHES, FETCH, GATHER, STEP_PARTS
from longft.engine.partial_offload import HYPERPARAMETERS

__all__ = ["ALLGATHER_STREAM", "GATHER", "STEP_PARTS", "DeferredStep", "install"]


class DeferredStep:
    """The sub-groups of the last optimizer step still to update, and the gate that updates them
    before the parameters they hold are fetched."""

    def __init__(self, optimizer, copier=None, gather_stream=None):
        self.opt = optimizer
        self.copier = copier           # param_copy_back.ChunkedCopyBack, where it is installed
        self.gather_stream = gather_stream  # the stream ZeRO-3 gathers parameters on (GPU)
        groups = ds.sub_groups(optimizer)
        self.groups = len(groups)      # sub-groups in the optimizer
        self.group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        self.persistent = [ds.persistent(g) for g in groups]
        self.pending: deque[int] = deque()
        self.norm = None               # the loss-scaled global norm, on the CPU
        self.hyper: list[dict] = []    # each param group's hyper-parameters at step()
        self.deferred = 0              # sub-groups updated after step() returned (tests, logs)

    def step(self, closure=None):
        """DeepSpeed ZeRO-3's `step()` up to its sub-group loop; the loop is left pending."""
        import torch

        self.finish()
        o = self.opt
        scaled = ds.step_start(o)
        if scaled is None:              # fp16 overflow or a NaN/inf norm: no update, as DeepSpeed
            return
        self.norm = scaled.cpu()
        self.hyper = [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in o.optimizer.param_groups]
        self.pending = deque(range(self.groups))
        if self.copier is not None and torch.cuda.is_available():
            # the last work that reads the partitions (the backward) is queued by now: the
            # copy-back waits for it, not for the next forward's layers queued before a sub-group
            self.copier.after = torch.cuda.Event()
            self.copier.after.record()

    def advance(self, params) -> None:
        """Update, in order, every pending sub-group up to the last one holding one of `params`."""
        if self.pending:
            self._through(max((self.group_of.get(id(p), -1) for p in params), default=-1))

    def finish(self) -> None:
        """Update every pending sub-group (before anything reads the weights but a fetch)."""
        if self.pending:
            self._through(self.pending[-1])

    def _through(self, last: int) -> None:
        """Update the pending sub-groups up to `last`, in order; DeepSpeed's end of step after
        the last of them."""
        while self.pending and self.pending[0] <= last:
            self._update(self.pending.popleft())
            self.deferred += 1
        if not self.pending:
            self._post_step()

    def _update(self, i: int) -> None:
        """One iteration of DeepSpeed's sub-group loop, with the step's hyper-parameters."""
        import torch

        o = self.opt
        with torch.no_grad():
            ds.prepare_sub_group(o, i)
            ds.rescale_sub_group(o, i, self.norm)
            groups = o.optimizer.param_groups
            now = [{k: g[k] for k in h} for g, h in zip(groups, self.hyper)]
            for g, h in zip(groups, self.hyper):
                g.update(h)
            try:
                ds.optimizer_step(o, i)
            finally:
                for g, h in zip(groups, now):
                    g.update(h)
            ds.reassign_sub_group(o, i)
            ds.release_sub_group(o, i)
            if self.persistent[i]:
                ds.gather(self.persistent[i])
            flat = ds.partition16(o, i)
            if flat is not None and flat.is_cuda and self.gather_stream is not None:
                # ZeRO-3 gathers on a stream of its own: it reads the partition after this update
                self.gather_stream.wait_stream(torch.cuda.current_stream(flat.device))

    def _post_step(self) -> None:
        """DeepSpeed's end of step, less the gathering of persistent parameters (done per
        sub-group in `_update`)."""
        try:
            ds.post_step(self.opt, gather_persistent=False)
        finally:
            if self.copier is not None:
                self.copier.after = None
        _warn_cache_flushes(self.opt)


def _warn_cache_flushes(o) -> None:
    """The allocator-flush warning DeepSpeed's step ends with (a sign of memory pressure)."""
    import torch

    flushes = getattr(o, CACHE_FLUSHES, None)
    if not torch.cuda.is_available() or flushes is None:
        return
    retries = torch.cuda.memory_stats().get("num_alloc_retries") or 0
    if retries > flushes:
        print(f"longft: {retries - flushes} pytorch allocator cache flushes "
              "since the last step: memory pressure, which costs speed (DeepSpeed's warning)",
              flush=True)
        setattr(o, CACHE_FLUSHES, retries)


def install(engine, copier=None) -> DeferredStep | None:
    """Defer `engine.optimizer`'s sub-group loop into the next forward's parameter fetches, and
    make `engine.backward` and `engine.save_checkpoint` finish it first; `copier`: the chunked
    copy-back installed on the same optimizer (param_copy_back.install), if any. None (nothing changed)
    for an optimizer that is not DeepSpeed's ZeRO-3 one with its sub-groups on the host or the GPU
    (NVMe swapping and Muon are left to DeepSpeed)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    o = getattr(engine, "optimizer", None)
    if o is None or any(not hasattr(o, a) for a in STEP_PARTS) or ds.swaps(o) or ds.uses_muon(o) \
            or not hasattr(getattr(o, "optimizer", None), "param_groups"):
        return None
    coordinator = ds.param_coordinator(o)
    fetch, gather = getattr(coordinator, FETCH, None), getattr(coordinator, GATHER, None)
    if fetch is None or gather is None:
        return None
    d = DeferredStep(o, copier, getattr(coordinator, ALLGATHER_STREAM, None))

    def fetch_sub_module(module, forward):
        if d.pending:
            d.advance(iter_params(module, recurse=z3_leaf_module(module)))
        return fetch(module, forward)

    def all_gather_params(params, forward):
        if d.pending:
            d.advance(params)
        return gather(params, forward)

    backward, save = engine.backward, engine.save_checkpoint

    def backward_after_update(*args, **kwargs):
        d.finish()
        return backward(*args, **kwargs)

    def save_after_update(*args, **kwargs):
        d.finish()
        return save(*args, **kwargs)

    o.step = d.step
    setattr(coordinator, FETCH, fetch_sub_module)
    setattr(coordinator, GATHER, all_gather_params)
    engine.backward = backward_after_update
    engine.save_checkpoint = save_after_update
    return d

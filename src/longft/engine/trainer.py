"""The training loop on one rank: build the model (ZeRO-3 partitioned as it is created), patch it,
hand it to DeepSpeed, run `train.iterations` optimizer steps and log every one to runs/train.

`train` = `setup` (everything before the first step, returned as a `Session`) -> `loop` (the
steps, checkpoints, export, the run log's "end" record) -> a barrier.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from longft.config.params import Config
from longft.config.plan import Patches, Plan
from longft.data.store import PreparedDataset
from longft.engine import (
    block_warmup,
    checkpoint,
    ds_config,
    host_cache,
    profiling,
    stop,
    train_step,
    ulysses,
)
from longft.engine.batches import (
    PASSES_BOUNDARIES,
    SkipFirst,
    micro_batches,
    micro_batches_per_epoch,
    passes,
    steps_for_epochs,
)
from longft.engine.build import build
from longft.engine.environment import environment
from longft.engine.evaluate import Evaluator
from longft.engine.export import export
from longft.engine.interrupted import save_step, stop_after
from longft.engine.optimizer import client_optimizer
from longft.engine.optimizer_patches import patch_optimizer
from longft.errors import TrainingError
from longft.measure import live
from longft.measure.progress import LayerProgress
from longft.measure.runlog import RunLog
from longft.model import attention
from longft.model.tiled_mlp import decoder_layers


def _first_step_warnings(offloaded_bytes: int, offloader, patches: Patches) -> None:
    """A memory technique that was asked for but did nothing in the first step."""
    from longft.model.keep_attention import KeptKernels

    if offloader is not None and not offloaded_bytes:
        print("longft: warning: checkpointing.mode cpu_offload moved nothing to the host in the "
              "first step (layer inputs under 1 MiB, or gradient checkpointing was re-enabled "
              "after the patch)", flush=True)
    if patches.attention_kept_layers and not KeptKernels.replayed_total:
        print("longft: warning: checkpointing.keep_attention kept no attention output in the first "
              "step (the attention ran on a kernel it cannot keep, e.g. SDPA's math fallback); it "
              "costs nothing but saves nothing either", flush=True)


@dataclass
class Session:
    """What `setup` hands the step loop: the DeepSpeed engine and what each step reads."""

    engine: Any
    model: Any  # the patched (and peft-wrapped) model inside the engine; its layers show progress
    keep: Any  # HfDeepSpeedConfig under ZeRO-3, held here: transformers keeps only a weakref
    offloader: Any  # checkpoint_offload.CheckpointOffload, or None
    batches: Iterator[dict]  # CPU micro-batches, from the first one the resumed run has not seen
    pad_id: int
    fingerprint: str  # of the params, written with every checkpoint
    start: int  # the step the run resumed after (0: a fresh run)
    rank: int
    world: int
    cuda: bool
    rows: int = 0  # prepared training rows, for the passes over them (epoch)
    live: Any = None  # measure/live.LiveMetrics: rank 0's dvclive (and TensorBoard) curves
    evaluator: Evaluator | None = None  # the held-out split (engine/evaluate.py), None without one
    sp: Any = None  # ulysses.SequenceParallel with hardware.sequence_parallel > 1
    profiler: profiling.StepProfiler = profiling.OFF  # output.profile_steps
    deferred: Any = None  # overlap_step.DeferredStep with zero.overlap_step on


def with_steps(cfg: Config, rows: int) -> Config:
    """cfg with train.iterations worked out from train.epochs and the prepared rows (cfg itself
    when iterations is set): what the LR schedule, the step loop and the logs then read."""
    t = cfg.train
    if t.epochs is None:
        return cfg
    n = steps_for_epochs(t.epochs, rows, cfg.world_size, t.micro_batch_size, cfg.grad_accum_steps)
    if t.warmup_iterations >= n:
        raise TrainingError(
            f"train.epochs {t.epochs} is {n} optimizer step(s) over {rows} prepared rows (global "
            f"batch {t.global_batch_size}), not more than train.warmup_iterations "
            f"({t.warmup_iterations}), so no step would be timed; raise train.epochs, lower "
            f"train.warmup_iterations or train.global_batch_size, or prepare more data")
    return replace(cfg, train=replace(t, iterations=n))


def _init_distributed(cfg: Config, plan: Plan) -> tuple[int, int, bool]:
    """This rank's device and process group, checked against params; (rank, world, cuda)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    device = plan.resolved.device.value
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.world_size:
        raise TrainingError(f"launched with {world} processes but params ask for "
                            f"{cfg.world_size} (hardware.num_gpus x num_nodes)")
    if device == "cuda" and cfg.hardware.vram_limit_gib:
        total = torch.cuda.get_device_properties(local_rank).total_memory
        torch.cuda.set_per_process_memory_fraction(cfg.hardware.vram_limit_gib * 2**30 / total, local_rank)
    deepspeed.runtime.utils.set_random_seed(cfg.train.seed)
    return rank, world, device == "cuda"


def _loader(cfg: Config, data_dir: Path, rank: int, world: int, cuda: bool):
    """(DataLoader, its SkipFirst sampler, pad id) over this rank's share of the prepared rows."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = PreparedDataset(data_dir)
    need = cfg.train.micro_batch_size * world
    if len(data) < need:
        raise TrainingError(f"{len(data)} prepared rows but one micro-step needs {need} "
                            f"(micro_batch_size x GPUs); raise data.num_samples")
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=cfg.train.seed, drop_last=True)
    sampler = SkipFirst(sampler)
    loader = DataLoader(data, batch_size=cfg.train.micro_batch_size, sampler=sampler,
                        pin_memory=cuda, num_workers=0)
    pad_id = int(data.meta["pad_token_id"]) if data.meta.get("pad_token_id") is not None else -1
    return loader, sampler, pad_id


def _resume(engine, cfg: Config, *, ckpt_dir: Path | None, fp: str, loader, sampler: SkipFirst,
            rank: int):
    """(start step, micro-batches from there on): the newest complete checkpoint's engine state,
    data position and RNG state when output.resume, else (0, from the first micro-batch)."""
    start = 0
    if ckpt_dir is not None and cfg.output.resume:
        start, client = checkpoint.resume(engine, ckpt_dir, fp, lambda m: rank == 0 and print(m))
    # the data position follows the step, without loading the skipped batches
    batches = micro_batches(loader, sampler, start * cfg.grad_accum_steps)
    if start:
        if (start * cfg.grad_accum_steps) % len(loader):
            # mid-epoch: the run that wrote the checkpoint made this epoch's DataLoader iterator
            # (which draws from the RNG) before saving its RNG state; so do we
            batches = itertools.chain([next(batches)], batches)
        checkpoint.set_rng_state(client.get("rng", {}))
        if rank == 0:
            tag = checkpoint.FINAL if checkpoint.final_step(ckpt_dir, fp) == start else f"step-{start}"
            print(f"resumed from {ckpt_dir}/{tag}" + (f" (step {start})" if tag == checkpoint.FINAL
                                                       else ""), flush=True)
    return start, batches


def setup(cfg: Config, plan: Plan, ds: dict, data_dir: Path, ckpt_dir: Path | None) -> Session:
    """Everything before the first step: process group, data loader, the model built (ZeRO-3
    partitioned as it is created), patched and handed to DeepSpeed, the resumed state (when
    output.resume finds a checkpoint) and the shared host gradient slot."""
    import deepspeed

    rank, world, cuda = _init_distributed(cfg, plan)
    loader, sampler, pad_id = _loader(cfg, data_dir, rank, world, cuda)
    model, keep, offloader = build(cfg, plan, ds)
    evaluator = Evaluator.open(data_dir, model, rank=rank, world=world, micro=cfg.train.micro_batch_size,
                               every=cfg.train.eval_every,
                               packed=plan.resolved.packed_attention.value in PASSES_BOUNDARIES)
    n_sp, mpu, sp = cfg.hardware.sequence_parallel, None, None
    if n_sp > 1:  # DeepSpeed's Ulysses attention and process groups (engine/ulysses.py)
        mpu = ulysses.register(model, n_sp, cfg.train.micro_batch_size, cfg.data.max_seq_length)
        sp = ulysses.SequenceParallel.of(mpu)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds,
                                      optimizer=client_optimizer(cfg),
                                      lr_scheduler=ds_config.lr_scheduler(cfg), mpu=mpu)
    fp = checkpoint.fingerprint(cfg, data_dir)
    start, batches = _resume(engine, cfg, ckpt_dir=ckpt_dir, fp=fp, loader=loader,
                            sampler=sampler, rank=rank)
    if sp is not None:
        batches = sp.shard(batches, pad_id, engine.device)
    if cfg.sparse.blocks and not start:  # a resumed run loaded its blocks with the checkpoint
        picked = block_warmup.choose(
            engine, cfg, loader.dataset, rank=rank, world=world, pad_id=pad_id, offloader=offloader,
            packed=plan.resolved.packed_attention.value in PASSES_BOUNDARIES)
        if rank == 0:
            print(f"longft: sparse warm-up: {picked}", flush=True)
    deferred = patch_optimizer(engine, cfg, plan, rank)
    host_cache.empty_after_init(cuda)  # zero.Init's freed pinned blocks back to the OS
    return Session(engine=engine, model=model, keep=keep, offloader=offloader, batches=batches,
                   pad_id=pad_id, fingerprint=fp, start=start, rank=rank, world=world, cuda=cuda,
                   evaluator=evaluator, sp=sp, deferred=deferred)


def _clock(cuda: bool):
    """perf_counter after the GPU's queued work is done: what a step phase really took."""
    import torch

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _log_step(s: Session, step: int, rec: train_step.StepRecord, *, cfg: Config, plan: Plan,
              log: RunLog, bar) -> None:
    """Step `step`'s "iter" record, the progress bar and (without a bar) a line every log_every;
    a loss that is not finite stops the run."""
    import torch

    if not math.isfinite(rec.loss):
        raise TrainingError(f"loss is {rec.loss} at step {step}: training would go "
                            f"on on garbage. Lower optim.lr, check the data, or use bf16")
    epoch = passes(step, s.rows, s.world, cfg.train.micro_batch_size, cfg.grad_accum_steps) \
        if s.rows else None
    # a resumed session warms up again; `session` (the step it resumed after) keeps each session's
    # timing apart: throughput is one session's (metrics/summary.py)
    log.write("iter", **rec.fields(), step=step, timed=step > s.start + cfg.train.warmup_iterations,
              session=s.start,
              seq_tokens=cfg.grad_accum_steps * cfg.train.micro_batch_size * cfg.data.max_seq_length,
              max_allocated_bytes=torch.cuda.max_memory_allocated() if s.cuda else None,
              max_reserved_bytes=torch.cuda.max_memory_reserved() if s.cuda else None,
              epoch=None if epoch is None else round(epoch, 4), **s.profiler.marks(step))
    if step == s.start + 1 and s.rank == 0:
        _first_step_warnings(rec.offloaded_bytes, s.offloader, plan.patches)
    if s.rank == 0:
        tok_s = rec.tokens * s.world / rec.time_s  # rank 0's tokens x ranks; metrics sum them
        gnorm = "-" if rec.grad_norm is None else f"{rec.grad_norm:.3g}"
        bar.set_postfix(loss=f"{rec.loss:.4f}", gnorm=gnorm, tok_s=f"{tok_s:.0f}")
        if s.live is not None:
            s.live.log(step, {"loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm,
                              "tokens_per_s": tok_s, "epoch": epoch})
        if step % cfg.train.log_every == 0 and bar.disable:
            ep = "" if epoch is None else f" epoch {epoch:.2f}"
            print(f"step {step}/{cfg.train.iterations} loss {rec.loss:.4f} "
                  f"lr {rec.lr:.2e} grad_norm {gnorm} {tok_s:,.0f} tok/s "
                  f"{rec.time_s:.2f} s/step{ep}", flush=True)


def _periodic_checkpoint(s: Session, cfg: Config, ckpt_dir: Path | None, step: int) -> bool:
    """output.checkpoint_every (not after the last step: the final checkpoint follows); saved?"""
    every = cfg.output.checkpoint_every
    saved = bool(ckpt_dir is not None and every and step % every == 0
                 and step < cfg.train.iterations)
    if saved:
        save_step(s.engine, cfg, ckpt_dir, step, s.fingerprint)
    return saved


def loop(s: Session, cfg: Config, plan: Plan, *, log: RunLog, ckpt_dir: Path | None,
         export_dir: Path | None = None, stopper: stop.StopRequest | None = None) -> None:
    """Steps start+1 .. train.iterations, each logged, with periodic checkpoints; then the final
    checkpoint and the export. Ends the run log with status complete, failed (re-raised; a CUDA
    out-of-memory as a TrainingError that says what to change) or interrupted (`_stop`)."""
    import torch
    from tqdm import tqdm

    now = _clock(s.cuda)
    progress = LayerProgress(decoder_layers(s.model), enabled=s.rank == 0)
    last_s = None
    bar = tqdm(range(s.start + 1, cfg.train.iterations + 1), desc="train", unit="step",
               initial=s.start, total=cfg.train.iterations, disable=s.rank != 0 or None)
    step = s.start

    def asked() -> int:  # a collective: every rank asks at the same points
        return stopper.agreed(s.engine.device) if stopper is not None else 0

    try:
        # Forward and backward (with its recompute) both run under the pinned SDPA kernel order.
        with attention.context(plan.resolved.sdpa_backend.value):
            for step in bar:
                progress.start_step(last_s)
                with s.profiler.around(step):
                    rec = train_step.step(
                        s.engine, s.batches, accum=cfg.grad_accum_steps * cfg.hardware.sequence_parallel,
                        pad_id=s.pad_id, now=now, offloader=s.offloader,
                        packed=plan.resolved.packed_attention.value in PASSES_BOUNDARIES, sp=s.sp)
                progress.end_step()
                last_s = rec.time_s
                _log_step(s, step, rec, cfg=cfg, plan=plan, log=log, bar=bar)
                if s.evaluator is not None:
                    if s.deferred is not None and s.evaluator.due(step):
                        s.deferred.finish()   # the head is gathered outside the fetches it gates
                    s.evaluator.periodic(s.engine, step, log, asked)
                saved = _periodic_checkpoint(s, cfg, ckpt_dir, step)
                if sig := asked():
                    bar.close()
                    stop_after(s.engine, cfg, ckpt_dir=ckpt_dir, step=step, fp=s.fingerprint,
                               saved=saved, signum=sig, log=log, rank=s.rank)
            if s.deferred is not None:
                s.deferred.finish()         # the last step's update, before anything reads it
            if s.evaluator is not None:
                s.evaluator.final(s.engine, step, log, asked)
            if sig := asked():  # during the final evaluation (which it ended)
                bar.close()
                stop_after(s.engine, cfg, ckpt_dir=ckpt_dir, step=step, fp=s.fingerprint,
                           saved=False, signum=sig, log=log, rank=s.rank)
        if (ckpt_dir is not None and cfg.output.save_checkpoint
                and checkpoint.final_step(ckpt_dir, s.fingerprint) != step):  # not resumed from it
            # like a step checkpoint (atomic, COMPLETE): a run whose export fails resumes here
            checkpoint.save(s.engine, ckpt_dir, step, s.fingerprint, cfg.output.keep_last,
                            {"rng": checkpoint.rng_state(), "step": step}, name=checkpoint.FINAL)
        if export_dir is not None:
            export(s.engine, cfg, export_dir, step)
        # a signal during the final checkpoint or the export: the stage exits 130/143, so the
        # run is not complete to the train stage (run/earlier.py) and DVC runs it again; final/
        # stays unfinished so that re-run resumes it and trains no step again
        late = asked()
        if ckpt_dir is not None and cfg.output.save_checkpoint and s.rank == 0 and not late:
            checkpoint.mark_finished(ckpt_dir)  # a re-run retrains; it resumes only an unfinished run
    except stop.Stopped:
        raise
    except torch.OutOfMemoryError as e:
        log.write("end", status="failed", steps=step - 1, error=f"CUDA out of memory: {e}")
        raise TrainingError(
            f"CUDA out of memory at step {step}, sequence length {cfg.data.max_seq_length}, "
            f"micro-batch {cfg.train.micro_batch_size}: lower data.max_seq_length or "
            f"train.micro_batch_size, offload more (zero.offload_param: cpu) or keep checkpointing "
            f"on") from None
    except BaseException as e:
        log.write("end", status="failed", steps=step - 1, error=f"{type(e).__name__}: {e}")
        raise
    log.write("end", status="complete", steps=step)
    if sig := late:  # during the final checkpoint or the export, both of which were finished
        log.close()
        if s.rank == 0:
            print(f"longft: {stop.name(sig)} came during the final checkpoint and export; both "
                  f"were written and the run is complete", flush=True)
        import torch.distributed as dist

        dist.barrier()
        raise stop.Stopped(sig, step)


def train(cfg: Config, plan: Plan, ds: dict, *, data_dir: Path, run_dir: Path,
          ckpt_dir: Path | None, export_dir: Path | None = None,
          stopper: stop.StopRequest | None = None) -> None:
    """One rank's run: `setup`, then `loop` logging to run_dir/rank<r>.jsonl, then a barrier so
    no rank exits while others still write. `stopper` (worker.py): SIGINT/SIGTERM stop the run after
    the current step, see stop.py."""
    import torch.distributed as dist

    live.check_available(cfg.output.tensorboard)  # before any model work
    # NVMe swap files of this run only (removed at the end; the checkpoints hold the states)
    swap = ds_config.nvme_run_dir(ds, os.environ.get("MASTER_PORT") or str(os.getppid()))
    rows = len(PreparedDataset(data_dir))
    cfg = with_steps(cfg, rows)  # train.epochs -> train.iterations, before the LR schedule is made
    s = setup(cfg, plan, ds, data_dir, ckpt_dir)
    s.rows = rows
    if s.rank == 0 and cfg.train.epochs is not None:
        per_epoch = micro_batches_per_epoch(rows, s.world, cfg.train.micro_batch_size)
        print(f"longft: train.epochs {cfg.train.epochs}: {rows} prepared rows, {per_epoch} "
              f"micro-batches of {cfg.train.micro_batch_size} an epoch per rank, "
              f"{cfg.grad_accum_steps} a step -> {cfg.train.iterations} optimizer steps", flush=True)
    s.live = live.LiveMetrics(run_dir, s.start, cfg.output.tensorboard, enabled=s.rank == 0)
    s.profiler = profiling.StepProfiler.of(cfg, run_dir, s.rank, s.start, s.cuda, s.engine)
    try:
        with RunLog(run_dir, s.rank, resume_step=s.start) as log:
            if s.rank == 0 and not s.start:
                log.write("env", **environment(cfg, plan, ds, s.engine))
            loop(s, cfg, plan, log=log, ckpt_dir=ckpt_dir, export_dir=export_dir, stopper=stopper)
    finally:
        s.profiler.close()
        s.live.close()
    dist.barrier()
    if swap and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(swap, ignore_errors=True)

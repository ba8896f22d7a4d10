"""`longft max-context --confirm`: the estimator's longest context, confirmed by short real runs.

Each candidate length (`longft.estimate.max_context.candidates_for_confirmation`, the estimator's answer +-10 %)
runs, from the longest down, through the real stages prepare -> patch -> train (then metrics) in
<work>/seq-<L>/, the way scripts/bench.py runs a row (`longft.run.pipeline.run_params`). The params
file is overlaid with

    data.max_seq_length: L          data.num_samples: iterations x global batch (synthetic/random)
    train.iterations: --iterations  train.warmup_iterations: 1 (0 when --iterations is 1)
    output: no checkpoint, no export, no resume
    hardware.vram_limit_gib: --gpu-mem - 1.9 GiB (CUDA context), when --gpu-mem is below the GPU's size
    kernels.tiled_mlp: what `auto` resolved to in the estimate (at its longest context)

The VRAM cap emulates a smaller card (say 16 GiB) on a larger one: it caps torch's reserved
memory, and the estimator's "fits" is reserved + 1.9 GiB of context <= the card. The tiled MLP is
pinned so that the runs test what was estimated: `auto` would turn it on from 65,536 tokens in some
runs only. Everything else (model, data source and packing, micro/global batch, offload,
checkpointing, the other kernels) stays as in the params.

Search: the first length that completes is the confirmed maximum. A run that does not fit goes on
down: the train stage ran out of GPU memory ("CUDA out of memory"), the train stage refused to start
because the predicted host RAM exceeds what is available, or the run completed but its measured
host RSS is above --host-mem. Any other failure stops the search (exit 2) with the stage and the
log. When every candidate is out of memory the estimator was more than ~10 % optimistic: the
search goes on halving the shortest length (multiples of 1024, down to 1024) until one fits, and
reports the bracket between the longest length that fits and the shortest that did not.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from longft.config.params import ConfigError, from_dict, merge
from longft.config.sections import GENERATED_SOURCES
from longft.estimate.max_context import SEQ_STEP
from longft.estimate.types import CUDA_CONTEXT_BYTES, GIB
from longft.hardware import TILED_MLP_FROM

FITS, NO_FIT, ERROR = "fits", "does not fit", "error"
CUDA_CONTEXT_GIB = round(CUDA_CONTEXT_BYTES / GIB, 2)


@dataclass
class RunResult:
    seq: int
    status: str                  # FITS | NO_FIT | ERROR
    seconds: float
    reason: str = ""             # NO_FIT: which memory; ERROR: stage and exit code
    measured: dict = field(default_factory=dict)   # GiB, from metrics/train.json (None: not measured)
    work: str | None = None
    log: str | None = None
    speed: dict = field(default_factory=dict)      # tokens_per_s, step_s, timed_steps (train.json)

    @property
    def fits(self) -> bool:
        return self.status == FITS


Runner = Callable[[int], RunResult]


def memory_failure(stage: str, output: str) -> str | None:
    """Why a failed stage ran out of memory, from its output; None for any other failure."""
    if stage != "train":
        return None
    # trainer.py's message, torch's OutOfMemoryError in a traceback, a kernel's failed cudaMalloc,
    # or a library's failed workspace allocation
    if any(m in output for m in ("CUDA out of memory", "CUDA error: out of memory",
                                 "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")):
        return "CUDA out of memory"
    if "not enough host RAM for this run" in output:  # preflight.host_memory's refusal
        return "host RAM: predicted peak above the RAM available (refused before start)"
    # DeepSpeed's launcher reports a rank that got SIGKILL: on a run that fills host RAM, the
    # kernel's out-of-memory killer
    if re.search(r"return code = -9\b|\bKilled\b|exit(?:ed with)? code 137\b", output):
        return "host RAM: a rank was killed (SIGKILL, most likely the kernel's out-of-memory killer)"
    return None


def measured(train: dict | None) -> dict:
    """The peaks of metrics/train.json, in GiB (None where not measured, e.g. VRAM on CPU)."""
    v, d = (train or {}).get("peak_vram") or {}, (train or {}).get("peak_dram") or {}
    return {"vram_allocated_gib": v.get("max_allocated_gib"),
            "vram_reserved_gib": v.get("max_reserved_gib"),
            "vram_nvml_gib": v.get("nvml_used_gib"), "host_rss_gib": d.get("rss_tree_gib")}


def measured_speed(train: dict | None) -> dict:
    """What a confirmation run says of speed: tokens/s and the median step of metrics/train.json
    (its timed steps; with --iterations 1 the only step, warm-up included)."""
    t = train or {}
    return {"tokens_per_s": t.get("tokens_per_s"),
            "step_s": (t.get("iter_latency_s") or {}).get("median"),
            "timed_steps": t.get("timed_steps")}


def predicted(est, tokens_per_s: float | None = None) -> dict:
    """An Estimate's peaks in GiB, and the speed heuristic's tokens/s where there is one, for the
    report."""
    return {"vram_allocated_gib": round(est.gpu_allocated / GIB, 3),
            "vram_reserved_gib": round(est.gpu_reserved / GIB, 3),
            "vram_nvml_gib": round(est.gpu_nvml / GIB, 3), "host_rss_gib": round(est.host_rss / GIB, 3),
            "tokens_per_s": round(tokens_per_s) if tokens_per_s else None}


def run_overlay(seq: int, iterations: int, global_batch: int, data_source: str,
                vram_limit_gib: float | None) -> dict:
    """The params overlay of one confirmation run (see the module docstring)."""
    over: dict = {"data": {"max_seq_length": seq},
                  # steps, not the user's train.epochs (exactly one of the two may be set)
                  "train": {"iterations": iterations, "epochs": None,
                            "warmup_iterations": 1 if iterations > 1 else 0},
                  "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 0,
                             "resume": False}}
    if data_source in GENERATED_SOURCES:   # one sample per row; files keep their read cap
        over["data"]["num_samples"] = iterations * global_batch
    if vram_limit_gib is not None:
        over["hardware"] = {"vram_limit_gib": vram_limit_gib}
    return over


class PipelineRunner:
    """The real runner: one length through prepare -> patch -> train (-> metrics)."""

    def __init__(self, params: dict, source: str, work: Path, iterations: int,
                 vram_limit_gib: float | None, host_budget_gib: float | None):
        cfg = from_dict(params, source)
        self.params, self.source, self.work = params, source, work
        self.over = lambda seq: run_overlay(seq, iterations, cfg.train.global_batch_size,
                                            cfg.data.source, vram_limit_gib)
        self.host_budget = host_budget_gib

    def params_for(self, seq: int) -> dict:
        return merge(self.params, self.over(seq))

    def check(self, seqs) -> None:
        """ConfigError now, before any run, if a length's params are invalid."""
        for s in seqs:
            from_dict(self.params_for(s), f"{self.source} with the --confirm overlay at {s}")

    def __call__(self, seq: int) -> RunResult:
        from longft.run.pipeline import run_params

        work = self.work / f"seq-{seq}"
        run = run_params(self.params_for(seq), work, self.source)
        train = run.read_json("metrics/train.json")
        m = measured(train)
        res = RunResult(seq, FITS, round(run.seconds, 1), measured=m, work=str(work),
                        log=str(run.log), speed=measured_speed(train))
        host = m["host_rss_gib"]
        if run.failed is not None:
            why = memory_failure(run.failed.name, run.failed.output)
            res.status = NO_FIT if why else ERROR
            res.reason = why or f"stage {run.failed.name} exited {run.failed.code}"
        elif self.host_budget is not None and host is not None and host > self.host_budget:
            res.status, res.reason = NO_FIT, (f"host RSS {host:.2f} GiB > --host-mem "
                                              f"{self.host_budget:g} GiB")
        return res


def search(candidates: list[int], run: Runner, say: Callable[[str], None] = print,
           step: int = SEQ_STEP) -> tuple[list[RunResult], int]:
    """Run the candidates from the longest down until one fits, or one fails for another reason.

    Returns every run's result and the confirmed maximum (0: none fits, or the search stopped on an
    error: the last result says which). When all candidates do not fit, halves the shortest one
    (rounded down to a multiple of `step`, down to `step`) until a length fits.
    """
    results: list[RunResult] = []

    def attempt(seq: int, what: str) -> bool:          # True: stop here
        say(f"[max-context] {seq:,} tokens ({what}): prepare, patch, train ...")
        t = time.time()
        r = run(seq)
        results.append(r)
        say(f"[max-context] {seq:,} tokens: {r.status}{' (' + r.reason + ')' if r.reason else ''}"
            f" after {time.time() - t:.0f} s" + (f"; log {r.log}" if r.log and not r.fits else ""))
        return r.status != NO_FIT

    order = sorted(set(candidates), reverse=True)
    if not any(attempt(s, f"candidate {i} of {len(order)}") for i, s in enumerate(order, 1)):
        seq = order[-1]
        while seq > step:
            seq = max(step, seq // 2 // step * step)
            if attempt(seq, "halving: every longer length did not fit"):
                break
    return results, (results[-1].seq if results and results[-1].fits else 0)


def vram_cap(gpu_mem: float, card_gib: float | None, params_cap: float | None) -> float | None:
    """hardware.vram_limit_gib for the runs: emulate a card of `gpu_mem` GiB on a larger one."""
    if card_gib is None or gpu_mem >= card_gib - 0.05:
        return params_cap
    cap = round(gpu_mem - CUDA_CONTEXT_GIB, 2)
    if cap <= 0:
        raise ConfigError([f"--gpu-mem {gpu_mem:g}: at most the CUDA context ({CUDA_CONTEXT_GIB} "
                           "GiB); nothing would be left to train with"], "longft max-context --confirm")
    return cap if params_cap is None else min(cap, params_cap)


def fmt(x: float | None, w: int = 6, spec: str = ".2f") -> str:
    return f"{x:{w}{spec}}" if isinstance(x, (int, float)) else f"{'-':>{w}}"


def table(results: list[RunResult], predict: Callable[[int], dict]) -> str:
    head = (f"{'length':>9}  {'predicted GiB':^22}  {'measured GiB':^29}  {'tokens/s':^15}  "
            f"{'fits':<4} {'s':>5}\n"
            f"{'':>9}  {'NVML':>6} {'resvd':>6} {'host':>8}  {'alloc':>6} {'resvd':>6} {'NVML':>6} "
            f"{'host':>8}  {'pred':>7} {'meas':>7}")
    rows = []
    for r in results:
        p, m = predict(r.seq), r.measured
        fits = {FITS: "yes", NO_FIT: "no", ERROR: "err"}[r.status]
        tps = r.speed.get("tokens_per_s") if r.fits else None
        rows.append(f"{r.seq:>9,}  {fmt(p['vram_nvml_gib'])} {fmt(p['vram_reserved_gib'])} "
                    f"{fmt(p['host_rss_gib'], 8)}  {fmt(m.get('vram_allocated_gib'))} "
                    f"{fmt(m.get('vram_reserved_gib'))} {fmt(m.get('vram_nvml_gib'))} "
                    f"{fmt(m.get('host_rss_gib'), 8)}  {fmt(p.get('tokens_per_s'), 7, ',.0f')} "
                    f"{fmt(tps, 7, ',.0f')}  "
                    f"{fits:<4} {r.seconds:5.0f}" + (f"  {r.reason}" if r.reason else ""))
    return "\n".join([head, *rows])


@dataclass
class Confirmation:
    """What `--confirm` runs with; checked (ConfigError) before the estimate is printed."""
    params: dict
    source: str
    work: Path
    out: Path
    iterations: int
    vram_limit_gib: float | None
    host_budget_gib: float | None
    device: str
    notes: list[str]

    def run(self, estimate: dict, candidates: list[int], predict: Callable[[int], dict],
            runner: Runner | None = None, say: Callable[[str], None] = print) -> int:
        """Run the search, print the table, write the JSON report; the exit code."""
        from longft.atomic import write_json

        if not candidates:
            raise ConfigError(["no length to run: --max-seq is below 1024"], "longft max-context")
        runner = runner or PipelineRunner(self.params, self.source, self.work, self.iterations,
                                          self.vram_limit_gib, self.host_budget_gib)
        if hasattr(runner, "check"):
            runner.check(candidates)
        say(f"\nlongft max-context --confirm: {len(candidates)} candidate(s), {self.iterations} "
            f"iteration(s) each, on {self.device}, in {self.work}")
        for n in self.notes:
            say(f"note: {n}")
        results, best = search(candidates, runner, say)
        last = results[-1]
        fails = [r.seq for r in results if r.status == NO_FIT and r.seq > best]
        preds = {r.seq: predict(r.seq) for r in results}     # one estimate a length, for both
        report = {"estimate": estimate, "device": self.device, "iterations": self.iterations,
                  "vram_limit_gib": self.vram_limit_gib, "host_budget_gib": self.host_budget_gib,
                  "notes": self.notes, "candidates": candidates,
                  "runs": [dict(dataclasses.asdict(r), predicted=preds[r.seq]) for r in results],
                  "confirmed_max_seq": best,
                  "shortest_not_fitting": min(fails) if fails else None, "error": None}
        say("\n" + table(results, preds.__getitem__))
        if last.status == ERROR:
            report["error"] = (f"the run at {last.seq:,} tokens failed, not for memory: "
                               f"{last.reason}; see {last.log}")
            say(f"\nstopped: {report['error']}")
        elif best == 0:
            say(f"\nnothing fits: every length down to {last.seq:,} tokens did not fit")
        else:
            say(f"\nconfirmed: {best:,} tokens train ({self.device}); the estimator said "
                f"{estimate['max_seq']:,}" + (f"; {min(fails):,} did not fit" if fails else
                                              "; the longest candidate fitted, so the limit may "
                                              "be higher (--max-seq, or a larger --gpu-mem)"))
        pinned = (self.params.get("kernels") or {}).get("tiled_mlp")
        if best and pinned == "on" and best < TILED_MLP_FROM and any("auto is on" in n for n in self.notes):
            say(f"note: these runs pinned kernels.tiled_mlp on; under auto {best:,} tokens would run "
                f"untiled (auto tiles from {TILED_MLP_FROM:,}): set kernels.tiled_mlp: on to train it")
        write_json(self.out, report)
        say(f"report: {self.out}")
        return 2 if last.status == ERROR else 0 if best else 1


def prepare(params_path: str, cfg, hw, *, model_type: str, estimated: dict, gpu_mem: float,
            host_mem: float | None, iterations: int, work: Path | None,
            out: Path | None) -> Confirmation:
    """Check the --confirm request against this machine (ConfigError: exit 2 before any run).
    `estimated`: the resolved `auto` values the estimate used."""
    import tempfile

    from longft.config.typed_yaml import DuplicateKeyError, load_yaml
    from longft.hardware import resolve

    where = "longft max-context --confirm"
    if iterations < 1:
        raise ConfigError([f"--iterations: must be >= 1, got {iterations}"], where)
    device = resolve(cfg, hw, model_type)["device"].value        # PlanError: e.g. cuda but no GPU
    notes = []
    cap = cfg.hardware.vram_limit_gib
    if device == "cuda":
        if hw.gpu_mem_gib is not None and gpu_mem > hw.gpu_mem_gib + 0.05:
            raise ConfigError([f"--gpu-mem {gpu_mem:g} is more than the {hw.gpu_mem_gib:g} GiB of "
                               f"this {hw.gpu_name}: runs here cannot confirm it (drop --confirm, "
                               "or run on a larger GPU)"], where)
        cap = vram_cap(gpu_mem, hw.gpu_mem_gib, cap)
        if cap != cfg.hardware.vram_limit_gib:
            notes.append(f"a {gpu_mem:g} GiB card emulated on the {hw.gpu_mem_gib:g} GiB "
                         f"{hw.gpu_name}: hardware.vram_limit_gib {cap:g} (the CUDA context takes "
                         f"~{CUDA_CONTEXT_GIB} GiB more)")
    else:
        notes.append("the runs are on the CPU (no CUDA GPU here, or hardware.device cpu): they show "
                     "that each length trains and measure host RAM, but confirm nothing about GPU "
                     "memory; run --confirm on the GPU for that")
    if host_mem is not None and hw.host_mem_gib and host_mem > hw.host_mem_gib + 0.05:
        notes.append(f"--host-mem {host_mem:g} GiB is more than this machine's {hw.host_mem_gib:g} "
                     "GiB: the runs are limited by this machine's RAM")
    work = work or Path(tempfile.gettempdir()) / "longft-max-context"
    try:  # the strict loader, as params.load: a repeated key is refused, not the last one kept
        raw = load_yaml(Path(params_path).read_text()) or {}
    except DuplicateKeyError as e:
        raise ConfigError([e.problem], str(params_path)) from None
    if cfg.kernels.tiled_mlp == "auto":
        # the estimate resolved auto at its longest context; so do the runs (auto would turn the
        # tiled MLP on from 65,536 in some runs and not in others)
        tiled = "on" if estimated.get("tiled_mlp") else "off"
        raw = merge(raw, {"kernels": {"tiled_mlp": tiled}})
        notes.append(f"kernels.tiled_mlp auto is {tiled} in the estimate and in every run; set it "
                     "to on or off in the params to choose")
    return Confirmation(raw, params_path, work, out or work / "max_context.json", iterations, cap,
                        host_mem, device, notes)

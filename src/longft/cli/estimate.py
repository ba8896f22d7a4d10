"""Predict before you run: `longft estimate`, `longft placement` and `longft max-context`.

    longft estimate [--params params.yaml] [--gpu-mem GiB] [--host-mem GiB]
    longft placement --gpu-mem 80 --host-mem 256 --gpus 1 --model llama3.1-8b --seq 65536 [--out overlay.yaml]
    longft max-context [--params params.yaml] [--gpu-mem GiB] [--host-mem GiB] [--max-seq N] \
        [--confirm [--iterations 2] [--work DIR] [--out FILE]]

(`longft` is the console script of longft.cli, which hands these commands to `main(command, argv)`;
`python -m longft.cli estimate ...` works without installing it.)

estimate: the itemised memory table of a params file; exit 0 when it fits, 1 when it does not, 2
for bad params (a data.max_seq_length past the model's positions among them, as prepare and patch).
placement: the fastest placement that fits (offload x checkpointing x micro-batch), written as a params
overlay; exit 1 with the closest candidate's numbers when nothing fits.
max-context: the longest sequence (a multiple of 1024) that fits, by binary search; with --confirm,
short real training runs at `candidates_for_confirmation()`, longest first, find the longest that
does train (longft.run.confirm; exit 0 found, 1 none fits, 2 bad input or a run failed otherwise).
GPU and host sizes default to the detected hardware; the flags override. Formulas, calibration and
the speed heuristic: docs/estimator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from longft.argtypes import integer, number, out_dir, out_file
from longft.cli.target import architecture_of as _architecture
from longft.cli.target import blocks_fit, within_positions
from longft.cli.target import resolve_on_gpu as _resolve
from longft.estimate.estimator import GIB, describe, estimate, fits, format_table, setup_from_config
from longft.estimate.format import unmeasured
from longft.estimate.max_context import SEQ_STEP, _max_context_auto_tiled, candidates_for_confirmation, max_context
from longft.estimate.placement import MODES, best, search, tokens_per_second
from longft.estimate.placement_overlay import overlay
from longft.hardware import TILED_MLP_FROM

__all__ = [
    "main", "COMMANDS", "cmd_estimate", "cmd_placement", "cmd_max_context", "SEQ_STEP", "max_context",
    "candidates_for_confirmation",
    # from longft.estimate.placement and .max_context, for the tests
    "tokens_per_second", "MODES", "search", "best", "overlay",
]

# ---------------------------------------------------------------- shared pieces


def _sizes(a, hw) -> tuple[float | None, float | None]:
    gpu = a.gpu_mem if a.gpu_mem is not None else hw.gpu_mem_gib
    host = a.host_mem if a.host_mem is not None else (hw.host_mem_gib or None)
    return gpu, host


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    """--params, --gpu-mem, --host-mem: the arguments `estimate` and `max-context` share."""
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu-mem", type=number(above=0, what="GiB of one GPU"),
                    help="GiB of one GPU (default: detected)")
    ap.add_argument("--host-mem", type=number(above=0, what="GiB of host RAM"),
                    help="GiB of host RAM per node (default: detected)")


def _load(params: str):
    from longft.config.params import load

    return load(params)


# ---------------------------------------------------------------- estimate


def _within_model(cfg) -> None:
    """The prepare and patch stages' refusal of a data.max_seq_length past the model's positions
    (model.loading.check_context_length), so that estimate never calls such a run one that fits."""
    from longft.model.loading import check_context_length, load_model_config

    check_context_length(load_model_config(cfg.model), cfg.data.max_seq_length, cfg.model.name)


def cmd_estimate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longft estimate",
                                 description="Itemised peak VRAM / DRAM prediction for a params file.")
    _add_run_args(ap)
    a = ap.parse_args(argv)
    from longft.hardware import detect

    cfg = _load(a.params)
    _within_model(cfg)
    hw = detect()
    arch = _architecture(cfg.model)
    blocks_fit(cfg, arch)
    resolved, notes = _resolve(cfg, hw, arch["model_type"])
    est = estimate(arch, setup_from_config(cfg, resolved))
    gpu_mem, host_mem = _sizes(a, hw)
    fit = fits(est, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)
    print(f"longft estimate: {cfg.model.name} ({a.params})")
    for n in notes + unmeasured(est.setup):
        print(f"note: {n}")
    if gpu_mem is None:
        print("note: no GPU size to compare with; pass --gpu-mem")
    print(format_table(est, fit))
    return 0 if fit.ok else 1



# ---------------------------------------------------------------- placement: longft.cli.placement


def cmd_placement(argv: list[str]) -> int:
    from longft.cli.placement import cmd_placement as placement

    return placement(argv)


def cmd_max_context(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longft max-context",
                                 description="Longest context (multiple of 1024) that fits.")
    _add_run_args(ap)
    ap.add_argument("--max-seq", type=integer(least=SEQ_STEP, what="tokens"), default=None,
                    help="upper end of the search (default: the model's max_position_embeddings)")
    ap.add_argument("--confirm", action="store_true",
                    help="then confirm with short real runs at the candidate lengths, longest first "
                    "(longft.run.confirm; docs/estimator.md)")
    ap.add_argument("--iterations", type=integer(least=1, what="steps"), default=2,
                    help="--confirm: training steps per run")
    ap.add_argument("--work", type=out_dir, help="--confirm: work folder, one seq-<L>/ per run "
                    "(default: <tmp>/longft-max-context)")
    ap.add_argument("--out", type=out_file, help="--confirm: JSON report "
                    "(default: <work>/max_context.json)")
    a = ap.parse_args(argv)
    from longft.hardware import detect

    cfg = _load(a.params)
    hw = detect()
    arch = _architecture(cfg.model)
    blocks_fit(cfg, arch)
    resolved, notes = _resolve(cfg, hw, arch["model_type"])
    gpu_mem, host_mem = _sizes(a, hw)
    if gpu_mem is None:
        print("longft max-context: no GPU here; pass --gpu-mem", file=sys.stderr)
        return 2
    if a.max_seq is not None:
        within_positions(cfg.model, a.max_seq, "--max-seq")
    top = a.max_seq or arch.get("max_position_embeddings") or 1 << 20
    base = setup_from_config(cfg, resolved)
    if cfg.kernels.tiled_mlp == "auto" and not (cfg.lora.rank > 0 and cfg.lora.dropout > 0):
        best_seq, tiled = _max_context_auto_tiled(arch, base, gpu_mem, host_mem,
                                                  cfg.hardware.vram_limit_gib, top)
        base = dataclasses.replace(base, tiled_mlp=tiled)
        resolved = {**resolved, "tiled_mlp": tiled}
        notes.append(f"kernels.tiled_mlp auto: {'on' if tiled else 'off'} at the longest context "
                     f"(on from {TILED_MLP_FROM:,} tokens)")
    else:
        best_seq = max_context(arch, base, gpu_mem_gib=gpu_mem, host_mem_gib=host_mem,
                               vram_limit_gib=cfg.hardware.vram_limit_gib, max_seq=top)
    job = None
    if a.confirm:  # bad --confirm input fails here (ConfigError, exit 2), before any run
        from longft.run.confirm import predicted, prepare

        job = prepare(a.params, cfg, hw, model_type=arch["model_type"], estimated=resolved,
                      gpu_mem=gpu_mem, host_mem=host_mem, iterations=a.iterations, work=a.work,
                      out=a.out)
    print(f"longft max-context: {cfg.model.name}, micro-batch {base.micro_batch}, "
          f"{base.world_size} rank(s), GPU {gpu_mem:g} GiB, host {host_mem} GiB, search up to {top:,}")
    for n in notes + unmeasured(base):
        print(f"note: {n}")
    if best_seq == 0:
        e = estimate(arch, dataclasses.replace(base, seq_len=SEQ_STEP))
        print(f"even {SEQ_STEP} tokens do not fit:")
        print(format_table(e, fits(e, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)))
        if job is None:
            return 1
    else:
        e = estimate(arch, dataclasses.replace(base, seq_len=best_seq))
        print(f"longest context that fits: {best_seq:,} tokens "
              f"(VRAM {e.gpu_nvml / GIB:.1f} GiB NVML-level, host {e.host_rss / GIB:.1f} GiB)")
        nxt = estimate(arch, dataclasses.replace(base, seq_len=best_seq + SEQ_STEP))
        need = (f"{best_seq + SEQ_STEP:,} would need VRAM {nxt.gpu_nvml / GIB:.1f} GiB, "
                f"host {nxt.host_rss / GIB:.1f} GiB")
        if best_seq + SEQ_STEP <= top:
            print(f"  {need}")
        elif not fits(nxt, gpu_mem, host_mem, cfg.hardware.vram_limit_gib).ok:
            print(f"  that is the upper end of the search and the limit of memory too: {need}")
        else:
            print("  that is the upper end of the search: memory is not the limit (--max-seq to go on)")
    cands = candidates_for_confirmation(best_seq, limit=top)
    print(("confirming" if job else "confirm on the GPU (--confirm)") + " with short runs at "
          "data.max_seq_length = " + ", ".join(f"{s:,}" for s in cands))
    if best_seq:
        print(format_table(e, fits(e, gpu_mem, host_mem, cfg.hardware.vram_limit_gib)))
    if job is None:
        return 0
    answer = {"model": cfg.model.name, "params": a.params, "max_seq": best_seq, "search_up_to": top,
              "gpu_mem_gib": gpu_mem, "host_mem_gib": host_mem,
              "setup": describe(dataclasses.replace(base, seq_len=best_seq or SEQ_STEP))}
    gpu_name = hw.gpu_name if job.device == "cuda" else None   # no speed to predict on the CPU

    def predict(seq):
        at = dataclasses.replace(base, seq_len=seq)
        return predicted(estimate(arch, at),
                         tokens_per_second(arch, at, gpu_name) if gpu_name else None)
    return job.run(answer, cands, predict)


COMMANDS = {"estimate": cmd_estimate, "placement": cmd_placement, "max-context": cmd_max_context}


def main(command: str, argv: list[str]) -> int:
    """Run one of `estimate`, `placement`, `max-context` with its arguments; returns the exit code
    (0 fits / found, 1 does not fit / nothing found, 2 bad params or arguments)."""
    from longft.errors import UserError

    if command not in COMMANDS:
        print(f"longft: unknown command {command!r} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](argv)
    except UserError as e:
        print(f"longft {command}: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:      # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)

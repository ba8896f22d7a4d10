"""`longft placement`: the fastest placement that fits, as a params overlay; when nothing fits, what does.

    longft placement --gpu-mem 24 --host-mem 60 --gpus 1 --model llama3.1-8b --seq 131072 \
        [--params params.yaml] [--lora any|none|RANK] [--quantize any|none|nf4|int8] \
        [--optimizer any|adamw|adamw_8bit|paged_adamw_8bit] [--optimizer-states any|fp32|bf16] \
        [--nvme-path DIR [--disk-bandwidth disk.json]] [--sparse-blocks N [--sparse-block-size B]] \
        [--data data/prepared] [--out overlay.yaml]

With a params file the overlay keeps their train.global_batch_size: only the micro-batches that
divide it are searched, the rest accumulated (`overlay_file.batch_target`; docs/planner.md says why).
The search (longft.estimate.placement) covers what the params train (full-parameter, LoRA, QLoRA or
block-sparse, over a bf16 or quantized base, and their optimizer); --lora, --quantize, --optimizer,
--optimizer-states and --sparse-blocks widen or pin it. The overlay keeps the base params' model, data and LoRA
choices. When nothing fits (exit 1) it prints the longest context that fits for full-parameter, LoRA
and QLoRA training and the smallest changes that make the asked run fit (longft.estimate.advice),
each with its predicted speed, and the overlay of the smallest. docs/estimator.md has the search and
the speed model.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from longft.argtypes import integer, number, out_file
from longft.cli.overlay_file import batch_target, write_overlay
from longft.estimate.estimator import GIB, format_table
from longft.estimate.format import unmeasured
from longft.estimate.placement import (
    NEAR_TIE,
    Candidate,
    Tuning,
    best,
    describe_placement,
    near_budget,
    search,
    why_chosen,
)
from longft.estimate.placement_overlay import overlay

QUANTIZE = ("none", "nf4", "int8")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="longft placement",
                                 description="Fastest placement that fits, as a params overlay.")
    ap.add_argument("--gpu-mem", type=number(above=0, what="GiB of one GPU"), required=True,
                    help="GiB of one GPU")
    ap.add_argument("--host-mem", type=number(above=0, what="GiB of host RAM"), required=True,
                    help="GiB of host RAM")
    ap.add_argument("--gpus", type=integer(least=1, what="GPUs"), default=1)
    ap.add_argument("--model", help="a name in configs/models, a config path, or a pretrained model "
                    "(default: the params' model.name, kept as it is)")
    ap.add_argument("--seq", type=integer(least=1, what="tokens"), required=True,
                    help="sequence length, within the model's positions")
    ap.add_argument("--out", type=out_file, help="write the overlay YAML here")
    ap.add_argument("--params", default="params.yaml",
                    help="base params (precision, kernels, LoRA); defaults if the file is absent")
    ap.add_argument("--max-micro", type=integer(least=1, what="micro-batch"), default=64)
    ap.add_argument("--gpu-name", help="GPU model for the peak-FLOPS lookup of the speed ranking "
                    "(default: the detected one)")
    ap.add_argument("--optimizer-states", choices=("fp32", "bf16", "any"),
                    help="optimizer-state precisions to search (default: the params' "
                    "zero.optimizer_states; bf16 halves their bytes but changes numerics, so it is "
                    "searched only when asked)")
    ap.add_argument("--lora", help="what trains: none (all parameters), RANK (LoRA at that rank) or "
                    "any (both; LoRA at the params' rank, else 16). Default: the params' lora.rank")
    ap.add_argument("--quantize", choices=(*QUANTIZE, "any"),
                    help="the frozen base weights under LoRA or sparse blocks: none, nf4 or int8 "
                    "(QLoRA or block-sparse over a quantized base, bitsandbytes, on ZeRO-2), or "
                    "any of them. Default: the params' lora.quantize")
    ap.add_argument("--optimizer", choices=(*OPTIMIZERS, "any"),
                    help="adamw, adamw_8bit or paged_adamw_8bit (bitsandbytes' 8-bit states on the "
                    "GPU, no optimizer offload), or any (adamw and adamw_8bit). Default: the "
                    "params' optim.name")
    ap.add_argument("--nvme-path", help="also search ZeRO-Infinity: optimizer states in files "
                    "under this directory (its free space is the disk budget)")
    ap.add_argument("--disk-bandwidth", metavar="DISK_JSON",
                    help="with --nvme-path: the disk's read and write GiB/s, the JSON that "
                    "`python bench/nvme/disk_bandwidth.py DIR --out DISK_JSON` writes; NVMe "
                    "speeds are predicted at them (default: 2e9 B/s each way, assumed)")
    ap.add_argument("--sparse-blocks", type=integer(least=0, what="blocks"),
                    help="block-sparse finetuning: blocks trained per target matrix (sparse.blocks; "
                    "0: off), in place of the params' own (and of their LoRA). Default: the params'")
    ap.add_argument("--data", help="a prepared data directory (data/prepared after `dvc repro`): "
                    "predict tokens/s at its documents' lengths and padding (its stats.json), as "
                    "the run will count them; without it, one document fills each row")
    ap.add_argument("--sparse-block-size", type=integer(least=1, what="block size"),
                    help="the blocks' side with --sparse-blocks (sparse.block_size). Default: the "
                    "params'")
    return ap


def tunings(cfg, lora: str | None, quantize: str | None, optimizer: str | None) -> tuple[Tuning, ...]:
    """What the search may train, the params' own way first: --lora x --quantize x --optimizer,
    each defaulting to the params. Raises ValueError for a combination that cannot be."""
    own = Tuning(cfg.lora.rank, cfg.lora.quantize if cfg.lora.rank else "none", cfg.optim.name)
    sparse = cfg.sparse.blocks and lora is None  # the params train blocks (sparse.*): search that
    if lora is None:
        ranks = [cfg.lora.rank]
    elif lora == "none":
        ranks = [0]
    elif lora == "any":
        ranks = [0, cfg.lora.rank or 16]
    elif lora.isdigit() and int(lora) > 0:
        ranks = [int(lora)]
    else:
        raise ValueError(f"--lora {lora!r}: give none, any or a rank > 0")
    quants = (list(QUANTIZE) if quantize == "any" else [quantize] if quantize
              else [cfg.lora.quantize])
    if quantize not in (None, "none") and not any(ranks) and not sparse:   # any too: else ignored
        raise ValueError(f"--quantize {quantize} quantizes the base weights under LoRA or sparse "
                         "blocks: add --lora RANK or --lora any (the params train all parameters)")
    opts = ["adamw", "adamw_8bit"] if optimizer == "any" else [optimizer or cfg.optim.name]
    out = [Tuning(r, q if r else "none", o) for r in ranks for q in quants for o in opts]
    if sparse:  # blocks over the params' base (bf16, or quantized), or over --quantize's
        out = [Tuning(0, q, o, cfg.sparse.blocks, cfg.sparse.block_size) for q in quants
               for o in opts]
        own = Tuning(0, cfg.lora.quantize, cfg.optim.name, cfg.sparse.blocks, cfg.sparse.block_size)
    out = list(dict.fromkeys(out))
    return tuple(sorted(out, key=lambda t: t != own))


def _model_overlay(a, base_cfg, shipped: bool) -> tuple[dict | None, str | None]:
    """The overlay's model section and a note: none when the search is for the base params' own model
    (by name, or by the same architecture: a pretrained model asked for by its shipped name keeps
    its weights); else the asked model (an architecture is a random-init run)."""
    if a.model is None or base_cfg is None or a.model == base_cfg.model.name:
        return None, None
    section = {"name": a.model, **({"source": "random"} if shipped else {})}
    try:
        from longft.cli.target import architecture_of
        from longft.config.params import ModelConfig
        from longft.estimate.arch import dims

        same = dims(architecture_of(base_cfg.model)) == dims(architecture_of(ModelConfig(**section)))
    except Exception:  # noqa: BLE001 - the params' model may not load here (hub id offline)
        same = False
    m = base_cfg.model
    if same:
        return None, (f"{a.model} has the architecture of the params' model {m.name!r} "
                      f"({m.source}): the overlay keeps the params' model")
    return section, (f"the overlay sets model {section}: it replaces the params' model {m.name!r} "
                     f"({m.source}); leave out --model to search for the params' own model")


def _config(a):
    """(the Config to search placements for, the overlay's model section or None, a note about it or None,
    the params' global batch or None): the base params (or the defaults) at --seq and --gpus, with
    --model where it is another model."""
    from longft.config.params import from_dict, load
    from longft.model.loading import shipped_architectures

    has_params = Path(a.params).is_file()
    base_cfg = load(a.params) if has_params else None
    shipped = a.model is not None and (a.model in shipped_architectures()
                                       or Path(a.model).suffix == ".json")
    model_over, model_note = _model_overlay(a, base_cfg, shipped)
    if base_cfg is None:     # no params to keep a model from: the overlay names it
        model_over = {"name": a.model, **({"source": "random"} if shipped else {})}
    nodes = base_cfg.hardware.num_nodes if base_cfg else 1   # --gpus is per node, as num_gpus
    over = {"data": {"max_seq_length": a.seq}, "hardware": {"num_gpus": a.gpus},
            "train": {"micro_batch_size": 1, "global_batch_size": a.gpus * nodes},
            **({"model": model_over} if model_over else {})}
    if a.sparse_blocks is not None:   # blocks in place of the params' own and of their LoRA
        over["sparse"] = {"blocks": a.sparse_blocks,
                          **({"block_size": a.sparse_block_size} if a.sparse_block_size else {})}
        if a.sparse_blocks:
            over["lora"] = {"rank": 0}
    elif a.sparse_block_size is not None:
        over["sparse"] = {"block_size": a.sparse_block_size}
    cfg = load(a.params, over) if has_params else from_dict(over, a.params)
    return cfg, model_over, model_note, base_cfg.train.global_batch_size if base_cfg else None


def cmd_placement(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    from longft.cli.target import architecture_of, blocks_fit, resolve_on_gpu, within_positions
    from longft.estimate.estimator import setup_from_config
    from longft.hardware import detect

    if a.model is None and not Path(a.params).is_file():
        print("longft placement: no --model and no params file to take it from", file=sys.stderr)
        return 2
    if a.sparse_blocks and a.lora is not None:
        print(f"longft placement: --sparse-blocks {a.sparse_blocks} searches block-sparse "
              f"finetuning and --lora {a.lora} another way of training, and a run trains one way: "
              "leave out --lora, or --sparse-blocks (when nothing fits, the answer lists LoRA and "
              "blocks side by side)", file=sys.stderr)
        return 2
    cfg, model_over, model_note, params_batch = _config(a)
    batch, batch_note = batch_target(params_batch, cfg.world_size)
    try:
        allowed = tunings(cfg, a.lora, a.quantize, a.optimizer)
    except ValueError as e:
        print(f"longft placement: {e}", file=sys.stderr)
        return 2
    hw = detect()
    arch = architecture_of(cfg.model)
    within_positions(cfg.model, a.seq, "--seq")
    blocks_fit(cfg, arch)
    resolved, notes = resolve_on_gpu(cfg, hw, arch["model_type"])
    base = setup_from_config(cfg, resolved)
    data_note = None
    if a.data:
        from longft.data.store import attention_shape

        span, padding = attention_shape(a.data, a.seq)
        base = dataclasses.replace(base, attention_length=span, padding=padding)
        data_note = (f"speed at {a.data}'s documents: attention over {span:,.0f} tokens on average "
                     f"(sum of L^2 / sum of L), {padding:.0%} padding left out of tokens/s")
    gpu_name = a.gpu_name or (hw.gpu_name if hw.device == "cuda" else None)
    wanted = a.optimizer_states or cfg.zero.optimizer_states
    states = ("fp32", "bf16") if wanted == "any" else (wanted,)
    if "bf16" in states and base.precision != "bf16":
        print(f"longft placement: bf16 optimizer states need precision bf16 (resolved {base.precision}); "
              "searching fp32 states only", file=sys.stderr)
        states = ("fp32",)
    disk = disk_note = None
    if a.disk_bandwidth and not a.nvme_path:
        print("longft placement: --disk-bandwidth is the disk under --nvme-path: give --nvme-path "
              "DIR too", file=sys.stderr)
        return 2
    if a.nvme_path:
        from longft.hardware import nvme

        bad = nvme.path_problems(a.nvme_path, 0)
        if bad:
            print("longft placement: " + "; ".join(bad), file=sys.stderr)
            return 2
        disk = shutil.disk_usage(a.nvme_path).free / GIB
        if a.disk_bandwidth:
            try:
                read, write = nvme.bandwidth(a.disk_bandwidth)
            except ValueError as e:
                print(f"longft placement: {e}", file=sys.stderr)
                return 2
            base = dataclasses.replace(base, disk_read_bps=read, disk_write_bps=write)
            disk_note = (f"NVMe speed at {a.disk_bandwidth}'s disk: read {read / GIB:.2f} GiB/s, "
                         f"write {write / GIB:.2f} GiB/s")
        else:
            disk_note = ("NVMe speed assumes the disk reads and writes 2e9 B/s (1.86 GiB/s); "
                         "measure yours with `python bench/nvme/disk_bandwidth.py "
                         f"{a.nvme_path} --out disk.json` and pass --disk-bandwidth disk.json")
    def run_search(tunings: tuple[Tuning, ...], global_batch: int | None) -> list[Candidate]:
        return search(arch, base, gpu_mem_gib=a.gpu_mem, host_mem_gib=a.host_mem, gpu_name=gpu_name,
                      max_micro=a.max_micro, share_grads=cfg.zero.host_grad_buffer != "full", states=states,
                      disk_gib=disk, tunings=tunings, chunked_copy_back=cfg.zero.copy_back != "deepspeed",
                      global_batch=global_batch)
    cands = run_search(allowed, batch)
    model_name = a.model or cfg.model.name
    print(f"longft placement: {model_name}, seq {a.seq:,}, {a.gpus} GPU(s) of {a.gpu_mem:g} GiB, "
          f"host {a.host_mem:g} GiB")
    from longft.estimate.speed import peak_note

    speed_note = peak_note(gpu_name, base.precision)
    for n in notes + [n for n in (model_note, data_note, batch_note, speed_note, disk_note) if n]:
        print(f"note: {n}")
    print("searched: " + "; ".join(t.name for t in allowed) + f"; optimizer states "
          f"{', '.join(states)}" + ("; NVMe" if disk is not None else "")
          + " (--lora, --quantize, --optimizer, --optimizer-states, --nvme-path widen it)")
    _print_fitting(cands, a.gpu_mem, a.host_mem)
    choice = best(cands, gpu_mem_gib=a.gpu_mem, host_mem_gib=a.host_mem)
    if choice is None:
        from longft.cli.placement_advice import nothing_fits

        return nothing_fits(a, arch, base, cands, allowed=allowed, states=states, disk=disk, cfg=cfg,
                            gpu_name=gpu_name, model_over=model_over, params_batch=params_batch)
    print(f"\nchosen: {describe_placement(choice)} (~{choice.tokens_per_s:,.0f} tok/s predicted)")
    if batch:
        s = choice.setup
        print(f"batch: micro-batch {s.micro_batch} x {s.world_size} GPU(s) x {s.grad_accum} "
              f"accumulation step(s) = global batch {batch}" + (
                  "" if batch_note else ", the params' train.global_batch_size (only the "
                  "micro-batches that divide it were searched)"))
        larger = best(run_search((Tuning.of(choice.setup),), None), gpu_mem_gib=a.gpu_mem, host_mem_gib=a.host_mem)
        _say_larger_batch(choice, larger, batch)
    why = why_chosen(choice, cands, a.gpu_mem, a.host_mem)
    if why:
        print(f"not the fastest: {why}")
    for w in near_budget(choice, a.gpu_mem, a.host_mem):
        print(f"warning: {w}")
    for n in unmeasured(choice.setup):
        print(f"note: {n}")
    print(format_table(choice.est, choice.fit))
    write_overlay(a.out, overlay(choice, a.gpus, model_over, a.nvme_path), choice, gpu_mem=a.gpu_mem,
                  host_mem=a.host_mem, params_batch=params_batch)
    return 0


def _say_larger_batch(choice: Candidate, larger: Candidate | None, batch: int) -> None:
    """A note where a larger global batch (one micro-step a step, same tuning) is faster beyond a
    near-tie: what the overlay did not trade the params' batch for, and how to plan it."""
    if larger is None or larger.tokens_per_s <= (1 + NEAR_TIE) * choice.tokens_per_s:
        return
    s = larger.setup
    if s.micro_batch * s.world_size <= batch:
        return
    print(f"note: a larger global batch trains faster here: micro-batch {s.micro_batch} x "
          f"{s.world_size} GPU(s) = global batch {s.micro_batch * s.world_size}, "
          f"~{larger.tokens_per_s:,.0f} tok/s (the optimizer step spread over more rows); it "
          f"changes the training (steps per epoch, the learning rate that suits it), so the "
          f"overlay keeps {batch}; to plan it, set train.global_batch_size: "
          f"{s.micro_batch * s.world_size} and run this again")


def _print_fitting(cands: list[Candidate], gpu_mem: float, host_mem: float) -> None:
    ok = sorted((c for c in cands if c.fit.ok), key=lambda c: -c.tokens_per_s)
    print(f"{len(ok)} fitting candidate(s); fastest per tuning x offload x checkpointing:")
    seen = set()
    for c in ok:
        s = c.setup
        key = (s.lora_rank, s.quantize, s.optimizer, c.offload, s.offload_ratio,
               s.optimizer_states, s.checkpointing)
        if key not in seen:
            seen.add(key)
            flag = "  (within 3 % of a budget)" if near_budget(c, gpu_mem, host_mem) else ""
            print(f"  {describe_placement(c)}: ~{c.tokens_per_s:,.0f} tok/s, GPU "
                  f"{c.est.gpu_nvml / GIB:.1f} GiB, host {c.est.host_rss / GIB:.1f} GiB{flag}")

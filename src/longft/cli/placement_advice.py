"""`longft placement` when nothing fits: the closest candidate, the longest context that fits for
full-parameter, LoRA and QLoRA training, the smallest changes that make the asked run fit, each
with its speed and overlay, and the overlay of the smallest in full (longft.estimate.advice
computes them; this module prints them, and with --out writes each overlay beside it)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from longft.estimate.advice import Ask, alternatives, longest_contexts, recommended
from longft.estimate.estimator import GIB, format_table
from longft.estimate.placement import Candidate, describe_placement, near_budget
from longft.estimate.placement_overlay import overlay


def _speed(c: Candidate, a) -> str:
    """Predicted speed and memory of a candidate, and on the next line its placement."""
    q = " (unmeasured)" if c.setup.quantize != "none" else ""
    near = " (within 3 % of a budget)" if near_budget(c, a.gpu_mem, a.host_mem) else ""
    return (f"~{c.tokens_per_s:>6,.0f} tok/s{q}, GPU {c.est.gpu_nvml / GIB:4.1f} GiB, host "
            f"{c.est.host_rss / GIB:5.1f} GiB{near}\n{'':6s}{describe_placement(c, tuning=False)}")


def _alt_path(out: str, name: str) -> Path:
    """Where --out puts the overlay of an alternative: overlay.yaml -> overlay.lora-r-16.yaml."""
    p = Path(out)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return p.with_name(f"{p.stem}.{slug}{p.suffix or '.yaml'}")


class _Overlays:
    """Prints each alternative's overlay on one line and, with --out, writes it to its own file."""

    def __init__(self, a, model_over: dict | None, params_batch: int | None):
        self.a, self.model_over, self.written = a, model_over, []
        self.params_batch = params_batch

    def show(self, name: str, c: Candidate, gpus: int) -> dict:
        from longft.cli.overlay_file import batch_changed, write_overlay

        ov = overlay(c, gpus, self.model_over, self.a.nvme_path)
        print(f"{'':6s}overlay: " + yaml.safe_dump(ov, default_flow_style=True, sort_keys=False,
                                                   width=1 << 16).strip())
        changed = batch_changed(ov, c.setup, self.params_batch)
        if changed:  # said beside the line a user copies, not only in the written file's header
            print(f"{'':6s}note: {changed}")
        if self.a.out:
            path = _alt_path(self.a.out, name)
            write_overlay(str(path), ov, c, gpu_mem=self.a.gpu_mem, host_mem=self.a.host_mem,
                          quiet=True, title=f"longft placement, instead of the asked run: {name}",
                          params_batch=self.params_batch)
            self.written.append(path)
        return ov


def nothing_fits(a, arch: dict, base, cands: list[Candidate], *, allowed, states, disk, cfg,
                 gpu_name: str | None, model_over: dict | None,
                 params_batch: int | None = None) -> int:
    """Print what fits instead of the asked run; exit code 1 (the asked run does not fit). Its
    overlays keep the params' global batch (`params_batch`, micro-batches that divide it,
    accumulating the rest) as the asked run's search does; where they cannot (more GPUs than
    divide it), each overlay's header says so."""
    from longft.cli.overlay_file import batch_target, write_overlay

    closest = min(cands, key=lambda c: c.overshoot(a.gpu_mem, a.host_mem))
    print(f"\nnothing fits. Closest: {describe_placement(closest)}:")
    print(format_table(closest.est, closest.fit))
    ask = Ask(gpu_mem_gib=a.gpu_mem, host_mem_gib=a.host_mem, gpus=a.gpus, gpu_name=gpu_name,
              states=states, tunings=allowed, disk_gib=disk, max_micro=a.max_micro,
              share_grads=cfg.zero.host_grad_buffer != "full",
              chunked_copy_back=cfg.zero.copy_back != "deepspeed",
              tiled_auto=cfg.kernels.tiled_mlp == "auto", lora_dropout=cfg.lora.dropout,
              top=max(a.seq, int(arch.get("max_position_embeddings") or a.seq)),
              global_batch=batch_target(params_batch, cfg.world_size)[0])
    shown = _Overlays(a, model_over, params_batch)
    print(f"\nlongest context that fits on {a.gpus} GPU(s) of {a.gpu_mem:g} GiB with "
          f"{a.host_mem:g} GiB of host RAM (up to {ask.top:,}):")
    for t, seq, c in longest_contexts(arch, base, ask):
        print(f"  {t.name:18s} " + (f"{seq:>9,} tokens  {_speed(c, a)}" if c else
                                     "none fits, not even 1,024 tokens"))
        if c:
            shown.show(f"longest {t.name}", c, a.gpus)
    alts = alternatives(arch, base, ask)
    print(f"\nchanges that make the asked run ({allowed[0].name}, {a.seq:,} tokens) fit, smallest "
          "first:")
    for alt in alts:
        flags = f"  [{alt.flags}]" if alt.flags else ""
        print(f"  {alt.change:34s} " + (_speed(alt.candidate, a) if alt.candidate else "does not fit")
              .replace("\n", f"{flags}\n", 1) + ("" if alt.candidate else flags))
        if alt.note:
            print(f"{'':6s}{alt.note}")
        if alt.candidate and (a.nvme_path or not alt.candidate.setup.nvme):  # NVMe: --nvme-path
            shown.show(alt.change, alt.candidate, alt.gpus)
    from longft.cli.overlay_file import experiment_of, run_line

    if shown.written:
        print(f"\nwrote (each runs as a DVC experiment named after its file and params; {a.out} "
              "itself is not written, the asked run does not fit):")
    for p in shown.written:
        print(f"  {p}: {run_line(p)}  (experiment {experiment_of(p)})")
    rec = recommended(alts, nvme_checked=bool(a.nvme_path))
    if rec is None:
        print("\nno single change makes it fit; the longest contexts above are what fits")
        return 1
    c = rec.candidate
    print(f"\nsmallest change that fits: {rec.change} (~{c.tokens_per_s:,.0f} tok/s predicted). "
          f"Its overlay (merge onto {a.params}; `longft placement ... {rec.flags}` "
          "searches it as the asked run):")
    write_overlay(None, overlay(c, rec.gpus, model_over, a.nvme_path), c, gpu_mem=a.gpu_mem,
                  host_mem=a.host_mem, title=f"longft placement, instead of the asked run: {rec.change}",
                  params_batch=params_batch)
    path = _alt_path(a.out, rec.change) if a.out else None
    if path in shown.written:
        print(f"run it: {run_line(path)}  (experiment {experiment_of(path)})")
    return 1

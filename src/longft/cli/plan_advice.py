"""`longft plan` when nothing fits: the closest candidate, the longest context that fits for
full-parameter, LoRA and QLoRA training, the smallest changes that make the asked run fit, and the
overlay of the smallest (longft.estimate.advice computes them; this module prints)."""

from __future__ import annotations

from longft.estimate.advice import Ask, alternatives, longest_contexts, recommended
from longft.estimate.estimator import GIB, format_table
from longft.estimate.placement import Candidate, describe_placement, overlay


def _speed(c: Candidate) -> str:
    """Predicted speed and memory of a candidate, and on the next line its placement."""
    q = " (unmeasured)" if c.setup.quantize != "none" else ""
    return (f"~{c.tokens_per_s:>6,.0f} tok/s{q}, GPU {c.est.gpu_nvml / GIB:4.1f} GiB, host "
            f"{c.est.host_rss / GIB:5.1f} GiB\n{'':6s}{describe_placement(c, tuning=False)}")


def nothing_fits(a, arch: dict, base, cands: list[Candidate], allowed, states, disk, cfg,
                 gpu_name: str | None, model_over: dict | None) -> int:
    """Print what fits instead of the asked run; exit code 1 (the asked run does not fit)."""
    from longft.cli.plan import write_overlay

    closest = min(cands, key=lambda c: c.overshoot(a.gpu_mem, a.host_mem))
    print(f"\nnothing fits. Closest: {describe_placement(closest)}:")
    print(format_table(closest.est, closest.fit))
    ask = Ask(gpu_mem_gib=a.gpu_mem, host_mem_gib=a.host_mem, gpus=a.gpus, gpu_name=gpu_name,
              states=states, tunings=allowed, disk_gib=disk, max_micro=a.max_micro,
              share_grads=cfg.zero.host_grad_buffer != "full",
              tiled_auto=cfg.kernels.tiled_mlp == "auto", lora_dropout=cfg.lora.dropout,
              top=max(a.seq, int(arch.get("max_position_embeddings") or a.seq)))
    print(f"\nlongest context that fits on {a.gpus} GPU(s) of {a.gpu_mem:g} GiB with "
          f"{a.host_mem:g} GiB of host RAM (up to {ask.top:,}):")
    for t, seq, c in longest_contexts(arch, base, ask):
        print(f"  {t.name:18s} " + (f"{seq:>9,} tokens  {_speed(c)}" if c else
                                     "none fits, not even 1,024 tokens"))
    alts = alternatives(arch, base, ask)
    print(f"\nchanges that make the asked run ({allowed[0].name}, {a.seq:,} tokens) fit, smallest "
          "first:")
    for alt in alts:
        flags = f"  [{alt.flags}]" if alt.flags else ""
        print(f"  {alt.change:34s} " + (_speed(alt.candidate) if alt.candidate else "does not fit")
              .replace("\n", f"{flags}\n", 1) + ("" if alt.candidate else flags))
        if alt.note:
            print(f"{'':6s}{alt.note}")
    rec = recommended(alts)
    if rec is None:
        print("\nno single change makes it fit; the longest contexts above are what fits")
        return 1
    c = rec.candidate
    print(f"\nsmallest change that fits: {rec.change} (~{c.tokens_per_s:,.0f} tok/s predicted). "
          f"Its overlay (merge onto {a.params}; `longft plan ... {rec.flags}` plans it as the "
          "asked run and writes it with --out):")
    write_overlay(None, overlay(c, rec.gpus, model_over, None), c, a.gpu_mem, a.host_mem,
                  title=f"longft plan, instead of the asked run: {rec.change}")
    return 1

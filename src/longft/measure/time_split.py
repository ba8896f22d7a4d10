"""The time split of profiled optimizer steps (output.profile_steps): where a step's seconds go,
computed from torch.profiler's Chrome trace events (engine/profiling.py records and exports them).

Phases are the CPU ranges engine/train_step.py opens: `longft.forward`, `longft.backward`,
`longft.optimizer` (the final engine.step()) and, inside it, the inner optimizer's own update
`longft.update` (CPU Adam with zero.offload_optimizer cpu) and, where DeepSpeed's ZeRO optimizer has
them (engine/profiling.py times its methods), `longft.clip` (its gradient unscale-and-clip pass,
over the host's fp32 gradients with offload) and `longft.copy_back` (the updated master weights
into the 16-bit partitions: DeepSpeed's own copy or zero.copy_back chunked); each profiled step
lies in a `longft.step` range. On a CUDA run every phase also gets its GPU side, from the kernel,
memcpy and memset events inside the phase's CPU range (the step clock synchronizes the GPU at the end of
forward, backward and optimizer, so their GPU work finishes inside their ranges; the nested ranges
count what ran during them: the chunked copy-back's copies mostly land after `longft.copy_back`):
  compute_s       union of kernel intervals (collectives' NCCL kernels excepted)
  comm_s          union of NCCL kernels (several GPUs: includes the time spent waiting for peers)
  htod_s, dtoh_s  union of host-to-device / device-to-host copies
  other_copy_s    union of the other copies (device to device) and memsets
  copy_overlap_s  copy time during which a kernel ran too (hidden behind compute)
  gpu_idle_s      the phase's time with no GPU activity at all (the GPU waits for the host)
Without GPU events (a CPU run) these fields are absent, not zero. `other_s` of a step is its time
outside the three phases (the next micro-batch read and copied, the clock's synchronizations).
"""

from __future__ import annotations

from longft.measure.intervals import Interval, intersect, length, union

STEP = "longft.step"
PHASES = ("forward", "backward", "optimizer", "update", "clip", "copy_back")
TOP = PHASES[:3]
"""The phases that do not nest: the rest of a step is `other_s`."""
RANGE = {p: f"longft.{p}" for p in PHASES}
"""The record_function name of each phase."""
GPU_KINDS = ("compute", "comm", "htod", "dtoh", "other_copy")


def gpu_kind(event: dict) -> str | None:
    """Which GPU activity a Chrome trace event is (one of GPU_KINDS), None for a CPU event."""
    cat, name = event.get("cat"), event.get("name", "")
    if cat == "kernel":
        return "comm" if name.lower().startswith("nccl") else "compute"
    if cat == "gpu_memcpy":
        return "htod" if "HtoD" in name else "dtoh" if "DtoH" in name else "other_copy"
    return "other_copy" if cat == "gpu_memset" else None


def _seconds(event: dict) -> Interval:
    """A complete ("X") event's (start, end) in seconds (the trace's ts and dur are microseconds)."""
    return event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6


def phase_split(cpu: list[Interval], gpu: dict[str, list[Interval]] | None) -> dict:
    """One phase: its CPU ranges' time, and with `gpu` ({kind: union of its intervals}) the GPU
    fields of the module docstring over those ranges."""
    wall = union(cpu)
    out = {"time_s": length(wall)}
    if gpu is not None:
        parts = {k: intersect(gpu[k], wall) for k in GPU_KINDS}
        copies = union(parts["htod"] + parts["dtoh"] + parts["other_copy"])
        out.update({f"{k}_s": length(v) for k, v in parts.items()})
        out["copy_overlap_s"] = length(intersect(parts["compute"], copies))
        out["gpu_idle_s"] = out["time_s"] - length(union(parts["compute"] + parts["comm"] + copies))
    return {k: round(v, 6) for k, v in out.items()}


def split(events: list[dict], steps: list[int]) -> dict:
    """The split of each profiled step (`steps`, in order: one `longft.step` range each) and their
    sum: {"steps", "gpu" (GPU fields present), "per_step": [{"step", "wall", "other_s", and a
    phase_split per PHASES}], "total": the same summed}."""
    marks = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    walls = sorted(_seconds(e) for e in marks if e.get("name") == STEP)
    if len(walls) != len(steps):
        raise ValueError(f"{len(walls)} {STEP} ranges in the trace for {len(steps)} profiled steps")
    kinds = [(gpu_kind(e), e) for e in events if e.get("ph") == "X"]
    gpu = None
    if any(k for k, _ in kinds):
        gpu = {k: union(_seconds(e) for kk, e in kinds if kk == k) for k in GPU_KINDS}
    per_step = []
    for n, (a, b) in zip(steps, walls):
        inside = [(e["name"], _seconds(e)) for e in marks if a <= _seconds(e)[0] < b]
        rec = {"step": n, "wall": phase_split([(a, b)], gpu)}
        for p in PHASES:
            rec[p] = phase_split([i for name, i in inside if name == RANGE[p]], gpu)
        rec["other_s"] = round(rec["wall"]["time_s"] - sum(rec[p]["time_s"] for p in TOP), 6)
        per_step.append(rec)
    return {"steps": list(steps), "gpu": gpu is not None, "per_step": per_step,
            "total": _total(per_step)}


def _total(per_step: list[dict]) -> dict:
    """Every field of the per-step records summed over the steps."""
    out: dict = {"other_s": round(sum(r["other_s"] for r in per_step), 6)}
    for p in ("wall",) + PHASES:
        keys = per_step[0][p] if per_step else {}
        out[p] = {k: round(sum(r[p][k] for r in per_step), 6) for k in keys}
    return out


COLUMNS = (("time_s", "s"), ("compute_s", "compute"), ("comm_s", "NCCL"), ("htod_s", "HtoD"), ("dtoh_s", "DtoH"),
           ("other_copy_s", "other copy"), ("copy_overlap_s", "copy||compute"),
           ("gpu_idle_s", "GPU idle"))


def table(s: dict, optimizer: str) -> str:
    """The summed split as a compact table: seconds per phase, and the GPU columns when present."""
    cols = COLUMNS if s["gpu"] else COLUMNS[:1]
    t, first, last = s["total"], s["steps"][0], s["steps"][-1]
    rows = [("step (wall)", t["wall"]), ("forward", t["forward"]), ("backward", t["backward"]),
            ("optimizer", t["optimizer"]), (f"  update ({optimizer})", t["update"])]
    rows += [(name, t[p]) for p, name in (("clip", "  clip (gradients)"),
                                          ("copy_back", "  copy back (weights)"))
             if t.get(p, {}).get("time_s")]             # only where the trace has the range
    rows.append(("other", {"time_s": t["other_s"]}))
    w, cw = max(len(r[0]) for r in rows), [max(len(c), 8) for _, c in cols]
    head = f"{'':{w}}" + "".join(f"  {c:>{n}}" for (_, c), n in zip(cols, cw))
    lines = [f"time split of profiled step(s) {first}..{last}, summed, seconds:", head]
    for name, v in rows:
        lines.append(f"{name:{w}}" + "".join(
            f"  {v[k]:{n}.4f}" if k in v else f"  {'':{n}}" for (k, _), n in zip(cols, cw)))
    return "\n".join(line.rstrip() for line in lines)

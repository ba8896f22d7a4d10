"""`longft report --benchmarks bench/results`: the one current results table that opens
BENCHMARKS.md, generated from the bench result files (scripts/bench.py's JSON), with the reference
study's rows beside the rows that run its workload.

    longft report --benchmarks bench/results                 # print the markdown table
    longft report --benchmarks bench/results --out table.md  # or write it

BENCHMARKS.md holds the output between the markers in MARKERS; tests/test_results_table.py fails
when the two differ, so the table cannot go stale. Which rows are current is a choice written
down here (CURRENT): the latest measured row of each workload. Superseded rows and their history
are in bench/LOG.md; a new measurement replaces its row's JSON and the table follows.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from longft.atomic import write_text
from longft.config.plan import Resolved
from longft.errors import UserError

MARKERS = ("<!-- results-table -->", "<!-- /results-table -->")
"""BENCHMARKS.md's generated block lies between these two lines."""


@dataclass(frozen=True)
class Reference:
    """One row of the reference study, measured with its own script on an H200 (random-init
    weights, SDPA, all-zero token ids; /work/shared/device/NOTES.md). Its "MB" are MiB."""
    name: str
    tokens_per_s: float
    vram_gib: float
    host_gib: float
    note: str


REFERENCES = {
    "A": Reference("A", 35_656, 28.64, 3.9, "median step"),
    "B": Reference("B", 37_377, 49.73, 31.6, "median step"),
    "C": Reference("C", 2_750, 52.9, 174.0, "printed as 54.2 GB, in MiB"),
}


@dataclass(frozen=True)
class Current:
    """One row of the table: a workload and the bench result (bench/results/<stem>.json) that is
    its latest measurement; `reference` names the reference row running the same workload."""
    workload: str
    stem: str
    reference: Optional[str] = None


CURRENT = (
    Current("reference A's workload at A's memory", "1b-16k-gpu-mb4", "A"),
    Current("reference A's workload, every attention output kept", "h200-1b-16k-gpu", "A"),
    Current("reference B's workload (micro-batch 20)", "h200-1b-16k-offload", "B"),
    Current("reference B's workload at B's memory", "h200-1b-16k-offload-w2mem", "B"),
    Current("the same, its allocator capped (a 53.6 GiB card)", "h200-1b-16k-offload-w2mem-cap",
            "B"),
    Current("reference B's workload at B's memory, flash-attn-4 kept", "h200-1b-16k-offload-w2mem-fa4",
            "B"),
    Current("the same, its allocator capped (a 53.6 GiB card)", "h200-1b-16k-offload-w2mem-fa4-cap",
            "B"),
    Current("the same, DeepSpeed's step as it is (zero.overlap_step off), same lease as the next",
            "h200-1b-16k-offload-w2mem-fa4-off", "B"),
    Current("the same, the step overlapped with the next forward (11 sub-groups)",
            "h200-1b-16k-offload-w2mem-fa4-overlap", "B"),
    Current("the same, the step overlapped with the next forward (18 sub-groups)",
            "h200-1b-16k-offload-w2mem-fa4-overlap-5e7", "B"),
    Current("B's memory, `longft placement`'s fastest placement (its own micro-batch)",
            "h200-1b-16k-w2mem-fastest"),
    Current("the same placement on ZeRO-2", "h200-1b-16k-w2mem-fastest-zero2"),
    Current("packed documents, flash-attn-4", "h200-1b-16k-packed-flash_attn_4"),
    Current("packed documents, flash-attn-4", "h200-1b-128k-packed-flash_attn_4"),
    Current("LoRA rank 8", "q3-1b-16k-lora8"),
    Current("reference C's workload in 40 GB of VRAM, 174 GiB of host RAM", "h200-8b-128k-shared",
            "C"),
    Current("reference C's workload on 128 GiB of host RAM", "h200-8b-128k-ratio", "C"),
    Current("reference C's workload on a 48 GiB card with 118 GiB of RAM, emulated",
            "h200-8b-128k-cap48", "C"),
    Current("the same, packed documents", "h200-8b-128k-ratio-packed-chunked"),
    Current("the same, flash-attn-4 kept", "h200-8b-128k-ratio-packed-fa4"),
    Current("LoRA rank 8, no offload", "q3-8b-128k-lora8"),
    Current("a 24 GiB card with 60 GiB of RAM, emulated: QLoRA, packed documents",
            "h200-8b-qlora-32k-cap24"),
    Current("the same card, block-sparse (46 blocks of 64^2 a matrix, LoRA r16's parameter count)",
            "h200-8b-sparse-32k-cap24"),
    Current("the same card, block-sparse over an NF4 base", "h200-8b-sparse-nf4-32k-cap24"),
    Current("the same card, LoRA r16 over bf16 weights at the planner's answer (micro-batch 2)",
            "h200-8b-lora-32k-cap24-mb2-ka9"),
    Current("the same card, block-sparse at the same placement", "h200-8b-sparse-32k-cap24-mb2"),
    Current("a 24 GiB card with 32 GiB of RAM, emulated: optimizer states on the disk (NVMe offload)",
            "h200-3b-32k-nvme-cap24-host32"),
    Current("2 GPUs", "h200x2-1b-16k-gpu"),
    Current("2 GPUs, one sequence per GPU", "h200x2-8b-128k-shared"),
)

COLUMNS = ("Workload", "Model, context", "longft setup", "tok/s", "MFU", "VRAM alloc (GiB)",
           "Host RSS (GiB)", "Reference: tok/s, VRAM, host", "vs reference", "Raw")
NOTES = (
    "tok/s: non-padding tokens per second over all GPUs and the timed steps. MFU: model "
    "FLOPs (attention per document on packed rows) over the H200's dense bf16 peak. VRAM alloc: "
    "torch max allocated on the busiest GPU. Host RSS: the whole process tree. Reference: the "
    "reference study's own script on the same H200 (rows A, B, C; its \"MB\" are MiB), beside the "
    "rows that run its workload (random token ids, one sequence a row); packed and LoRA rows do "
    "other work and have none, as has the placement row, whose micro-batch differs. The reference "
    "rows were measured on 2026-12-02, longft's on the dates in their JSON (bench/LOG.md).")


class ResultsTableError(UserError):
    """A listed result file is missing or not a complete bench result; the message names it."""


def _read(folder: Path, stem: str) -> dict:
    path = Path(folder) / f"{stem}.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsTableError(f"{path}: not readable ({e})") from None
    train = doc.get("train") if isinstance(doc, dict) else None
    if not isinstance(train, dict) or train.get("status") != "complete":
        raise ResultsTableError(f"{path}: not a complete bench result")
    return doc


def _model(params: dict) -> str:
    name = params["model"]["name"]
    short = {"llama3.2-1b": "Llama-3.2-1B", "llama3.2-3b": "Llama-3.2-3B",
             "llama3.1-8b": "Llama-3.1-8B"}.get(name, name)
    return f"{short}, {params['data']['max_seq_length']:,}"


def _setup(doc: dict) -> str:
    """The placement in a few words, read from the run's own params."""
    p = doc["params"]
    z, hw, ck, tr = p["zero"], p["hardware"], p["checkpointing"], p["train"]
    gpus = hw["num_gpus"] * hw["num_nodes"]
    states = (("optimizer", z["offload_optimizer"]), ("params", z["offload_param"]))
    on = {dev: [k for k, v in states if v == dev] for dev in ("cpu", "nvme")}
    off = on["cpu"]
    where = ", ".join(" + ".join(ks) + f" on {label}" for ks, label in
                      ((on["cpu"], "the CPU"), (on["nvme"], "NVMe")) if ks) or "all on the GPU"
    ratio = z.get("offload_ratio")
    if off and ratio not in (None, 1, 1.0):
        where += f" (offload_ratio {ratio})"
    parts = [f"{gpus}x {_gpu(doc)}", f"ZeRO-{z['stage']}, {where}",
             f"micro-batch {tr['micro_batch_size']}"]
    if p.get("lora", {}).get("rank"):
        q = p["lora"].get("quantize", "none")
        parts.append(f"LoRA r{p['lora']['rank']}" + (f" on {q} weights (QLoRA)" if q != "none" else ""))
    elif p.get("sparse", {}).get("blocks"):
        sp, q = p["sparse"], p.get("lora", {}).get("quantize", "none")
        parts.append(f"block-sparse {sp['blocks']} x {sp['block_size']}^2"
                     + (f" on {q} weights" if q != "none" else ""))
    if hw.get("vram_limit_gib"):
        parts.append(f"VRAM capped at {hw['vram_limit_gib']} GiB")
    mode = ck.get("mode")
    if mode == "cpu_offload":
        parts.append(f"layer checkpoints on the CPU ({ck.get('gpu_layers')} on the GPU)")
    if ck.get("keep_attention"):
        parts.append(f"keep_attention {ck['keep_attention']}")
    if (doc.get("env") or {}).get("attention") == "flash_attn_4" and not p["data"].get("pack"):
        parts.append("flash-attn-4")
    if p["data"].get("pack"):
        parts.append(f"packed ({_packed_kernel(doc)})")
    resolved = Resolved.from_dict(doc["plan"]["resolved"]) if doc.get("plan") else None
    if resolved is not None and resolved.copy_back.value == "chunked":
        parts.append("weights copied back in pinned chunks")
    if resolved is not None and resolved.overlap_step.value == "on":
        parts.append("step overlapped with the next forward")
    return ", ".join(parts)


def _gpu(doc: dict) -> str:
    name = (doc.get("env") or {}).get("gpu_name") or "GPU"
    return name.removeprefix("NVIDIA ")


def _packed_kernel(doc: dict) -> str:
    """The packed-attention kernel the run used: the resolved one in its plan, else its param."""
    resolved = ((doc.get("plan") or {}).get("resolved") or {}).get("packed_attention")
    got = resolved.get("value") if isinstance(resolved, dict) else resolved
    return str(got or doc["params"]["kernels"].get("packed_attention"))


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _fmt(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def row_cells(folder: Path, cur: Current) -> tuple[str, ...]:
    doc = _read(folder, cur.stem)
    t = doc["train"]
    tps = _num(t.get("tokens_per_s"))
    mfu = _num(t.get("mfu"))
    ref = REFERENCES[cur.reference] if cur.reference else None
    ref_cell = "" if ref is None else (f"{ref.name}: {ref.tokens_per_s:,.0f}, {ref.vram_gib:.2f}, "
                                       f"{ref.host_gib:.1f}")
    vs = "" if ref is None or tps is None else f"{tps / ref.tokens_per_s:.2f}x"
    return (cur.workload, _model(doc["params"]), _setup(doc), _fmt(tps, ",.0f"),
            "n/a" if mfu is None else f"{mfu * 100:.1f} %",
            _fmt(_num((t.get("peak_vram") or {}).get("max_allocated_gib")), ".2f"),
            _fmt(_num((t.get("peak_dram") or {}).get("rss_tree_gib")), ".1f"),
            ref_cell, vs, f"[{cur.stem}](bench/results/{cur.stem}.json)")


def render(folder: Path) -> str:
    """The markdown block (markers included) for the results in `folder`."""
    lines = [MARKERS[0], "| " + " | ".join(COLUMNS) + " |",
             "|---|---|---|" + "---:|" * 4 + "---|---:|---|"]
    lines += ["| " + " | ".join(row_cells(folder, cur)) + " |" for cur in CURRENT]
    lines += ["", NOTES, MARKERS[1]]
    return "\n".join(lines) + "\n"


def block_in(text: str) -> Optional[str]:
    """The generated block of a document (markers included), or None without one."""
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    if start < 0 or end < start:
        return None
    return text[start:end + len(MARKERS[1])] + "\n"


def main(args: argparse.Namespace) -> int:
    try:
        text = render(args.benchmarks)
    except ResultsTableError as e:
        print(f"longft report: {e}", file=sys.stderr)
        return 1
    if getattr(args, "out", None):
        write_text(args.out, text)
        print(f"longft report: results table -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

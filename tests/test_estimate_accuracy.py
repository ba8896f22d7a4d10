"""The memory estimator against the measured H200 rows (bench/results): the accuracy bar of
docs/estimator.md, one test per row and number, with the known misses listed."""

import json
from pathlib import Path

import pytest

from longft.config.params import from_dict
from longft.estimate.estimator import compare, estimate_for_plan

REPO = Path(__file__).resolve().parents[1]


def _bench_rows():
    """Rows measured with the current engine (bench/results/*.json; bench/results/archive/ holds
    rows of earlier engines) that ran to the end on an H200."""
    rows = []
    for p in sorted((REPO / "bench" / "results").glob("*.json")):
        row = json.loads(p.read_text())
        gpu = ((row.get("env") or {}).get("gpu_name") or "") if isinstance(row, dict) else ""
        if (row.get("status") == "ok" and ("H200" in gpu or "V100" in gpu)
                and "tiny" not in row["params"]["model"]["name"] and p.name not in EARLIER_ENGINE):
            rows.append(p)
    return rows


# Rows in bench/results (a sweep grid's report reads them there) measured with an engine that has
# changed since for what they measure. None now: the LoRA rows of bench/grids/q3-lora.yaml that ran
# at 7a8482e with peft's fp32 adapters (+5 GiB) were re-measured at 3052995 with the adapters in the
# training dtype (the old JSONs are in bench/results/archive/).
EARLIER_ENGINE: set[str] = set()

LORA_ROWS = ("q3-1b-16k-lora8", "q3-1b-16k-lora64", "q3-8b-128k-lora8", "q3-8b-128k-lora64")

# Known misses (issue 6), strict: fixing one turns its test red.
KNOWN_MISSES = {
    # 8B QLoRA at 352,256 tokens on an emulated 80 GiB card (0efa3c8): allocated 48.68 GiB against
    # 54.55 predicted (+12 %, on the safe side). Without FROZEN_BASE_SURPLUS_H (counted per token: 13.2
    # GiB here) the items say 41.40, so the unitemised surplus was 7.3 GiB, against 1.2 at 32K and
    # 106K: neither constant nor per token (bench/LOG.md). NVML was within 0.1 %.
    ("h200-8b-qlora-352k-cap80.json", "vram_max_allocated"),
    # Parameters offloaded to the CPU at small micro-batches (issue 22's q1 grid, 7a8482e): about
    # 0.77 GiB allocated and 2.5-3 GiB reserved that the estimate lacks, the same at every
    # micro-batch (at 16 and 48 the rows are within 2 %); not yet itemised (ZeRO-3's fetch buffers
    # of the offloaded parameters are the suspect).
    ("1b-16k-offload-mb1.json", "vram_max_allocated"),
    ("1b-16k-offload-mb1.json", "vram_max_reserved"),
    ("1b-16k-offload-mb1.json", "vram_nvml_used"),
    ("1b-16k-offload-mb4.json", "vram_max_reserved"),
    ("1b-16k-offload-mb4.json", "vram_nvml_used"),
    # the same placement with one ZeRO knob moved (q4 grid) or accumulation 4 (q5), at dd2797b:
    # 3.0-3.1 GiB reserved above the estimate, as on the mb4 row itself (allocated within 10 %)
    *((f"{row}.json", m) for row in ("q4-1b-16k-reduce-bucket-x4", "q4-1b-16k-prefetch-bucket-x4",
                                     "q4-1b-16k-persistence-1m", "q4-1b-16k-max-live-1e8",
                                     "q4-1b-16k-sub-group-1e8", "q5-1b-16k-accum4",
                                     "q5-1b-16k-accum16")
      for m in ("vram_max_reserved", "vram_nvml_used")),
    # LoRA (q3 grid, 3052995, the fixed engine): the host never reaches the start-up peak that the
    # full-parameter rows have (+1.64 GiB above the baseline, fitted on them, cause not attributed);
    # the LoRA rows peak after the last step at 3.68-3.84 GiB (1B and 8B alike) against 4.94.
    *((f"{row}.json", "dram_rss_tree") for row in LORA_ROWS),
    # Uncapped, DeepSpeed's side-stream pools cache 82 GiB reserved for 35 GiB allocated; capped at
    # 40 GiB (the cap40 row) the allocator flushes them and the run fits at the same speed.
    ("h200-8b-128k-offload.json", "vram_max_reserved"),
    ("h200-8b-128k-offload.json", "vram_nvml_used"),
    # The same on its 2-GPU row: 43.8 GiB reserved for 35.4 GiB allocated on each GPU.
    ("h200x2-8b-128k-offload.json", "vram_max_reserved"),
    ("h200x2-8b-128k-offload.json", "vram_nvml_used"),
    # The same uncapped pools on the 8B rows with 16 checkpoints on the GPU and 9 attention outputs
    # kept (83 GiB reserved for 36 allocated) and with everything on the GPU (122 for 75).
    ("h200-8b-128k-offload-keep9.json", "vram_max_reserved"),
    ("h200-8b-128k-offload-keep9.json", "vram_nvml_used"),
    ("h200-8b-128k-offload-gpuckpt.json", "vram_max_reserved"),
    ("h200-8b-128k-offload-gpuckpt.json", "vram_nvml_used"),
    # And on row (c) with the shared host gradient slot (52.7 GiB reserved for 36.5 allocated);
    # its capped twin (d) stays within 3.3 % (38.75 / 40.65 GiB predicted, 39.99 / 42.04 measured).
    ("h200-8b-128k-shared.json", "vram_max_reserved"),
    ("h200-8b-128k-shared.json", "vram_nvml_used"),
    # and on its 2-GPU row (45.3 GiB reserved for 36.7 allocated on each GPU)
    ("h200x2-8b-128k-shared.json", "vram_max_reserved"),
    ("h200x2-8b-128k-shared.json", "vram_nvml_used"),
    # and on W2 at the reference's memory (83eb794 and f9af21b: 65.4 GiB reserved for 48.7 allocated); its
    # capped twin h200-1b-16k-offload-w2mem-cap (ee3b7a9, cap 51.7 GiB) fills the cap and trains at
    # the same allocated 48.7 GiB
    ("h200-1b-16k-offload-w2mem.json", "vram_max_reserved"),
    ("h200-1b-16k-offload-w2mem.json", "vram_nvml_used"),
    # the same workload on flash-attn-4 (f9af21b: 65.4 GiB reserved for 48.7 allocated); capped
    # (-fa4-cap) it fills the cap at the same allocated 48.7 GiB
    ("h200-1b-16k-offload-w2mem-fa4.json", "vram_max_reserved"),
    ("h200-1b-16k-offload-w2mem-fa4.json", "vram_nvml_used"),
    # and its 9746e9e rows with the step overlapped and not (61.3-65.4 GiB reserved for 48.7)
    *((f"h200-1b-16k-offload-w2mem-fa4-{r}.json", k) for r in ("off", "overlap", "overlap-5e7")
      for k in ("vram_max_reserved", "vram_nvml_used")),
    # QLoRA and block-sparse over NF4 on the emulated 24 GiB card (2026-12-05, 504ca60): random
    # init of a model about to be quantized is built on the GPU (engine/build.py), where a
    # pretrained one, what the estimate counts, loads on the host first (13.3 GiB): 18.26 GiB
    # predicted, 11.48-11.88 measured, the measured peak being the steady one (10.8-11.3 predicted).
    *((f"h200-8b-{r}-32k-cap24.json", "dram_rss_tree") for r in ("qlora", "sparse-nf4")),
    # QLoRA's NVML count is 5.7 GiB above torch's reserved (20.20 against 14.46; the same in the
    # 50cade2 run), where block-sparse over the same NF4 base has 2.3 (a CUDA context): memory
    # outside torch's allocator, not attributed.
    ("h200-8b-qlora-32k-cap24.json", "vram_nvml_used"),
}
# The same LoRA rows peak after start-up, where the estimate (with its start-up constant) says
# start-up; strict too: the moment test asserts these are still mispredicted. And the two
# random-init NF4 rows above, for the same reason as their host peak.
MOMENT_MISSES = {f"{row}.json" for row in LORA_ROWS} | {
    f"h200-8b-{r}-32k-cap24.json" for r in ("qlora", "sparse-nf4")}
METRICS = ("vram_max_allocated", "vram_max_reserved", "vram_nvml_used", "dram_rss_tree")


def _at_cap(path) -> bool:
    """A row run under hardware.vram_limit_gib whose allocator filled the cap: its reserved and
    NVML numbers measure the cap, not the run (test_capped_row_is_predicted_to_fit_its_cap)."""
    row = json.loads(path.read_text())
    cap = row["params"]["hardware"].get("vram_limit_gib")
    return bool(cap) and row["train"]["peak_vram"]["max_reserved_gib"] >= 0.99 * cap


def _row_params():
    out = []
    for p in _bench_rows():
        for m in METRICS:
            marks = ([pytest.mark.xfail(strict=True, reason="known miss (issue 6)")]
                     if (p.name, m) in KNOWN_MISSES else [])
            if m in ("vram_max_reserved", "vram_nvml_used") and _at_cap(p):
                marks = [pytest.mark.skip(reason="reserved memory sits at the vram_limit_gib cap")]
            out.append(pytest.param(p, m, marks=marks, id=f"{p.stem}:{m}"))
    return out


def _estimate(path):
    """The row's params, its raw JSON and the current estimator's prediction for it."""
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config

    row = json.loads(path.read_text())
    cfg = from_dict(row["params"])
    arch = architecture(load_model_config(cfg.model))
    return cfg, row, estimate_for_plan(cfg, arch, row["plan"]["resolved"], row["train"]["world_size"])


def _predicted_vs_measured(path):
    cfg, row, pred = _estimate(path)
    return cfg, row, compare(pred, row["train"])


@pytest.mark.parametrize("path,metric", _row_params())
def test_h200_rows_within_10_percent(path, metric):
    """The accuracy bar: every measured H200 row within 10 % (VRAM allocated, reserved, NVML, RSS)."""
    _, _, c = _predicted_vs_measured(path)
    assert c[metric]["measured_gib"] is not None, c
    assert abs(c[metric]["rel_error"]) < 0.10, c[metric]


@pytest.mark.parametrize("name", ["h200-8b-128k-offload-cap40", "h200-8b-128k-shared-cap40"])
def test_capped_row_is_predicted_to_fit_its_cap(name):
    """Under hardware.vram_limit_gib the measured reserved memory is the cap; what the estimate
    must get right there is that the run fits: allocated and reserved predictions under the cap."""
    path = REPO / f"bench/results/{name}.json"
    cfg, row, c = _predicted_vs_measured(path)
    cap = cfg.hardware.vram_limit_gib
    assert row["status"] == "ok" and cap == 40
    assert c["vram_max_allocated"]["predicted_gib"] < cap
    assert c["vram_max_reserved"]["predicted_gib"] < cap
    assert c["vram_max_reserved"]["measured_gib"] <= cap


def test_bench_rows_are_found():
    assert len(_bench_rows()) >= 5


def test_host_peak_is_the_larger_moment_on_the_measured_rows():
    """Rows with little in host memory peak at start-up (before step 1), rows with pinned buffers
    later; the estimate predicts the moment each measured row peaked in. metrics._peak_step says 0
    for a peak before step 1, the step for one during a step, None for one after the last step
    (the pinned buffers are still held then): every complete row has its step rows, so None is
    "after start-up" here, not "unknown"."""
    seen = set()
    for path in _bench_rows():
        _, row, est = _estimate(path)
        dram = row["train"]["peak_dram"]
        if dram.get("rss_tree_peak_t") is None:
            continue
        assert row["train"]["steps"] >= 1 and row["train"]["timed_steps"] >= 1
        measured = "setup" if dram.get("rss_tree_peak_step") == 0 else "steady"
        if path.name in MOMENT_MISSES:  # strict known miss: fixing it turns this red
            assert est["host"]["peak_moment"] != measured, (path.name, "now predicted: drop it")
            continue
        assert est["host"]["peak_moment"] == measured, (path.name, dram)
        seen.add(measured)
    assert seen == {"setup", "steady"}


def _reestimate_max_context(report_name: str, overlay_name: str, fix: dict | None = None):
    """(measured, estimate): the run of a `longft max-context --confirm` report (bench/results)
    that fitted, and the current estimator's prediction for it, from its overlay (bench/configs)
    at its length and its card's cap; `fix` pins what the run had and today's auto would not."""
    import yaml

    from longft.config.params import Config, merge, to_dict
    from longft.estimate.estimator import estimate, setup_from_config
    from longft.hardware import Hardware, resolve
    from longft.model.architecture import architecture
    from longft.model.loading import load_model_config

    report = json.loads((REPO / "bench/results" / report_name).read_text())
    run = next(r for r in report["runs"] if r["status"] == "fits")
    assert run["seq"] == report["confirmed_max_seq"]
    over = yaml.safe_load((REPO / "bench/configs" / overlay_name).read_text())
    over.pop("bench_note")
    over = merge(over, {"data": {"max_seq_length": run["seq"]},
                        "hardware": {"vram_limit_gib": report["vram_limit_gib"]}})
    cfg = from_dict(merge(to_dict(Config()), merge(over, fix or {})))
    arch = architecture(load_model_config(cfg.model))
    # the 1-GPU H200 machine the runs had (its host size and cores change no `auto` here)
    h200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=125.9, cpu_count=16, flash_attn=False,
                    liger=True)
    resolved = {k: c.value for k, c in resolve(cfg, h200, arch["model_type"]).items()}
    return run["measured"], estimate(arch, setup_from_config(cfg, resolved))


def test_max_context_gpu_runs_within_10_percent():
    """`longft max-context --confirm` on the H200 (bench/results/maxctx-1b-16gib-maxctx.json): the
    run that fitted, re-estimated from its overlay at its length, within 10 % (allocated, host)."""
    from longft.estimate.estimator import GIB

    # measured at 6d93e57, before zero.host_grad_buffer and zero.copy_back existed: DeepSpeed's
    # full buffer and its own copy of the updated weights
    measured, est = _reestimate_max_context(
        "maxctx-1b-16gib-maxctx.json", "maxctx-1b.yaml",
        {"kernels": {"tiled_mlp": "on"},
         "zero": {"host_grad_buffer": "full", "copy_back": "deepspeed"}})
    assert abs(est.gpu_allocated / GIB / measured["vram_allocated_gib"] - 1) < 0.10
    assert abs(est.host_rss / GIB / measured["host_rss_gib"] - 1) < 0.10
    # tighter than the bar: without the step's bf16 temporary the host was 6.2 % under
    assert abs(est.host_rss / GIB / measured["host_rss_gib"] - 1) < 0.02


@pytest.mark.parametrize("report,overlay,gpu_within", [
    ("maxctx-8b-256k-ratio-139gib-maxctx.json", "maxctx-8b-256k-ratio.yaml", 0.10),
    # known miss (strict): 14.9 GiB too high at 524,288 tokens, on the safe side (docs/estimator.md)
    ("maxctx-8b-512k-bf16-139gib-maxctx.json", "maxctx-8b-512k-bf16.yaml", None),
])
def test_8b_context_reach_on_one_h200(report, overlay, gpu_within):
    """Issue 33's context reach, confirmed on the H200 with 118 GiB of host RAM (ee3b7a9): 8B full
    parameter at 262,144 tokens (fp32 states, offload_ratio 0.8) and 524,288 (bf16 states, every
    layer checkpoint but 4 in pinned host memory). The host within 2 %; the GPU never under the
    measurement (a run the estimate says fits must fit), within 10 % at 256K (reserved too). The
    excess is about 30 KB a token at both lengths (7.5 GiB at 256K, 14.9 at 512K) against ~0 on
    the unpacked 128K rows: a per-token backward term too high beyond 128K, not attributed yet."""
    from longft.estimate.estimator import GIB

    measured, est = _reestimate_max_context(report, overlay)
    assert abs(est.host_rss / GIB / measured["host_rss_gib"] - 1) < 0.02
    for key, predicted in (("vram_allocated_gib", est.gpu_allocated),
                           ("vram_reserved_gib", est.gpu_reserved)):
        gpu = predicted / GIB / measured[key] - 1
        assert gpu > 0, key
        if gpu_within is not None:
            assert gpu < gpu_within, key
        else:
            assert gpu >= 0.10, f"{key} now within 10 %: drop it from the known misses"


def test_qlora_rows_on_the_emulated_24_gib_card():
    """QLoRA (issue 31) on the H200 capped to a 24 GiB card. The 32K row (measured again at 504ca60,
    the same memory as at 50cade2) is the one the surplus
    (gpu.FROZEN_BASE_SURPLUS_H) was fitted to: within 5 % of its peak allocated checks the item's
    arithmetic, not the fit. The 128K row is the independent check: it ran out of memory under its
    cap, and the estimate must not say it fits (the items alone said it did)."""
    cfg, row, c = _predicted_vs_measured(REPO / "bench/results/h200-8b-qlora-32k-cap24.json")
    assert row["train"]["status"] == "complete" and cfg.lora.quantize == "nf4"
    assert abs(c["vram_max_allocated"]["rel_error"]) < 0.05, c["vram_max_allocated"]
    cfg, row, c = _predicted_vs_measured(REPO / "bench/results/h200-8b-qlora-128k-cap24.json")
    assert "CUDA out of memory" in "\n".join(row["log_tail"])
    assert c["vram_max_reserved"]["predicted_gib"] > cfg.hardware.vram_limit_gib, c


def test_frozen_base_rows_of_one_lease_on_the_emulated_24_gib_card():
    """The 2026-12-05 lease's bf16 rows (issue 51) that showed the surplus is a frozen base's, not
    bitsandbytes': LoRA r16 at micro-batch 2 ran out of memory under the cap where its placement
    said 19.85 GiB allocated (the estimate must now say it does not fit), and block-sparse over bf16 weights
    allocated 1.92 GiB above its items (now within 5 %); block-sparse over NF4 stays within 1 %."""
    cfg, row, c = _predicted_vs_measured(REPO / "bench/results/h200-8b-lora-32k-cap24-mb2.json")
    assert "CUDA out of memory" in "\n".join(row["log_tail"]) and cfg.lora.quantize == "none"
    assert c["vram_max_allocated"]["predicted_gib"] > cfg.hardware.vram_limit_gib, c
    # LoRA with checkpoints on the GPU measured none: not counted there
    cfg, row, est = _estimate(REPO / "bench/results/q3-8b-128k-lora8.json")
    assert cfg.lora.rank and cfg.checkpointing.mode != "cpu_offload"
    assert not any("surplus" in i["name"] for i in est["gpu"]["items"])
    assert abs(compare(est, row["train"])["vram_max_allocated"]["rel_error"]) < 0.01
    for name, within in (("h200-8b-sparse-32k-cap24", 0.05), ("h200-8b-sparse-nf4-32k-cap24", 0.01)):
        cfg, row, c = _predicted_vs_measured(REPO / f"bench/results/{name}.json")
        assert row["status"] == "ok" and cfg.sparse.blocks == 46, name
        assert abs(c["vram_max_allocated"]["rel_error"]) < within, (name, c["vram_max_allocated"])


def test_the_surplus_is_the_frozen_base_s_not_packing_s():
    """The two rows that separate the surplus's causes (135a550, one lease): full finetuning of
    packed documents with checkpoints offloaded has none (no item, within 2 %), and LoRA over one
    random sequence a row has it (without the item the estimate is 6 % under). The planner's
    answers at micro-batch 2 (LoRA r16 and block-sparse, 9 attention outputs kept) that trained on
    the 24 GiB card are within 1 % with the per-method figures (gpu.FROZEN_BASE_SURPLUS_BF16_H)."""
    cfg, row, est = _estimate(REPO / "bench/results/h200-1b-32k-packed-cpuckpt.json")
    assert cfg.data.pack and not cfg.lora.rank and cfg.checkpointing.mode == "cpu_offload"
    assert not any("surplus" in i["name"] for i in est["gpu"]["items"])
    assert abs(compare(est, row["train"])["vram_max_allocated"]["rel_error"]) < 0.02
    cfg, row, est = _estimate(REPO / "bench/results/h200-8b-lora-32k-cap24-unpacked.json")
    assert not cfg.data.pack and cfg.lora.rank == 16
    surplus = sum(i["bytes"] for i in est["gpu"]["items"] if "surplus" in i["name"]) / 2**30
    measured = row["train"]["peak_vram"]["max_allocated_gib"]
    assert est["gpu"]["allocated_gib"] - surplus < 0.94 * measured
    assert abs(compare(est, row["train"])["vram_max_allocated"]["rel_error"]) < 0.01
    for name in ("h200-8b-lora-32k-cap24-mb2-ka9", "h200-8b-sparse-32k-cap24-mb2"):
        cfg, row, c = _predicted_vs_measured(REPO / f"bench/results/{name}.json")
        assert row["train"]["status"] == "complete" and cfg.train.micro_batch_size == 2, name
        assert abs(c["vram_max_allocated"]["rel_error"]) < 0.01, (name, c["vram_max_allocated"])


@pytest.mark.parametrize("lora,blocks,quantize,mode,want", [
    (16, 0, "nf4", "gpu", 4.9), (16, 0, "nf4", "cpu_offload", 4.9),
    (16, 0, "int8", "gpu", 0.0), (16, 0, "int8", "cpu_offload", 4.9),
    (16, 0, "none", "gpu", 0.0), (16, 0, "none", "cpu_offload", 6.0),
    (0, 46, "none", "gpu", 0.0), (0, 46, "none", "cpu_offload", 7.7),
    (0, 46, "nf4", "gpu", 4.9), (0, 46, "nf4", "cpu_offload", 4.9),
    (0, 0, "none", "gpu", 0.0), (0, 0, "none", "cpu_offload", 0.0)])
def test_the_surplus_counted_for_each_kind_of_run(lora, blocks, quantize, mode, want):
    """Which runs count the measured surplus, and how much (`x·h` a token): NF4 always; a frozen
    base under checkpoint offload, by its base and method; full finetuning never (the 1B packed
    row with its checkpoints offloaded has none)."""
    from longft.estimate.gpu import frozen_base_surplus
    from longft.estimate.types import Setup

    s = Setup(micro_batch=1, seq_len=32768, lora_rank=lora, sparse_blocks=blocks, quantize=quantize,
              checkpointing=mode)
    assert frozen_base_surplus(s) == want

"""The planned rows of issues 8 (4 x H200) and 9 (8 x H200, incl. the 8 x V100 emulation), which
no session has run yet (bench/LOG.md, "Planned rows"): each overlay in bench/configs merges onto
the shipped params (the dataclass defaults) into valid params, and the estimator predicts that it
fits its machine with margin.

A row is estimated as the patch stage would on its machine: `auto` resolved for an H200 (cuDNN
attention, Liger), `hardware.num_gpus` ranks on one node. The machine comes from the overlay's
file-name prefix (MACHINES)."""

import dataclasses

import pytest
import yaml

from longft.config.params import Config, from_dict, merge, to_dict
from longft.estimate.estimator import GIB, estimate, fits, setup_from_config
from longft.hardware import Hardware, resolve
from longft.model.architecture import architecture
from longft.model.loading import load_model_config
from longft.run.pipeline import REPO


@dataclasses.dataclass(frozen=True)
class Machine:
    gpus: int                  # GPUs of the machine
    ranks: int                 # GPUs the rows of this prefix use (hardware.num_gpus)
    gpu_mem_gib: float         # usable memory of one GPU
    host_mem_gib: float        # host RAM of the node
    gpu_share: float = 0.95    # the most of a GPU (NVML-level prediction) a row may plan for
    host_share: float = 0.90   # the most of the host RAM (other processes need some)
    cap_share: float = 0.90    # under hardware.vram_limit_gib: the most of it reserved may take


MACHINES = {
    "h200x4-": Machine(gpus=4, ranks=4, gpu_mem_gib=139, host_mem_gib=512),
    "h200x7-": Machine(gpus=8, ranks=7, gpu_mem_gib=139, host_mem_gib=560),  # 7 of the 8 GPUs
    "h200x8-": Machine(gpus=8, ranks=8, gpu_mem_gib=139, host_mem_gib=560),
    "v100x8-": Machine(gpus=8, ranks=8, gpu_mem_gib=139, host_mem_gib=560),  # capped at 16 GiB
}

# The rows the issues ask for, and the reference's host RAM (GiB) where the issue says longft must
# use less (the Qwen2.5-14B rows: the reference needs more than the machine has).
EXPECTED = {
    "h200x4-1b-16k-offload", "h200x4-8b-128k", "h200x4-qwen14b-128k",
    "h200x8-1b-16k-offload", "h200x7-8b-128k", "h200x8-8b-128k", "h200x7-qwen14b-128k",
    "v100x8-8b-32k-fp16-cap16", "v100x8-8b-48k-fp16-cap16",
}
REFERENCE_DRAM_GIB = {"h200x4-qwen14b-128k": 787, "h200x7-qwen14b-128k": 1057}

OVERLAYS = sorted(p for p in (REPO / "bench" / "configs").glob("*.yaml")
                  if p.name.startswith(tuple(MACHINES)))


def machine(name: str) -> Machine:
    return next(m for prefix, m in MACHINES.items() if name.startswith(prefix))


def h200(n: int) -> Hardware:
    return Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=n, capability=(9, 0),
                    gpu_mem_gib=139.8, host_mem_gib=500, cpu_count=64, flash_attn=False, liger=True)


def load_row(path, **change):
    """(config, estimate) of an overlay merged onto the shipped defaults; `change` overrides
    overlay keys (section -> dict) before the merge."""
    over = yaml.safe_load(path.read_text())
    assert over.pop("bench_note")
    over = merge(over, change)
    cfg = from_dict(merge(to_dict(Config()), over), str(path))
    arch = architecture(load_model_config(cfg.model))
    resolved = {k: c.value for k, c in resolve(cfg, h200(cfg.hardware.num_gpus),
                                                arch["model_type"]).items()}
    return cfg, estimate(arch, setup_from_config(cfg, resolved))


def test_every_planned_row_is_there():
    assert {p.stem for p in OVERLAYS} == EXPECTED


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.stem)
def test_planned_row_is_valid_and_says_what_it_is(path):
    note = yaml.safe_load(path.read_text())["bench_note"]
    assert ("Issue 8" if path.name.startswith("h200x4-") else "Issue 9") in note
    assert "Reference" in note
    cfg, _ = load_row(path)
    m = machine(path.name)
    n = cfg.hardware.num_gpus
    assert n == m.ranks <= m.gpus and cfg.hardware.num_nodes == 1
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * n    # no accumulation
    assert cfg.data.source == "random" and not cfg.data.pack
    assert cfg.data.num_samples >= cfg.train.iterations * cfg.train.global_batch_size
    assert not cfg.output.save_checkpoint and not cfg.output.export
    if path.name.startswith("v100x8-"):
        assert cfg.precision == "fp16" and cfg.hardware.vram_limit_gib == 16
        assert (cfg.kernels.attention, cfg.kernels.sdpa_backend) == ("sdpa", "efficient")
    if "-1b-16k-" in path.name:       # the issues' rows: micro-batch 20, params + optimizer on CPU
        assert cfg.train.micro_batch_size == 20
        assert (cfg.zero.offload_optimizer, cfg.zero.offload_param) == ("cpu", "cpu")


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.stem)
def test_planned_row_fits_its_machine_with_margin(path):
    cfg, est = load_row(path)
    m = machine(path.name)
    cap = cfg.hardware.vram_limit_gib
    fit = fits(est, m.gpu_mem_gib, m.host_mem_gib, cap)
    assert fit.ok, fit.reasons
    assert est.gpu_nvml <= m.gpu_share * m.gpu_mem_gib * GIB, fit.reasons
    assert est.host_rss <= m.host_share * m.host_mem_gib * GIB, fit.reasons
    if cap is not None:
        assert est.gpu_reserved <= m.cap_share * cap * GIB, fit.reasons


@pytest.mark.parametrize("name", sorted(REFERENCE_DRAM_GIB))
def test_qwen14b_rows_need_less_host_ram_than_the_reference_and_the_machine(name):
    path = REPO / "bench" / "configs" / f"{name}.yaml"
    _, est = load_row(path)
    host = est.host_rss / GIB
    assert host < REFERENCE_DRAM_GIB[name] and host < machine(name).host_mem_gib


@pytest.mark.parametrize("name", sorted(REFERENCE_DRAM_GIB))
def test_qwen14b_rows_would_not_fit_without_offloading(name):
    """The check can fail: the same row with the optimizer on the GPU does not fit the GPU, and
    with every checkpoint offloaded it does not fit the host RAM (7 GPUs)."""
    path = REPO / "bench" / "configs" / f"{name}.yaml"
    m = machine(name)
    cfg, est = load_row(path, zero={"offload_optimizer": "none"})
    assert not fits(est, m.gpu_mem_gib, m.host_mem_gib, cfg.hardware.vram_limit_gib).gpu_ok
    if name.startswith("h200x7-"):
        cfg, est = load_row(path, checkpointing={"gpu_layers": 0})
        assert not fits(est, m.gpu_mem_gib, m.host_mem_gib).host_ok


def test_v100_rows_would_not_fit_the_cap_with_everything_on_the_gpu():
    path = REPO / "bench" / "configs" / "v100x8-8b-32k-fp16-cap16.yaml"
    cfg, est = load_row(path, zero={"offload_optimizer": "none", "offload_param": "none"})
    assert not fits(est, 139, 560, cfg.hardware.vram_limit_gib).gpu_ok

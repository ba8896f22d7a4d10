"""Where the optimizer lives (issue 18): a share on the GPU (zero.offload_ratio), bf16 states
(zero.optimizer_states), NVMe (zero.offload_optimizer: nvme) and core binding: the params checks,
the DeepSpeed dict, the estimator's items, the placement search and the up-front NVMe checks."""

import dataclasses
import json
from pathlib import Path

import pytest

from longft.config.params import ConfigError, from_dict
from longft.engine import ds_config
from longft.estimate.arch import numbers, optimizer_split
from longft.estimate.estimator import GIB, Setup, estimate, fits
from longft.estimate.placement import best, optimizer_seconds, ratio_for, search
from longft.estimate.placement_overlay import overlay
from longft.hardware import PlanError, nvme, resolve
from longft.run.launch import LaunchError, command
from longft.run.patch_stage import make_plan
from test_plan import CPU, H200, V100

REPO = Path(__file__).resolve().parents[1]
ARCH_8B = json.loads((REPO / "configs/models/llama3.1-8b.json").read_text())
BASE_8B = Setup(micro_batch=1, seq_len=131072, attention="sdpa", sdpa_backend="cudnn", liger=True,
                checkpointing="gpu", tiled_mlp=True, offload_optimizer=True, host_grad_buffer="shared")


def one_step(**zero):
    return {"train": {"global_batch_size": 1}, "zero": zero}


# ---------------------------------------------------------------- params


@pytest.mark.parametrize("zero,needle", [
    ({"offload_ratio": 0.0}, "zero.offload_ratio: must be in (0, 1]"),
    ({"offload_ratio": 1.5}, "zero.offload_ratio: must be in (0, 1]"),
    ({"offload_ratio": 0.5, "offload_optimizer": "none"}, "needs zero.offload_optimizer: cpu"),
    ({"offload_ratio": 0.5, "stage": 2}, "needs zero.stage 3"),
    ({"offload_ratio": 0.5, "offload_param": "cpu"}, "use one or the other"),
    ({"offload_optimizer": "nvme"}, "zero.nvme_path: required"),
    ({"offload_optimizer": "nvme", "nvme_path": "/x", "stage": 2}, "nvme needs zero.stage 3"),
    ({"nvme_path": "/x"}, "used only with zero.offload_optimizer: nvme"),
    ({"sub_group_size": 0}, "zero.sub_group_size: must be >= 1"),
])
def test_bad_optimizer_placement_is_refused_with_the_fix(zero, needle):
    with pytest.raises(ConfigError) as e:
        from_dict({"zero": zero})
    assert needle in str(e.value)


def test_bf16_states_need_bf16_precision_also_when_auto_resolves_otherwise():
    with pytest.raises(ConfigError, match="optimizer_states: bf16 needs precision bf16"):
        from_dict({"precision": "fp16", "zero": {"optimizer_states": "bf16"}})
    cfg = from_dict({"zero": {"optimizer_states": "bf16"}})      # precision auto
    with pytest.raises(PlanError, match="precision resolved to fp16"):
        resolve(cfg, V100, "llama")                               # a V100 resolves fp16
    assert resolve(cfg, H200, "llama")["precision"].value == "bf16"


def test_bind_cores_needs_the_deepspeed_launcher_and_numactl(monkeypatch):
    with pytest.raises(ConfigError, match="bind_cores: true needs hardware.launcher deepspeed"):
        from_dict({"hardware": {"bind_cores": True, "launcher": "torchrun"}})
    cfg = from_dict({"hardware": {"bind_cores": True}})
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    assert "--bind_cores_to_rank" in command(cfg, "cuda", ["--params", "p"], 29500)
    assert "--bind_cores_to_rank" not in command(from_dict({}), "cuda", ["--params", "p"], 29500)
    monkeypatch.setattr("shutil.which", lambda name: None if name == "numactl" else "/usr/bin/x")
    with pytest.raises(LaunchError, match="apt-get install numactl"):
        command(cfg, "cuda", ["--params", "p"], 29500)


# ---------------------------------------------------------------- DeepSpeed config


def test_ds_config_carries_ratio_bf16_states_nvme_and_sub_groups(tmp_path):
    z = ds_config.build(from_dict(one_step(offload_ratio=0.7, sub_group_size=12345)), "bf16", 64)
    assert z["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True,
                                                           "ratio": 0.7}
    assert z["zero_optimization"]["sub_group_size"] == 12345
    assert "ratio" not in ds_config.build(from_dict({}), "bf16", 64)["zero_optimization"]["offload_optimizer"]
    b = ds_config.build(from_dict({"zero": {"optimizer_states": "bf16"}}), "bf16", 64)["bf16"]
    assert b == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds_config.build(from_dict({}), "bf16", 64)["bf16"] == {"enabled": True}
    n = ds_config.build(from_dict({"zero": {"offload_optimizer": "nvme", "nvme_path": str(tmp_path)}}),
                        "bf16", 64)["zero_optimization"]["offload_optimizer"]
    assert n["device"] == "nvme" and n["nvme_path"] == str(tmp_path / "longft-optimizer")


# ---------------------------------------------------------------- estimator


def _deepspeed_gpu_groups(ratio: float, groups: int) -> int:
    """DeepSpeed 0.19.8's own rule (stage3._create_fp32_partitions), run on its own."""
    return sum(1 for i in range(groups) if not i >= int((1 - ratio) * groups))


@pytest.mark.parametrize("ratio", [1.0, 0.9, 0.75, 0.7, 0.5, 0.3, 0.1, 0.05])
def test_split_follows_deepspeeds_rule_and_moves_bytes_between_gpu_and_host(ratio):
    s = dataclasses.replace(BASE_8B, offload_ratio=ratio)
    n = numbers(ARCH_8B, s)
    assert len(n.gpu_groups) == _deepspeed_gpu_groups(ratio, len(n.groups))
    assert n.gpu_groups + n.host_groups == n.groups        # the first ones stay on the GPU
    e, full = estimate(ARCH_8B, s), estimate(ARCH_8B, BASE_8B)
    items = {i.name: i.bytes for i in e.items}
    on_gpu, on_host = sum(n.gpu_groups), sum(n.host_groups)
    assert items.get("optimizer on GPU: fp32 master, grad, m, v", 0) == 16 * on_gpu
    assert items["optimizer: fp32 master"] == 4 * on_host
    assert items["optimizer: Adam m, v (CPU Adam)"] == 8 * on_host
    # what leaves the host lands on the GPU, 16 B a parameter (plus the AdamW step buffer)
    moved = full.host_rss - e.host_rss
    assert moved >= 12 * on_gpu
    assert e.gpu_phases["backward"] - full.gpu_phases["backward"] == 16 * on_gpu
    assert optimizer_seconds(ARCH_8B, s) <= optimizer_seconds(ARCH_8B, BASE_8B)


def test_optimizer_split_without_offload_keeps_everything_on_the_gpu():
    assert optimizer_split(dataclasses.replace(BASE_8B, offload_optimizer=False), [5, 6]) == ([5, 6], [])
    assert optimizer_split(BASE_8B, [5, 6]) == ([], [5, 6])


def test_bf16_states_halve_the_host_model_states():
    e32 = {i.name: i.bytes for i in estimate(ARCH_8B, BASE_8B).items}
    e16 = {i.name: i.bytes for i in estimate(ARCH_8B, dataclasses.replace(
        BASE_8B, optimizer_states="bf16")).items}
    assert e16["optimizer: bf16 master"] * 2 == e32["optimizer: fp32 master"]
    assert e16["optimizer: Adam m, v (CPU Adam, bf16)"] * 2 == e32["optimizer: Adam m, v (CPU Adam)"]
    assert "step: bf16 copy of a sub-group (pageable)" not in e16     # no dtype change on the way back
    # on the GPU, bf16 master weights are the training weights: 4 B of moments a parameter
    g = estimate(ARCH_8B, dataclasses.replace(BASE_8B, offload_optimizer=False, optimizer_states="bf16",
                                              host_grad_buffer="full"))
    assert {i.name: i.bytes for i in g.items}["optimizer: bf16 master + Adam m, v"] == 4 * 8_030_261_248


def test_nvme_moves_the_states_to_disk_and_leaves_swap_buffers():
    from longft.estimate.host import io_aligned

    assert io_aligned(1_007_456_256, 4) == 1_007_456_256 and io_aligned(257, 4) == 512
    s = dataclasses.replace(BASE_8B, nvme=True, host_grad_buffer="full")
    e = estimate(ARCH_8B, s)
    names = {i.name: i for i in e.items}
    assert "optimizer: fp32 master" not in names and "CPU Adam fp32 gradients (pinned)" not in names
    assert e.disk_bytes == 16 * 8_030_261_248
    # DeepSpeed's own page-locked buffers (not torch's power-of-two cache): 4 x 4 B x the largest
    # sub-group, exactly, from start-up; and Adam's m and v of the first step, pageable
    buffers, first = names["NVMe swap buffers (page-locked)"], names[
        "first step: CPU Adam m, v (pageable)"]
    g = 1_048_608_768        # the 8B model's largest sub-group under sub_group_size 1e9
    assert buffers.bytes == 4 * 4 * g and "setup" in buffers.phases
    assert first.bytes * 2 == buffers.bytes and first.phases == ("steady",)
    assert fits(e, 139, 118, disk_gib=10).disk_ok is False
    assert fits(e, 139, 118, disk_gib=1000).disk_ok is True
    with pytest.raises(ValueError, match="nvme needs offload_optimizer"):
        estimate(ARCH_8B, dataclasses.replace(s, offload_optimizer=False))


def test_config_to_setup_carries_the_new_knobs():
    from longft.estimate.estimator import setup_from_config

    cfg = from_dict(one_step(offload_ratio=0.6, optimizer_states="bf16", sub_group_size=1000))
    s = setup_from_config(cfg, resolve(cfg, H200, "llama"))
    assert (s.offload_ratio, s.optimizer_states, s.sub_group_size, s.nvme) == (0.6, "bf16", 1000, False)


# ---------------------------------------------------------------- placement search


@pytest.mark.parametrize("groups", range(1, 41))
def test_ratio_for_gives_exactly_k_groups_under_deepspeeds_expression(groups):
    for k in range(groups):
        r = ratio_for(k, groups)
        assert 0 < r <= 1 and int((1 - r) * groups) == k, (k, groups, r)
    assert ratio_for(0, groups) == 1.0


def test_placement_finds_8b_at_128k_on_one_h200_with_128_gib_of_ram_only_through_the_ratio():
    """The issue's case: full offload needs ~128 GiB of host RAM; nothing fits without a ratio,
    and the search finds one, written to the overlay."""
    base = dataclasses.replace(BASE_8B, seq_len=128000, sdpa_backend="default")
    full_only = [c for c in search(ARCH_8B, base, gpu_mem_gib=128, host_mem_gib=110, gpu_name="NVIDIA H200",
                                   max_micro=2)
                 if c.setup.offload_ratio == 1.0 and c.fit.ok]
    assert full_only == []
    choice = best(search(ARCH_8B, base, gpu_mem_gib=128, host_mem_gib=110, gpu_name="NVIDIA H200", max_micro=2),
                  gpu_mem_gib=128,
                  host_mem_gib=110)
    assert choice is not None and choice.offload == "opt" and choice.setup.offload_ratio < 1
    assert choice.est.host_rss <= 110 * GIB and choice.est.gpu_nvml <= 128 * GIB
    ov = overlay(choice, 1, {"name": "llama3.1-8b", "source": "random"})
    assert ov["zero"]["offload_ratio"] == choice.setup.offload_ratio
    assert from_dict(ov).zero.offload_ratio == choice.setup.offload_ratio   # the overlay validates


def test_placement_searches_bf16_states_only_when_asked():
    base = dataclasses.replace(BASE_8B, seq_len=32768)
    fp32 = search(ARCH_8B, base, gpu_mem_gib=80, host_mem_gib=64, gpu_name=None, max_micro=1)
    assert {c.setup.optimizer_states for c in fp32} == {"fp32"}
    both = search(ARCH_8B, base, gpu_mem_gib=80, host_mem_gib=64, gpu_name=None, max_micro=1, states=("fp32", "bf16"))
    assert {c.setup.optimizer_states for c in both} == {"fp32", "bf16"}
    assert not any(c.setup.nvme for c in both)                  # no disk given: no NVMe
    disk = search(ARCH_8B, base, gpu_mem_gib=80, host_mem_gib=64, gpu_name=None, max_micro=1, disk_gib=500)
    assert any(c.setup.nvme and c.fit.ok for c in disk)


def test_placement_command_searches_the_ratio_and_writes_it(tmp_path, capsys, monkeypatch):
    from longft.cli.estimate import main

    monkeypatch.setattr("longft.hardware.detect", lambda: CPU)
    out = tmp_path / "ov.yaml"
    rc = main("placement", ["--gpu-mem", "128", "--host-mem", "110", "--model", "llama3.1-8b",
               "--seq", "65536", "--params", str(tmp_path / "none.yaml"), "--max-micro", "1",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "offload opt(ratio" in text
    import yaml

    ov = yaml.safe_load(out.read_text())
    assert 0 < ov["zero"]["offload_ratio"] <= 1
    from_dict(ov)


# ---------------------------------------------------------------- NVMe checks up front


def test_nvme_path_problems_name_the_fix(tmp_path, monkeypatch):
    assert "does not exist" in nvme.path_problems(str(tmp_path / "nope"), 0)[0]
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in nvme.path_problems(str(f), 0)[0]
    assert "GiB free" in nvme.path_problems(str(tmp_path), 2**60)[0]
    assert nvme.path_problems(str(tmp_path), 1) == []

    def no_write(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(nvme.tempfile, "NamedTemporaryFile", no_write)
    assert "cannot write in" in nvme.path_problems(str(tmp_path), 1)[0]


def test_libaio_missing_is_named_with_the_package(monkeypatch):
    class Builder:
        def is_compatible(self, verbose=False):
            return False

    class Acc:
        def create_op_builder(self, name):
            assert name == "AsyncIOBuilder"
            return Builder()

    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: Acc())
    (msg,) = nvme.libaio_problem()
    assert "libaio-dev" in msg and "apt-get install libaio-dev" in msg


def test_patch_stage_refuses_nvme_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "libaio_problem", lambda: [])
    cfg = from_dict({"zero": {"offload_optimizer": "nvme", "nvme_path": str(tmp_path / "missing")}})
    with pytest.raises(PlanError, match="does not exist"):
        make_plan(cfg, CPU)
    ok = from_dict({"zero": {"offload_optimizer": "nvme", "nvme_path": str(tmp_path)}})
    plan, ds = make_plan(ok, CPU)
    assert plan["memory_estimate"]["estimate"]["disk"]["bytes"] > 0
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    monkeypatch.setattr(nvme, "libaio_problem", lambda: ["libaio-dev missing"])
    with pytest.raises(PlanError, match="libaio-dev missing"):
        make_plan(ok, CPU)


def test_each_nvme_run_swaps_into_its_own_directory_and_stale_ones_are_named(tmp_path):
    ds = ds_config.build(from_dict({"zero": {"offload_optimizer": "nvme", "nvme_path": str(tmp_path)}}),
                         "bf16", 64)
    a, b = json.loads(json.dumps(ds)), json.loads(json.dumps(ds))
    da, db = ds_config.nvme_run_dir(a, "29500"), ds_config.nvme_run_dir(b, "29501")
    assert da != db and da == a["zero_optimization"]["offload_optimizer"]["nvme_path"]
    assert da.startswith(str(tmp_path / nvme.SWAP_DIR))
    assert ds_config.nvme_run_dir(ds_config.build(from_dict({}), "bf16", 64), "1") is None
    Path(da).mkdir(parents=True)
    (Path(da) / "states.swp").write_bytes(b"x" * 4096)     # left by a killed run
    (msg,) = nvme.path_problems(str(tmp_path), 2**60)
    assert "swap files of earlier longft runs" in msg and "run-*" in msg


def test_the_env_record_counts_deepspeeds_own_sub_group_placement():
    from types import SimpleNamespace

    from longft.engine.environment import optimizer_groups

    where = {0: "cuda", 1: "cuda", 2: "cpu", 3: "cpu", 4: "cpu"}
    assert optimizer_groups(SimpleNamespace(optimizer=SimpleNamespace(subgroup_to_device=where))) == \
        {"gpu": 2, "host": 3}
    assert optimizer_groups(SimpleNamespace(optimizer=SimpleNamespace())) is None   # no offload
    assert optimizer_groups(None) is None


def test_a_ratio_on_the_cpu_is_refused_rather_than_ignored():
    # DeepSpeed's CPU accelerator names its "device" sub-groups cpu: all would step with CPU Adam
    with pytest.raises(ConfigError, match="on CPU every sub-group is on the host already"):
        from_dict({**one_step(offload_ratio=0.5), "hardware": {"device": "cpu"}})
    cfg = from_dict(one_step(offload_ratio=0.5))          # device auto: decided by the machine
    with pytest.raises(PlanError, match="device auto found no CUDA GPU here"):
        resolve(cfg, CPU, "llama")
    resolve(cfg, H200, "llama")                          # a GPU: fine


def test_the_search_copies_back_as_copy_back_auto_would():
    """Candidates with the optimizer on the CPU and the parameters on the GPU (ZeRO-3, fp32
    states) copy the updated weights back through pinned chunks, as zero.copy_back auto resolves
    there, and their host estimate has the chunks, not DeepSpeed's pageable copy of a sub-group;
    every other placement keeps DeepSpeed's copy. zero.copy_back: deepspeed turns it off."""
    chunks, pageable = "step: copy-back chunks (pinned)", "step: bf16 copy of a sub-group (pageable)"
    kw = dict(gpu_mem_gib=141, host_mem_gib=256, gpu_name="NVIDIA H200", max_micro=1,
              modes=("gpu",), states=("fp32", "bf16"))
    cands = search(ARCH_8B, BASE_8B, **kw)
    seen = set()
    for c in cands:
        s = c.setup
        expect = ("chunked" if c.offload == "opt" and s.optimizer_states == "fp32" else "deepspeed")
        assert s.copy_back == expect, (c.offload, s.optimizer_states)
        host = {i.name for i in c.est.host_items()}
        if expect == "chunked":
            assert chunks in host and pageable not in host
        seen.add((c.offload, s.copy_back))
    assert ("opt", "chunked") in seen and ("opt+param", "deepspeed") in seen
    off = search(ARCH_8B, BASE_8B, chunked_copy_back=False, **kw)
    assert {c.setup.copy_back for c in off} == {"deepspeed"}
    assert any(pageable in {i.name for i in c.est.host_items()} for c in off if c.offload == "opt")


@pytest.mark.parametrize("over", [
    {}, {"zero": {"offload_param": "cpu"}}, {"zero": {"offload_optimizer": "none"}},
    {"zero": {"stage": 2}}, {"zero": {"optimizer_states": "bf16"}}, {"precision": "fp32"},
    {"precision": "fp16"}, {"lora": {"rank": 8, "quantize": "nf4"}, "zero": {"stage": 2}},
    {"lora": {"rank": 8}},
    {"zero": {"offload_ratio": 0.5}}, {"hardware": {"device": "cpu"}},
    {"zero": {"offload_optimizer": "nvme", "nvme_path": "/tmp"}},
])
def test_the_search_and_the_run_resolve_copy_back_alike(over):
    """placement.copy_back_for (what a candidate is estimated with) and hardware.policy's
    resolve_copy_back (what the run does) agree, from the same params."""
    from longft.config.params import merge
    from longft.estimate.estimator import setup_from_config
    from longft.estimate.placement import copy_back_for

    cfg = from_dict(merge({"precision": "bf16", "train": {"global_batch_size": 1},
                           "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none"}},
                          over))
    hw = CPU if cfg.hardware.device == "cpu" else H200
    r = resolve(cfg, hw, "llama")
    assert copy_back_for(setup_from_config(cfg, r)) == r["copy_back"].value, r["copy_back"].reason


def test_the_overlay_says_auto_unless_the_params_chose_deepspeed():
    """A candidate's overlay leaves zero.copy_back to auto where auto gives the copy it was
    estimated with (a chunked in the base params would be refused on an opt+param candidate) and
    keeps deepspeed where the params turned chunked off."""
    kw = dict(gpu_mem_gib=141, host_mem_gib=256, gpu_name="NVIDIA H200", max_micro=1, modes=("gpu",))
    for c in search(ARCH_8B, BASE_8B, **kw):
        assert overlay(c, 1)["zero"]["copy_back"] == "auto", c.offload
    off = [c for c in search(ARCH_8B, BASE_8B, chunked_copy_back=False, **kw)]
    got = {c.offload: overlay(c, 1)["zero"]["copy_back"] for c in off}
    assert got["opt"] == "deepspeed" and got["opt+param"] == "auto" and got["none"] == "auto"

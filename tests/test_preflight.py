"""Too little host RAM for the planned run is refused before any rank starts (and before anything
is deleted), with predicted vs available GiB and the fixes; hardware.host_mem_check: false skips it."""

import collections
import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from longft.config.params import Config, ConfigError, from_dict, merge, to_dict
from longft.config.plan import Plan
from longft.run.pipeline import REPO, run_all
from longft.run.preflight import HostMemoryError, host_memory
from test_plan_file import plan_dict  # tests/ is on sys.path under pytest

GIB = 2**30
VM = collections.namedtuple("svmem", "total available percent used free")


def fake_memory(monkeypatch, available_gib, total_gib=4.0):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(
        int(total_gib * GIB), int(available_gib * GIB), 0.0, 0, int(available_gib * GIB)))


def plan_with(rss_gib, device="cpu", checkpointing="gpu"):
    items = [{"name": "optimizer: Adam m, v (CPU Adam)", "bytes": int(rss_gib * 0.6 * GIB)},
             {"name": "process baseline", "bytes": int(rss_gib * 0.4 * GIB)}]
    return Plan.from_dict(plan_dict({"device": device, "checkpointing": checkpointing},
                                    host_rss_bytes=int(rss_gib * GIB), host_items=items))


@pytest.fixture(scope="module")
def default_plan():
    from longft.hardware import detect
    from longft.run.patch_stage import make_plan

    return Plan.from_dict(make_plan(from_dict({}), detect())[0])


def test_default_params_pass_on_this_machine(default_plan):
    note = host_memory(from_dict({}), default_plan)
    assert note.startswith("host RAM: predicted peak") and "available" in note


def test_too_little_ram_is_refused_with_numbers_and_fixes(monkeypatch, default_plan):
    fake_memory(monkeypatch, available_gib=0.25)
    cfg = from_dict({})
    need = default_plan.memory_estimate.host_rss_bytes / GIB
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, default_plan)
    msg = str(e.value)
    assert f"predicts a peak of {need:.2f} GiB" in msg
    assert "only 0.25 GiB is available (of 4.0 GiB total)" in msg
    assert "data.max_seq_length (4096) or train.micro_batch_size (1)" in msg
    assert "more RAM" in msg and "hardware.host_mem_check: false" in msg
    assert "nothing was deleted" in msg


def test_gpu_offload_fixes_are_named_when_they_apply():
    cfg = from_dict({"hardware": {"device": "auto"}, "zero": {"offload_param": "cpu"},
                     "checkpointing": {"mode": "cpu_offload"}})
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, plan_with(300, device="cuda", checkpointing="cpu_offload"),
                    available=100 * GIB)
    msg = str(e.value)
    assert "300.00 GiB" in msg and "100.00 GiB is available" in msg
    assert "checkpointing.mode: gpu instead of cpu_offload" in msg
    assert "zero.offload_param: none" in msg and "zero.offload_optimizer: none" in msg
    assert "optimizer: Adam m, v (CPU Adam) 180.00 GiB" in msg  # the largest item first


def test_the_check_can_be_turned_off(monkeypatch):
    fake_memory(monkeypatch, available_gib=0.01)
    cfg = from_dict({"hardware": {"host_mem_check": False}})
    assert host_memory(cfg, plan_with(10)) is None


def test_host_mem_check_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"hardware.host_mem_check: expected bool, got 'maybe'"):
        from_dict({"hardware": {"host_mem_check": "maybe"}})


def test_train_stage_refuses_before_starting_ranks_and_deletes_nothing(tmp_path, monkeypatch,
                                                                         capsys):
    params = merge(to_dict(Config()),
                   {"data": {"num_samples": 4, "max_seq_length": 1024}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))
    # What an earlier run left: measurements, a complete checkpoint, an export.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rank0.jsonl").write_text('{"type": "iter", "step": 1}\n')
    ckpt = tmp_path / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(json.dumps({"fingerprint": "other", "step": 2}))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"weights")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    fake_memory(monkeypatch, available_gib=0.1)
    monkeypatch.setattr(sys, "argv", [
        "train.py", "--params", str(tmp_path / "params.yaml"),
        "--plan", str(tmp_path / "artifacts/plan.json"),
        "--ds-config", str(tmp_path / "artifacts/ds_config.json"), "--data", str(tmp_path / "data"),
        "--run", str(tmp_path / "run"), "--checkpoints", str(tmp_path / "checkpoints"),
        "--export", str(tmp_path / "export")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "stages" / "train.py"), run_name="__main__")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("longft train: not enough host RAM for this run")
    assert "only 0.10 GiB is available" in err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing deleted or written: no rank, no memory sampler ran


# ---------------------------------------------------------------- output directories (issue 20)

from longft.run.preflight import OutputDirError, writable  # noqa: E402


def test_output_dirs_that_can_be_created_pass_and_nothing_is_created(tmp_path):
    writable({"run directory": tmp_path / "runs" / "train", "checkpoint directory": tmp_path,
              "export directory": tmp_path / "export"}, beside=("export directory",))
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_under_a_file_or_that_is_a_file_is_refused_with_every_problem(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError) as e:
        writable({"checkpoint directory": tmp_path / "f" / "checkpoints",
                  "export directory": tmp_path / "f"})
    msg = str(e.value)
    assert f"checkpoint directory {tmp_path / 'f' / 'checkpoints'} cannot be created: " \
           f"{tmp_path / 'f'} is not a directory" in msg
    assert f"export directory {tmp_path / 'f'} exists and is not a directory" in msg
    assert "No rank was started and nothing was deleted" in msg


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/sys is Linux's")
def test_a_directory_nobody_can_write_in_is_refused_by_a_real_probe():
    # /sys/kernel refuses new files even to root (chmod-based tests pass as root)
    with pytest.raises(OutputDirError, match=r"checkpoint directory /sys/kernel/longft-ckpt cannot "
                                             r"be created \(.*\): Permission denied; fix its "
                                             r"permissions or owner"):
        writable({"checkpoint directory": Path("/sys/kernel/longft-ckpt")})


def test_train_stage_refuses_an_unwritable_checkpoint_dir_before_any_rank(tmp_path, monkeypatch,
                                                                        capsys):
    params = merge(to_dict(Config()), {"data": {"num_samples": 2, "max_seq_length": 1024}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "blocker").write_text("a file where checkpoints/ would go")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.setattr(sys, "argv", [
        "train.py", "--params", str(tmp_path / "params.yaml"),
        "--plan", str(tmp_path / "artifacts/plan.json"),
        "--ds-config", str(tmp_path / "artifacts/ds_config.json"), "--data", str(tmp_path / "data"),
        "--run", str(tmp_path / "run"), "--checkpoints", str(tmp_path / "blocker" / "ckpt"),
        "--export", str(tmp_path / "export")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "stages" / "train.py"), run_name="__main__")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("longft train: the train stage cannot write its outputs")
    assert f"checkpoint directory {tmp_path / 'blocker' / 'ckpt'} cannot be created" in err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and not (tmp_path / "run").exists()

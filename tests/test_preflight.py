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
from longft.run.launch import LaunchError
from longft.run.pipeline import REPO, run_all
from longft.run.preflight import HostMemoryError, gpu_memory, host_memory
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
    # the process baseline is the peak: no params change shrinks it
    assert "To fit: free host memory (close other jobs) or use a machine with more RAM." in msg
    assert "hardware.host_mem_check: false" in msg
    assert "nothing was deleted" in msg


def fixes(msg):
    return msg.split("To fit: ")[1].split(". `longft estimate`")[0]


def test_model_states_get_placement_and_smaller_states_not_the_sequence(monkeypatch):
    """Walk finding 7: 8B full-parameter on a 22 GiB host was told to lower data.max_seq_length
    or train.micro_batch_size (1), which shrink none of its largest items (Adam m, v 59.83 GiB).
    Real plans: the estimator's own item names."""
    from longft.hardware import Hardware
    from longft.run.patch_stage import make_plan
    from test_plan_file import H200

    cfg = from_dict({"model": {"name": "llama3.1-8b"}})
    cpu = Plan.from_dict(make_plan(cfg, Hardware(device="cpu", host_mem_gib=24, cpu_count=2))[0])
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, cpu, available=22 * GIB)
    msg = str(e.value)
    assert "Largest items: optimizer: Adam m, v (CPU Adam) 59.83 GiB;" in msg
    assert fixes(msg) == ("fewer or smaller model states: LoRA or QLoRA (lora.rank, lora.quantize), "
                          "8-bit Adam (optim.name: adamw_8bit) or bf16 states (zero.optimizer_states: "
                          "bf16); free host memory (close other jobs) or use a machine with more RAM")
    cfg = from_dict({"model": {"name": "llama3.1-8b"}, "hardware": {"device": "auto"}})
    gpu = Plan.from_dict(make_plan(cfg, H200)[0])
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, gpu, available=int(21.97 * GIB))
    assert fixes(str(e.value)).startswith(
        "`longft placement --gpu-mem 139.8 --host-mem 21.9 --seq 4096 --lora any --quantize any "
        "--optimizer any --optimizer-states any` finds a placement that fits, with LoRA or QLoRA")
    assert "max_seq_length" not in fixes(str(e.value))


def test_activations_get_the_sequence_and_checkpointing_and_micro_batch_only_above_1():
    cfg = from_dict({"hardware": {"device": "auto"}, "checkpointing": {"mode": "cpu_offload"},
                     "train": {"micro_batch_size": 2, "global_batch_size": 2}})
    items = [{"name": "activation checkpoints (pinned)", "bytes": 240 * GIB, "phases": ["steady"]},
             {"name": "process baseline", "bytes": 60 * GIB, "phases": ["setup", "steady"]},
             {"name": "start-up: pinned blocks of DeepSpeed's init", "bytes": 200 * GIB,
              "phases": ["setup"]}]   # a start-up item, not held at the training peak
    plan = Plan.from_dict(plan_dict({"device": "cuda", "checkpointing": "cpu_offload"},
                                    host_rss_bytes=300 * GIB, host_items=items))
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, plan, available=100 * GIB)
    msg = str(e.value)
    assert "Largest items: activation checkpoints (pinned) 240.00 GiB; process baseline 60.00 GiB." \
        in msg
    assert fixes(msg) == ("lower data.max_seq_length (4096) or train.micro_batch_size (2); use "
                          "checkpointing.mode: gpu instead of cpu_offload (activation checkpoints "
                          "stay in GPU memory); free host memory (close other jobs) or use a "
                          "machine with more RAM")
    cfg = from_dict({"hardware": {"device": "auto"}, "checkpointing": {"mode": "cpu_offload"}})
    with pytest.raises(HostMemoryError) as e:
        host_memory(cfg, plan, available=100 * GIB)
    assert fixes(str(e.value)).startswith("lower data.max_seq_length (4096); use checkpointing")


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


class FakeNvml:
    """Two GPUs: (free GiB, [(pid, used GiB)]) each, as pynvml reports them."""

    def __init__(self, *gpus):
        self.gpus = gpus

    def nvmlDeviceGetMemoryInfo(self, h):
        return collections.namedtuple("mem", "free")(int(self.gpus[h][0] * GIB))

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        proc = collections.namedtuple("proc", "pid usedGpuMemory")
        return [proc(pid, int(used * GIB)) for pid, used in self.gpus[h][1]]


def gpu_plan(nvml_gib):
    d = plan_dict({"device": "cuda"}, host_rss_bytes=GIB)
    d["memory_estimate"]["estimate"]["gpu"] = {"nvml_bytes": int(nvml_gib * GIB)}
    return Plan.from_dict(d)


def test_a_second_job_on_the_card_is_refused_before_any_rank_starts():
    """The walkthrough's last point: a second run on a card another job holds would run out of
    GPU memory after its model was built; it is refused at once, naming the other job."""
    import os

    cfg = from_dict({"hardware": {"num_gpus": 2}})
    plan = gpu_plan(20)
    busy = FakeNvml((60.0, []), (9.5, [(4242, 12.0)]))
    with pytest.raises(LaunchError) as e:
        gpu_memory(cfg, plan, "cuda", (busy, [0, 1]))
    msg = str(e.value)
    assert "a rank needs 20.00 GiB" in msg and "GPU 1: 9.5 GiB free, held by pid 4242" in msg
    assert "GPU 0" not in msg and "12.0 GiB" in msg and "--gpu-mem 9.5 " in msg
    assert "hardware.gpu_mem_check: false" in msg and "nothing was deleted" in msg
    # enough free beside the other job, or the card free of others: it starts
    assert "no other job" in gpu_memory(cfg, plan, "cuda", (FakeNvml((60.0, []), (21.0, [(4242, 12.0)])),
                                                              [0, 1]))
    assert gpu_memory(cfg, plan, "cuda", (FakeNvml((60.0, []), (9.5, [(os.getpid(), 12.0)])), [0, 1]))
    # a one-GPU run does not look at the second card; an emulated card needs no more than its cap
    assert gpu_memory(from_dict({}), plan, "cuda", (busy, [0, 1]))
    capped = from_dict({"hardware": {"num_gpus": 2, "vram_limit_gib": 7.0}})
    assert "a rank needs 8.90 GiB" in gpu_memory(capped, plan, "cuda", (FakeNvml((60.0, []), (9.5, [(1, 1)])),
                                                                       [0, 1]))
    # not checked: CPU, the check off, no NVML
    assert gpu_memory(cfg, plan, "cpu", (busy, [0, 1])) is None
    off = from_dict({"hardware": {"num_gpus": 2, "gpu_mem_check": False}})
    assert gpu_memory(off, plan, "cuda", (busy, [0, 1])) is None
    assert gpu_memory(cfg, plan, "cuda", (None, [])) is None
    # under a CUDA context free: no placement to suggest (--gpu-mem 0 is no answer)
    with pytest.raises(LaunchError) as e:
        gpu_memory(cfg, plan, "cuda", (FakeNvml((60.0, []), (0.4, [(4242, 79.0)])), [0, 1]))
    assert "GPU 1: 0.4 GiB free" in str(e.value) and "longft placement" not in str(e.value)

    class Unsupported(FakeNvml):  # NVML on MIG or vGPU: the query is not supported
        NVMLError = RuntimeError

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            raise self.NVMLError("Not Supported")
    assert gpu_memory(cfg, plan, "cuda", (Unsupported((60.0, []), (9.5, [])), [0, 1])) == (
        "GPU memory: not checked (NVML on GPU 0: Not Supported)")


@pytest.mark.gpu
def test_a_second_job_on_a_real_card_is_refused():
    """On the GPU machine: another process holding 80 % of the card, NVML names it."""
    import subprocess

    import torch

    total = torch.cuda.mem_get_info()[1]
    code = ("import time, torch; x = torch.empty(%d, dtype=torch.uint8, device='cuda'); "
            "print('ready', flush=True); time.sleep(300)" % int(0.8 * total))
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(LaunchError, match=f"held by pid {holder.pid} "):
            gpu_memory(from_dict({}), gpu_plan(0.5 * total / GIB), "cuda")
        assert "no other job" in gpu_memory(from_dict({}), gpu_plan(0.1 * total / GIB), "cuda")
    finally:
        holder.kill()

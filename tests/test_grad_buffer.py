"""zero.host_grad_buffer: shared (grad_buffer.py) trains exactly as DeepSpeed's own full buffer,
through the real stages on the CPU (ZeRO-3, optimizer on the CPU, one micro-step per step), and
the estimator counts its one slot."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, ModelConfig, merge, to_dict
from longft.engine.grad_buffer import MAP, GradBufferError, share
from longft.estimate.estimator import GIB, Setup, estimate
from longft.model.architecture import architecture
from longft.model.loading import load_model_config
from longft.run.launch import free_port
from longft.run.pipeline import run_params, run_stage, stage_commands

SRC = Path(__file__).resolve().parents[1] / "src"

# DeepSpeed's warm-up runs step 1 at lr 0; steps 2-5 update the weights, so the losses of steps
# 3-5 depend on the updates made through the gradient buffer
OVERLAY = {"data": {"num_samples": 6, "max_seq_length": 1024},
           "train": {"global_batch_size": 1, "iterations": 5, "warmup_iterations": 1},
           "output": {"save_checkpoint": False, "export": False}}


def run(tmp_path, mode, extra=None):
    params = merge(to_dict(Config()),
                   merge(OVERLAY, {"zero": {"host_grad_buffer": mode}, **(extra or {})}))
    r = run_params(params, tmp_path / mode)
    assert r.failed is None, r.log.read_text()[-3000:]
    rows = [json.loads(x) for x in (r.work / "run" / "rank0.jsonl").read_text().splitlines()]
    return r, rows


@pytest.mark.slow
def test_shared_buffer_trains_bit_for_bit_like_the_full_one_and_resumes(tmp_path):
    full, full_rows = run(tmp_path, "full")
    shared, shared_rows = run(tmp_path, "shared", {"output": {"checkpoint_every": 2}})
    losses = [[x["loss"] for x in rows if x["type"] == "iter"] for rows in (full_rows, shared_rows)]
    assert len(losses[0]) == 5
    assert all(x["lr"] > 0 for x in full_rows if x["type"] == "iter" and x["step"] >= 2)
    assert losses[0] == losses[1]             # the same updates, to the last bit
    env = {m: next(x for x in rows if x["type"] == "env")
           for m, rows in (("full", full_rows), ("shared", shared_rows))}
    assert env["full"]["host_grad_buffer"] == "full" and env["shared"]["host_grad_buffer"] == "shared"
    assert "host gradient buffer shared" in shared.log.read_text()
    assert "host gradient buffer shared" not in full.log.read_text()
    # The train stage again, from the periodic checkpoint step-2 (step-4 removed): the buffer is
    # shared after the load, and steps 4 and 5 see updates made through it after the resume.
    shutil.rmtree(shared.work / "checkpoints" / "step-4")
    as_killed_after_last_checkpoint(shared.work / "checkpoints")
    out = run_stage("train", stage_commands(shared.work / "params.yaml", shared.work)["train"])
    assert "resumed from" in out and "step-2" in out and "host gradient buffer shared" in out
    rows = [json.loads(x) for x in (shared.work / "run" / "rank0.jsonl").read_text().splitlines()]
    again = {x["step"]: x["loss"] for x in rows if x["type"] == "iter"}
    assert [again[s] for s in (3, 4, 5)] == losses[0][2:]


SHARE_WORKER = textwrap.dedent('''
    import json, sys
    import torch, deepspeed
    from longft.engine import grad_buffer
    deepspeed.init_distributed(dist_backend="gloo")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    out = {}
    for mode in ("full", "shared"):
        torch.manual_seed(0)
        sizes = [(16, 48), (48, 8), (8, 16)]           # partitions of 48x16+48, 8x48+8, 16x8+16
        model = torch.nn.Sequential(*[torch.nn.Linear(i, o) for i, o in sizes])
        engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
        opt = engine.optimizer
        before = opt.grad_partitions_flat_buffer.numel()
        freed = grad_buffer.share(opt) if mode == "shared" else 0
        buf = opt.grad_partitions_flat_buffer
        slots = getattr(opt, grad_buffer.MAP)          # DeepSpeed's own slots, as it reads them
        x = torch.randn(4, 16)
        for _ in range(3):
            loss = engine(x.bfloat16()).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            bits = [p.detach().view(torch.int16).view(-1).tolist() for p in model.parameters()]
        out[mode] = {"before": before, "after": buf.numel(), "freed": freed, "bits": bits,
                     "same_storage": all(t.data_ptr() == buf.data_ptr() for t in slots.values()),
                     "slots": sorted(t.numel() for t in slots.values())}
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.slow  # two DeepSpeed engines in a subprocess: ~17 s on 2 loaded cores
def test_share_swaps_deepspeeds_own_buffer_and_trains_bit_for_bit(tmp_path):
    """DeepSpeed's real ZeRO-3 optimizer (CPU Adam, one rank on gloo, in a subprocess): share()
    leaves one buffer of the largest partition, every slot DeepSpeed writes points into it, and
    three steps through it give the same weights, to the bit, as DeepSpeed's full buffer."""
    script = tmp_path / "worker.py"
    script.write_text(SHARE_WORKER)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # (Popen, not subprocess.run: conftest would take `run`, this file's stage runner, for it)
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as p:
        stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stdout[-2000:] + stderr[-4000:]
    got = json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT "))[7:])
    full, shared = got["full"], got["shared"]
    total = 48 * 16 + 48 + 8 * 48 + 8 + 16 * 8 + 16
    assert full["before"] == full["after"] == shared["before"] == total
    assert shared["after"] == 48 * 16                 # the largest partition: one slot
    assert shared["freed"] == (total - 48 * 16) * 2   # bf16 bytes given back
    assert shared["slots"] == full["slots"] and shared["same_storage"]
    assert not full["same_storage"]
    assert shared["bits"] == full["bits"]             # the same updates through the one slot


def test_share_refuses_what_it_cannot_do():
    with pytest.raises(GradBufferError, match="zero.host_grad_buffer: full"):
        share(types.SimpleNamespace())          # not DeepSpeed's ZeRO-3 optimizer
    for change, match in (({"gradient_accumulation_steps": 2}, "one micro-step per step"),
                          ({"offload_optimizer": False}, "offload_optimizer: cpu"),
                          ({"dtype": torch.float16}, "fp16")):
        opt = types.SimpleNamespace(**{"grad_partitions_flat_buffer": torch.zeros(4),
                                       "gradient_accumulation_steps": 1, "offload_optimizer": True,
                                       "dtype": torch.bfloat16, **change})
        setattr(opt, MAP, {1: torch.zeros(4)})
        with pytest.raises(GradBufferError, match=match) as e:
            share(opt)
        assert "zero.host_grad_buffer: full" in str(e.value)
        assert opt.grad_partitions_flat_buffer.numel() == 4     # nothing swapped


def test_checkpoint_fingerprint_ignores_the_host_grad_buffer():
    """The buffer does not change the trajectory (above), so a run may resume across a change of
    it, and checkpoints written before the knob existed still resume; other zero knobs count."""
    from longft.config.params import from_dict
    from longft.engine.checkpoint import fingerprint

    one = {"train": {"global_batch_size": 1}}
    fps = {m: fingerprint(from_dict(merge(one, {"zero": {"host_grad_buffer": m}})))
           for m in ("auto", "full", "shared")}
    assert len(set(fps.values())) == 1
    assert fingerprint(from_dict(merge(one, {"zero": {"offload_param": "cpu"}}))) != fps["auto"]


def test_shared_host_grad_buffer_swaps_the_16_gib_block_for_one_slot():
    """Row (c)'s setup: DeepSpeed pins 2 B x 8.03B parameters of gradient slots (a 16 GiB block);
    shared (grad_buffer.py) leaves one slot of the largest partition, the 525M-element embedding
    (1.05 GB: a 1 GiB block). The start-up moment is unchanged: it still holds the full block, and
    the slot reuses the embedding's freed 1 GiB zero.Init block from torch's pinned cache."""
    base = Setup(micro_batch=1, seq_len=128000, checkpointing="cpu_offload", gpu_layers=16,
                 keep_attention=9, tiled_mlp=True, offload_optimizer=True, offload_param=True)
    arch = architecture(load_model_config(ModelConfig(source="random", name="llama3.1-8b")))
    full = estimate(arch, base)
    shared = estimate(arch, dataclasses.replace(base, host_grad_buffer="shared"))
    f, s = ({i.name: i.bytes for i in e.items if i.where == "host"} for e in (full, shared))
    assert f["gradients: partitions (pinned)"] == 16 * GIB
    assert "gradients: partitions (pinned)" not in s
    assert s["gradients: one shared staging slot (pinned)"] == GIB
    assert full.host_moments["steady"] - shared.host_moments["steady"] == 15 * GIB
    assert shared.host_moments["setup"] == full.host_moments["setup"]
    assert shared.gpu_allocated == full.gpu_allocated
    for change in ({"grad_accum": 2}, {"precision": "fp16"}, {"offload_optimizer": False}):
        bad = dataclasses.replace(base, host_grad_buffer="shared", **change)
        assert any("host_grad_buffer shared needs" in p for p in bad.problems()), change

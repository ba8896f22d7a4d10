"""A CUDA out-of-memory in a step is reported with the step, the sequence length, the micro-batch and
what to change, without a traceback; the run is recorded as failed and its metrics incomplete.
(The real thing, on an H200 capped at 16 GiB: bench/results/h200-1b-16k-cap16-oom.json.)"""

import json
import os
import subprocess
import sys

import yaml

from longft.config.params import Config, merge, to_dict
from longft.run.launch import environment, free_port
from longft.run.pipeline import run_all, run_stage, stage_commands

OVERLAY = {"data": {"num_samples": 4, "max_seq_length": 1024},
           "train": {"iterations": 4, "warmup_iterations": 1},
           "output": {"save_checkpoint": False, "export": False}}

# One rank started the way the launcher starts it; its second step runs out of memory the way a
# CUDA allocation does (torch.OutOfMemoryError from inside the step).
DRIVER = """
import sys, torch
from longft.engine import train_step
real, calls = train_step.step, []
def step(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return real(*a, **k)
train_step.step = step
from longft.engine.worker import main
sys.exit(main(sys.argv[1:]))
"""


def test_out_of_memory_is_reported_with_step_and_sequence_length(tmp_path):
    params = merge(to_dict(Config()), OVERLAY)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch"))
    args = ["--params", str(tmp_path / "params.yaml"),
            "--plan", str(tmp_path / "artifacts/plan.json"),
            "--ds-config", str(tmp_path / "artifacts/ds_config.json"),
            "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run")]
    env = environment("cpu", dict(os.environ))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port(29671)))
    p = subprocess.run([sys.executable, "-c", DRIVER, *args], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert ("longft train: CUDA out of memory at step 2, sequence length 1024, micro-batch 1: "
            "lower data.max_seq_length or train.micro_batch_size, offload more "
            "(zero.offload_param: cpu) or keep checkpointing on") in p.stderr
    assert "Traceback" not in p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "iter"] == [1]
    assert rows[-1]["type"] == "end" and rows[-1]["status"] == "failed"
    assert rows[-1]["error"].startswith("CUDA out of memory")
    run_stage("metrics", stage_commands(tmp_path / "params.yaml", tmp_path)["metrics"])
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["status"] == "incomplete"

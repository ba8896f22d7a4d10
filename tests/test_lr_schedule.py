"""Every optimizer step moves the weights (issue 19): the old DeepSpeed schedules applied lr 0 at
the first two steps, so the step-3 loss was bit-identical at lr 1e-3 and 3e-4, and the log printed
the next step's lr. Through the real stages on CPU: the logged lr is the one each step applied, and
the loss after one step already depends on optim.lr. One of the runs also profiles its step after
the warm-up (output.profile_steps, issue 33): the split times DeepSpeed's CPU Adam update, its
gradient clipping and its copy of the updated weights."""

import json

import pytest
import yaml

from longft.config.params import Config, from_dict, merge, to_dict
from longft.engine import ds_config
from longft.run.pipeline import run_all

pytestmark = pytest.mark.slow


def run(work, lr, profile_steps=0):
    work.mkdir(parents=True)
    params = merge(to_dict(Config()), {
        "data": {"num_samples": 6, "max_seq_length": 1024},
        "train": {"iterations": 3, "warmup_iterations": 1, "global_batch_size": 1},
        "optim": {"lr": lr, "warmup_steps": 2, "scheduler": "cosine"},
        "output": {"save_checkpoint": False, "export": False, "profile_steps": profile_steps}})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    recs = [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]
    return [r for r in recs if r["type"] == "iter"], params


def test_every_step_applies_a_nonzero_lr_and_the_log_shows_it(tmp_path):
    hi, params = run(tmp_path / "hi", 1e-3)
    lo, _ = run(tmp_path / "lo", 3e-4, profile_steps=1)
    cfg = from_dict(params)
    # the logged lr is what the step applied: warm-up (1/2, 2/2), then cosine to min_lr_ratio
    assert [r["lr"] for r in hi] == pytest.approx([1e-3 * ds_config.lr_factor(cfg, i)
                                                   for i in range(3)])
    assert hi[0]["lr"] == pytest.approx(5e-4) and hi[-1]["lr"] == pytest.approx(1e-4)
    # step 1 sees the same weights in both runs; from step 2 on the lr has moved them differently
    assert hi[0]["loss"] == lo[0]["loss"]
    assert hi[1]["loss"] != lo[1]["loss"] and hi[2]["loss"] != lo[2]["loss"]
    # the profiled run: step 2 (after the one warm-up step) under torch.profiler, marked in its record
    assert [r.get("profiled", False) for r in lo] == [False, True, False]
    prof = tmp_path / "lo" / "run" / "profile"
    split = json.loads((prof / "rank0.split.json").read_text())
    assert split["steps"] == [2] and split["optimizer"] == "DeepSpeedCPUAdam" and split["gpu"] is False
    assert split["total"]["update"]["time_s"] > 0
    assert 0 < split["total"]["update"]["time_s"] <= split["total"]["optimizer"]["time_s"]
    # DeepSpeed ZeRO-3's own clipping pass and copy of the updated weights, timed in ranges of theirs
    for p in ("clip", "copy_back"):
        assert 0 < split["total"][p]["time_s"] <= split["total"]["optimizer"]["time_s"], p
    assert (prof / "rank0.trace.json.gz").stat().st_size > 0
    assert not (tmp_path / "hi" / "run" / "profile").exists()

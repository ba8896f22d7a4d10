"""Block-sparse finetuning through the stages on CPU (DeepSpeed ZeRO-3, gloo; issue 51): the
warm-up runs, a re-run resumes from the periodic checkpoint with the blocks it chose (no new
warm-up) and gives the same losses and the same exported weights, bit for bit; the export is a
plain model without block tensors, which `longft generate` loads. Then the same rows over an NF4
base (lora.quantize, ZeRO-2): the warm-up and training run over bitsandbytes' 4-bit linears, and the
export is the plain model in fp32 (the blocks merged into the de-quantized base), with the base it
was trained on recorded, which `longft generate` loads."""

import json

import pytest
import yaml

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, merge, to_dict
from longft.run.pipeline import run_all, run_stage, stage_commands

pytestmark = pytest.mark.slow

OVERLAY = {"data": {"num_samples": 8, "eval_samples": 4},
           "train": {"iterations": 4, "warmup_iterations": 1},
           "sparse": {"blocks": 4, "block_size": 16, "warmup_steps": 2},
           "output": {"checkpoint_every": 2}}


def _losses(work):
    recs = [json.loads(x) for x in (work / "run" / "rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "iter"}


def test_sparse_run_resumes_exactly_and_exports_a_plain_model(tmp_path):
    import torch
    from safetensors.torch import load_file

    from longft.cli import main as cli
    from longft.generate.loading import load_export

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merge(to_dict(Config()), OVERLAY)))
    out = run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch", "train"))["train"]
    assert "sparse warm-up" in out
    plan = json.loads((tmp_path / "artifacts" / "plan.json").read_text())
    assert plan["model"]["n_trainable"] == 4 * 16 * 16 * 14  # blocks x b^2 x 14 linears
    first, weights = _losses(tmp_path), load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(first) == [1, 2, 3, 4] and not [k for k in weights if "sparse" in k]

    as_killed_after_last_checkpoint(tmp_path / "checkpoints")  # a completed run in place retrains
    again = run_stage("train", stage_commands(tmp_path / "params.yaml", tmp_path)["train"])
    assert "resumed from" in again and "step-2" in again and "sparse warm-up" not in again
    assert _losses(tmp_path) == first
    resumed = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)

    export = load_export(tmp_path / "export")
    assert export.kind == "block_sparse_merged"
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "hi",
                     "--max-new-tokens", "2"]) == 0

    # over an NF4 base: patch and train again on the same prepared rows (ZeRO-2, no checkpoint)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merge(to_dict(Config()), merge(OVERLAY, {
        "train": {"iterations": 2}, "lora": {"quantize": "nf4"}, "zero": {"stage": 2},
        "output": {"checkpoint_every": 0, "save_checkpoint": False}}))))
    out = run_all(tmp_path / "params.yaml", tmp_path, ("patch", "train"))["train"]
    assert "sparse warm-up" in out and sorted(_losses(tmp_path)) == [1, 2]
    plan = json.loads((tmp_path / "artifacts" / "plan.json").read_text())
    assert plan["resolved"]["quantize"]["value"] == "nf4"
    info = json.loads((tmp_path / "export" / "longft_export.json").read_text())
    assert info["kind"] == "block_sparse_merged" and info["base"]["quantize"] == "nf4"
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert not [k for k in weights if "sparse" in k or "absmax" in k]
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert load_export(tmp_path / "export").base.startswith("blocks merged into")
    assert cli.main(["generate", "--export", str(tmp_path / "export"), "--prompt", "hi",
                     "--max-new-tokens", "2"]) == 0

"""hardware.sequence_parallel 2 on CPU (2 gloo ranks through longft's own launcher, DeepSpeed's
Ulysses): the per-step losses and gradient norms equal those of one rank training the same rows
(fp32), for unpacked rows and for packed rows of several documents, whose documents must stay
apart after the all-to-all (a leak between documents would change the losses)."""

import json
import socket

import pytest
import yaml

from interrupted_run import as_killed_after_last_checkpoint
from longft.config.params import Config, merge, to_dict
from longft.data.store import PreparedDataset
from longft.model.packed_attention import document_lengths
from longft.run.pipeline import run_all, run_stage, stage_commands

pytestmark = pytest.mark.slow


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(work, rank: int = 0) -> list[dict]:
    return [json.loads(x) for x in (work / "run" / f"rank{rank}.jsonl").read_text().splitlines()]


def steps(work, rank: int = 0) -> list[dict]:
    return [r for r in rows(work, rank) if r["type"] == "iter"]


def run(tmp_path, name: str, gpus: int, sp: int, data: dict, device: str = "cpu",
        **over) -> list[dict]:
    work = tmp_path / name
    work.mkdir()
    params = merge(to_dict(Config()), {
        "hardware": {"device": device, "num_gpus": gpus, "sequence_parallel": sp,
                     "master_port": unused_port()},
        "precision": "fp32",
        "data": {"num_samples": 8, "eval_samples": 0, "max_seq_length": 2048, **data},
        "train": {"iterations": 3, "warmup_iterations": 1, "global_batch_size": 2},
        "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 0}})
    params = merge(params, over)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    out = run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    return steps(work), out


PACKED = {"pack": True, "synthetic_lengths": "mixed", "max_seq_length": 4096, "num_samples": 12}
"""7 packed 4096-token rows, most holding 2 documents, one of them across the slice edge."""


@pytest.mark.parametrize("data, over", [
    ({"pack": False, "eval_samples": 4}, {}),  # and the held-out eval (no all-to-all there)
    (PACKED, {}),
    ({"pack": False}, {"kernels": {"tiled_mlp": "on", "tiled_mlp_tokens": 256}}),
], ids=["one-document-a-row", "packed", "tiled-mlp"])
def test_two_ranks_of_one_sequence_match_one_rank(tmp_path, data, over):
    compare(tmp_path, data, "cpu", over)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or
                    __import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_of_one_sequence_match_one_gpu_with_every_memory_technique(tmp_path):
    """ZeRO-3 offload, checkpoint offload, the tiled MLP and Liger's fused loss, packed rows."""
    compare(tmp_path, PACKED, "cuda", {
        "kernels": {"liger": "on", "tiled_mlp": "on", "tiled_mlp_tokens": 1024,
                    "attention": "sdpa"},
        "checkpointing": {"mode": "cpu_offload"}, "zero": {"offload_param": "cpu"}})


def compare(tmp_path, data, device, over):
    one, _ = run(tmp_path, "one", 1, 1, data, device, **over)
    two, out = run(tmp_path, "two", 2, 2, data, device, **over)
    plan = json.loads((tmp_path / "two" / "artifacts" / "plan.json").read_text())
    if data["pack"]:
        assert plan["resolved"]["packed_attention"]["value"] == "per_document"
        data_rows = PreparedDataset(tmp_path / "two" / "data")
        edges = [document_lengths(data_rows[i]["position_ids"][None])[0]
                 for i in range(len(data_rows))]
        assert any(2048 < e < 4096 for e in edges)  # a document crosses the two ranks' slices
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (one, two)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (one, two)
    # the ranks' slices add up to the rows' real tokens and the per-document squares
    other = steps(tmp_path / "two", 1)
    for a, b, c in zip(one, two, other):
        assert b["tokens"] + c["tokens"] == a["tokens"]
        assert b["doc_sq_tokens"] + c["doc_sq_tokens"] == a["doc_sq_tokens"]
        assert c["loss"] == b["loss"]
    if data.get("eval_samples"):
        evals = [[r for r in rows(tmp_path / w) if r["type"] == "eval"] for w in ("one", "two")]
        assert len(evals[0]) == len(evals[1]) == 1
        assert evals[1][0]["loss"] == pytest.approx(evals[0][0]["loss"], rel=1e-5)


def test_a_sequence_parallel_run_resumes_from_its_checkpoint(tmp_path):
    """DeepSpeed checkpoints under the Ulysses mpu load back, and the data stream (the adapter
    over the resumed position) picks up where the step left off: the re-run of steps 3-4 from
    the step-2 checkpoint logs the losses of the uninterrupted run."""
    first, _ = run(tmp_path, "two", 2, 2, {"pack": False}, train={"iterations": 4},
                   output={"checkpoint_every": 2, "keep_last": 2})
    work = tmp_path / "two"
    as_killed_after_last_checkpoint(work / "checkpoints")  # a completed run in place retrains
    again = run_stage("train", stage_commands(work / "params.yaml", work)["train"])
    assert f"resumed from {work / 'checkpoints'}/step-2" in again
    resumed = steps(work)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(first, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (first, resumed)

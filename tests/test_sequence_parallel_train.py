"""hardware.sequence_parallel 2 on CPU (2 gloo ranks through longft's own launcher, DeepSpeed's
Ulysses): the per-step losses and gradient norms equal those of one rank training the same rows
(fp32), for unpacked rows and for packed rows of several documents, whose documents must stay
apart after the all-to-all (a leak between documents would change the losses)."""

import json
import socket

import pytest
import yaml

from longft.config.params import Config, merge, to_dict
from longft.run.pipeline import run_all

pytestmark = pytest.mark.slow


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps(work, rank: int = 0) -> list[dict]:
    rows = [json.loads(x) for x in (work / "run" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == "iter"]


def run(tmp_path, name: str, gpus: int, sp: int, data: dict) -> list[dict]:
    work = tmp_path / name
    work.mkdir()
    params = merge(to_dict(Config()), {
        "hardware": {"device": "cpu", "num_gpus": gpus, "sequence_parallel": sp,
                     "master_port": unused_port()},
        "precision": "fp32",
        "data": {"num_samples": 8, "eval_samples": 0, "max_seq_length": 2048, **data},
        "train": {"iterations": 3, "warmup_iterations": 1, "global_batch_size": 2},
        "output": {"save_checkpoint": False, "export": False, "checkpoint_every": 0}})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    out = run_all(work / "params.yaml", work, ("prepare", "patch", "train"))
    return steps(work), out


@pytest.mark.parametrize("data", [{"pack": False}, {"pack": True, "synthetic_lengths": "mixed"}],
                         ids=["one-document-a-row", "packed"])
def test_two_ranks_of_one_sequence_match_one_rank(tmp_path, data):
    one, _ = run(tmp_path, "one", 1, 1, data)
    two, out = run(tmp_path, "two", 2, 2, data)
    plan = json.loads((tmp_path / "two" / "artifacts" / "plan.json").read_text())
    if data["pack"]:
        assert plan["resolved"]["packed_attention"]["value"] == "per_document"
        assert max(r["doc_sq_tokens"] for r in one) < 2048 * 2048  # several documents a row
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

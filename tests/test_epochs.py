"""train.epochs (issue 19): the step count from the prepared rows, the passes over the data in the
run log and metrics, each epoch a reshuffle of every row, and per-step grad_norm / dvclive /
TensorBoard curves, through the real stages on CPU (ZeRO-3 with CPU Adam)."""

import csv
import itertools
import json

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from longft.config.params import Config, ConfigError, from_dict, merge, to_dict
from longft.engine.batches import SkipFirst, micro_batches, micro_batches_per_epoch, passes, steps_for_epochs
from longft.engine.trainer import TrainingError, with_steps
from longft.run.coverage import coverage_note


def test_steps_and_passes_follow_rows_batch_and_world():
    # 48 rows, 1 GPU, micro 1, accumulation 2: 48 micro-batches an epoch, 24 steps
    assert micro_batches_per_epoch(48, 1, 1) == 48
    assert steps_for_epochs(1, 48, 1, 1, 2) == 24 and steps_for_epochs(2, 48, 1, 1, 2) == 48
    assert steps_for_epochs(0.5, 48, 1, 1, 2) == 12
    assert passes(24, 48, 1, 1, 2) == 1.0 and passes(30, 48, 1, 1, 2) == 1.25
    # 7 rows on 2 ranks, micro 2: 3 rows a rank (one left over), 2 micro-batches (2 + 1)
    assert micro_batches_per_epoch(7, 2, 2) == 2
    assert steps_for_epochs(3, 7, 2, 2, 1) == 6
    # a fraction of a step is rounded up, and a run is at least one step
    assert steps_for_epochs(1, 5, 1, 2, 2) == 2  # 3 micro-batches, 2 a step
    assert steps_for_epochs(0.01, 48, 1, 1, 2) == 1


def cfg_with(**train):
    return from_dict(merge(to_dict(Config()), {"train": train}))


def test_with_steps_derives_iterations_and_refuses_an_untimed_run():
    cfg = cfg_with(iterations=None, epochs=2, global_batch_size=2, warmup_iterations=2)
    assert with_steps(cfg, 30).train.iterations == 30  # 30 micro-batches an epoch, 2 a step
    assert with_steps(cfg, 30).train.epochs == 2
    fixed = cfg_with(iterations=7)
    assert with_steps(fixed, 30) is fixed  # iterations set: nothing derived
    with pytest.raises(TrainingError, match=r"2 optimizer step\(s\) over 2 prepared rows.*warmup"):
        with_steps(cfg, 2)


def test_a_step_count_that_leaves_a_files_rows_out_is_said_before_training():
    # the walkthrough's run: the demo's 12 steps of 2 rows on 259 rows of the user's jsonl
    cfg = cfg_with(iterations=12, global_batch_size=2)
    note = coverage_note(cfg, {"num_rows": 259, "source": "jsonl"})
    assert note == ("train: note: 12 steps of 2 rows cover 9 % of the 259 prepared rows "
                    "(train.iterations 12): set train.epochs: 1 (train.iterations: null) to pass "
                    "over all of them")
    assert "cover 92 %" in coverage_note(cfg, {"num_rows": 26, "source": "parquet"})
    assert coverage_note(cfg, {"num_rows": 24, "source": "jsonl"}) is None   # one whole pass
    assert coverage_note(cfg, {"num_rows": 259, "source": "synthetic"}) is None  # generated
    assert coverage_note(cfg, {"num_rows": 259, "source": "random"}) is None
    epochs = cfg_with(iterations=None, epochs=0.5)
    assert coverage_note(epochs, {"num_rows": 259, "source": "jsonl"}) is None  # passes asked
    assert "under 1 %" in coverage_note(cfg, {"num_rows": 100_000, "source": "hf"})
    assert "cover 99 %" in coverage_note(cfg_with(iterations=249), {"num_rows": 500, "source": "jsonl"})


def test_exactly_one_of_iterations_and_epochs():
    for train in ({"epochs": 2}, {"iterations": None}, {"iterations": None, "epochs": None}):
        with pytest.raises(ConfigError, match="set exactly one"):
            cfg_with(**train)
    with pytest.raises(ConfigError, match="train.epochs: must be > 0"):
        cfg_with(iterations=None, epochs=0)
    assert cfg_with(iterations=None, epochs=0.5).train.epochs == 0.5


class Rows(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def epochs_of(rank, world, rows=11, micro=2, start=0, count=None):
    data = Rows(rows)
    sampler = SkipFirst(DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                           seed=3, drop_last=True))
    loader = DataLoader(data, batch_size=micro, sampler=sampler)
    per_epoch = micro_batches_per_epoch(rows, world, micro)
    assert len(loader) == per_epoch
    stream = micro_batches(loader, sampler, start)
    return [b.tolist() for b in itertools.islice(stream, count or 3 * per_epoch)], per_epoch


def test_every_epoch_reshuffles_and_the_ranks_share_each_epoch_without_overlap():
    world = 2
    streams = [epochs_of(r, world) for r in range(world)]
    per_epoch = streams[0][1]
    orders = []
    for e in range(3):
        seen = [sum(s[e * per_epoch:(e + 1) * per_epoch], []) for s, _ in streams]
        both = sum(seen, [])
        assert len(both) == len(set(both)) == 11 // world * world  # one left over per epoch
        orders.append(seen[0])
    assert orders[0] != orders[1] != orders[2]


def test_resume_mid_epoch_two_continues_the_same_stream():
    full, per_epoch = epochs_of(0, 1, rows=9, micro=2)  # 5 micro-batches an epoch (2+2+2+2+1)
    start = per_epoch + 2  # two micro-batches into the second epoch
    resumed, _ = epochs_of(0, 1, rows=9, micro=2, start=start, count=len(full) - start)
    assert resumed == full[start:]


# --------------------------------------------------------------------------- real run on CPU


@pytest.mark.slow
def test_an_epochs_run_through_the_stages(tmp_path):
    from longft.metrics.summary import summarize
    from longft.run.pipeline import run_all

    params = merge(to_dict(Config()), {
        "data": {"num_samples": 6, "max_seq_length": 1024},
        "train": {"iterations": None, "epochs": 1.5, "warmup_iterations": 1, "global_batch_size": 1},
        "output": {"save_checkpoint": False, "export": False, "tensorboard": True}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch", "train"))
    rows = json.loads((tmp_path / "data" / "stats.json").read_text())["rows"]
    steps = steps_for_epochs(1.5, rows, 1, 1, 1)
    recs = [json.loads(x) for x in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    iters = [r for r in recs if r["type"] == "iter"]
    assert [r["step"] for r in iters] == list(range(1, steps + 1))
    assert iters[-1]["epoch"] == pytest.approx(steps / rows, abs=1e-4)
    assert f"-> {steps} optimizer steps" in out["train"]
    # the global gradient norm of every step, from DeepSpeed under ZeRO-3 with CPU Adam
    norms = [r["grad_norm"] for r in iters]
    assert all(n is not None and n > 0 for n in norms) and len(set(norms)) > 1
    assert f"grad_norm {norms[-1]:.3g}" in out["train"]
    # dvclive: one row per step for each curve
    live = tmp_path / "run" / "live" / "plots" / "metrics"
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "epoch"):
        with open(live / f"{name}.tsv", newline="") as f:
            table = list(csv.DictReader(f, delimiter="\t"))
        assert [int(r["step"]) for r in table] == list(range(1, steps + 1)), name
    with open(live / "grad_norm.tsv", newline="") as f:
        assert [float(r["grad_norm"]) for r in csv.DictReader(f, delimiter="\t")] == \
            pytest.approx(norms)
    assert not (tmp_path / "run" / "live" / "dvc.yaml").exists()  # dvclive wrote no dvc.yaml
    # TensorBoard events with the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/grad_norm")] == list(range(1, steps + 1))
    # metrics: the passes made and the norms
    train, _, loss_rows = summarize(tmp_path / "run", None)
    assert train["epochs"] == pytest.approx(steps / rows, abs=1e-4)
    assert train["grad_norm"]["last"] == pytest.approx(norms[-1], rel=1e-4)
    assert [r["epoch"] for r in loss_rows][-1] == pytest.approx(steps / rows, abs=1e-4)


def test_checkpoint_fingerprint_counts_the_total_steps_not_when_to_evaluate():
    """Another eval interval still resumes its checkpoints; another length of run does not (the
    cosine schedule spans the total steps: issue 36), nor does another lr."""
    from longft.config.params import from_dict
    from longft.engine.checkpoint import fingerprint

    base = fingerprint(from_dict({}))
    assert fingerprint(from_dict({"train": {"iterations": None, "epochs": 2.0}})) != base
    assert fingerprint(from_dict({"train": {"iterations": 24}})) != base
    assert fingerprint(from_dict({"train": {"eval_every": 5}})) == base
    assert fingerprint(from_dict({"optim": {"lr": 5e-4}})) != base

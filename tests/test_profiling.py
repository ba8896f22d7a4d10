"""output.profile_steps (issue 33): interval arithmetic, the time split computed by hand from
synthetic trace events, which steps are profiled, and a tiny torch model stepped by
engine/train_step.py under the real StepProfiler (trace written and parsed, phases timed)."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from longft.config.params import from_dict
from longft.engine import profiling
from longft.measure.intervals import intersect, length, union
from longft.measure.time_split import split, table


def test_union_sorts_merges_touching_and_drops_empty_intervals():
    assert union([(3, 4), (0, 1), (1, 2), (5, 5), (1.5, 2.5)]) == [(0, 2.5), (3, 4)]
    assert union([]) == []


def test_intersect_and_length_of_disjoint_lists():
    x, y = [(0, 2), (3, 6)], [(1, 4), (5, 7)]
    assert intersect(x, y) == [(1, 2), (3, 4), (5, 6)]
    assert intersect(x, []) == [] and intersect([(0, 1)], [(1, 2)]) == []
    assert length(intersect(x, y)) == 3 and length(x) == 5


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


CPU = "user_annotation"
# microseconds. Step 7: 0..1000 with forward 100..400, backward 400..800, optimizer 850..950 and
# the update inside it 870..920. Step 8: 2000..2500, two forward ranges (accumulation), no GPU work.
EVENTS = [
    _x("longft.step", CPU, 0, 1000), _x("longft.forward", CPU, 100, 300),
    _x("longft.backward", CPU, 400, 400), _x("longft.optimizer", CPU, 850, 100),
    _x("longft.update", CPU, 870, 50), _x("longft.clip", CPU, 855, 10),
    _x("longft.copy_back", CPU, 925, 20),
    _x("longft.step", CPU, 2000, 500), _x("longft.forward", CPU, 2000, 100),
    _x("longft.forward", CPU, 2200, 50),
    _x("aten::mm", "cpu_op", 120, 100),
    _x("longft.forward", "gpu_user_annotation", 150, 10),  # the GPU stream's copy of the range
    _x("gemm_a", "kernel", 150, 100), _x("gemm_b", "kernel", 200, 100), _x("gemm_c", "kernel", 500, 200),
    _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 280, 70),
    _x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 650, 100),
    _x("Memset (Device)", "gpu_memset", 760, 20),
    _x("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "kernel", 780, 10),  # a collective: not compute
    _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 900, 10),
]
US = 1e-6


def test_split_by_hand_with_gpu_events():
    s = split(EVENTS, [7, 8])
    assert s["steps"] == [7, 8] and s["gpu"] is True
    one = s["per_step"][0]
    assert one["step"] == 7
    # forward 100..400: kernels 150..300, HtoD 280..350 (20 of it under a kernel), GPU busy 150..350
    assert one["forward"] == pytest.approx({"time_s": 300 * US, "compute_s": 150 * US, "htod_s": 70 * US,
                                            "comm_s": 0, "dtoh_s": 0, "other_copy_s": 0, "copy_overlap_s": 20 * US,
                                            "gpu_idle_s": 100 * US})
    # backward 400..800: kernel 500..700, DtoH 650..750, memset 760..780, NCCL 780..790: busy 250 + 30
    assert one["backward"] == pytest.approx({"time_s": 400 * US, "compute_s": 200 * US, "htod_s": 0,
                                             "comm_s": 10 * US, "dtoh_s": 100 * US, "other_copy_s": 20 * US,
                                             "copy_overlap_s": 50 * US, "gpu_idle_s": 120 * US})
    assert one["optimizer"]["other_copy_s"] == pytest.approx(10 * US)
    assert one["optimizer"]["gpu_idle_s"] == pytest.approx(90 * US)
    assert one["update"]["time_s"] == pytest.approx(50 * US) and one["update"]["gpu_idle_s"] == pytest.approx(40 * US)
    # the ranges nested in the optimizer: clip 855..865, copy back 925..945 (no GPU work in either)
    assert one["clip"]["time_s"] == pytest.approx(10 * US) and one["clip"]["gpu_idle_s"] == pytest.approx(10 * US)
    assert one["copy_back"]["time_s"] == pytest.approx(20 * US)
    assert one["wall"]["compute_s"] == pytest.approx(350 * US)
    assert one["wall"]["gpu_idle_s"] == pytest.approx((1000 - 490) * US)
    assert one["other_s"] == pytest.approx(200 * US)
    two = s["per_step"][1]
    assert two["forward"]["time_s"] == pytest.approx(150 * US) and two["forward"]["compute_s"] == 0
    assert two["backward"]["time_s"] == 0 and two["other_s"] == pytest.approx(350 * US)
    assert two["clip"]["time_s"] == 0 and two["copy_back"]["time_s"] == 0
    t = s["total"]
    assert t["forward"]["time_s"] == pytest.approx(450 * US)
    assert t["forward"]["gpu_idle_s"] == pytest.approx(250 * US)
    assert t["wall"]["time_s"] == pytest.approx(1500 * US) and t["other_s"] == pytest.approx(550 * US)
    text = table(s, "DeepSpeedCPUAdam")
    assert "update (DeepSpeedCPUAdam)" in text and "HtoD" in text and "GPU idle" in text
    assert "clip (gradients)" in text and "copy back (weights)" in text
    assert "step(s) 7..8" in text


def test_cpu_only_split_has_no_gpu_fields():
    cpu_only = [e for e in EVENTS if e["cat"] in (CPU, "cpu_op")]
    s = split(cpu_only, [7, 8])
    assert s["gpu"] is False
    assert s["per_step"][0]["forward"] == {"time_s": pytest.approx(300 * US)}
    assert set(s["total"]["update"]) == {"time_s"}
    assert "HtoD" not in table(s, "AdamW")
    no_ranges = [e for e in cpu_only if e["name"] not in ("longft.clip", "longft.copy_back")]
    assert "clip" not in table(split(no_ranges, [7, 8]), "AdamW")    # rows only for ranges present


def test_split_refuses_a_trace_whose_steps_do_not_match():
    with pytest.raises(ValueError, match="2 longft.step ranges in the trace for 1 profiled steps"):
        split(EVENTS, [7])


def _cfg(n, warmup=2, iterations=6):
    return from_dict({"train": {"iterations": iterations, "warmup_iterations": warmup},
                      "output": {"profile_steps": n}})


def test_profiled_steps_follow_the_warmup_and_a_resumed_run_profiles_what_is_left():
    assert profiling.steps(_cfg(2), start=0) == range(3, 5)
    assert profiling.steps(_cfg(0), start=0) == range(0)
    assert profiling.steps(_cfg(2), start=3) == range(4, 5)
    assert profiling.steps(_cfg(2), start=4) == range(5, 5)


def test_rank_0_says_when_fewer_steps_are_profiled(tmp_path, capsys):
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer="inner"))
    prof = profiling.StepProfiler.of(_cfg(3), tmp_path, rank=0, start=3, cuda=False, engine=engine)
    assert prof.steps == range(4, 6) and prof.optimizer == "inner"  # ZeRO's basic optimizer
    assert "steps 4..5 profiled (the run has 6 steps and resumed after step 3)" in capsys.readouterr().out
    prof = profiling.StepProfiler.of(_cfg(3), tmp_path, rank=0, start=6, cuda=False, engine=object())
    assert prof.steps == range(7, 6) and prof.optimizer is None
    assert "no step profiled, the run resumed after step 6" in capsys.readouterr().out
    profiling.StepProfiler.of(_cfg(3), tmp_path, rank=1, start=6, cuda=False, engine=object())
    assert capsys.readouterr().out == ""


class FakeEngine:
    """What train_step.step uses of a DeepSpeed engine, over a plain torch model and AdamW:
    the optimizer steps on every `accum`-th engine.step(), as DeepSpeed's does."""

    def __init__(self, model, accum):
        import torch

        self.model, self.accum, self.calls = model, accum, 0
        self.device = torch.device("cpu")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.skipped_steps = 0

    def __call__(self, input_ids, labels, position_ids):
        import torch.nn.functional as F

        logits = self.model(input_ids)
        return SimpleNamespace(loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()))

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.calls += 1
        if self.calls % self.accum == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def get_lr(self):
        return [1e-3]

    def get_global_grad_norm(self):
        return None


def test_a_tiny_model_profiled_through_train_step(tmp_path, capsys):
    import time

    import torch

    from longft.engine import train_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    engine, accum = FakeEngine(model, accum=2), 2
    ids = [torch.randint(1, 64, (1, 16)) for _ in range(20)]
    batches = iter({"input_ids": x, "labels": x, "position_ids": torch.arange(16)[None]} for x in ids)
    cfg = _cfg(2, warmup=1, iterations=4)
    prof = profiling.StepProfiler.of(cfg, tmp_path, rank=0, start=0, cuda=False,
                                     engine=SimpleNamespace(optimizer=engine.optimizer))
    assert prof.steps == range(2, 4) and prof.optimizer is engine.optimizer
    recs = []
    for step in range(1, 5):
        with prof.around(step):
            rec = train_step.step(engine, batches, accum=accum, pad_id=-1, now=time.perf_counter)
        recs.append({**rec.fields(), **prof.marks(step)})
    assert [r.get("profiled", False) for r in recs] == [False, True, True, False]
    assert "step" not in vars(engine.optimizer)  # the update's wrapper is gone after the last one
    trace = tmp_path / "profile" / "rank0.trace.json.gz"
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"longft.step", "longft.forward", "longft.backward", "longft.update"} <= names
    s = json.loads((tmp_path / "profile" / "rank0.split.json").read_text())
    assert s["steps"] == [2, 3] and len(s["per_step"]) == 2 and s["gpu"] is False
    assert s["optimizer"] == "AdamW" and s["trace"] == "rank0.trace.json.gz"
    for p in ("forward", "backward", "optimizer", "update"):
        assert s["total"][p]["time_s"] > 0, p
    assert s["total"]["update"]["time_s"] <= s["total"]["optimizer"]["time_s"]
    assert "compute_s" not in s["total"]["forward"]
    out = capsys.readouterr().out
    assert "update (AdamW)" in out and "https://ui.perfetto.dev" in out


def test_a_run_stopped_inside_the_profiled_steps_unwraps_the_optimizer(tmp_path):
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    prof = profiling.StepProfiler(tmp_path, 0, range(1, 3), cuda=False, optimizer=opt)
    with pytest.raises(RuntimeError):
        with prof.around(1):
            raise RuntimeError("stopped")
    assert "step" in vars(opt)
    prof.close()
    assert "step" not in vars(opt) and not (tmp_path / "profile").exists()


def test_a_run_stopped_inside_the_profiled_steps_unwraps_the_zero_optimizer_too(tmp_path):
    import torch

    zero = ZeroLike([torch.nn.Parameter(torch.zeros(2))])
    own = zero._reassign_or_swap_out_partitioned_parameters
    prof = profiling.StepProfiler(tmp_path, 0, range(1, 3), cuda=False, optimizer=zero.optimizer,
                                  zero=zero)
    with pytest.raises(RuntimeError):
        with prof.around(1):
            raise RuntimeError("stopped")
    assert "unscale_and_clip_grads" in vars(zero)
    assert zero._reassign_or_swap_out_partitioned_parameters is not own
    prof.close()
    assert "unscale_and_clip_grads" not in vars(zero) and "step" not in vars(zero.optimizer)
    assert zero._reassign_or_swap_out_partitioned_parameters is own


def test_an_earlier_runs_files_go_and_a_failed_split_does_not_stop_training(tmp_path, capsys,
                                                                           monkeypatch):
    import torch

    old = tmp_path / "profile"
    old.mkdir()
    for name in ("rank0.split.json", "rank0.trace.json.gz", "rank1.split.json"):
        (old / name).write_text("{}")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    engine = SimpleNamespace(optimizer=opt)
    # resumed past the profiled steps: nothing profiled, the earlier files stay (and it says why)
    profiling.StepProfiler.of(_cfg(2), tmp_path, rank=0, start=6, cuda=False, engine=engine)
    assert (old / "rank0.split.json").exists()
    prof = profiling.StepProfiler.of(_cfg(2), tmp_path, rank=0, start=0, cuda=False, engine=engine)
    assert sorted(p.name for p in old.iterdir()) == ["rank1.split.json"]  # its own rank's only

    def broken(events, steps):
        raise ValueError("a trace it cannot read")
    monkeypatch.setattr(profiling.time_split, "split", broken)
    for step in prof.steps:
        with prof.around(step):
            opt.step()
    assert "the profile could not be written (ValueError: a trace it cannot read); training goes on" \
        in capsys.readouterr().out
    assert "step" not in vars(opt) and not (old / "rank0.split.json").exists()


@pytest.mark.gpu
def test_on_cuda_the_split_has_compute_and_host_device_copies(tmp_path):
    """The train stage on CUDA with DeepSpeed's CPU Adam (zero.offload_optimizer cpu): the profiled
    step's split has kernels, gradients copied to the host and updated weights copied back."""
    import torch
    import yaml

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from longft.config.params import Config, merge, to_dict
    from longft.run.pipeline import run_all

    params = merge(to_dict(Config()), {
        "data": {"num_samples": 6, "max_seq_length": 1024, "eval_samples": 0},
        "train": {"iterations": 3, "warmup_iterations": 1, "global_batch_size": 1},
        "zero": {"offload_optimizer": "cpu"}, "hardware": {"device": "cuda"},
        "output": {"save_checkpoint": False, "export": False, "profile_steps": 1}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    run_all(tmp_path / "params.yaml", tmp_path, ("prepare", "patch", "train"))
    prof = tmp_path / "run" / "profile"
    s = json.loads((prof / "rank0.split.json").read_text())
    assert s["steps"] == [2] and s["gpu"] is True and s["optimizer"] == "DeepSpeedCPUAdam"
    t = s["total"]
    assert t["forward"]["compute_s"] > 0 and t["backward"]["compute_s"] > 0
    assert t["wall"]["htod_s"] > 0 and t["wall"]["dtoh_s"] > 0  # weights in, gradients out
    for phase in ("wall", "forward", "backward", "optimizer", "update"):
        v = t[phase]
        assert 0 <= v["gpu_idle_s"] <= v["time_s"], phase
        assert v["copy_overlap_s"] <= min(v["compute_s"], v["htod_s"] + v["dtoh_s"] + v["other_copy_s"]), phase
    assert t["update"]["time_s"] > 0
    # DeepSpeed's clipping pass and the copy-back (zero.copy_back auto: chunked here) in their own
    # ranges; the chunks' copies land inside the optimizer phase (the step waits for them)
    plan = json.loads((tmp_path / "artifacts" / "plan.json").read_text())
    assert plan["resolved"]["copy_back"]["value"] == "chunked"
    assert t["clip"]["time_s"] > 0 and t["copy_back"]["time_s"] > 0
    assert t["optimizer"]["htod_s"] > 0
    assert (prof / "rank0.trace.json.gz").stat().st_size > 0


class ZeroLike:
    """What engine/profiling.py times of DeepSpeed's ZeRO optimizer: its step clips the gradients,
    runs the inner optimizer, then copies the weights back (one sub-group); the copy back is an
    attribute of the instance, as engine/param_copy_back.py installs it."""

    def __init__(self, params):
        import torch

        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        self.calls = []
        self._reassign_or_swap_out_partitioned_parameters = self._copy_back

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        self.calls.append("clip")

    def _copy_back(self, sub_group_id):
        self.calls.append("copy_back")

    def step(self):
        self.unscale_and_clip_grads(0, 1.0)
        self.optimizer.step()
        self._reassign_or_swap_out_partitioned_parameters(0)

    def zero_grad(self):
        self.optimizer.zero_grad()


def test_zero_clip_and_copy_back_get_ranges_of_their_own_in_profiled_steps(tmp_path, capsys):
    import time

    import torch

    from longft.engine import train_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    engine = FakeEngine(model, accum=1)
    zero = engine.optimizer = ZeroLike(model.parameters())
    own = zero._reassign_or_swap_out_partitioned_parameters
    batches = iter({"input_ids": x, "labels": x, "position_ids": torch.arange(16)[None]}
                   for x in [torch.randint(1, 64, (1, 16)) for _ in range(6)])
    prof = profiling.StepProfiler.of(_cfg(2, warmup=1, iterations=4), tmp_path, rank=0, start=0,
                                     cuda=False, engine=engine)
    assert prof.optimizer is zero.optimizer and prof.zero is zero
    for step in range(1, 5):
        with prof.around(step):
            train_step.step(engine, batches, accum=1, pad_id=-1, now=time.perf_counter)
    assert zero.calls == ["clip", "copy_back"] * 4            # the wrapped methods still ran
    assert "unscale_and_clip_grads" not in vars(zero)          # unwrapped: the class's again
    assert zero._reassign_or_swap_out_partitioned_parameters == own   # the instance's own, back
    s = json.loads((tmp_path / "profile" / "rank0.split.json").read_text())
    for p in ("update", "clip", "copy_back"):
        assert 0 < s["total"][p]["time_s"] <= s["total"]["optimizer"]["time_s"], p
    out = capsys.readouterr().out
    assert "clip (gradients)" in out and "copy back (weights)" in out

"""`longft max-context --confirm` (longft.run.confirm): the search order and stop rules with a fake
runner, the checks before any run, and one real confirmation through the stages on the CPU."""

import json
import os
import re

import pytest
import yaml

from longft.cli.estimate import main
from longft.config.params import Config, ConfigError, merge, to_dict
from longft.hardware import Hardware
from longft.run import confirm
from longft.run.confirm import ERROR, FITS, NO_FIT, RunResult, memory_failure, run_overlay, search, vram_cap
from longft.run.pipeline import REPO

K = 1024
CANDIDATES = [58 * K, 61 * K, 64 * K, 67 * K, 70 * K]   # candidates_for_confirmation(65536)
H200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                gpu_mem_gib=139.8, host_mem_gib=125.9, cpu_count=16, flash_attn=False, liger=True)
CPU = Hardware(device="cpu", host_mem_gib=24, cpu_count=2)


class Fake:
    """Fits up to `limit` tokens; `error_at`: that length fails for another reason."""

    def __init__(self, limit, error_at=None):
        self.limit, self.error_at, self.calls = limit, error_at, []

    def __call__(self, seq):
        self.calls.append(seq)
        if seq == self.error_at:
            return RunResult(seq, ERROR, 3.0, "stage train exited 1", log=f"/w/seq-{seq}/log.txt")
        if seq > self.limit:
            # a run can be judged no-fit after it completed (host RSS over --host-mem) and
            # still have a speed: the table shows none for it
            return RunResult(seq, NO_FIT, 2.0, "CUDA out of memory",
                             {"vram_allocated_gib": None, "host_rss_gib": 5.0},
                             speed={"tokens_per_s": 999.0, "step_s": 1.0, "timed_steps": 1})
        return RunResult(seq, FITS, 1.0, "", {"vram_allocated_gib": 13.2, "vram_reserved_gib": 13.9,
                                              "vram_nvml_gib": 15.8, "host_rss_gib": 27.5},
                         speed={"tokens_per_s": 12345.6, "step_s": 8.3, "timed_steps": 1})


def quiet(_):
    pass


def test_search_goes_down_from_the_longest_and_stops_at_the_first_fit():
    run = Fake(limit=63 * K)
    results, best = search(CANDIDATES, run, quiet)
    assert run.calls == [70 * K, 67 * K, 64 * K, 61 * K]          # 58K is never run
    assert best == 61 * K and [r.status for r in results] == [NO_FIT] * 3 + [FITS]
    run = Fake(limit=100 * K)
    assert search(CANDIDATES, run, quiet)[1] == 70 * K and run.calls == [70 * K]


def test_search_stops_on_a_failure_that_is_not_memory():
    run = Fake(limit=63 * K, error_at=67 * K)
    results, best = search(CANDIDATES, run, quiet)
    assert run.calls == [70 * K, 67 * K] and best == 0
    assert results[-1].status == ERROR


def test_search_halves_below_the_candidates_when_none_fits():
    run = Fake(limit=20 * K)
    results, best = search(CANDIDATES, run, quiet)
    assert run.calls == [70 * K, 67 * K, 64 * K, 61 * K, 58 * K, 29 * K, 14 * K]
    assert best == 14 * K
    run = Fake(limit=0)                                            # nothing fits at all
    assert search([3 * K, 4 * K], run, quiet)[1] == 0
    assert run.calls == [4 * K, 3 * K, 1 * K]                      # 1024 is the last try


def test_out_of_memory_is_told_apart_from_other_failures():
    # the train stage's output of a real OOM (bench/results/h200-1b-16k-cap16-oom.json)
    real = json.loads((REPO / "bench/results/h200-1b-16k-cap16-oom.json").read_text())
    assert memory_failure("train", "\n".join(real["log_tail"])) == "CUDA out of memory"
    assert memory_failure("train", "torch.OutOfMemoryError: CUDA out of memory. Tried to ...")
    assert memory_failure("train", "RuntimeError: CUDA error: out of memory") == "CUDA out of memory"
    assert "host RAM" in memory_failure("train", "longft train: not enough host RAM for this run: ")
    assert memory_failure("train", "RuntimeError: NCCL error") is None
    assert memory_failure("train", "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate") == \
        "CUDA out of memory"
    killed = "[launch.py:350:sigkill_handler] ... exiting with return code = -9"
    assert "killed" in memory_failure("train", killed)
    assert memory_failure("train", "exiting with return code = -6") is None  # an abort is an error
    assert memory_failure("patch", "CUDA out of memory") is None    # only a training run "fits"


def test_overlay_and_the_emulated_card():
    over = run_overlay(8 * K, 2, 4, "random", 14.1)
    assert over["data"] == {"max_seq_length": 8 * K, "num_samples": 8}
    assert over["train"] == {"iterations": 2, "epochs": None, "warmup_iterations": 1}
    assert over["output"]["save_checkpoint"] is False and over["output"]["export"] is False
    assert over["hardware"] == {"vram_limit_gib": 14.1}
    one = run_overlay(K, 1, 2, "jsonl", None)
    assert one["train"]["warmup_iterations"] == 0 and "num_samples" not in one["data"]
    assert "hardware" not in one
    assert vram_cap(16, 139.8, None) == pytest.approx(16 - 1.9)   # reserved + CUDA context = 16
    assert vram_cap(16, 139.8, 10.0) == 10.0                      # the params' own cap is lower
    assert vram_cap(139.8, 139.8, None) is None                   # the whole card: no cap
    with pytest.raises(ConfigError, match="CUDA context"):
        vram_cap(1.5, 139.8, None)


@pytest.fixture
def on(monkeypatch):
    def use(hw):
        monkeypatch.setattr("longft.hardware.detect", lambda: hw)
    return use


@pytest.fixture
def fake(monkeypatch):
    """Replace the real runner; remember what the command built it with."""
    made = {}

    def use(run):
        def factory(params, source, work, iterations, vram_limit_gib, host_budget_gib):
            made.update(params=params, work=work, iterations=iterations, vram=vram_limit_gib,
                        host=host_budget_gib)
            return run
        monkeypatch.setattr(confirm, "PipelineRunner", factory)
        return made
    return use


def params_1b(tmp_path):
    raw = {"model": {"source": "random", "name": "llama3.2-1b"},
           "data": {"source": "random", "pack": False},
           "checkpointing": {"mode": "gpu"},
           "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none"},
           "train": {"micro_batch_size": 1, "global_batch_size": 1}}
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def test_command_confirms_below_the_estimate_and_writes_the_report(tmp_path, on, fake, capsys):
    on(H200)
    made = fake(Fake(limit=96 * K))
    args = ["--params", params_1b(tmp_path), "--gpu-mem", "16", "--host-mem", "120", "--confirm",
            "--work", str(tmp_path / "w")]
    assert main("max-context", args) == 0
    out = capsys.readouterr().out
    assert made["vram"] == pytest.approx(14.1) and made["iterations"] == 2
    # tiled_mlp auto is on at the estimate's longest context (over 65,536): the runs pin it on
    assert made["params"]["kernels"] == {"tiled_mlp": "on"} and "tiled_mlp auto is on" in out
    rep = json.loads((tmp_path / "w" / "max_context.json").read_text())
    est = rep["estimate"]["max_seq"]
    assert est > 32 * K and rep["candidates"][-1] > est > rep["candidates"][0]
    assert rep["confirmed_max_seq"] == max(c for c in rep["candidates"] if c <= 96 * K)
    assert [r["status"] for r in rep["runs"]][-1] == FITS
    assert all(r["status"] == NO_FIT for r in rep["runs"][:-1])
    assert rep["shortest_not_fitting"] == min(r["seq"] for r in rep["runs"][:-1])
    assert rep["runs"][-1]["measured"]["vram_allocated_gib"] == 13.2
    assert rep["runs"][-1]["predicted"]["vram_nvml_gib"] <= 16.5
    assert f"confirmed: {rep['confirmed_max_seq']:,} tokens" in out
    assert "emulated" in out and "hardware.vram_limit_gib 14.1" in out
    row = [line for line in out.splitlines() if line.lstrip().startswith(f"{rep['confirmed_max_seq']:,}")]
    assert row and "13.20" in row[0] and "yes" in row[0]
    # speed: the run's measured tokens/s beside the speed heuristic's for the H200 at that length
    fit = rep["runs"][-1]
    assert fit["speed"]["tokens_per_s"] == 12345.6 and fit["speed"]["step_s"] == 8.3
    assert fit["predicted"]["tokens_per_s"] > 1000 and "12,346" in row[0]
    assert f"{fit['predicted']['tokens_per_s']:,}" in row[0]
    # a run that did not fit shows no measured speed in the table
    for r in rep["runs"][:-1]:
        line = next(x for x in out.splitlines() if x.lstrip().startswith(f"{r['seq']:,} "))
        assert " 999 " not in line and re.search(r" - +no +\d+ +CUDA out of memory$", line), line


def test_command_exit_codes_for_nothing_fits_and_other_failures(tmp_path, on, fake, capsys):
    on(H200)
    args = ["--params", params_1b(tmp_path), "--gpu-mem", "16", "--max-seq", "4096", "--confirm",
            "--work", str(tmp_path)]                  # the estimate is 4,096: one candidate
    run = Fake(limit=0)
    fake(run)
    assert main("max-context", args) == 1
    assert run.calls == [4 * K, 2 * K, K]
    assert "nothing fits: every length down to 1,024 tokens did not fit" in capsys.readouterr().out
    fake(Fake(limit=10 ** 6, error_at=4 * K))
    assert main("max-context", args) == 2
    out = capsys.readouterr().out
    assert "stopped: the run at 4,096 tokens failed, not for memory: stage train exited 1; see " \
           "/w/seq-4096/log.txt" in out
    rep = json.loads((tmp_path / "max_context.json").read_text())
    assert rep["confirmed_max_seq"] == 0 and rep["error"].startswith("the run at 4,096 tokens")


def test_bad_confirm_input_is_refused_before_any_run(tmp_path, on, fake, capsys):
    run = Fake(limit=10 ** 6)
    fake(run)
    p = params_1b(tmp_path)
    on(H200)
    assert main("max-context", ["--params", p, "--confirm", "--iterations", "0"]) == 2
    assert "--iterations" in capsys.readouterr().err
    assert main("max-context", ["--params", p, "--gpu-mem", "200", "--confirm"]) == 2
    assert "more than the 139.8 GiB" in capsys.readouterr().err
    on(CPU)
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text(yaml.safe_dump(merge(yaml.safe_load(open(p)), {"hardware": {"device": "cuda"}})))
    assert main("max-context", ["--params", str(cuda), "--gpu-mem", "16", "--confirm"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert run.calls == []


@pytest.mark.slow
def test_confirmation_runs_the_real_stages_on_cpu(tmp_path, monkeypatch, capsys):
    """Two candidates (5,120 and 4,096) of the tiny model through prepare -> patch -> train ->
    metrics, one step each. A test hook (tests/fixtures/oom_above) makes steps above 4,096 tokens
    raise torch's CUDA out-of-memory error inside the real trainer: the longer run fails the real
    way (the train stage exits 2 with the trainer's message) and the search goes on down."""
    hook = REPO / "tests" / "fixtures" / "oom_above"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hook), str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("LONGFT_TEST_OOM_ABOVE", "4096")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(to_dict(Config())))
    work = tmp_path / "work"
    code = main("max-context", ["--params", str(params), "--gpu-mem", "16", "--max-seq", "5120",
                                "--confirm", "--iterations", "1", "--work", str(work)])
    out = capsys.readouterr().out
    assert code == 0, out
    rep = json.loads((work / "max_context.json").read_text())
    assert rep["candidates"] == [4096, 5120]
    oom, ok = rep["runs"]
    assert (oom["seq"], oom["status"], oom["reason"]) == (5120, NO_FIT, "CUDA out of memory")
    assert "CUDA out of memory at step 1, sequence length 5120" in open(oom["log"]).read()
    assert (ok["seq"], ok["status"]) == (4096, FITS) and rep["confirmed_max_seq"] == 4096
    assert rep["shortest_not_fitting"] == 5120
    assert 0.1 < ok["measured"]["host_rss_gib"] < 24
    # the one step's speed from metrics/train.json; no speed is predicted on the CPU
    assert ok["speed"]["tokens_per_s"] > 0 and ok["speed"]["timed_steps"] == 1
    assert ok["speed"]["step_s"] > 0 and ok["predicted"]["tokens_per_s"] is None
    train = json.loads((work / "seq-4096" / "metrics" / "train.json").read_text())
    assert train["status"] == "complete" and train["seq_len"] == 4096 and train["steps"] == 1
    ran = yaml.safe_load((work / "seq-4096" / "params.yaml").read_text())
    assert ran["data"]["max_seq_length"] == 4096 and ran["output"]["save_checkpoint"] is False
    assert not (work / "seq-4096" / "checkpoints" / "final").exists()
    if rep["device"] == "cpu":
        assert "confirm nothing about GPU memory" in out


def test_auto_tiling_is_searched_where_it_applies():
    """kernels.tiled_mlp auto tiles from 65,536 tokens: memory drops there, so the search takes the
    tiled lengths first and the untiled ones below 65,536 only when no tiled length fits."""
    import dataclasses

    from longft.cli.estimate import _max_context_auto_tiled, max_context
    from longft.estimate.types import Setup
    from longft.run.pipeline import REPO

    arch = json.loads((REPO / "configs/models/llama3.2-1b.json").read_text())
    base = Setup(micro_batch=1, seq_len=4096, checkpointing="gpu", offload_optimizer=True)
    seq, tiled = _max_context_auto_tiled(arch, base, 16, None, None, 1 << 20)
    assert tiled and seq >= 65536
    assert seq == max_context(arch, dataclasses.replace(base, tiled_mlp=True), gpu_mem_gib=16, host_mem_gib=None,
                              vram_limit_gib=None)
    assert seq > max_context(arch, dataclasses.replace(base, tiled_mlp=False), gpu_mem_gib=16, host_mem_gib=None,
                             vram_limit_gib=None)
    seq, tiled = _max_context_auto_tiled(arch, base, 6, None, None, 1 << 20)
    assert not tiled and 0 < seq < 65536
    assert seq == max_context(arch, dataclasses.replace(base, tiled_mlp=False), gpu_mem_gib=6, host_mem_gib=None,
                              vram_limit_gib=None)


def test_a_confirmed_length_below_the_tiling_threshold_says_to_pin_tiling(tmp_path, on, fake, capsys):
    """The runs pin the tiled MLP the estimate used (on, above 65,536); if only a shorter length
    trains, auto would run that one untiled: the command says to pin it."""
    on(H200)
    fake(Fake(limit=60 * K))
    args = ["--params", params_1b(tmp_path), "--gpu-mem", "16", "--host-mem", "120", "--confirm",
            "--work", str(tmp_path / "w")]
    assert main("max-context", args) == 0
    rep = json.loads((tmp_path / "w" / "max_context.json").read_text())
    assert rep["confirmed_max_seq"] < 65536
    assert "set kernels.tiled_mlp: on to train it" in capsys.readouterr().out

"""params.yaml validation: every problem reported together, before any work. The shipped params
have one source of truth, the dataclass defaults; the tests never read the workspace's params.yaml
(a user edits it), only the committed one, to check that it sets exactly those defaults."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from longft.config.params import Config, ConfigError, from_dict, load, merge, to_dict

REPO = Path(__file__).resolve().parents[1]


def flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def committed_params_yaml() -> dict:
    """params.yaml as committed (git HEAD), whatever the working copy now says."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: the committed params.yaml cannot be read")
    p = subprocess.run([git, "show", "HEAD:./params.yaml"], cwd=REPO, capture_output=True,
                       text=True, check=False)
    if p.returncode:
        pytest.skip(f"no committed params.yaml here (git show: {p.stderr.strip()})")
    return yaml.safe_load(p.stdout)


def test_committed_params_yaml_sets_exactly_the_dataclass_defaults():
    want, got = flat(to_dict(Config())), flat(committed_params_yaml())
    wrong = sorted(f"{k}: params.yaml {got.get(k, '(not set)')!r}, "
                   f"default {want.get(k, '(no such field)')!r}"
                   for k in want.keys() | got.keys()
                   if k not in got or k not in want or got[k] != want[k]
                   or type(got[k]) is not type(want[k]))
    assert not wrong, "params.yaml (HEAD) and the dataclass defaults differ:\n" + "\n".join(wrong)


def test_shipped_defaults_are_valid_and_survive_a_params_file(tmp_path):
    # what the tests write for their runs: the defaults (plus overrides) as a params.yaml
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(to_dict(Config())))
    cfg = load(p)
    assert cfg == from_dict({}) == Config()
    assert cfg.model.name == "tiny-llama" and cfg.data.max_seq_length == 4096
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas) == (1e-3, 0.01, (0.9, 0.95))
    assert cfg.grad_accum_steps == cfg.train.global_batch_size // cfg.train.micro_batch_size


def test_master_port_is_auto_or_a_port_from_1024():
    assert from_dict({}).hardware.master_port == "auto"
    assert from_dict({"hardware": {"master_port": 29600}}).hardware.master_port == 29600
    for bad, says in ((80, "must be auto or a TCP port in 1024-65535"),
                      (70000, "must be auto or a TCP port in 1024-65535"),
                      ("29511", "expected int or 'auto', got '29511'"),
                      ("any", "expected int or 'auto', got 'any'"),
                      (True, "expected int or 'auto', got True")):
        with pytest.raises(ConfigError) as e:
            from_dict({"hardware": {"master_port": bad}})
        assert len(e.value.problems) == 1 and says in e.value.problems[0], (bad, e.value.problems)


def test_all_problems_reported_at_once():
    raw = {
        "model": {"nmae": "x"},                       # unknown key
        "data": {"max_seq_length": "long"},           # wrong type
        "train": {"micro_batch_size": 0},             # out of range
        "precision": "fp8",                           # not an allowed value
        "bogus_section": {},
    }
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    msg = str(e.value)
    assert "model.nmae: unknown key" in msg
    assert "data.max_seq_length: expected int" in msg
    assert "precision: 'fp8' is not one of" in msg
    assert "bogus_section: unknown key" in msg
    assert "train.micro_batch_size: must be > 0" in msg
    assert len(e.value.problems) == 5


def test_range_and_combination_problems_together():
    raw = {"train": {"micro_batch_size": 3, "global_batch_size": 4, "iterations": 5,
                     "warmup_iterations": 5},
           "zero": {"stage": 2, "offload_param": "cpu"},
           "optim": {"lr": -1.0, "betas": [0.9, 1.5], "warmup_steps": 0},
           "hardware": {"num_nodes": 2}}
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    msg = str(e.value)
    assert "global_batch_size (4) must be a multiple of train.micro_batch_size x GPUs (3 x 2 = 6)" in msg
    assert "warmup_iterations (5) must be < train.iterations" in msg
    assert "zero.offload_param: 'cpu' needs zero.stage 3" in msg
    assert "optim.lr: must be > 0" in msg
    assert "optim.betas[1]: must be in [0, 1)" in msg
    assert "optim.warmup_steps: must be >= 1, got 0" in msg   # DeepSpeed refused it after start-up
    assert "hardware.hostfile: required" in msg


def test_cpu_cannot_offload_checkpoints_or_use_fp16():
    with pytest.raises(ConfigError) as e:
        from_dict({"hardware": {"device": "cpu"}, "precision": "fp16",
                   "checkpointing": {"mode": "cpu_offload"}})
    assert len(e.value.problems) == 2
    assert "cpu_offload" in str(e.value) and "fp16" in str(e.value)


def test_yaml_on_off_and_exponents(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("kernels:\n  liger: off\noptim:\n  lr: 1e-4\n")
    cfg = load(p)
    assert cfg.kernels.liger == "off"
    assert cfg.optim.lr == pytest.approx(1e-4)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


def test_non_finite_floats_are_refused(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("optim:\n  lr: .nan\n  eps: .inf\n  betas: [0.9, nan]\n"
                 "hardware:\n  vram_limit_gib: -.inf\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    assert e.value.problems == [
        "hardware.vram_limit_gib: must be a finite number, got -inf; set a number",
        "optim.lr: must be a finite number, got nan; set a number",
        "optim.betas[1]: must be a finite number, got 'nan'; set a number",
        "optim.eps: must be a finite number, got inf; set a number"]


def test_seed_must_be_an_unsigned_32_bit_int():
    for seed in (-1, 2**32):
        with pytest.raises(ConfigError, match=rf"train.seed: must be in 0 .. 4294967295 .*got {seed}"):
            from_dict({"train": {"seed": seed}})
    assert from_dict({"train": {"seed": 0}}).train.seed == 0


def test_duplicate_keys_are_refused_with_their_lines(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("optim:\n  lr: 1.0e-3\n  weight_decay: 0.0\n  lr: 2.0e-5\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    assert e.value.problems == ["key 'lr' is given twice (lines 2 and 4); only the last would "
                                "count, so delete one of them"]
    p.write_text("train: {seed: 1}\ntrain: {seed: 2}\n")
    with pytest.raises(ConfigError, match=r"key 'train' is given twice \(lines 1 and 2\)"):
        load(p)


def test_empty_params_file_is_refused(tmp_path):
    p = tmp_path / "params.yaml"
    for text in ("", "# all commented out\n#train:\n#  seed: 1\n"):
        p.write_text(text)
        with pytest.raises(ConfigError, match=r"params.yaml is empty; copy the shipped params.yaml"):
            load(p)
    p.write_text("{}\n")  # explicit: the defaults
    assert load(p) == Config()


def test_overrides_merge_deeply():
    base = to_dict(Config())
    out = merge(base, {"train": {"iterations": 3}})
    assert out["train"]["iterations"] == 3
    assert out["train"]["micro_batch_size"] == base["train"]["micro_batch_size"]
    assert base == to_dict(Config())  # not modified


def test_config_is_frozen():
    cfg = from_dict({})
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.iterations = 5  # type: ignore[misc]


def test_long_context_knobs_are_validated():
    with pytest.raises(ConfigError) as e:
        from_dict({"checkpointing": {"mode": "gpu", "gpu_layers": 4},
                   "kernels": {"tiled_mlp": "sometimes", "tiled_mlp_tokens": 0}})
    text = str(e.value)
    assert "checkpointing.gpu_layers: 4 only applies to checkpointing.mode cpu_offload" in text
    assert "kernels.tiled_mlp_tokens: must be >= 1, got 0" in text
    assert "kernels.tiled_mlp" in text and "sometimes" in text
    with pytest.raises(ConfigError, match="checkpointing.gpu_layers: must be >= 0, got -1"):
        from_dict({"checkpointing": {"mode": "cpu_offload", "gpu_layers": -1},
                   "hardware": {"device": "cuda"}})
    ok = from_dict({"checkpointing": {"mode": "cpu_offload", "gpu_layers": 20},
                    "hardware": {"device": "cuda", "expandable_segments": False}})
    assert ok.checkpointing.gpu_layers == 20 and ok.hardware.expandable_segments is False


def test_profile_steps_must_lie_within_the_run():
    def problem(n, iterations=6, warmup=2):
        with pytest.raises(ConfigError) as e:
            from_dict({"train": {"iterations": iterations, "warmup_iterations": warmup},
                       "output": {"profile_steps": n}})
        return str(e.value)

    assert "output.profile_steps: must be >= 0 (0 = off), got -1" in problem(-1)
    assert ("output.profile_steps (4) would profile steps 3..6 (after train.warmup_iterations 2) and "
            "leave no timed step of train.iterations 6: set output.profile_steps to at most 3 or "
            "train.iterations to at least 7") in problem(4)
    assert "profile steps 3..7" in problem(5)
    assert from_dict({"train": {"iterations": 6, "warmup_iterations": 2},
                      "output": {"profile_steps": 3}}).output.profile_steps == 3
    # with train.epochs the train stage profiles the steps there are (engine/profiling.steps)
    assert from_dict({"train": {"iterations": None, "epochs": 1.0},
                      "output": {"profile_steps": 50}}).output.profile_steps == 50


def test_patch_says_when_a_lora_adapter_of_a_random_init_model_will_not_load(tmp_path, monkeypatch,
                                                                             capsys):
    """Walkthrough (2026-12-05): a LoRA run over random weights exported an adapter that only
    `longft generate`, after training, said it cannot load. The patch stage says so first."""
    import runpy
    import sys

    import yaml

    from longft.config.checks import notes

    raw = {"model": {"source": "random", "name": "tiny-llama"}, "lora": {"rank": 4}}
    assert notes(from_dict(raw))[0].startswith("output.export_lora: adapter over a random-init")
    assert notes(from_dict({**raw, "output": {"export_lora": "merged"}})) == []
    assert notes(from_dict({**raw, "lora": {"rank": 0}})) == []
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(sys, "argv", ["patch.py", "--params", str(tmp_path / "params.yaml"),
                                      "--out", str(tmp_path / "artifacts")])
    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(repo / "stages" / "patch.py"), run_name="__main__")
    assert e.value.code == 0
    assert "patch: note: output.export_lora: adapter over a random-init model" in capsys.readouterr().out

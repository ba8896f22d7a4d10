"""params.yaml validation: every problem reported together, before any work."""

from pathlib import Path

import pytest
import yaml

from longft.config.params import ConfigError, from_dict, load, merge

REPO = Path(__file__).resolve().parents[1]


def test_shipped_params_load_with_expected_values():
    cfg = load(REPO / "params.yaml")
    assert cfg.model.name == "tiny-llama"
    assert cfg.data.max_seq_length >= 4096
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.grad_accum_steps == cfg.train.global_batch_size // cfg.train.micro_batch_size


def test_code_defaults_are_the_reference_study_adamw():
    cfg = from_dict({})
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas) == (1e-4, 0.01, (0.9, 0.95))


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


def test_overrides_merge_deeply():
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    out = merge(base, {"train": {"iterations": 3}})
    assert out["train"]["iterations"] == 3
    assert out["train"]["micro_batch_size"] == base["train"]["micro_batch_size"]
    assert yaml.safe_load((REPO / "params.yaml").read_text()) == base


def test_config_is_frozen():
    cfg = from_dict({})
    with pytest.raises(Exception):
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

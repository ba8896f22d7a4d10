"""The estimator takes the engine's own rules, each written once (issue 50): the ZeRO section that
ds_config builds for the run (zero.overlap_step as resolved), and QLoRA's ZeRO stage."""

import pytest

from longft.config.params import ConfigError, from_dict
from longft.estimate.estimator import setup_from_config, zero_knobs
from longft.hardware import Choice

RESOLVED = {"device": Choice("cuda", ""), "precision": Choice("bf16", ""), "attention": Choice("sdpa", ""),
            "liger": Choice(True, ""), "checkpointing": Choice("gpu", "")}


def test_the_estimate_takes_the_zero_knobs_the_run_writes_with_overlap_step_on():
    """The estimator uses ds_config's own builder with zero.overlap_step as resolved: 8B's
    persistence threshold is 0 with the overlap (every parameter fetched), 10 x hidden without."""
    from longft.engine import ds_config

    cfg = from_dict({"zero": {"offload_optimizer": "cpu"}})
    for on in (False, True):
        s = setup_from_config(cfg, {**RESOLVED, "overlap_step": Choice("on" if on else "off", "")})
        assert s.overlap_step is on
        ran = ds_config.build(cfg, "bf16", 4096, overlap_step=on)["zero_optimization"]
        assert zero_knobs(s, 4096) == ran
        assert ran["stage3_param_persistence_threshold"] == (0 if on else 40960)


def test_qlora_runs_on_zero_2_by_one_rule():
    from longft.config import qlora
    from longft.estimate import quantized

    assert quantized.qlora_zero_stage is qlora.stage
    with pytest.raises(ConfigError, match=r"zero\.stage=2"):   # params name the stage that runs
        from_dict({"lora": {"rank": 16, "quantize": "nf4"}})
    cfg = from_dict({"lora": {"rank": 16, "quantize": "nf4"}, "zero": {"stage": 2}})
    s = setup_from_config(cfg, {**RESOLVED, "quantize": Choice("nf4", "")})
    assert s.zero_stage == qlora.QLORA_STAGE == 2

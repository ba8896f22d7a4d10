"""artifacts/plan.json through `config.plan.Plan`: make_plan's dict survives the round trip byte for
byte, plans written before a knob existed read with what the code did then, and a missing, corrupt
or misshapen file is one clear error that names the file and says how to write it again."""

import copy
import json

import pytest

from longft.config.params import ConfigError, from_dict
from longft.config.plan import OLDER_DEFAULTS, Choice, Plan, PlanFileError, Resolved
from longft.hardware import Choice as HardwareChoice
from longft.hardware import Hardware
from longft.run.patch_stage import make_plan

H200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                gpu_mem_gib=139.8, host_mem_gib=256, cpu_count=32, flash_attn=False, liger=True)

RESOLVED = {"device": "cpu", "precision": "bf16", "attention": "sdpa", "sdpa_backend": "default",
            "liger": False, "tiled_mlp": False, "checkpointing": "gpu", "host_grad_buffer": "full"}


def plan_dict(resolved=None, host_rss_bytes=None, host_items=(), model_config=None) -> dict:
    """A complete plan.json dict, small enough to write by hand (other test files use it)."""
    est = None if host_rss_bytes is None else {
        "host": {"rss_bytes": host_rss_bytes, "items": list(host_items)}}
    return {
        "config": {}, "hardware": {"device": "cpu"},
        "resolved": {k: {"value": v, "reason": "test"}
                     for k, v in {**RESOLVED, **(resolved or {})}.items()},
        "model_config": model_config or {},
        "model": {"name": "tiny-llama", "source": "random", "n_params": 1000, "n_trainable": 1000},
        "patches": {"replaced_modules": {}},
        "batch": {"world_size": 1},
        "memory_estimate": {"model_states_bytes": {"weights": 2000},
                            **({"estimate": est} if est else {}), "note": "test"},
    }


@pytest.fixture  # per test: the autouse fixture in conftest.py undoes Liger's global patches
def made():
    """make_plan's dict on a faked H200: Liger replacements, kept attention, a tuple capability."""
    cfg = from_dict({"checkpointing": {"keep_attention": 1}})
    return make_plan(cfg, H200)[0]


def test_make_plan_round_trips_byte_for_byte(made):
    plan = Plan.from_dict(made)
    assert json.dumps(plan.to_dict(), indent=2) == json.dumps(made, indent=2)
    on_disk = json.loads(json.dumps(made))
    assert Plan.from_dict(on_disk).to_dict() == on_disk
    assert plan.resolved.device == Choice("cuda", made["resolved"]["device"]["reason"])
    assert plan.resolved.liger.value is True and plan.patches.replaced_modules
    assert plan.patches.attention_kept_layers == 1
    assert plan.model.n_params == made["model"]["n_params"]
    assert plan.memory_estimate.host_rss_bytes == made["memory_estimate"]["estimate"]["host"][
        "rss_bytes"]
    assert [k for k, _ in plan.resolved.items()] == list(made["resolved"])


def test_read_writes_nothing_back_and_is_frozen(made, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(made, indent=2))
    plan = Plan.read(path)
    assert plan == Plan.from_dict(made)
    with pytest.raises(AttributeError):
        plan.model = None
    with pytest.raises(TypeError):
        plan.model_config["hidden_size"] = 1
    assert isinstance(plan.to_dict()["model_config"], dict)  # json-able again


def test_hardware_resolve_choices_are_the_plan_choices():
    assert HardwareChoice is Choice
    from_choices = Resolved.from_dict({k: Choice(v, "r") for k, v in RESOLVED.items()})
    assert from_choices == Resolved.from_dict({k: {"value": v, "reason": "r"}
                                               for k, v in RESOLVED.items()})
    assert Resolved.from_dict(RESOLVED).precision == Choice("bf16", "")


def test_older_plans_fill_what_the_code_did_then():
    old = plan_dict()
    for k in ("sdpa_backend", "tiled_mlp", "host_grad_buffer"):
        del old["resolved"][k]
    del old["memory_estimate"]["model_states_bytes"]["weights"]  # any sizes are passed through
    plan = Plan.from_dict(old)
    r = plan.resolved
    assert (r.sdpa_backend.value, r.tiled_mlp.value, r.host_grad_buffer.value) == (
        "default", False, "full")
    assert r.tiled_mlp == OLDER_DEFAULTS["tiled_mlp"]
    assert "before the knob existed" in r.tiled_mlp.reason
    assert plan.patches.attention_kept_layers == 0   # before checkpointing.keep_attention
    assert plan.memory_estimate.estimate is None     # before the estimator
    assert plan.memory_estimate.host_rss_bytes is None and plan.memory_estimate.host_items == ()
    assert "estimate" not in plan.to_dict()["memory_estimate"]


def test_missing_file_names_it_and_says_how_to_write_it(tmp_path):
    path = tmp_path / "artifacts" / "plan.json"
    with pytest.raises(PlanFileError) as e:
        Plan.read(path)
    assert isinstance(e.value, ConfigError)  # stages print it and exit 2
    msg = str(e.value)
    assert str(path) in msg and "does not exist" in msg and "re-run `dvc repro patch`" in msg


def test_corrupt_file_is_a_plan_file_error(tmp_path, made):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(made)[:200])  # a write cut short
    with pytest.raises(PlanFileError, match="is not valid JSON") as e:
        Plan.read(path)
    assert str(path) in str(e.value) and "re-run `dvc repro patch`" in str(e.value)
    path.write_text("[1, 2]")
    with pytest.raises(PlanFileError, match="expected a JSON object, got list"):
        Plan.read(path)


def test_wrong_shape_lists_every_problem():
    bad = copy.deepcopy(plan_dict())
    del bad["resolved"]["device"]
    bad["resolved"]["liger"]["value"] = "yes"
    bad["resolved"]["warp_speed"] = {"value": 9, "reason": "x"}
    bad["model"]["n_params"] = "1000"
    bad["patches"] = {"liger": False}
    with pytest.raises(PlanFileError) as e:
        Plan.from_dict(bad, "runs/x/plan.json")
    msg = str(e.value)
    assert msg.startswith("5 problem(s) in runs/x/plan.json:")
    for part in ("resolved.device: missing", "resolved.liger.value: expected bool, got 'yes'",
                 "resolved.warp_speed: unknown knob", "model.n_params: expected int, got '1000'",
                 "patches.replaced_modules: expected an object, got None"):
        assert part in msg
    top = plan_dict()
    del top["batch"]
    top["extra"] = 1
    with pytest.raises(PlanFileError, match=r"batch: missing\n  - extra: unknown key"):
        Plan.from_dict(top)

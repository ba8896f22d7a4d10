"""engine/build.py's plan guard: the train stage builds the real model, patches it as the plan
says, and refuses to train when the modules it replaced are not the ones the patch stage
recorded in plan.json (a plan from another model or library version)."""

import copy

import pytest

from longft.config.params import from_dict
from longft.config.plan import Plan
from longft.engine.build import build
from longft.errors import TrainingError
from longft.hardware import Hardware
from longft.run.patch_stage import make_plan

H200 = Hardware(device="cuda", gpu_name="NVIDIA H200", gpu_count=1, capability=(9, 0),
                gpu_mem_gib=139.8, host_mem_gib=256, cpu_count=32, flash_attn=False, liger=True)
LIGER = {"LlamaMLP->LigerSwiGLUMLP": 2, "LlamaRMSNorm->LigerRMSNorm": 5}  # tiny Llama: 2 layers


@pytest.fixture
def plan_and_ds():
    """make_plan on a faked H200 (Liger on: modules replaced), its device set to the CPU, where the
    test builds the model (ZeRO-2: no zero.Init, so no process group is needed)."""
    import transformers.models.llama.modeling_llama as llama

    cfg = from_dict({"zero": {"stage": 2}})
    # Liger swaps modeling_llama's classes process-wide as it patches the patch stage's meta model;
    # the train stage is another process, which builds from transformers' own classes
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
            mp.setattr(llama, name, getattr(llama, name))
        made, ds = make_plan(cfg, H200)
    made["resolved"]["device"] = {"value": "cpu", "reason": "test: built on the CPU"}
    return cfg, made, ds


def test_a_model_patched_as_the_plan_says_is_built(plan_and_ds):
    cfg, made, ds = plan_and_ds
    plan = Plan.from_dict(made)
    assert plan.resolved.liger.value and dict(plan.patches.replaced_modules) == LIGER  # not empty
    model, _, offloader = build(cfg, plan, ds)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert model.model.norm._get_name() == "LigerRMSNorm"  # the real model carries the patches


@pytest.mark.parametrize("recorded", [
    {"LlamaRMSNorm->LigerRMSNorm": 5},                            # Liger's MLP not in the plan
    {**LIGER, "LlamaRMSNorm->LigerRMSNorm": 4},                   # another count
    {},                                                           # a plan made without Liger
])
def test_a_model_patched_otherwise_than_the_plan_is_refused(plan_and_ds, recorded):
    cfg, made, ds = plan_and_ds
    other = copy.deepcopy(made)
    other["patches"]["replaced_modules"] = recorded
    with pytest.raises(TrainingError, match="patched modules differ from the plan.*dvc repro patch"):
        build(cfg, Plan.from_dict(other), ds)

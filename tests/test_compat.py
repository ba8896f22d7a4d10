"""longft.compat: each private internal is checked when the plan is made; a library without it turns
the knob off (auto) or refuses once, clearly (set in params) — never a traceback mid-run."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from longft.compat import Access
from longft.compat import gate as compat
from longft.compat import transformers as tf_compat
from longft.config.params import from_dict
from longft.config.plan import Choice
from longft.model import packed_attention

VARLEN_OP = "torch.nn.attention.varlen.torch.ops.torch_attn._varlen_attn"

STAGE3 = "deepspeed.runtime.zero.stage3"
COORD = "deepspeed.runtime.zero.partitioned_param_coordinator"


def fake(monkeypatch, name: str, **attrs) -> types.ModuleType:
    """Put a module `name` holding only `attrs` where importlib finds it."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def fake_source(monkeypatch, tmp_path, name: str, source: str) -> types.ModuleType:
    """A module `name` from `source` (a file, so that inspect reads its classes' source)."""
    import importlib.util

    path = tmp_path / (name.replace(".", "_") + ".py")
    path.write_text(source)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    monkeypatch.setitem(sys.modules, name, mod)
    mod.__loader__.exec_module(mod)
    return mod


@pytest.fixture
def deepspeed_without_pre_step(monkeypatch, tmp_path):
    """A DeepSpeed whose ZeRO-3 optimizer lost `_pre_step` (everything else overlap_step uses is there)."""
    import deepspeed  # noqa: F401  (the real package first: the fakes replace only its ZeRO-3 modules)

    from longft.compat import deepspeed as ds

    state = "".join(f"        self.{a.name} = None\n" for a in ds.ACCESSES
                    if a.feature == "overlap_step" and a.owner == ds.OPTIMIZER and a.kind == "instance")
    methods = "".join(f"    def {m}(self): pass\n" for m in ds.STEP_METHODS if m != "_pre_step")
    fake_source(monkeypatch, tmp_path, STAGE3, "class DeepSpeedZeroOptimizer_Stage3:\n"
                f"    def __init__(self):\n{state}{methods}")
    fake_source(monkeypatch, tmp_path, COORD, "def iter_params(m): pass\n"
                "class PartitionedParameterCoordinator:\n"
                "    def __init__(self): self.__allgather_stream = None\n"
                "    def fetch_sub_module(self): pass\n"
                "    def __all_gather_params(self): pass\n")


def test_an_access_says_what_is_gone(monkeypatch):
    fake(monkeypatch, "fakelib", Thing=type("Thing", (), {"present": 1}))
    assert Access("x", "fakelib", "present", owner="Thing").missing() is None
    assert Access("x", "fakelib", "moved", owner="Thing").missing() == "fakelib.Thing.moved is gone"
    assert Access("x", "fakelib", "Thing").missing() is None
    assert "cannot be imported" in Access("x", "fakelib_not_installed", "f").missing()


def test_overlap_step_auto_turns_off_with_the_reason(deepspeed_without_pre_step):
    cfg = from_dict({})
    choices = {"overlap_step": Choice("on", "auto: ...")}
    record, problems = compat.gate(cfg, choices)
    assert problems == []
    assert choices["overlap_step"].value == "off"
    assert "DeepSpeedZeroOptimizer_Stage3._pre_step is gone" in choices["overlap_step"].reason
    assert choices["overlap_step"].reason.count(" is gone") == 1     # the rest is there
    label = f"{STAGE3}.DeepSpeedZeroOptimizer_Stage3._pre_step"
    assert record[label] == f"{label} is gone"
    assert record[f"{STAGE3}.DeepSpeedZeroOptimizer_Stage3._post_step"] == "ok"


def test_overlap_step_set_on_refuses_once_with_the_fix(deepspeed_without_pre_step):
    cfg = from_dict({"zero": {"overlap_step": "on"}})
    choices = {"overlap_step": Choice("on", "set in params")}
    _, problems = compat.gate(cfg, choices)
    assert len(problems) == 1
    assert problems[0].startswith("zero.overlap_step: on needs a library internal that is not there")
    assert "_pre_step is gone" in problems[0] and "set zero.overlap_step: auto or off" in problems[0]
    assert choices["overlap_step"].value == "on"


def test_liger_without_its_instance_patch_turns_off_or_refuses(monkeypatch):
    fake(monkeypatch, "liger_kernel.transformers")  # no _apply_liger_kernel_to_instance
    choices = {"liger": Choice(True, "auto: CUDA")}
    _, problems = compat.gate(from_dict({}), choices)
    assert choices["liger"].value is False and not problems
    assert "_apply_liger_kernel_to_instance is gone" in choices["liger"].reason
    _, problems = compat.gate(from_dict({"kernels": {"liger": "on"}}), {"liger": Choice(True, "set")})
    assert len(problems) == 1 and "kernels.liger: on needs" in problems[0]


def test_what_has_no_off_refuses(monkeypatch):
    fake(monkeypatch, "bitsandbytes")
    fake(monkeypatch, "bitsandbytes.functional")   # dequantize_4bit moved
    _, problems = compat.gate(from_dict({}), {"quantize": Choice("nf4", "set in params")})
    assert len(problems) == 1 and problems[0].startswith("lora.quantize: nf4 needs")
    assert "set lora.quantize: none" in problems[0]


def test_the_installed_libraries_have_every_internal():
    """The lock's versions (and scripts/test_newest.sh's newest inside pyproject's caps)."""
    found = compat.check()
    gone = {label: why for per in found.values() for label, why in per.items() if why}
    if torch.version.cuda is None:   # a CPU build has no pinned-host cache to empty
        assert gone.pop("torch._C._host_emptyCache", None) == "torch._C._host_emptyCache is gone"
    if not packed_attention.varlen_available():   # torch before 2.10 (the images' 2.9.1): no varlen
        assert gone.pop(VARLEN_OP).startswith("torch.nn.attention.varlen cannot be imported")
    assert not gone
    assert set(found) == {a.feature for _, a in compat.accesses()}


def test_a_hub_kernel_function_is_named_by_its_forward():
    """transformers 5.25 with `kernels`: apply_rotary_pos_emb is an nn.Module calling the function."""
    def apply_rotary_pos_emb(q, k):
        return q, k

    Func = type("Func", (torch.nn.Module,), {"forward": staticmethod(apply_rotary_pos_emb)})
    assert tf_compat.function_name(Func()).endswith("apply_rotary_pos_emb")
    assert tf_compat.function_name(apply_rotary_pos_emb).endswith(
        "test_a_hub_kernel_function_is_named_by_its_forward.<locals>.apply_rotary_pos_emb")


def test_a_zero3_export_needs_deepspeeds_gather_and_clip_scale_is_recorded(monkeypatch):
    """The export's gather of ZeRO-3's partitions is checked when the plan is made (a moved method
    refuses before training, not a traceback after it); clip_scale, which falls back to DeepSpeed's
    own clipping, is recorded and never refused."""
    from longft.compat import deepspeed as ds

    record, problems = compat.gate(from_dict({}), {})
    assert record[f"{ds.ENGINE_MODULE}.{ds.ENGINE}.{ds.CONSOLIDATED}"] == "ok" and not problems
    assert record[f"{STAGE3}.DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads"] == "ok"
    import deepspeed

    monkeypatch.setattr(deepspeed, ds.ENGINE, type("DeepSpeedEngine", (), {}))
    _, problems = compat.gate(from_dict({}), {})
    assert len(problems) == 1 and problems[0].startswith("output.export (under zero.stage 3) needs")
    assert f"{ds.CONSOLIDATED} is gone" in problems[0]
    _, problems = compat.gate(from_dict({"output": {"export": False}}), {})
    assert not problems   # no export, nothing gathered


def test_keep_attention_on_varlen_rows_refuses_where_torch_lost_varlen_attns_op(monkeypatch):
    """keep_attention has no off: on varlen_attn's packed rows it needs torch_attn::_varlen_attn
    (a moved op would keep nothing there), so its loss refuses; other rows do not need it."""
    from longft.compat import torch as torch_compat
    from longft.model import keep_attention

    cfg = from_dict({"checkpointing": {"keep_attention": 2}})
    if packed_attention.varlen_available():   # torch 2.10 and later (the images' 2.9.1 has none)
        record, problems = compat.gate(cfg, {"packed_attention": Choice("varlen", "auto")})
        assert record[VARLEN_OP] == "ok" and not problems
        assert torch_compat.varlen_attn_op() in keep_attention.kernel_ops()
    namespace = types.SimpleNamespace(ops=types.SimpleNamespace(torch_attn=types.SimpleNamespace()))
    fake(monkeypatch, torch_compat.VARLEN_MODULE, torch=namespace)   # the op moved
    record, problems = compat.gate(cfg, {"packed_attention": Choice("varlen", "auto")})
    assert record[VARLEN_OP] == f"{VARLEN_OP} is gone"
    assert len(problems) == 1 and problems[0].startswith(
        "checkpointing.keep_attention (on varlen_attn's packed rows) needs a library internal")
    assert torch_compat.varlen_attn_op() is None
    record, problems = compat.gate(cfg, {"packed_attention": Choice("per_document", "auto")})
    assert VARLEN_OP not in record and not problems
    _, problems = compat.gate(from_dict({}), {"packed_attention": Choice("varlen", "auto")})
    assert not problems   # keep_attention 0 keeps nothing


def test_the_host_cache_emptying_is_recorded_on_cuda_and_falls_back_to_the_public_call(monkeypatch):
    """The trainer empties the pinned-host cache through torch._C._host_emptyCache, else through
    torch.accelerator.empty_host_cache; its loss is recorded in plan.json (CUDA runs), never refused."""
    from longft.compat import torch as torch_compat

    label = "torch._C._host_emptyCache"
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    record, problems = compat.gate(from_dict({}), {"device": Choice("cuda", "auto")})
    assert record[label] == f"{label} is gone" and not problems
    record, _ = compat.gate(from_dict({}), {"device": Choice("cpu", "auto")})
    assert label not in record
    calls = []
    # (torch.accelerator.empty_host_cache is torch 2.10's; the images' 2.9.1 lacks it)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("public"),
                        raising=False)
    assert torch_compat.empty_host_cache() and calls == ["public"]
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False)
    record, _ = compat.gate(from_dict({}), {"device": Choice("cuda", "auto")})
    assert record[label] == "ok"
    assert torch_compat.empty_host_cache() and calls == ["public", "private"]
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    assert not torch_compat.empty_host_cache()

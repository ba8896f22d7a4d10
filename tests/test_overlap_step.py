"""engine/overlap_step.py: DeepSpeed ZeRO-3's sub-group loop left pending by step() and run in the
next forward, just before each sub-group's parameters are fetched; the weights, the losses and the
lr are DeepSpeed's own, bit for bit."""

import types

import pytest

from longft.engine import overlap_step
from zero3_cpu import run_zero3

pytest.importorskip("deepspeed")


def test_install_leaves_what_it_does_not_know_alone():
    assert overlap_step.install(types.SimpleNamespace(optimizer=None)) is None
    assert overlap_step.install(types.SimpleNamespace(optimizer=object())) is None
    swapping = types.SimpleNamespace(**{a: None for a in overlap_step.STEP_PARTS}, swap_optimizer=True,
                                     optimizer=types.SimpleNamespace(param_groups=[]))   # NVMe only
    assert overlap_step.install(types.SimpleNamespace(optimizer=swapping)) is None


def test_the_trainer_reports_the_sub_groups_the_deferred_step_holds(monkeypatch, capsys):
    """optimizer_patches says how many sub-groups update during the next forward, and that few
    overlap little (the count is DeferredStep's: DeepSpeed's state is read in compat/deepspeed.py)."""
    from longft.engine import optimizer_patches

    opt = types.SimpleNamespace(fp16_groups=[[object()], [object(), object()]])
    monkeypatch.setattr(overlap_step, "install", lambda engine, copier=None: overlap_step.DeferredStep(opt))
    deferred = optimizer_patches._defer_step(types.SimpleNamespace(optimizer=opt), rank=0)
    assert deferred.groups == 2 and deferred.persistent == [[], []]
    out = capsys.readouterr().out
    assert "the optimizer step's 2 sub-groups update during the next forward" in out
    assert "with 2 little of the update can overlap" in out


@pytest.mark.slow
@pytest.mark.parametrize("offload_param", [False, True])
@pytest.mark.parametrize("clipping", [1e6, 1e-3])
def test_the_deferred_step_trains_deepspeeds_bits(tmp_path, offload_param, clipping):
    """Parameters fetched (persistence 0), on the GPU's place or on the host, with an lr that
    moves every step and with and without clipping: each step returns with every sub-group
    pending, the next forward (with or without gradients) updates them as it fetches, and the
    losses, the forwards between steps, the final lr and the weights are DeepSpeed's, and so are
    the calls of its sub-group loop (each sub-group prepared, stepped, copied back and released,
    in order, between the step's start and its end)."""
    kw = dict(clipping=clipping, offload_param=offload_param, persistence=0, schedule=True,
              evaluate=True)
    own = run_zero3(tmp_path, **kw)
    over = run_zero3(tmp_path, overlap=True, **kw)
    groups = over["pending"][0]
    assert groups > 2 and over["pending"] == [groups] * 3       # step() left them all pending
    assert over["deferred"] == 3 * groups
    assert len(set(own["losses"])) == 3 and own["evals"] != own["losses"]
    assert over["losses"] == own["losses"] and over["evals"] == own["evals"]
    assert over["lrs"] == own["lrs"] and over["bits"] == own["bits"]
    assert 0 < min(own["norms"]) and over["norms"] == own["norms"]      # the step's gradient norm
    assert len(own["calls"]) == 3 * (2 + groups * 4 + 1) and over["calls"] == own["calls"]


@pytest.mark.slow
def test_a_nan_gradient_skips_the_step_as_deepspeed_does(tmp_path):
    """A NaN gradient norm (DeepSpeed's groups report it as the -1 sentinel) makes DeepSpeed skip
    the step, bf16 included; the deferred step skips it too: no sub-group is left pending, the
    weights stay finite and are DeepSpeed's bits, and the step's norm is reported as inf."""
    own = run_zero3(tmp_path, persistence=0, nan_at=1)
    over = run_zero3(tmp_path, overlap=True, persistence=0, nan_at=1)
    assert own["norms"][1] == float("inf") and over["norms"] == own["norms"]
    assert over["pending"][1] == 0 and over["losses"][2] == own["losses"][2]
    assert over["bits"] == own["bits"]


@pytest.mark.slow
def test_persistent_parameters_are_gathered_after_their_sub_group(tmp_path):
    """With DeepSpeed's default persistence every small parameter stays gathered and is never
    fetched: each is gathered again right after its sub-group's update, before the next forward
    uses it, so the losses are still DeepSpeed's. The step's start released them all
    (`_partition_all_parameters`): left ungathered, the next forward would fetch them again (the
    same values, one gather more on the critical path) and anything reading them outside a
    forward would find them empty; so the step leaves each gathered with DeepSpeed's bits."""
    own = run_zero3(tmp_path, schedule=True)
    over = run_zero3(tmp_path, overlap=True, schedule=True)
    assert over["losses"] == own["losses"] and over["bits"] == own["bits"]
    assert all(status == "AVAILABLE" and len(bits) > 0 for status, bits in own["after"])
    assert over["after"] == own["after"] and over["calls"] == own["calls"]
    # each of the 12 parameters (6 layers' weight and bias) gathered once a step, as DeepSpeed does
    assert own["gathered"] == over["gathered"] == 3 * 12


@pytest.mark.slow
def test_frozen_layers_are_fetched_without_waiting_and_the_rest_train_deepspeeds_bits(tmp_path):
    """Frozen weights (a LoRA run's base model) belong to no sub-group: their fetches update
    nothing, and the trainable layers still train DeepSpeed's bits."""
    kw = dict(clipping=1e-3, offload_param=True, persistence=0, schedule=True, freeze=2)
    own = run_zero3(tmp_path, **kw)
    over = run_zero3(tmp_path, overlap=True, **kw)
    assert over["pending"][0] >= 2 and len(set(own["losses"])) == 3
    assert over["losses"] == own["losses"] and over["bits"] == own["bits"]

"""Per-layer progress: counts every layer in forward and in backward."""

import io

import torch

from longft.measure.progress import LayerProgress


def tiny(checkpointing: bool):
    from transformers import AutoModelForCausalLM

    from longft.config.params import ModelConfig
    from longft.model.loading import load_model_config

    m = AutoModelForCausalLM.from_config(load_model_config(ModelConfig()), dtype=torch.float32)
    m.config.use_cache = False
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def step(model, prog, last):
    prog.start_step(last)
    ids = torch.randint(1, 300, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    counts = (prog.forward, prog.backward)
    prog.end_step()
    return counts


def test_counts_forward_and_recompute_per_layer_once_a_step_is_slow():
    model = tiny(checkpointing=True)
    out = io.StringIO()
    prog = LayerProgress(model.model.layers, enabled=True, after_s=5.0, file=out)
    assert step(model, prog, last=1.0) == (0, 0)       # fast steps: no bar, nothing counted
    assert step(model, prog, last=12.0) == (2, 2)      # 2 layers forward, 2 in backward
    assert "layer" in out.getvalue()
    prog.remove()
    assert step(model, prog, last=12.0) == (0, 0)      # hooks gone


def test_without_checkpointing_too_and_disabled_does_nothing():
    model = tiny(checkpointing=False)
    prog = LayerProgress(model.model.layers, enabled=True, file=io.StringIO())
    assert step(model, prog, last=10.0) == (2, 2)
    off = LayerProgress(model.model.layers, enabled=False)
    assert step(model, off, last=10.0) == (0, 0) and off.bar is None

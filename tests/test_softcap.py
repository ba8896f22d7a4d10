"""Gemma 2 softcaps its attention logits (cap * tanh(s / cap)), which SDPA and longft's packed
attention cannot apply: auto picks a kernel that does (FlashAttention-2 where it runs, else
eager) and says so in plan.json; a pinned sdpa is refused; the packed path refuses it at the
last moment too (issue 20). Tiny Gemma 2 configs from transformers, nothing downloaded."""

import json

import pytest
import torch

from longft.config.params import from_dict
from longft.hardware import PlanError, resolve
from longft.model import packed_attention as pa
from longft.model import patches as patch
from test_plan import A100, CPU, H200  # noqa: E402  (tests/ is on sys.path under pytest)

GEMMA2 = {"model_type": "gemma2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 8192, "sliding_window": 8192}


def gemma2_config(**over):
    from transformers import Gemma2Config

    raw = {k: v for k, v in {**GEMMA2, **over}.items() if k != "model_type"}
    return Gemma2Config(**raw)


def test_the_cap_is_read_from_the_config():
    assert patch.attention_softcap(gemma2_config()) == 50.0  # transformers' Gemma 2 default
    assert patch.attention_softcap(gemma2_config(attn_logit_softcapping=None)) is None
    from transformers import LlamaConfig
    assert patch.attention_softcap(LlamaConfig()) is None


@pytest.mark.parametrize("hw,kernel", [(CPU, "eager"), (H200, "eager"),
                                       (A100, "flash_attention_2")])
def test_auto_takes_a_kernel_that_applies_the_cap_and_says_why(hw, kernel):
    cfg = from_dict({"hardware": {"device": "auto"}})
    r = resolve(cfg, hw, "gemma2", softcap=50.0)
    assert r["attention"].value == kernel
    assert "softcaps attention logits (attn_logit_softcapping 50)" in r["attention"].reason
    assert "SDPA ignores" in r["attention"].reason
    # packed rows: eager's block mask or flash-attn's varlen kernel, never SDPA per document
    assert r["packed_attention"].value == ("mask" if kernel == "eager" else "flash_attention_2")
    # the same config without a cap keeps SDPA
    assert resolve(cfg, hw, "llama")["attention"].value in ("sdpa", "flash_attention_2")


def test_a_pinned_sdpa_is_refused_with_the_fix():
    cfg = from_dict({"kernels": {"attention": "sdpa"}})
    with pytest.raises(PlanError, match=r"kernels.attention: sdpa cannot apply this model's "
                                        r"attention logit softcapping \(attn_logit_softcapping "
                                        r"50\).*set kernels.attention: auto, eager or "
                                        r"flash_attention_2"):
        resolve(cfg, CPU, "gemma2", softcap=50.0)


def test_the_patch_stage_plans_gemma2_with_eager_and_the_model_runs_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from longft.hardware import detect
    from longft.run.patch_stage import make_plan

    f = tmp_path / "gemma2.json"
    f.write_text(json.dumps(GEMMA2))
    cfg = from_dict({"model": {"name": str(f)}, "data": {"max_seq_length": 1024}})
    plan, _ = make_plan(cfg, detect())  # CPU here
    attn = plan["resolved"]["attention"]
    assert attn["value"] == "eager" and "attn_logit_softcapping 50" in attn["reason"]
    assert plan["resolved"]["packed_attention"]["value"] == "mask"
    assert plan["patches"]["attn_implementation"] == "eager"
    # the trainer builds the model with that kernel: the cap is applied (eager_attention_forward)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma2_config(), attn_implementation=attn["value"])
    model.config.use_cache = False
    with torch.no_grad():   # scores far beyond the cap of 50: random init keeps them near 0
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(200)
    ids = torch.randint(0, 300, (1, 16))
    capped = model(ids).logits
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert not torch.allclose(capped, model(ids).logits)  # the cap changes the result


def test_patch_refuses_a_capped_model_on_the_sdpa_based_packed_kernels():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma2_config(), attn_implementation="eager")
    with pytest.raises(patch.PatchError, match=r"softcaps attention logits \(attn_logit_softcapping"
                                               r" 50\), which kernels.packed_attention per_document"):
        patch.apply(model, liger=False, checkpointing="none", packed="per_document")


def test_the_packed_attention_function_refuses_a_cap_and_a_short_sliding_window():
    fwd = pa.make_forward("per_document")
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(pa.PackedAttentionError, match="cannot apply attention logit softcapping"):
        fwd(module, q, q, q, None, softcap=50.0)
    cu = torch.tensor([0, 6, 8], dtype=torch.int32)
    with pytest.raises(pa.PackedAttentionError, match=r"sliding window \(4 tokens\) to a 6-token"):
        fwd(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=6, sliding_window=4)
    out, _ = fwd(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=6, sliding_window=6)
    assert out.shape == (1, 8, 2, 4)

"""estimate/arch.py's counts against the models transformers builds: the estimator's parameter list
is the model's own, in order, with the biases Qwen2 and `attention_bias` add; and the edge cases of
the trainable subset (one sparse block, no target) that the formulas divide by or take a max of."""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from longft.estimate.arch import largest_target, numbers, param_numels, trainable_numels
from longft.estimate.types import Setup
from longft.model.architecture import architecture

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True}),  # q, k, v and o
    ("llama", {"tie_word_embeddings": False, "mlp_bias": True}),
    ("qwen2", {"tie_word_embeddings": False}),          # q/k/v biases, not said in its config
    ("mistral", {"tie_word_embeddings": False, "attention_bias": True}),  # ignored by Mistral
])
def test_the_parameter_list_is_the_models_own_in_order(model_type, extra):
    arch = dict(TINY, model_type=model_type, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dict(TINY, **extra)))
    assert [n for _, n in param_numels(arch)] == [p.numel() for p in model.parameters()]
    # what the estimator is given: plan.json's model_config, read from the model's config
    assert param_numels(architecture(model.config)) == param_numels(arch)
    biases = [n for name, n in param_numels(arch) if name.endswith(".bias")]
    assert len(biases) == sum(p.ndim == 1 and "proj" in n for n, p in model.named_parameters())


def test_one_sparse_block_is_block_sparse_not_full_finetuning():
    arch = dict(TINY, model_type="llama")
    s = Setup(1, 128, sparse_blocks=1, sparse_block_size=16, sparse_targets=("q_proj", "down_proj"))
    assert trainable_numels(arch, s) == [16 * 16] * (2 * TINY["num_hidden_layers"])
    n = numbers(arch, s)
    assert n.adapters == 16 * 16 * 4 and n.largest == 16 * 16


def test_no_target_and_no_quantized_base_count_zero():
    arch = dict(TINY, model_type="llama")
    assert largest_target(arch, ()) == 0
    assert largest_target(arch, ("gate_proj",)) == 64 * 96
    plain = numbers(arch, Setup(1, 128))
    assert (plain.Pq, plain.quant_bytes, plain.biggest_q) == (0, 0, 0)
    qlora = numbers(arch, dataclasses.replace(Setup(1, 128), lora_rank=4, quantize="nf4",
                                             lora_targets=("q_proj", "v_proj")))
    assert qlora.biggest_q == 64 * 64 and qlora.Pq == (64 * 64 + 64 * 32) * TINY["num_hidden_layers"]


def test_rank_one_lora_and_fp32_element_bytes():
    arch = dict(TINY, model_type="llama")
    s = Setup(1, 128, lora_rank=1, lora_targets=("q_proj",))
    assert trainable_numels(arch, s) == [1 * 64, 64 * 1] * TINY["num_hidden_layers"]
    assert numbers(arch, dataclasses.replace(s, precision="fp32")).w == 4
    assert numbers(arch, s).w == 2

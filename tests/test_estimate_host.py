"""estimate/host.py's rules against hand-computed numbers: torch's pinned host cache as the
estimator replays it (a block freed stays resident until the cache is emptied, and the peak before
the emptying is the start-up item), and ZeRO-1/2's host buffers under CPU offload."""

from longft.estimate.arch import trainable_numels
from longft.estimate.estimator import LAUNCHER_BASE_BYTES, RANK_BASE_BYTES, Setup, estimate
from longft.estimate.host import pinned_peak, pinned_pool

MiB = 2**20

SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
             tie_word_embeddings=False)
"""141,632 parameters: embedding and lm_head 384 x 64 = 24,576 each, the final norm 64; per layer
q and o 64 x 64 = 4,096, k and v 64 x 32 = 2,048, gate, up and down 64 x 176 = 11,264, two norms of 64."""


def test_an_emptied_cache_gives_its_blocks_back_and_the_peak_is_before_it():
    start = [("alloc", "a", 3 * MiB), ("alloc", "b", MiB), ("free", "a", 0), ("empty", "", 0)]
    # a's block is 4 MiB (a power of two), cached once freed, given back by the emptying
    assert pinned_pool(start) == ({"b": MiB}, MiB)
    assert pinned_peak(start) == 4 * MiB + MiB              # rounding, as pinned_pool, by default
    assert pinned_peak(start, rounding=False) == 3 * MiB + MiB  # not pinned (a CPU run): exact sizes,
    assert pinned_pool(start, rounding=False) == ({"b": MiB}, MiB)  # and freed for real
    # after the emptying nothing is cached: a new 4 MiB request takes a new block
    live, resident = pinned_pool(start + [("alloc", "c", 4 * MiB)])
    assert live == {"b": MiB, "c": 4 * MiB} and resident == MiB + 4 * MiB


def host(e) -> dict[str, int]:
    return {i.name: i.bytes for i in e.items if i.where == "host"}


def test_zero2_cpu_offload_pins_its_buffers_and_accumulation_buffers_only_when_accumulating():
    """ZeRO-1/2 with offload_optimizer: the fp32 master, a bf16 staging copy, a staging buffer of
    the largest parameter and CPU Adam's fp32 gradients, each one pinned block (a power of two);
    with more than one micro-step a step, an accumulation buffer per parameter too."""
    P = 141_632
    one = Setup(micro_batch=1, seq_len=128, zero_stage=2, offload_optimizer=True)
    e = host(estimate(SMALL, one))
    buffers = {"optimizer: fp32 master (pinned)": 1 * MiB,       # 4 B x P = 566,528 -> 2^20
               "weights: bf16 staging (pinned)": MiB // 2,       # 2 B x P = 283,264 -> 2^19
               "gradients: staging (pinned)": 64 * 1024,         # 2 B x 24,576 = 49,152 -> 2^16
               "CPU Adam fp32 gradients (pinned)": 1 * MiB}      # 4 B x P -> 2^20
    assert {k: e[k] for k in buffers} == buffers
    assert e["optimizer: Adam m, v (CPU Adam)"] == 2 * 4 * P
    assert "gradient accumulation buffers (pinned)" not in e
    # DeepSpeed's init pins them all before the cache is emptied (nothing freed: the same bytes)
    assert e["start-up: pinned blocks of DeepSpeed's init"] == sum(buffers.values())
    assert e["process baseline"] == LAUNCHER_BASE_BYTES + RANK_BASE_BYTES

    acc = host(estimate(SMALL, Setup(micro_batch=1, seq_len=128, zero_stage=2, offload_optimizer=True,
                                     grad_accum=2)))
    # one bf16 buffer per parameter, each rounded up to a power of two:
    # embedding and lm_head 49,152 B -> 65,536; final norm 128; per layer q, o 8,192, k, v 4,096,
    # gate, up, down 22,528 -> 32,768, two norms 128
    per_layer = 2 * 8192 + 2 * 4096 + 3 * 32768 + 2 * 128
    assert acc["gradient accumulation buffers (pinned)"] == 2 * 65536 + 128 + 2 * per_layer == 377_472
    assert acc["start-up: pinned blocks of DeepSpeed's init"] == sum(buffers.values()) + 377_472


def test_the_optimizer_items_say_which_share_of_the_sub_groups_is_on_the_host():
    """ZeRO-3 with offload_optimizer: the master and Adam's moments are 4 B and 8 B per host
    element; under offload_ratio < 1 their formula says how many sub-groups CPU Adam steps
    (DeepSpeed keeps int((1 - ratio) x groups) on the GPU: int(0.5 x 1) = 0 of SMALL's one)."""
    P = 141_632

    def formulas(**kw):
        e = estimate(SMALL, Setup(micro_batch=1, seq_len=128, offload_optimizer=True, **kw))
        return {i.name: (i.bytes, i.formula) for i in e.items if i.name.startswith("optimizer:")}

    assert formulas() == {"optimizer: fp32 master": (4 * P, "1 x 4 B x 141,632"),
                          "optimizer: Adam m, v (CPU Adam)": (8 * P, "1 x 8 B x 141,632")}
    half = formulas(offload_ratio=0.5)
    assert half["optimizer: fp32 master"] == (4 * P, "1 x 4 B x 141,632 (offload_ratio 0.5: 1 of 1 sub-groups)")
    assert half["optimizer: Adam m, v (CPU Adam)"][1].endswith("(offload_ratio 0.5: 1 of 1 sub-groups)")


def test_offloaded_parameters_of_a_frozen_base_stay_in_zero_inits_blocks():
    """ZeRO-3 with offload_param: zero.Init pins each parameter's partition, and the optimizer moves
    the parameters it owns into one buffer. In full finetuning that is every parameter (the
    per-parameter blocks are freed, and only the start-up peak holds both); under LoRA or
    block-sparse the frozen base keeps its blocks and the buffer holds the trained ones alone."""
    from longft.estimate.arch import param_numels
    from longft.estimate.host import pinned

    base = dict(micro_batch=1, seq_len=128, zero_stage=3, offload_optimizer=True, offload_param=True)
    full = host(estimate(SMALL, Setup(**base)))
    assert full["weights: partitions (pinned)"] == pinned(2 * 141_632)
    assert not any("frozen" in k for k in full)
    per_param = sum(pinned(2 * n) for _, n in param_numels(SMALL))
    for frozen in (Setup(**base, lora_rank=4, lora_targets=("q_proj", "v_proj")),
                   Setup(**base, sparse_blocks=1, sparse_block_size=16, sparse_targets=("q_proj",))):
        e = host(estimate(SMALL, frozen))
        trained = sum(trainable_numels(SMALL, frozen))
        assert e["weights: frozen partitions (pinned)"] == per_param, frozen
        assert e["weights: trained partitions (pinned)"] == pinned(2 * trained), frozen
        assert "weights: partitions (pinned)" not in e

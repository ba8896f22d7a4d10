"""The memory estimator by hand on Llama-3.2-1B, the shapes of the H200 rows (a) and (b)
(BENCHMARKS.md); the small-config and placement cases are in test_estimate.py, the measured rows in
test_estimate_accuracy.py. Every expected number is the arithmetic of docs/estimator.md."""

from longft.estimate.estimator import (
    GIB,
    LAUNCHER_BASE_BYTES,
    RANK_BASE_BYTES,
    SETUP_LAUNCHER_BYTES,
    SETUP_RANK_BYTES,
    Setup,
    estimate,
)
from test_estimate import LLAMA_1B, MiB, items


def test_llama_1b_row_a_by_hand():
    """H200 row (a): 16K x micro-batch 4, ZeRO-3 nothing offloaded; measured 28.657 GiB allocated."""
    e = estimate(LLAMA_1B, Setup(micro_batch=4, seq_len=16384))
    P, T, h, I, V = 1_235_814_400, 65536, 2048, 8192, 128256
    saved = 2 * (2 * h + (2048 + 512) + 512 + 2048 + h + 3 * I) + 8 + 4 * 32
    assert saved == 71816
    backward = {
        "weights: partitions": 2 * P,                                   # 2,471,628,800
        "gradients: partitions": 2 * P,
        "optimizer: fp32 master + Adam m, v": 12 * P,                   # 14,829,772,800
        "gradients: reduce bucket + one in flight": 2 * (h * h + h * I),
        "inputs + rotary cos/sin": T * (24 + 2 * 2 * 64),
        "activation checkpoints (GPU)": 16 * T * h * 2,                  # 4 GiB
        "saved tensors of the recomputed layer": T * saved,              # 4.383 GiB
        "backward transients of one layer": T * 2 * (I + h),             # 1.25 GiB
        "tied lm_head grad (held to embedding bwd)": V * h * 2,
    }
    got = items(e)
    assert {k: got[k] for k in backward} == backward
    assert e.gpu_peak_phase == "backward"
    assert e.gpu_allocated == sum(backward.values()) == 30_702_338_048          # 28.594 GiB
    assert got["step: fp32 gradient of the largest sub-group"] == 6 * 1_003_012_096
    assert abs(e.gpu_allocated / GIB - 28.657) / 28.657 < 0.01


def test_llama_1b_row_b_host_by_hand():
    """H200 row (b): parameters and optimizer on the CPU, micro-batch 20. zero.Init's per-parameter
    pinned partitions (embed 525 MB -> 512 MiB block, 16 x 116 MiB of layers) go back to the OS when
    the trainer empties torch's pinned cache after deepspeed.initialize: no cached-blocks item."""
    e = estimate(LLAMA_1B, Setup(micro_batch=20, seq_len=16384, offload_optimizer=True,
                                 offload_param=True))
    P = 1_235_814_400
    want = {
        "process baseline": LAUNCHER_BASE_BYTES + RANK_BASE_BYTES,
        "start-up peak above the baseline":
            SETUP_LAUNCHER_BYTES + SETUP_RANK_BYTES - LAUNCHER_BASE_BYTES - RANK_BASE_BYTES,
        "weights: partitions (pinned)": 2**32,                  # 2 B x P = 2.47e9 -> 4 GiB block
        "CPU Adam fp32 gradients (pinned)": 2**32 + 2**30,      # 4 B x 1,003,012,096 and x 232,802,304
        "gradients: partitions (pinned)": 2**32,
        "DataLoader pinned batches": 6 * 4 * MiB,               # 20 x 16384 x 8 B -> 4 MiB, 2 x 3
        "optimizer: fp32 master": 4 * P,
        "optimizer: Adam m, v (CPU Adam)": 8 * P,
        # at start-up, before the trainer empties the pinned cache: zero.Init's per-parameter
        # blocks (embed 512 MiB; a layer 8 + 2 + 2 + 8 + 3 x 32 MiB and two 4 KiB norms; the final
        # norm) freed into the cache but resident, and the three buffers above
        "start-up: pinned blocks of DeepSpeed's init":
            2**29 + 16 * (116 * MiB + 2 * 4096) + 4096 + 2**32 + (2**32 + 2**30) + 2**32,
    }
    assert items(e, "host") == want
    start_up = {"process baseline", "start-up peak above the baseline", "optimizer: fp32 master",
                "start-up: pinned blocks of DeepSpeed's init"}
    # the start-up moment (15.4 GiB of pinned blocks) is smaller than training's (CPU Adam's m, v)
    assert sum(want[k] for k in start_up) < e.host_rss
    assert e.host_rss == sum(want.values()) - want["start-up peak above the baseline"] \
        - want["start-up: pinned blocks of DeepSpeed's init"]


def test_llama_1b_row_b_gpu_by_hand():
    e = estimate(LLAMA_1B, Setup(micro_batch=20, seq_len=16384, offload_optimizer=True,
                                 offload_param=True))
    T, h, I, V, layer = 327680, 2048, 8192, 128256, 60_821_504
    got = items(e)
    assert got["backward transients of one layer"] == T * 2 * (I + h)
    assert "weights: partitions" not in got and "optimizer: fp32 master + Adam m, v" not in got
    assert got["weights: gathered decoder layers"] == 2 * layer * (1 + 5)
    assert got["weights: gathered lm_head"] == 2 * V * h
    assert got["ZeRO-3 prefetch bucket"] == 2 * int(0.9 * h * h)
    assert got["activation checkpoints (GPU)"] == 16 * T * h * 2                 # 20 GiB
    assert got["saved tensors of the recomputed layer"] == T * 71816
    assert e.gpu_peak_phase == "backward"
    assert abs(e.gpu_allocated / GIB - 50.725) / 50.725 < 0.03

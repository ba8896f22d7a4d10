"""Random token ids for speed and memory benchmarks (`data.source: random`).

Ids are uniform in [1, vocab_size): never all zeros, which would flatter kernels and make the
loss trivial. Every token is trained on (labels = input_ids) and each row is one document.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def random_rows(num_rows: int, max_len: int, vocab_size: int, seed: int
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """num_rows rows of (input_ids, labels, position_ids), int32 of length max_len; seeded."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 to draw ids in [1, vocab_size), got {vocab_size}")
    rng = np.random.default_rng(seed)
    pos = np.arange(max_len, dtype=np.int32)
    for _ in range(num_rows):
        ids = rng.integers(1, vocab_size, size=max_len, dtype=np.int32)
        yield ids, ids.copy(), pos.copy()

"""How much of a file source's prepared rows a run trains on, said by the train stage before it
starts: a step count left from the synthetic demo (train.iterations 12) on one's own data trains a
few percent of it, and the run's `epoch 0.09` would be the only sign.

    train: note: 12 steps of 2 rows cover 9 % of the 259 prepared rows (train.iterations 12): set
    train.epochs: 1 (train.iterations: null) to pass over all of them

Generated data (data.source synthetic or random) are as many rows as asked for, so no note; nor with
train.epochs, which counts passes over the rows itself.
"""

from __future__ import annotations

from longft.config.params import Config
from longft.config.sections import GENERATED_SOURCES
from longft.engine.batches import micro_batches_per_epoch, passes


def coverage_note(cfg: Config, meta: dict) -> str | None:
    """The note when train.iterations covers less than one pass over the prepared rows of a file
    source (data/prepared/meta.json `meta`: num_rows, source); None otherwise."""
    t = cfg.train
    rows = int(meta.get("num_rows") or 0)
    if t.iterations is None or meta.get("source") in GENERATED_SOURCES \
            or not micro_batches_per_epoch(rows, cfg.world_size, t.micro_batch_size):
        return None  # (fewer rows than ranks: the trainer refuses that itself)
    share = passes(t.iterations, rows, cfg.world_size, t.micro_batch_size, cfg.grad_accum_steps)
    if share >= 1:
        return None
    pct = f"{int(100 * share)} %" if share >= 0.01 else "under 1 %"  # never "100 %" short of it
    return (f"train: note: {t.iterations} steps of {t.global_batch_size} rows cover {pct} of the "
            f"{rows} prepared rows (train.iterations {t.iterations}): set train.epochs: 1 "
            f"(train.iterations: null) to pass over all of them")

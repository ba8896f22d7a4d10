"""Tokenized samples -> fixed-length rows of max_seq_length (input_ids, labels, position_ids).

Packing (`data.pack: true`) puts several samples in one row, first-fit over the samples sorted by
decreasing length. Packed documents must not attend to each other: position ids restart at 0 for
every document, and transformers derives a block-diagonal causal mask from that when no attention
mask is given (`masking_utils.find_packed_sequence_indices`: a new sequence starts wherever the
position id does not grow by 1; FlashAttention-2 uses the same boundaries). The label of the first
token of every document is -100: the model shifts labels by one, so that label would otherwise
train the last token of the previous document to predict the next document's first token.

The tail of a row is padding: pad_token_id, label -100, and position ids that continue the last
document's. Attention is causal, so no real token attends to the tail, and a row that holds a
single document needs no mask at all (the fast is_causal path of SDPA/FlashAttention).

transformers only derives that mask when the model is called with attention_mask=None *and* no
KV cache: call it with `use_cache=False` (config.use_cache defaults to True, and in train mode too
a DynamicCache is then created and the packed documents attend to each other;
tests/test_data_packing.py checks both).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from longft.data.errors import BadRecords, DataError
from longft.data.tokenize import IGNORE_INDEX, Sample


def fit_length(sample: Sample, max_len: int, truncate: bool, bad: BadRecords) -> Sample | None:
    """The sample cut to max_len tokens (truncate), or a too_long bad record (None when skipped)."""
    if len(sample) <= max_len:
        return sample
    if truncate:
        return Sample(sample.input_ids[:max_len], sample.labels[:max_len], sample.where)
    bad.handle(DataError(
        f"{sample.where}: {len(sample)} tokens, longer than data.max_seq_length {max_len}; raise "
        f"data.max_seq_length or set data.truncate: true", "too_long"))
    return None


def fit_sample(sample: Sample, fmt: str, max_len: int, truncate: bool, split_text: bool,
               bad: BadRecords) -> list[Sample]:
    """What a tokenized record becomes: itself; a text record longer than max_len split into
    pieces (split_text); otherwise cut (truncate) or refused as too_long ([] when skipped)."""
    if fmt == "text" and split_text and len(sample) > max_len:
        return split_sample(sample, max_len)
    fitted = fit_length(sample, max_len, truncate, bad)
    return [] if fitted is None else [fitted]


def split_sample(sample: Sample, max_len: int) -> list[Sample]:
    """A sample cut into consecutive pieces of max_len tokens (the last one shorter), each its own
    document: nothing is lost but, at each cut, the label of the piece's first token (a document's
    first label never reaches the loss, see build_row). For long `text` records (data.split_text)."""
    n = len(sample)
    parts = range(0, n, max_len)
    return [Sample(sample.input_ids[i:i + max_len], sample.labels[i:i + max_len],
                   f"{sample.where} part {k + 1}/{len(parts)}") for k, i in enumerate(parts)]


def trainable_tokens(sample: Sample) -> int:
    """Labels that reach the loss once packed (the first token of a document never does)."""
    return int(np.count_nonzero(sample.labels[1:] != IGNORE_INDEX))


def plan_rows(lengths: Sequence[int], max_len: int, pack: bool) -> list[list[int]]:
    """Sample indices per row. pack=False: one sample per row; True: first-fit decreasing."""
    if any(n > max_len or n <= 0 for n in lengths):
        raise ValueError(f"every length must be in [1, {max_len}]; cut samples with fit_length")
    if not pack:
        return [[i] for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep file order
    free = np.empty(len(lengths), dtype=np.int64)  # room left in each open row
    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        fits = free[: len(rows)] >= n
        j = int(np.argmax(fits)) if len(rows) else 0
        if not len(rows) or not fits[j]:
            j = len(rows)
            rows.append([])
            free[j] = max_len
        rows[j].append(i)
        free[j] -= n
    for r in rows:  # documents in file order within a row
        r.sort()
    return rows


def build_row(samples: Sequence[Sample], max_len: int, pad_id: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row (input_ids, labels, position_ids), int32 of length max_len, padded at the end.

    Padding continues the positions of the last document instead of starting a new one: under
    causal attention no real token can see the tail, and a row holding one document then needs no
    block-diagonal mask (transformers keeps the fast is_causal path; see
    transformers.masking_utils.find_packed_sequence_indices).
    """
    ids = np.full(max_len, pad_id, dtype=np.int32)
    labels = np.full(max_len, IGNORE_INDEX, dtype=np.int32)
    pos = np.empty(max_len, dtype=np.int32)
    off = start = 0
    for s in samples:
        n = len(s)
        if off + n > max_len:
            raise ValueError(f"samples of {off + n} tokens do not fit a row of {max_len}")
        ids[off: off + n] = s.input_ids
        labels[off: off + n] = s.labels
        labels[off] = IGNORE_INDEX
        pos[off: off + n] = np.arange(n)
        start, off = off, off + n
    pos[off:] = np.arange(off - start, max_len - start)
    return ids, labels, pos


def iter_rows(samples: Sequence[Sample], plan: list[list[int]], max_len: int, pad_id: int
              ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    for row in plan:
        yield build_row([samples[i] for i in row], max_len, pad_id)


def pack_samples(samples: Sequence[Sample], max_len: int, pad_id: int, pack: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All rows stacked: (input_ids, labels, position_ids), each int32 [rows, max_len]."""
    plan = plan_rows([len(s) for s in samples], max_len, pack)
    rows = list(iter_rows(samples, plan, max_len, pad_id))
    if not rows:
        empty = np.zeros((0, max_len), dtype=np.int32)
        return empty, empty.copy(), empty.copy()
    return tuple(np.stack(a) for a in zip(*rows))  # type: ignore[return-value]

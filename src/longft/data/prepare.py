"""The prepare stage: data.* and the tokenizer -> data/prepared (see store.py) and stats.json.

Records (files, datasets or the synthetic task) are tokenized, cut or refused when too long,
packed into rows of data.max_seq_length and written atomically together with stats.json: records
read, skipped records by reason, samples, rows, truncated samples, tokens, trainable tokens (labels
that reach the loss), padding, packing efficiency and a histogram of sample lengths.
`data.source: random` writes random ids without a tokenizer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from longft.config.params import Config
from longft.data.errors import BadRecords, DataError
from longft.data.packing import fit_length, iter_rows, plan_rows, trainable_tokens
from longft.data.random_tokens import random_rows
from longft.data.records import RecordReader
from longft.data.store import DatasetWriter
from longft.data.synthetic import synthetic_records
from longft.data.tokenize import IGNORE_INDEX, Sample, chat_token_count, tokenize_record
from longft.model.loading import check_context_length, check_vocab, load_model_config, load_tokenizer


def length_histogram(lengths) -> dict[str, int]:
    """Counts per power-of-two bin, keyed "lo-hi" (lengths in (hi/2, hi]), in increasing order."""
    bins = Counter(1 << (n - 1).bit_length() for n in lengths if n > 0)
    return {("1" if hi == 1 else f"{hi // 2 + 1}-{hi}"): bins[hi] for hi in sorted(bins)}


class _RowTally:
    """Token counts over the rows written."""

    def __init__(self):
        self.tokens = self.trainable = self.padding = 0

    def add(self, ids: np.ndarray, labels: np.ndarray, pad: int) -> None:
        self.padding += pad
        self.tokens += len(ids) - pad
        self.trainable += int(np.count_nonzero(labels[1:] != IGNORE_INDEX))  # labels[0] is shifted out


def _tokenized_samples(cfg: Config, tok, bad: BadRecords, stats: dict) -> list[Sample]:
    dc = cfg.data
    if dc.source == "synthetic":
        records = synthetic_records(dc.num_samples, dc.max_seq_length, cfg.train.seed,
                                    lambda msgs: chat_token_count(msgs, tok), dc.synthetic_lengths)
        reader = None
    else:
        records = reader = RecordReader(dc, bad)
    samples, lengths, truncated, untrainable = [], [], 0, 0
    for rec in tqdm(records, total=dc.num_samples or None, desc="tokenize", unit="rec",
                    disable=None):
        try:
            s = tokenize_record(rec, tok, dc.train_on_prompt)
        except DataError as e:
            if e.reason is None:  # not about this record (e.g. no chat template): stop
                raise
            bad.handle(e)
            continue
        lengths.append(len(s))
        fitted = fit_length(s, dc.max_seq_length, dc.truncate, bad)
        if fitted is None:
            continue
        truncated += fitted is not s
        if trainable_tokens(fitted) == 0:  # e.g. truncation cut off the whole answer
            untrainable += 1
            continue
        samples.append(fitted)
    stats.update(
        format=reader.format if reader else "messages",
        records=reader.records_read if reader else dc.num_samples,
        skipped=dict(sorted(bad.counts.items())),
        truncated_samples=truncated,
        dropped_untrainable_samples=untrainable,
        samples=len(samples),
        sample_length_histogram=length_histogram(lengths))
    if not samples:
        raise DataError(f"no trainable samples: {stats['records']} records read, skipped "
                        f"{stats['skipped'] or 'none'}, {untrainable} without a trained token after "
                        f"truncation; check data.path / data.format, or raise data.max_seq_length")
    return samples


def documents_per_row(counts: list[int]) -> dict:
    """Mean, min, max and a histogram ({documents: rows}) of the documents packed into each row:
    with several a row, attention runs per document (model/packed_attention.py)."""
    if not counts:
        return {"mean": 0.0, "min": 0, "max": 0, "histogram": {}}
    hist: dict[str, int] = {}
    for c in sorted(counts):
        hist[str(c)] = hist.get(str(c), 0) + 1
    return {"mean": round(sum(counts) / len(counts), 3), "min": min(counts), "max": max(counts),
            "histogram": hist}


def prepare(cfg: Config, out_dir: str | Path) -> dict:
    """Prepare cfg.data into out_dir (replacing it only on success); return the stats written."""
    dc, length = cfg.data, cfg.data.max_seq_length
    model_config = load_model_config(cfg.model)
    check_context_length(model_config, length, cfg.model.name)
    tally = _RowTally()
    stats: dict = {"source": dc.source, "max_seq_length": length, "pack": dc.pack}
    if dc.source == "random":
        n = dc.num_samples
        meta = {"vocab_size": model_config.vocab_size,
                "pad_token_id": getattr(model_config, "pad_token_id", None),
                "source": "random", "format": "token_ids"}
        docs_per_row = [1] * n
        stats.update(format="token_ids", records=0, skipped={}, truncated_samples=0,
                     dropped_untrainable_samples=0, samples=n,
                     sample_length_histogram=length_histogram([length] * n))
        rows = random_rows(n, length, model_config.vocab_size, cfg.train.seed)
        pad_counts = [0] * n
    else:
        tok = load_tokenizer(cfg.model)
        check_vocab(tok, model_config)
        samples = _tokenized_samples(cfg, tok, BadRecords(dc.on_bad_record), stats)
        plan = plan_rows([len(s) for s in samples], length, dc.pack)
        meta = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "source": dc.source,
                "format": stats["format"]}
        n = len(plan)
        rows = iter_rows(samples, plan, length, tok.pad_token_id)
        pad_counts = [length - sum(len(samples[i]) for i in row) for row in plan]
        docs_per_row = [len(row) for row in plan]
    with DatasetWriter(out_dir, n, length) as writer:
        for i, (ids, labels, pos) in enumerate(rows):
            writer.write(i, ids, labels, pos)
            tally.add(ids, labels, pad_counts[i])
        stats.update(rows=n, tokens=tally.tokens, trainable_tokens=tally.trainable,
                     padding_tokens=tally.padding,
                     packing_efficiency=round(tally.tokens / (n * length), 4),
                     documents_per_row=documents_per_row(docs_per_row))
        writer.commit(meta, {"stats.json": stats})
    return stats

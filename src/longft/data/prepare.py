"""The prepare stage: data.* and the tokenizer -> data/prepared (see store.py) and stats.json.

Records (files, datasets or the synthetic task) are tokenized, cut or refused when too long,
packed into rows of data.max_seq_length and written atomically together with stats.json: records
read, skipped records by reason, samples, rows, truncated samples, tokens, trainable tokens (labels
that reach the loss), padding, packing efficiency and a histogram of sample lengths.
`data.source: random` writes random ids without a tokenizer.

The held-out split (`data.eval_samples`, split.py) is packed on its own into data/prepared/eval
(the same layout, plus samples.json for the retrieval score), inside the same atomic write;
stats.json describes the training rows, and its "eval" entry the held-out ones.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from longft.config.params import Config
from longft.data.errors import BadRecords, DataError
from longft.data.packing import fit_sample, iter_rows, plan_rows, trainable_tokens
from longft.data.random_tokens import random_rows
from longft.data.records import RecordReader
from longft.data.split import sample_info, scoring_fields, split_samples
from longft.data.store import EVAL_DIR, SAMPLES, DatasetWriter
from longft.data.synthetic import synthetic_records
from longft.data.text_dir import ignored_note
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


def _tokenize(records, tok, dc, bad: BadRecords, *, total: int | None, desc: str = "tokenize",
              score: list | None = None, origin: list | None = None
              ) -> tuple[list[Sample], list[int], int, int, int]:
    """(usable samples, every sample's length before fitting, truncated, untrainable, text
    records split); with `score` a list, the retrieval fields of each usable sample are appended
    to it; with `origin` a list, the index of the record each usable sample came from (a split
    text record gives several)."""
    samples, lengths, truncated, untrainable, split = [], [], 0, 0, 0
    # a text record that will be cut is tokenized only as far as the cut (tokenize.text_ids)
    bound = dc.max_seq_length if dc.truncate and not dc.split_text else None
    for n_rec, rec in enumerate(tqdm(records, total=total, desc=desc, unit="rec", disable=None)):
        try:
            s = tokenize_record(rec, tok, dc.train_on_prompt, max_tokens=bound)
        except DataError as e:
            if e.reason is None:  # not about this record (e.g. no chat template): stop
                raise
            bad.handle(e)
            continue
        lengths.append(len(s))
        pieces = fit_sample(s, rec.format, dc.max_seq_length, dc.truncate, dc.split_text, bad)
        truncated += len(pieces) == 1 and pieces[0] is not s
        split += len(pieces) > 1
        for fitted in pieces:
            if trainable_tokens(fitted) == 0:  # e.g. truncation cut off the whole answer
                untrainable += 1
                continue
            samples.append(fitted)
            if origin is not None:
                origin.append(n_rec)
            if score is not None:
                score.append(scoring_fields(rec, fitted, tok))
    return samples, lengths, truncated, untrainable, split


def _tokenized_samples(cfg: Config, tok, bad: BadRecords, stats: dict
                       ) -> tuple[list[Sample], list[Sample], list]:
    """(training samples, held-out samples, the held-out samples' retrieval fields)."""
    dc = cfg.data
    count = lambda msgs: chat_token_count(msgs, tok)  # noqa: E731
    if dc.source == "synthetic":
        records = synthetic_records(dc.num_samples, dc.max_seq_length, cfg.train.seed, count,
                                    dc.synthetic_lengths)
        reader = None
    else:
        records = reader = RecordReader(dc, bad)
    origin: list[int] = []
    samples, lengths, truncated, untrainable, split = _tokenize(records, tok, dc, bad,
                                                                total=dc.num_samples, origin=origin)
    stats.update(
        format=reader.format if reader else "messages",
        records=reader.records_read if reader else dc.num_samples,
        skipped=dict(sorted(bad.counts.items())),
        truncated_samples=truncated,
        dropped_untrainable_samples=untrainable,
        samples=len(samples),
        sample_length_histogram=length_histogram(lengths))
    _drops(stats, reader, untrainable, split)
    if not samples:
        raise DataError(f"no trainable samples: {stats['records']} records read, skipped "
                        f"{stats['skipped'] or 'none'}, {untrainable} without a trained token after "
                        f"truncation; check data.path / data.format, or raise data.max_seq_length")
    score: list = []
    if dc.source == "synthetic":
        held_records = synthetic_records(dc.eval_samples, dc.max_seq_length, cfg.train.seed, count,
                                         dc.synthetic_lengths, start=dc.num_samples)
        held, *_ = _tokenize(held_records, tok, dc, BadRecords("error"), total=dc.eval_samples,
                             desc="held-out", score=score)
    else:
        # by record: every piece of a split text record on the same side
        samples, held, note = split_samples(samples, dc.eval_samples, cfg.train.seed, origin)
        score = [None] * len(held)
        stats["samples"] = len(samples)
        if note:
            stats["eval_note"] = note
            print(f"prepare: note: {note}", flush=True)
    return samples, held, score


def _write_eval(writer: DatasetWriter, held: list[Sample], score: list, cfg: Config, tok) -> dict:
    """The held-out rows into <out>/eval (inside the training dataset's atomic write); its stats."""
    length = cfg.data.max_seq_length
    plan = plan_rows([len(s) for s in held], length, cfg.data.pack)
    info = sample_info(held, plan, score)
    tally = _RowTally()
    assert writer.tmp is not None
    with DatasetWriter(writer.tmp / EVAL_DIR, len(plan), length) as w:
        for i, (ids, labels, pos) in enumerate(iter_rows(held, plan, length, tok.pad_token_id)):
            w.write(i, ids, labels, pos)
            tally.add(ids, labels, length - sum(len(held[j]) for j in plan[i]))
        meta = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                "source": cfg.data.source, "format": "held-out"}
        w.commit(meta, {SAMPLES: {"samples": info}})
    return {"samples": len(held), "rows": len(plan), "tokens": tally.tokens,
            "trainable_tokens": tally.trainable,
            "scored_samples": sum(1 for e in info if e.get("cite")),
            "sample_length_histogram": length_histogram([len(s) for s in held])}


def _drops(stats: dict, reader: RecordReader | None, untrainable: int, split: int) -> None:
    """stats.json's account of what did not reach the rows: records_total (in the source),
    records_capped (left unread by data.num_samples), split_text_records, and `dropped`: every
    record or sample left out, by reason (num_samples, the skipped reasons, untrainable)."""
    capped = reader.records_capped if reader else 0
    stats.update(records_total=reader.records_total if reader else stats["records"],
                 records_capped=capped, split_text_records=split,
                 dropped={k: v for k, v in [("num_samples", capped), *stats["skipped"].items(),
                                            ("untrainable", untrainable)] if v},
                 cap_note=reader.cap_message() if reader else None)


def drop_notes(stats: dict, dc) -> list[str]:
    """One line per way records or tokens were lost, with the fix (printed and in stats.json)."""
    notes = [stats.pop("cap_note", None),
             ignored_note(dc.path) if dc.source == "text_dir" else None]
    skipped = dict(stats.get("skipped", {}))
    too_long = skipped.pop("too_long", 0)
    if too_long:
        notes.append(f"{too_long} record(s) skipped as longer than data.max_seq_length "
                     f"{dc.max_seq_length} (data.truncate false, data.on_bad_record skip); raise "
                     f"data.max_seq_length or set data.truncate: true")
    if skipped:
        notes.append(f"{sum(skipped.values())} malformed record(s) skipped (data.on_bad_record: "
                     f"skip): " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
                     + "; set data.on_bad_record: error to see each with its file and line")
    if stats.get("dropped_untrainable_samples"):
        notes.append(f"{stats['dropped_untrainable_samples']} sample(s) dropped with no trained "
                     f"token left (after truncation the answer was gone, or nothing but the first "
                     f"token of a piece); raise data.max_seq_length")
    if stats.get("truncated_samples"):
        notes.append(f"{stats['truncated_samples']} sample(s) cut to data.max_seq_length "
                     f"{dc.max_seq_length}: their tails are not trained on (data.truncate: true); "
                     f"raise it, or set data.truncate: false to refuse them")
    if stats.get("split_text_records"):
        notes.append(f"{stats['split_text_records']} text record(s) longer than "
                     f"data.max_seq_length split into documents of {dc.max_seq_length} tokens "
                     f"(data.split_text: true)")
    efficiency = stats.get("packing_efficiency")
    if efficiency is not None and efficiency < PADDING_NOTE_BELOW:
        notes.append(f"{1 - efficiency:.0%} of the rows' tokens are padding, which every layer "
                     f"computes as the tail of each row's last document (attention included): "
                     + ("more documents, or a lower data.max_seq_length, waste less" if dc.pack
                        else "set data.pack: true, or lower data.max_seq_length"))
    return [n for n in notes if n]


PADDING_NOTE_BELOW = 0.5
"""A packing efficiency below this is said (drop_notes): the step time is paid for the padding."""


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


def attention_length(doc_lengths: list[int]) -> float | None:
    """sum(L_i^2) / sum(L_i) over the documents: the span a token's causal attention covers on
    average, as the FLOPs count it (packed rows attend per document; the same number a run's
    train.json reports). `longft placement --data` predicts speed at it."""
    tokens = sum(doc_lengths)
    return round(sum(n * n for n in doc_lengths) / tokens, 1) if tokens else None


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
        doc_lengths = [length] * n
        held = []  # random ids have nothing to learn: no held-out split
    else:
        tok = load_tokenizer(cfg.model)
        check_vocab(tok, model_config)
        samples, held, score = _tokenized_samples(cfg, tok, BadRecords(dc.on_bad_record), stats)
        plan = plan_rows([len(s) for s in samples], length, dc.pack)
        meta = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "source": dc.source,
                "format": stats["format"]}
        n = len(plan)
        rows = iter_rows(samples, plan, length, tok.pad_token_id)
        pad_counts = [length - sum(len(samples[i]) for i in row) for row in plan]
        docs_per_row = [len(row) for row in plan]
        doc_lengths = [len(samples[i]) for row in plan for i in row]
    with DatasetWriter(out_dir, n, length) as writer:
        for i, (ids, labels, pos) in enumerate(rows):
            writer.write(i, ids, labels, pos)
            tally.add(ids, labels, pad_counts[i])
        stats.update(rows=n, tokens=tally.tokens, trainable_tokens=tally.trainable,
                     padding_tokens=tally.padding,
                     packing_efficiency=round(tally.tokens / (n * length), 4),
                     documents_per_row=documents_per_row(docs_per_row),
                     attention_length=attention_length(doc_lengths))
        stats["eval"] = _write_eval(writer, held, score, cfg, tok) if held else \
            {"samples": 0, "rows": 0, "tokens": 0, "trainable_tokens": 0, "scored_samples": 0,
             "sample_length_histogram": {}}
        stats["eval"]["note"] = stats.pop("eval_note", None)
        stats["notes"] = drop_notes(stats, dc)
        for note in stats["notes"]:
            print(f"prepare: note: {note}", flush=True)
        writer.commit(meta, {"stats.json": stats})
    return stats

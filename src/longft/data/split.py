"""The held-out split (`data.eval_samples`) and what scoring it needs.

Which samples are held out:
- synthetic: samples num_samples .. num_samples + eval_samples - 1 of the same generator
  (synthetic.py), so the training samples are exactly those `num_samples` alone gives;
- files and datasets: `eval_samples` of the usable samples (after skipping, truncation and
  dropping samples with no trained token), picked by a generator seeded with train.seed
  (`pick_eval`); the rest train. Same file and seed, same split. At most a tenth of a file's
  samples is held out (`MAX_EVAL_SHARE`; none from fewer than ten), so the default count never
  takes a small file's training data; prepare says so when it holds out fewer than asked.

Held-out samples are packed only among themselves (data/prepared/eval, store.py), so no row mixes
training and held-out documents, and the trainer never reads them as training rows.

Per held-out sample, samples.json records where it lies (row, offset, length) and, for the
synthetic task, what the retrieval score needs: the cited document's id, the number of documents,
its relative position (0 = first, 1 = last), and the token spans, in row coordinates, of the
cited number N in the answer's "[doc N]" and of the asked value. Spans come from the rendered chat
template's character offsets (fast tokenizers); a sample whose span cannot be mapped (a slow
tokenizer, a template that changes the text, truncation that cut the answer) is kept for the eval
loss with "cite": null and left out of the retrieval score.
"""

from __future__ import annotations

import random
from typing import Sequence

from longft.data.errors import DataError
from longft.data.synthetic import SyntheticRecord
from longft.data.tokenize import IGNORE_INDEX, Sample


def pick_eval(n: int, k: int, seed: int) -> list[int]:
    """The sorted indices of the k held-out samples among n, drawn from (seed) alone."""
    if k <= 0:
        return []
    if k >= n:
        raise DataError(f"data.eval_samples {k} leaves no training sample: only {n} usable "
                        f"samples were read; lower data.eval_samples (0 = no held-out split) or "
                        f"give more records (data.num_samples, data.path)")
    return sorted(random.Random(f"longft-eval-split:{seed}").sample(range(n), k))


MAX_EVAL_SHARE = 0.1
"""The largest share of a file's usable samples held out for evaluation."""


def split_samples(samples: Sequence[Sample], k: int, seed: int,
                  origin: Sequence[int] | None = None
                  ) -> tuple[list[Sample], list[Sample], str | None]:
    """(train, held-out samples, a note when fewer than k are held out): min(k, a tenth of the
    records) held out by `pick_eval`, both lists in their original order. `origin`: the record
    each sample came from (None: one record each); all pieces of a record (a text record split
    over rows) go to the same side, so no held-out text continues a trained one."""
    origin = list(range(len(samples))) if origin is None else list(origin)
    records = sorted(set(origin))
    n = len(records)
    k_eff = min(k, int(n * MAX_EVAL_SHARE))
    note = None
    if k_eff < k:
        note = (f"held out {k_eff} of {n} records for evaluation, not data.eval_samples {k}: at "
                f"most a tenth of a file's records is held out, so training keeps 90 %"
                + ("" if k_eff else " (no eval loss for this run)")
                + "; give more records or lower data.eval_samples")
    held = {records[i] for i in pick_eval(n, k_eff, seed)}
    return ([s for s, r in zip(samples, origin) if r not in held],
            [s for s, r in zip(samples, origin) if r in held], note)


def _token_span(enc, start_char: int, end_char: int) -> tuple[int, int] | None:
    first, last = enc.char_to_token(start_char), enc.char_to_token(end_char - 1)
    return None if first is None or last is None else (first, last + 1)


def answer_token_spans(rec: SyntheticRecord, sample: Sample, tokenizer
                       ) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Token spans (within the sample) of the cited number and of the value in the answer, or None
    when they cannot be located exactly or are not all trained tokens."""
    answer = rec.messages[-1]["content"]
    try:
        text = tokenizer.apply_chat_template(list(rec.messages), tokenize=False)
        enc = tokenizer(text, add_special_tokens=False)
        at = text.rfind(answer)
        if at < 0 or enc["input_ids"][:len(sample)] != sample.input_ids.tolist():
            return None
        cite = _token_span(enc, at + rec.cite_chars[0], at + rec.cite_chars[1])
        value = _token_span(enc, at + rec.value_chars[0], at + rec.value_chars[1])
    except (ValueError, NotImplementedError):  # a slow tokenizer has no character offsets
        return None
    if cite is None or value is None or max(cite[1], value[1]) > len(sample):
        return None
    labels = sample.labels
    # the first token of a packed document never has a label (packing.build_row)
    if cite[0] < 1 or value[0] < 1 or (labels[cite[0]:cite[1]] == IGNORE_INDEX).any() \
            or (labels[value[0]:value[1]] == IGNORE_INDEX).any():
        return None
    return cite, value


def sample_info(samples: Sequence[Sample], plan: list[list[int]],
                scoring: Sequence[dict | None]) -> list[dict]:
    """samples.json: one entry per held-out sample, in sample order, with its row, offset and
    length, and (when `scoring[i]` has them) the retrieval fields with spans moved to row
    coordinates."""
    out: list[dict] = [{} for _ in samples]
    for r, row in enumerate(plan):
        off = 0
        for i in row:
            entry = {"sample": i, "where": samples[i].where, "row": r, "offset": off,
                     "length": len(samples[i])}
            extra = scoring[i] if i < len(scoring) else None
            if extra:
                entry.update(num_docs=extra["num_docs"], cited_doc=extra["cited_doc"],
                             position=round(extra["position"], 4))
                spans = extra.get("spans")
                entry["cite"] = [off + spans[0][0], off + spans[0][1]] if spans else None
                entry["value"] = [off + spans[1][0], off + spans[1][1]] if spans else None
            out[i] = entry
            off += len(samples[i])
    return out


def scoring_fields(rec, sample: Sample, tokenizer) -> dict | None:
    """What the retrieval score needs of one synthetic sample (None for other records)."""
    if not isinstance(rec, SyntheticRecord):
        return None
    return {"num_docs": rec.num_docs, "cited_doc": rec.cited_doc,
            "position": rec.relative_position,
            "spans": answer_token_spans(rec, sample, tokenizer)}

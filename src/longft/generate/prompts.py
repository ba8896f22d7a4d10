"""Prompts for `longft generate`: a user's text through the chat template, or the held-out records
of data/prepared/eval (never trained on), cut where the trained answer starts, with that answer as
the reference to compare against.

A held-out record trained whole has no such cut: a `text` record (its first token is the only one
without a label) or one prepared with data.train_on_prompt. It is continued instead: the prompt is
its first part and the reference the rest (`continuation_cut`): the first half, or more when the
record is long, so that the reference is at most --max-new-tokens (what the model writes is
compared with a reference of the same length, and a long record's context is used).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longft.data.store import held_out
from longft.data.tokenize import chat_template
from longft.errors import UserError

IGNORE = -100


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: list[int]
    reference: list[int] | None = None
    """The held-out record's trained tokens (its answer); None for a user's prompt."""
    continued: int | None = None
    """A held-out record trained whole (text): its length; the prompt is its first part and the
    reference the rest. None: a prompt cut before the trained answer, or a user's prompt."""


def chat_prompt(tokenizer, text: str, name: str = "prompt") -> Prompt:
    """A user turn rendered by the chat template, ending with the assistant's generation prompt
    (the format the finetune trained on); plain text when the tokenizer has no chat template."""
    try:
        chat_template(tokenizer)
    except UserError:
        return Prompt(name, list(tokenizer(text, add_special_tokens=True)["input_ids"]))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    return Prompt(name, list(ids))


def continuation_cut(length: int, max_new_tokens: int) -> int:
    """Where a held-out record of `length` tokens trained whole is cut: after its first half, or
    later so that the rest (the reference) is at most max_new_tokens tokens; at least 1."""
    return max((length + 1) // 2, length - max_new_tokens, 1)


def held_out_prompts(prepared: Path, n: int, max_new_tokens: int = 128) -> list[Prompt]:
    """The first n held-out samples of a prepared dataset, each cut before its first trained
    token (the prompt) with the trained tokens as reference; a sample trained whole (text) is cut
    at `continuation_cut` instead. UserError without a held-out split."""
    got = held_out(prepared)
    if got is None:
        raise UserError(f"{prepared}/eval: no held-out split (data.eval_samples 0 or data.source "
                        "random); give prompts with --prompt instead")
    data, samples = got
    out = []
    for i, s in enumerate(samples[:n]):
        row = data.arrays["input_ids"][s["row"]]
        labels = data.arrays["labels"][s["row"]]
        lo, hi = int(s["offset"]), int(s["offset"]) + int(s["length"])
        ids, lab = np.asarray(row[lo:hi], dtype=np.int64), np.asarray(labels[lo:hi], dtype=np.int64)
        trained = np.flatnonzero(lab != IGNORE)
        if not len(trained):
            continue  # nothing to answer
        whole = trained[0] <= 1  # no prompt part: the first token of a document has no label
        if whole and len(ids) < 2:
            continue  # nothing to continue
        cut = continuation_cut(len(ids), max_new_tokens) if whole else int(trained[0])
        out.append(Prompt(f"held-out {i}", ids[:cut].tolist(), ids[cut:][lab[cut:] != IGNORE].tolist(),
                          continued=len(ids) if whole else None))
    return out

"""Prompts for `longft generate`: a user's text through the chat template, or the held-out records
of data/prepared/eval (never trained on), cut where the trained answer starts, with that answer as
the reference to compare against.
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


def held_out_prompts(prepared: Path, n: int) -> list[Prompt]:
    """The first n held-out samples of a prepared dataset, each cut before its first trained
    token (the prompt) with the trained tokens as reference; UserError without a held-out split."""
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
        if not len(trained) or trained[0] == 0:
            continue  # nothing to answer (text records are trained from the first token)
        out.append(Prompt(f"held-out {i}", ids[: trained[0]].tolist(),
                          ids[trained[0]:][lab[trained[0]:] != IGNORE].tolist()))
    return out

"""Record -> (input_ids, labels), with labels = -100 on every token that is not trained on.

- messages: the tokenizer's chat template. The assistant tokens come from the template's
  `{% generation %}` markers (`assistant_masks`); a template without markers falls back to
  rendering the conversation prefix before and after each assistant turn and masking the difference.
- prompt_completion: bos + prompt (masked) + completion + eos (trained).
- text: bos + text + eos, all trained.
`train_on_prompt` trains on every token. Labels are aligned with input_ids; the model shifts them.

A `text` record far longer than a row (one 50 MB book: 87 s and 9.9 GiB RSS to tokenize whole, only
to be cut to max_seq_length) is tokenized a prefix at a time (`text_ids`): CHARS_PER_TOKEN
characters per token needed, doubled until the prefix gives enough tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from longft.data.errors import DataError
from longft.data.records import Record

IGNORE_INDEX = -100
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Sample:
    """One tokenized record (any length). `where` names the record it came from."""

    input_ids: np.ndarray
    labels: np.ndarray
    where: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


def chat_template(tokenizer) -> str:
    """The tokenizer's chat template, or a DataError that says how to get one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates; "default" is the one used for chat
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"the tokenizer {name!r} has no chat template, so chat `messages` records cannot be "
            f"tokenized; set model.tokenizer to a tokenizer with a chat template (for example "
            f"configs/tokenizers/byte or the instruct model's own), or use prompt_completion or "
            f"text records (data.format)")
    return template


def _render(tokenizer, messages, **kw):
    import jinja2

    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True, **kw)
    except jinja2.TemplateError as e:  # e.g. "roles must alternate user/assistant"
        raise DataError(f"chat template rejected the conversation: {e}", "template_error") from None


def chat_token_count(messages, tokenizer) -> int:
    """Length in tokens of a conversation rendered by the chat template."""
    chat_template(tokenizer)
    return len(_render(tokenizer, messages)["input_ids"])


def tokenize_messages(messages, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, assistant mask) of a conversation, both int arrays of the same length."""
    if _GENERATION.search(chat_template(tokenizer)):
        out = _render(tokenizer, messages, return_assistant_tokens_mask=True)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if mask.any():
            return np.asarray(out["input_ids"]), mask
    # No generation markers (or they marked nothing): an assistant turn spans from the end of the
    # prefix rendered with the generation prompt to the end of the prefix that includes the turn.
    ids = np.asarray(_render(tokenizer, messages)["input_ids"])
    mask = np.zeros(len(ids), dtype=bool)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True)["input_ids"]) \
            if i else 0
        end = len(_render(tokenizer, messages[: i + 1])["input_ids"])
        mask[start:end] = True
    return ids, mask


def _plain(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


CHARS_PER_TOKEN = 16
"""First guess of characters a token covers when only a text's first tokens are needed: above
every real tokenizer's average (~4 for English BPE, 1 for the byte tokenizer), so one prefix is
almost always enough."""
_MARGIN = 16
"""Tokens beyond the ones needed that a prefix must give: the last few tokens of a prefix can
differ from the whole text's (a word cut in two), so they are never used."""


def text_ids(tokenizer, text: str, max_tokens: int | None,
             chars_per_token: int = CHARS_PER_TOKEN) -> tuple[list[int], bool]:
    """(token ids, complete) of `text` without special tokens. max_tokens None: all of it,
    complete. Otherwise the work is bounded by the tokens needed, not by the text: a prefix of
    max_tokens x chars_per_token characters (cut at a whitespace) is tokenized, and a twice as
    long one only while it gives too few tokens. complete False: the ids are the text's first
    max_tokens tokens (the same ones the whole text gives: the prefix's last tokens, which a cut
    word can change, are dropped) and the text has more."""
    if max_tokens is None:
        return _plain(tokenizer, text), True
    n = max(1, max_tokens + _MARGIN) * chars_per_token
    while n < len(text):
        cut = text.rfind(" ", n // 2, n)  # end on a whole word where there is one
        ids = _plain(tokenizer, text[:cut if cut > 0 else n])
        if len(ids) > max_tokens + _MARGIN:
            return ids[:max_tokens], False
        n *= 2
    ids = _plain(tokenizer, text)
    return (ids, True) if len(ids) <= max_tokens else (ids[:max_tokens], False)


def tokenize_record(record: Record, tokenizer, train_on_prompt: bool = False,
                    max_tokens: int | None = None) -> Sample:
    """Tokenize one record into a Sample; labels are IGNORE_INDEX where not trained on.
    max_tokens (for samples that will be cut to that length, data.truncate): a `text` record is
    tokenized only as far as needed (`text_ids`); one that is longer comes back with
    max_tokens + 1 tokens (no eos), so the caller's length check still sees it as too long."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if record.format == "messages":
        try:
            ids, trained = tokenize_messages(record.messages, tokenizer)
        except DataError as e:
            raise DataError(f"{record.where}: {e}" if e.reason else str(e), e.reason) from None
    elif record.format == "prompt_completion":
        prompt = bos + _plain(tokenizer, record.prompt)
        completion = _plain(tokenizer, record.completion) + eos
        ids = np.asarray(prompt + completion)
        trained = np.arange(len(ids)) >= len(prompt)
    elif record.format == "text":
        body, complete = text_ids(tokenizer, record.text,
                                  None if max_tokens is None else max_tokens + 1 - len(bos))
        ids = np.asarray(bos + body + (eos if complete else []))
        trained = np.ones(len(ids), dtype=bool)
    else:
        raise ValueError(f"unknown record format {record.format!r}")
    ids = ids.astype(np.int32)
    labels = ids.copy() if train_on_prompt else np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
    return Sample(ids, labels, record.where)

"""Record -> (input_ids, labels), with labels = -100 on every token that is not trained on.

- messages: the tokenizer's chat template. The assistant tokens come from the template's
  `{% generation %}` markers (`assistant_masks`); a template without markers falls back to
  rendering the conversation prefix before and after each assistant turn and masking the difference.
- prompt_completion: bos + prompt (masked) + completion + eos (trained).
- text: bos + text + eos, all trained.
`train_on_prompt` trains on every token. Labels are aligned with input_ids; the model shifts them.
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


def tokenize_record(record: Record, tokenizer, train_on_prompt: bool = False) -> Sample:
    """Tokenize one record into a Sample; labels are IGNORE_INDEX where not trained on."""
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
        ids = np.asarray(bos + _plain(tokenizer, record.text) + eos)
        trained = np.ones(len(ids), dtype=bool)
    else:
        raise ValueError(f"unknown record format {record.format!r}")
    ids = ids.astype(np.int32)
    labels = ids.copy() if train_on_prompt else np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
    return Sample(ids, labels, record.where)

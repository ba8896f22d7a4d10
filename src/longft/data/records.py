"""Read training records from a jsonl file, a parquet file, a `datasets` dataset or a directory of
text files (text_dir.py: each file one text record).

Three record layouts are understood (extra keys are ignored):
- messages: {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
  (chat, as in THUDM/LongCite-45k, whose records also carry keys such as "idx" and "dataset");
- prompt_completion: {"prompt": "...", "completion": "..."};
- text: {"text": "..."}.
`data.format: auto` picks the layout from the keys of the first record, and a file holds one layout:
a later record of another layout stops the stage (skipping it would drop every record of that
layout). Every record keeps where it came from (`file:line` for jsonl, `path row N` for parquet and
datasets, the file for text_dir) so that a malformed one is reported precisely;
`data.on_bad_record` decides whether it stops the run or is skipped and counted.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from longft.config.params import DataConfig
from longft.config.sections import PATH_SOURCES
from longft.data.errors import BadRecords, DataError
from longft.data.text_dir import TextFile, text_files

FORMATS = ("messages", "prompt_completion", "text")
ROLES = ("system", "user", "assistant", "tool")
"""The chat roles a record may use (the OpenAI / Hugging Face chat-template set)."""


@dataclass(frozen=True)
class Record:
    """One validated record. Only the fields of its `format` are set."""

    where: str
    """Origin for error messages: `file.jsonl:12`, `path row 11`, or the file (text_dir)."""
    format: str
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    completion: str = ""
    text: str = ""


def detect_format(obj: Any) -> str | None:
    """The layout implied by a record's keys, or None when none matches."""
    if not isinstance(obj, dict):
        return None
    present = {k for k, v in obj.items() if v is not None}  # parquet/datasets fill absent with None
    if "messages" in present:
        return "messages"
    if {"prompt", "completion"} <= present:
        return "prompt_completion"
    if "text" in present:
        return "text"
    return None


def _bad(where: str, what: str, reason: str) -> DataError:
    return DataError(f"{where}: {what}", reason)


def parse_record(obj: Any, fmt: str, where: str) -> Record:
    """Validate a raw record against layout `fmt`; raise DataError (with a reason) if malformed."""
    if not isinstance(obj, dict):
        raise _bad(where, f"expected a JSON object, got {type(obj).__name__}", "wrong_type")
    if fmt == "messages":
        return Record(where, fmt, messages=_parse_messages(obj, where))
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in obj:
                raise _bad(where, f"missing key {key!r} (keys: {sorted(obj)})", "missing_key")
            if not isinstance(obj[key], str):
                raise _bad(where, f"{key!r} must be a string, got {type(obj[key]).__name__}",
                           "wrong_type")
        if not obj["completion"].strip():  # only the end-of-text token would be trained on
            raise _bad(where, "'completion' is empty; nothing to train on", "empty_answer")
        return Record(where, fmt, prompt=obj["prompt"], completion=obj["completion"])
    if fmt == "text":
        if "text" not in obj:
            raise _bad(where, f"missing key 'text' (keys: {sorted(obj)})", "missing_key")
        if not isinstance(obj["text"], str):
            raise _bad(where, f"'text' must be a string, got {type(obj['text']).__name__}",
                       "wrong_type")
        if not obj["text"]:
            raise _bad(where, "'text' is empty", "empty_text")
        return Record(where, fmt, text=obj["text"])
    raise ValueError(f"unknown record format {fmt!r}")


def _parse_messages(obj: dict, where: str) -> tuple[dict, ...]:
    if "messages" not in obj:
        raise _bad(where, f"missing key 'messages' (keys: {sorted(obj)})", "missing_key")
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        raise _bad(where, f"'messages' must be a list, got {type(msgs).__name__}", "wrong_type")
    if not msgs:
        raise _bad(where, "'messages' is empty", "empty_messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _bad(where, f"messages[{i}] must be an object with 'role' and 'content'",
                       "missing_key")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise _bad(where, f"messages[{i}]: 'role' and 'content' must be strings", "wrong_type")
        if m["role"] not in ROLES:  # a chat template renders an unknown role as nothing trained
            close = difflib.get_close_matches(m["role"], ROLES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _bad(where, f"messages[{i}]: unknown role {m['role']!r}; {hint}known roles: "
                       f"{', '.join(ROLES)}; fix the record's role", "unknown_role")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        roles = sorted({m["role"] for m in out})
        raise _bad(where, f"no message with role 'assistant' (roles: {roles}); nothing to train on",
                   "no_assistant")
    if not any(m["content"].strip() for m in out if m["role"] == "assistant"):
        # the chat template's end-of-turn tokens would be all it trains on
        raise _bad(where, "every assistant answer is empty; nothing to train on", "empty_answer")
    return tuple(out)


# --------------------------------------------------------------------------- raw sources


class _Line(bytes):
    """A jsonl line, parsed only when used: the lines past data.num_samples are only counted."""

    def decode_record(self, where: str) -> Any:
        try:
            return json.loads(self)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            return _bad(where, f"not valid JSON ({e})", "bad_json")


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, line) per non-blank line; the reader parses it (a line that is not JSON becomes a
    DataError)."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield f"{path}:{lineno}", _Line(line)


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"data.path: {path} is not a readable parquet file ({e})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=256):
        for obj in batch.to_pylist():
            yield f"{path} row {row}", obj
            row += 1


def _hf(name: str, split: str) -> Iterator[tuple[str, Any]]:
    for i, obj in enumerate(_hf_dataset(name, split)):
        yield f"{name} row {i}", obj


def _hf_dataset(name: str, split: str):
    """The datasets.Dataset of `name` (a save_to_disk directory, a local dataset or a hub name)."""
    import datasets

    p = Path(name)
    saved = p.is_dir() and any((p / f).is_file() for f in ("dataset_dict.json", "state.json"))
    if p.is_dir() and not saved:
        _refuse_text_lines(p)
    if saved:
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.split: {name} has no split {split!r} "
                                f"(splits: {', '.join(ds)}); set data.split to one of them")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name, split=split)
        except Exception as e:  # datasets raises many unrelated types (network, format, split)
            raise DataError(
                f"data.path: cannot load dataset {name!r} split {split!r} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); give a directory written by "
                f"Dataset.save_to_disk, a local dataset directory, or a name reachable from this "
                f"machine") from None
    return ds


def _refuse_text_lines(p: Path) -> None:
    """A plain directory that `datasets` would read with its `text` builder, one record per LINE of
    its files (a folder of documents becoming thousands of one-line records): refused with the
    fix. A directory of jsonl/parquet/csv files (a cloned hub dataset) loads as before."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(str(p)).name
    except Exception:  # not a dataset directory at all: load_dataset says why, below
        return
    if builder == "text":
        raise DataError(
            f"data.path: {p} is a plain directory of text files, which data.source hf would read "
            f"one line per record; for one document per .txt/.md file set data.source: text_dir "
            f"(-S data.source=text_dir), for records put them in a jsonl with data.source: jsonl, "
            f"or give a directory written by Dataset.save_to_disk")


def _known_total(dc: DataConfig) -> int | None:
    """How many records the source holds, from its metadata (parquet footer, dataset length)
    without reading them; None where the reader counts them unparsed (jsonl lines, text_dir
    files)."""
    if dc.source == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(dc.path).metadata.num_rows
    if dc.source == "hf":
        return len(_hf_dataset(dc.path, dc.split))
    return None


def _raw(dc: DataConfig) -> Iterator[tuple[str, Any]]:
    if dc.source == "hf":
        return _hf(dc.path, dc.split)
    if dc.source == "text_dir":
        return text_files(dc.path)
    path = Path(dc.path)
    if not path.is_file():
        raise DataError(f"data.path: {path} not found (data.source: {dc.source}); set data.path to "
                        f"an existing .{dc.source} file, relative to where the stage runs")
    return _jsonl(path) if dc.source == "jsonl" else _parquet(path)


class RecordReader:
    """Iterates the validated records of `dc` (jsonl, parquet, hf or text_dir), applying `bad`.

    After iteration: `records_read` counts every record met (skipped ones included), `format` is
    the layout used, and `records_capped` the records left unread because `dc.num_samples` valid
    records had been yielded (null = all are read). `cap_message()` says so in words.
    """

    def __init__(self, dc: DataConfig, bad: BadRecords):
        if dc.source not in PATH_SOURCES:
            raise ValueError(f"RecordReader reads files and datasets, not source {dc.source!r}")
        self.dc = dc
        self.bad = bad
        self.format: str | None = "text" if dc.source == "text_dir" else \
            None if dc.format == "auto" else dc.format
        self._format_from: str | None = None
        """Where data.format auto took the layout from (the first record)."""
        self.records_read = 0
        self.records_capped = 0

    @property
    def records_total(self) -> int:
        return self.records_read + self.records_capped

    def cap_message(self) -> str | None:
        """What data.num_samples left out, and the fix; None when it left nothing out."""
        if not self.records_capped:
            return None
        return (f"data.num_samples is {self.dc.num_samples}: read the first {self.records_read} of "
                f"the {self.records_total} records of {self.dc.path} and dropped the other "
                f"{self.records_capped}; set data.num_samples: null to use every record")

    def __iter__(self) -> Iterator[Record]:
        yielded, cap = 0, self.dc.num_samples
        raw = iter(_raw(self.dc))
        for where, obj in raw:
            if cap is not None and yielded >= cap:
                total = _known_total(self.dc)   # parquet / hf: from metadata, nothing read
                self.records_capped = (total - self.records_read if total is not None
                                       else 1 + sum(1 for _ in raw))  # counted, not read
                break
            self.records_read += 1
            try:
                if isinstance(obj, (_Line, TextFile)):
                    obj = obj.decode_record(where)
                if isinstance(obj, DataError):
                    raise obj
                if self.format is None:
                    self.format, self._format_from = detect_format(obj), where
                    if self.format is None:
                        raise self._undetectable(where, obj)
                record = parse_record(obj, self.format, where)
            except DataError as e:
                self._refuse_mixed(obj, where)
                self.bad.handle(e)
                continue
            yielded += 1
            yield record
        if self.records_read == 0:
            raise DataError(f"data.path: {self.dc.path} has no records; check the file (or "
                            f"data.split for source hf)")

    def _refuse_mixed(self, obj: Any, where: str) -> None:
        """A record of another layout than the one data.format auto took from the first: a file
        of two layouts, not a bad record (skipping would drop every record of that layout)."""
        other = detect_format(obj) if self._format_from else None
        if other and other != self.format:
            raise DataError(
                f"{where}: a {other!r} record, but data.format auto took the layout {self.format!r} "
                f"from the first record ({self._format_from}), and one file holds one layout; "
                f"split the file into one file per layout, or set data.format to the layout to "
                f"train on")

    @staticmethod
    def _undetectable(where: str, obj: Any) -> DataError:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        hint = (" (ShareGPT layout: convert 'conversations' [{from, value}] to 'messages' "
                "[{role, content}])" if isinstance(obj, dict) and "conversations" in obj else "")
        return _bad(where, f"cannot tell the record layout from keys {keys}: expected 'messages', "
                    f"'prompt'+'completion' or 'text'{hint}; or set data.format", "unknown_format")

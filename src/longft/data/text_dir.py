"""`data.source: text_dir`: a directory of plain-text documents, one `text` record per file.

Every file under data.path whose name ends in .txt or .md (any case), in its sub-directories too,
is one record, in the order of their paths relative to data.path (sorted, so the same directory
gives the same records, and the same held-out split, on every machine). Names starting with a dot
(.git, .DS_Store, editor swap files) are left out, files and directories alike; other files are
counted and named in a note, not read. A file is read when its record is used, decoded as UTF-8
(a leading byte-order mark is dropped); the text path then applies unchanged: a long file is split
into documents of data.max_seq_length (data.split_text), packed, split for held-out, counted in
stats.json.

A file that is not UTF-8 or is empty is a bad record (data.on_bad_record): the error names the
file, what is wrong and the fix. A data.path that does not exist, is not a directory or holds no
.txt/.md file stops the stage.
"""

from __future__ import annotations

import codecs
import os
import shlex
from pathlib import Path
from typing import Iterator

from longft.data.errors import DataError

SUFFIXES = (".txt", ".md")
"""The file names read as documents (compared lower-case)."""

_BOMS = {b"\xff\xfe": ("UTF-16", "utf-16"), b"\xfe\xff": ("UTF-16", "utf-16")}
"""Byte-order marks of encodings that are not UTF-8: (the name said, iconv's name)."""
_LATIN1 = ("Latin-1 / Windows-1252", "latin1")


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _walk(root: Path):
    """Every file under root, symlinked folders followed (each real folder once: no loops)."""
    seen = set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        # in name order, hidden ones left out: which path reaches a folder linked twice does not
        # depend on the order the filesystem lists them
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        yield from (Path(folder, f) for f in files)


def list_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(the documents, the other files) under `root`, each sorted by its path relative to root."""
    docs, other = [], []
    for p in sorted(_walk(root), key=lambda p: p.relative_to(root).as_posix()):
        if not p.is_file() or _hidden(p.relative_to(root)):
            continue
        (docs if p.suffix.lower() in SUFFIXES else other).append(p)
    return docs, other


def documents(path: str) -> list[Path]:
    """The document files of data.path, or a DataError naming what is wrong and the fix."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path: {root} not found (data.source: text_dir); set data.path to a "
                        f"directory of .txt/.md files, relative to where the stage runs")
    if not root.is_dir():
        fix = ("put it in a directory of its own and set data.path to that directory"
               if root.suffix.lower() in SUFFIXES else
               "for a file of records set data.source: jsonl or parquet")
        raise DataError(f"data.path: {root} is a file, but data.source text_dir reads a directory "
                        f"of .txt/.md files (one document each); {fix}")
    docs, other = list_files(root)
    if not docs:
        seen = (f"{len(other)} other file(s), e.g. {other[0].relative_to(root)}" if other
                else "no files")
        raise DataError(f"data.path: {root} has no .txt or .md file (sub-directories searched; "
                        f"{seen}); data.source text_dir reads each .txt/.md file as one document: "
                        f"convert the documents to UTF-8 .txt files, or give records in a jsonl "
                        f"with data.source: jsonl")
    return docs


def ignored_note(path: str) -> str | None:
    """The note naming the files of data.path that text_dir does not read; None when none."""
    root = Path(path)
    _, other = list_files(root)
    if not other:
        return None
    return (f"data.source text_dir read only the .txt/.md files of {root}: {len(other)} other "
            f"file(s) left out (e.g. {other[0].relative_to(root)}); rename or convert the ones that "
            f"are documents to .txt")


class TextFile:
    """A document file, read when its record is used (the files past data.num_samples are not)."""

    def __init__(self, path: Path):
        self.path = path

    def decode_record(self, where: str) -> dict | DataError:
        """{"text": the file's text}, or a DataError (with a reason) for a file not UTF-8 (or with
        NUL bytes) or empty."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise DataError(f"{where}: cannot read the file ({e.strerror}); fix its permissions or "
                            f"remove it") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            problem, (name, encoding) = _decode_problem(data, e)
            f, tmp = shlex.quote(str(self.path)), shlex.quote(f"{self.path}.utf8")
            return DataError(f"{where}: not UTF-8 text: {problem}; convert the file to UTF-8, e.g. "
                             f"from {name}: `iconv -f {encoding} -t utf-8 -o {tmp} {f} && "
                             f"mv {tmp} {f}`", "not_utf8")
        if "\x00" in text:  # valid UTF-8, but UTF-16 without a byte-order mark, or not text
            return DataError(f"{where}: not text: a NUL byte at offset {data.index(0)} (UTF-16 "
                             f"without a byte-order mark, or a binary file named .txt/.md); "
                             f"convert it to UTF-8 (`iconv -f utf-16 -t utf-8 ...`), or remove it",
                             "not_text")
        if not text.strip():
            return DataError(f"{where}: the file is empty ({len(data)} bytes"
                             f"{', only whitespace' if data else ''}); remove it or give it text",
                             "empty_text")
        return {"text": text}


def _decode_problem(data: bytes, e: UnicodeDecodeError) -> tuple[str, tuple[str, str]]:
    """(which byte, where, and what is wrong with it, in words; the likely encoding: its name and
    iconv's)."""
    if data[:2] in _BOMS:
        return f"it starts with a {_BOMS[data[:2]][0]} byte-order mark", _BOMS[data[:2]]
    start = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)  # utf-8-sig
    line = data.count(b"\n", 0, start) + 1                     # counts after the mark it dropped
    return f"byte 0x{data[start]:02x} at offset {start} (line {line}): {e.reason}", _LATIN1


def text_files(path: str) -> Iterator[tuple[str, TextFile]]:
    """(where, the lazily read file) per document of data.path; `where` is the file's path."""
    for p in documents(path):
        yield str(p), TextFile(p)

"""The prepared dataset on disk, written atomically, and the reader the trainer uses.

A directory (default data/prepared) with:
  input_ids.npy, labels.npy, position_ids.npy   int32 [num_rows, max_seq_length]
  meta.json   {num_rows, max_seq_length, vocab_size, pad_token_id, source, format,
               content_sha256 (of the three arrays: what the checkpoints are keyed on)}
  (plus any extra json files, e.g. stats.json)
  eval/       the held-out split (data.eval_samples, split.py) in the same layout, plus
              samples.json (per held-out sample: row, offset, length and the retrieval fields);
              absent when there is none. `held_out` reads it.
vocab_size is an upper bound of the ids (len(tokenizer), or the model's vocab_size for random ids);
labels are -100 where no loss is taken. The writer fills a temporary directory next to the target
and renames it into place only when complete, so a failed run never leaves half a dataset and an
existing good one survives it. The temporary directory is `.<name>.tmp-<pid>-<random>`: one that a
killed prepare (kill -9, OOM killer) left behind is removed by the next one, which says so on
stderr (atomic.remove_stale).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from longft.atomic import remove_stale, tmp_prefix, write_json
from longft.content import DATA_KEY, arrays_digest
from longft.data.errors import DataError

ARRAYS = ("input_ids", "labels", "position_ids")
META = "meta.json"
EVAL_DIR = "eval"
SAMPLES = "samples.json"
_FIX = "run `dvc repro prepare` (or `python stages/prepare.py --out {path}`)"


class DatasetWriter:
    """Context manager: `write(i, ids, labels, pos)` each row, then `commit(meta)` swaps it in.

    Leaving the block without commit (an exception included) deletes the temporary directory and
    leaves `out_dir` as it was.
    """

    def __init__(self, out_dir: str | Path, num_rows: int, max_len: int):
        self.out_dir = Path(out_dir)
        self.num_rows, self.max_len = num_rows, max_len
        self.tmp: Path | None = None
        self.arrays: dict[str, np.ndarray] = {}

    def __enter__(self) -> "DatasetWriter":
        parent = self.out_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        stale = [f".{self.out_dir.name}.tmp-"]
        if self.out_dir.exists():  # else a .old- may hold the only copy: left for a person
            stale.append(f".{self.out_dir.name}.old-")
        for base in stale:
            for line in remove_stale(parent, base):  # what killed prepares left behind
                print(f"longft: {line}", file=sys.stderr, flush=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(f".{self.out_dir.name}.tmp-"),
                                         dir=parent))
        umask = os.umask(0)  # mkdtemp makes the directory private; give it the usual mode
        os.umask(umask)
        self.tmp.chmod(0o777 & ~umask)
        for name in ARRAYS:
            self.arrays[name] = np.lib.format.open_memmap(
                self.tmp / f"{name}.npy", mode="w+", dtype=np.int32,
                shape=(self.num_rows, self.max_len))
        return self

    def write(self, i: int, input_ids, labels, position_ids) -> None:
        for name, row in zip(ARRAYS, (input_ids, labels, position_ids)):
            self.arrays[name][i] = row

    def commit(self, meta: dict, extra: dict[str, dict] | None = None) -> None:
        """Flush the arrays, write meta.json (and extra json files), move the result to out_dir."""
        assert self.tmp is not None, "commit() outside the `with` block"
        for a in self.arrays.values():
            a.flush()
        self.arrays.clear()
        # what the rows hold, not only how many: the training trajectory keys checkpoints on it
        full = {"num_rows": self.num_rows, "max_seq_length": self.max_len, **meta,
                DATA_KEY: arrays_digest(self.tmp)}
        for name, obj in {META: full, **(extra or {})}.items():
            write_json(self.tmp / name, obj)
        old = None
        if self.out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=tmp_prefix(f".{self.out_dir.name}.old-"),
                                        dir=self.out_dir.parent))
            old.rmdir()
            self.out_dir.rename(old)
        try:
            self.tmp.rename(self.out_dir)
        except OSError:
            if old is not None:
                old.rename(self.out_dir)
            raise
        self.tmp = None
        if old is not None:
            shutil.rmtree(old)

    def __exit__(self, *exc) -> None:
        self.arrays.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def write_dataset(out_dir: str | Path, input_ids: np.ndarray, labels: np.ndarray,
                  position_ids: np.ndarray, meta: dict, extra: dict[str, dict] | None = None) -> None:
    """Write whole [N, L] arrays atomically (see DatasetWriter)."""
    n, length = input_ids.shape
    if labels.shape != (n, length) or position_ids.shape != (n, length):
        raise ValueError(f"arrays must share shape {(n, length)}, got labels {labels.shape} "
                         f"and position_ids {position_ids.shape}")
    with DatasetWriter(out_dir, n, length) as w:
        for i in range(n):
            w.write(i, input_ids[i], labels[i], position_ids[i])
        w.commit(meta, extra)


class PreparedDataset(torch.utils.data.Dataset):
    """Rows of a prepared dataset as dicts of torch.long tensors: input_ids, labels, position_ids.

    Arrays are memory-mapped, so opening is instant and each worker reads only its rows.
    """

    def __init__(self, path: str | Path = "data/prepared"):
        self.path = Path(path)
        fix = _FIX.format(path=self.path)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: no prepared dataset here; {fix}")
        missing = [f for f in (META, *(f"{a}.npy" for a in ARRAYS)) if not (self.path / f).is_file()]
        if missing:
            raise DataError(f"{self.path}: incomplete prepared dataset (missing "
                            f"{', '.join(missing)}); {fix}")
        try:
            self.meta = json.loads((self.path / META).read_text())
            self.arrays = {a: np.load(self.path / f"{a}.npy", mmap_mode="r") for a in ARRAYS}
            shape = (self.meta["num_rows"], self.meta["max_seq_length"])
        except (ValueError, KeyError, OSError) as e:
            raise DataError(f"{self.path}: unreadable prepared dataset ({type(e).__name__}: {e}); "
                            f"{fix}") from None
        bad = {a: arr.shape for a, arr in self.arrays.items() if arr.shape != shape}
        if bad:
            raise DataError(f"{self.path}: arrays {bad} do not match meta.json {shape}; {fix}")

    @property
    def max_seq_length(self) -> int:
        return int(self.meta["max_seq_length"])

    def __len__(self) -> int:
        return int(self.meta["num_rows"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {a: torch.from_numpy(np.asarray(arr[i], dtype=np.int64)) for a, arr in self.arrays.items()}


def held_out(path: str | Path = "data/prepared") -> tuple[PreparedDataset, list[dict]] | None:
    """(the held-out rows, their samples.json entries) of a prepared dataset; None without a
    held-out split (data.eval_samples 0, source random, or prepared before the split existed)."""
    where = Path(path) / EVAL_DIR
    if not where.is_dir():
        return None
    data = PreparedDataset(where)
    try:
        samples = json.loads((where / SAMPLES).read_text())["samples"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where}: unreadable {SAMPLES} ({type(e).__name__}: {e}); "
                        f"{_FIX.format(path=path)}") from None
    return data, samples


def attention_shape(path: str | Path, seq_len: int) -> tuple[float, float]:
    """(attention_length, padding share) of a prepared data set's training rows, from its
    stats.json, for the speed heuristic (`longft placement --data`). DataError, naming the fix,
    when it is missing, older than those numbers, or prepared at another length than seq_len (its
    rows would pack differently)."""
    stats_file = Path(path) / "stats.json"
    fix = _FIX.format(path=path)
    try:
        stats = json.loads(stats_file.read_text())
    except FileNotFoundError:
        raise DataError(f"{stats_file}: no prepared data set here; {fix}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{stats_file}: unreadable ({type(e).__name__}: {e}); {fix}") from None
    length, span = stats.get("max_seq_length"), stats.get("attention_length")
    if length != seq_len:
        raise DataError(f"{path} holds rows of {length} tokens, not {seq_len:,}: documents pack "
                        f"differently at another length. Prepare it at {seq_len} (`dvc repro "
                        f"prepare` with data.max_seq_length: {seq_len}), or leave out --data")
    if not isinstance(span, (int, float)) or span <= 0:
        raise DataError(f"{stats_file} has no attention_length (prepared by an older longft); {fix}")
    return float(span), 1.0 - float(stats.get("packing_efficiency", 1.0))

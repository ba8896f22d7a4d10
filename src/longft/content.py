"""What a run trains on, by content: sha256 digests of the prepared data, the model and the
tokenizer, for the training trajectory (trajectory.py). Counts (rows, tokens) say nothing about
what the rows hold: a data file whose answers were all edited to the same lengths prepares to the
same counts, and its checkpoints must not be resumed.

- prepared data: the digest of its arrays (input_ids, labels, position_ids), computed once by the
  prepare stage and stored in meta.json (`content_sha256`); hashed here only for a dataset
  prepared before that key existed;
- model and tokenizer: a local file or folder, every file (names and bytes; a folder's hidden
  entries, such as .cache and .git, left out); a name in configs/models, its config file; a hub
  id, the commit of its snapshot in the local hub cache (else the id itself).
Big local files (a model's safetensors) are hashed once per (path, size, modification time): the
digests are kept in ~/.cache/longft/digests.json, so each rank and each run do not read GBs again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from longft.atomic import write_json

DATA_KEY = "content_sha256"
ARRAYS = ("input_ids", "labels", "position_ids")
CACHE = Path.home() / ".cache" / "longft" / "digests.json"
_CACHED_FROM = 1 << 24  # files smaller than 16 MiB are hashed each time


def _read_cache() -> dict:
    try:
        got = json.loads(CACHE.read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def file_digest(f: Path) -> str:
    """sha256 of a file's bytes (kept in CACHE for big files, keyed by path, size and mtime)."""
    f = Path(f).resolve()
    st = f.stat()
    key = f"{f}:{st.st_size}:{st.st_mtime_ns}"
    cache = _read_cache() if st.st_size >= _CACHED_FROM else {}
    if key in cache:
        return cache[key]
    with open(f, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if st.st_size >= _CACHED_FROM:
        try:
            write_json(CACHE, {**{k: v for k, v in cache.items() if not k.startswith(f"{f}:")},
                               key: digest})
        except OSError:
            pass  # no cache: hashed again next time
    return digest


def tree_digest(path: Path) -> str:
    """sha256 over a file, or over a folder's files (relative names and their digests, sorted)."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        h.update(f"{rel.as_posix()}\0{file_digest(f)}\n".encode())
    return h.hexdigest()


def arrays_digest(data_dir: Path) -> str:
    """The digest of a prepared dataset's arrays (what the prepare stage stores in meta.json)."""
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(f"{name}\0{file_digest(Path(data_dir) / f'{name}.npy')}\n".encode())
    return h.hexdigest()


def data_digest(data_dir: Path | None) -> str | None:
    """meta.json's `content_sha256`, else the arrays hashed now; None without prepared data."""
    if data_dir is None:
        return None
    try:
        meta = json.loads((Path(data_dir) / "meta.json").read_text())
        stored = meta.get(DATA_KEY) if isinstance(meta, dict) else None
        return stored if isinstance(stored, str) else arrays_digest(Path(data_dir))
    except (OSError, ValueError):
        return None


def _hub_commit(repo_id: str) -> str | None:
    """The commit of the hub cache's snapshot of repo_id (refs/main), or None."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    ref = Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def source_digest(name: str, shipped: Path | None = None) -> str:
    """A model or tokenizer by content: "sha256:<hex>" of a local path (or of `shipped`, the file
    a configs/models name stands for), "hub:<id>@<commit>" of a hub id in the local cache, else
    "hub:<id>"."""
    local = Path(name)
    if shipped is not None and not local.exists():
        local = shipped
    if local.exists():
        return "sha256:" + tree_digest(local)
    commit = _hub_commit(name)
    return f"hub:{name}@{commit}" if commit else f"hub:{name}"

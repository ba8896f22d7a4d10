"""The train stage's per-rank logs (runs/train/rank{r}.jsonl) read back: one RankLog per rank.

One JSON object a line: {"type": "iter", ...} per optimizer step, an "eval" per held-out
evaluation, one "env" (rank 0) and one "end". A line that does not parse (a rank killed mid-write)
is skipped, with a warning unless it is the last; a step or eval logged twice (a resumed run)
keeps the last record.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


@dataclass
class RankLog:
    rank: int
    iters: dict[int, dict] = field(default_factory=dict)
    evals: dict[int, dict] = field(default_factory=dict)
    env: Optional[dict] = None
    end: Optional[dict] = None


def read_rank(path: Path, rank: int) -> RankLog:
    out = RankLog(rank)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        log.warning("%s unreadable: %s", path, e)
        return out
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                log.warning("%s:%d: not JSON, skipped", path, i + 1)
            continue
        kind = rec.get("type") if isinstance(rec, dict) else None
        if kind == "iter" and isinstance(rec.get("step"), int):
            out.iters[rec["step"]] = rec  # a step logged twice (resume): the last one counts
        elif kind == "eval" and isinstance(rec.get("step"), int):
            out.evals[rec["step"]] = rec  # evaluated twice (resume): the last one counts
        elif kind == "env":
            out.env = rec
        elif kind == "end":
            out.end = rec
    return out


def read_ranks(run_dir: Path) -> dict[int, RankLog]:
    """Every rank{r}.jsonl of a run directory, by rank."""
    ranks = {}
    for p in sorted(run_dir.glob("rank*.jsonl")):
        m = re.fullmatch(r"rank(\d+)\.jsonl", p.name)
        if m:
            ranks[int(m.group(1))] = read_rank(p, int(m.group(1)))
    return dict(sorted(ranks.items()))


def read_json(path: Path) -> dict:
    """A JSON object file, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
